from __future__ import annotations

import re
import subprocess
from collections import Counter

import pytest
from oomguard.alerts.cases import cases
from oomguard.alerts.generate import RULE_TESTS, RULES
from oomguard.alerts.rules import alerts, recording_rules

from oomguard.catalog import exported_names
from oomguard.thresholds import AlertThresholds
from tests.promql import metric_names

ALERTS = alerts(AlertThresholds())
RECORDED = {r.record for r in recording_rules()}
PROMETHEUS_OWN = {"up", "ALERTS"}


def test_promtool_lint_passes(repo_root):
    r = subprocess.run(
        ["promtool", "check", "rules", "--lint-fatal", str(repo_root / RULES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(ALERTS) + len(RECORDED)} rules found" in r.stdout


def test_promtool_unit_tests_pass(repo_root):
    r = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=repo_root / RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_can_fail(repo_root, tmp_path):
    """A wrong expectation must make promtool fail: the tests above are not vacuous."""
    text = (repo_root / RULE_TESTS).read_text().replace("is 95% full", "is 96% full", 1)
    (tmp_path / RULE_TESTS.name).write_text(text)
    (tmp_path / RULES.name).write_text((repo_root / RULES).read_text())
    r = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "96% full" in r.stdout + r.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    firing = Counter(c.alert for c in cases() if c.firing)
    quiet = Counter(c.alert for c in cases() if not c.firing)
    for a in ALERTS:
        assert firing[a.name] >= 1, a.name
        if a.name != "Watchdog":  # it always fires
            assert quiet[a.name] >= 1, a.name
    hysteresis = [a for a in ALERTS if a.keep_firing_for]
    assert hysteresis, "some alerts must have keep_firing_for"


def test_mixin_conventions():
    names = [a.name for a in ALERTS]
    assert len(names) == len(set(names))
    for a in ALERTS:
        assert a.name == "Watchdog" or re.fullmatch(r"Oomguard[A-Z][A-Za-z]+", a.name), a.name
        assert a.severity in {"critical", "warning", "info", "none"}
        assert a.summary.endswith(".") and "{{" not in a.summary, a.name
        assert a.description.endswith("."), a.name
        ann = a.annotations(AlertThresholds())
        assert ann["runbook_url"].endswith(f"/{a.name}.md")
        assert a.action in {None, "lower_cap", "drain", "restart"}


def test_kv_usage_alone_never_carries_an_action():
    for a in ALERTS:
        if metric_names(a.expr) <= {"oomguard_vllm_kv_cache_usage_ratio"} and a.expr != "vector(1)":
            assert a.action is None, a.name


def test_every_metric_in_a_rule_is_exported_or_recorded():
    known = exported_names() | RECORDED | PROMETHEUS_OWN
    for expr in [a.expr for a in ALERTS] + [r.expr for r in recording_rules()]:
        unknown = metric_names(expr) - known
        assert not unknown, f"{expr!r} uses {unknown}"


def test_every_alert_has_exactly_one_runbook_and_every_runbook_one_alert(repo_root):
    runbooks = {p.stem for p in (repo_root / "runbooks").glob("*.md") if p.stem != "README"}
    assert runbooks == {a.name for a in ALERTS}
    for a in ALERTS:
        text = (repo_root / "runbooks" / f"{a.name}.md").read_text()
        for section in ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation"):
            assert section in text, (a.name, section)
        assert a.name in text.splitlines()[0]


@pytest.mark.parametrize("threshold", [0.8, 0.95])
def test_thresholds_flow_into_the_rules(threshold):
    t = AlertThresholds(kv_usage_high_ratio=threshold)
    (kv,) = [a for a in alerts(t) if a.name == "OomguardKVCacheUsageHigh"]
    assert kv.expr.endswith(f"> {threshold}")
