from __future__ import annotations

import re
import subprocess
from collections import Counter

import pytest
import yaml

from oomguard.actions import ACTION_ALERTS as ALL_ACTION_ALERTS
from oomguard.actions import ALERT_ACTIONS
from oomguard.alerts.cases import cases, expr_cases
from oomguard.alerts.generate import RULE_TESTS, RULES, prometheus_config
from oomguard.alerts.rules import all_alerts, all_recording_rules, rule_groups
from oomguard.catalog import CATALOG, exported_names
from oomguard.manifests import kubernetes as k8s
from oomguard.thresholds import AlertThresholds
from tests.conftest import VLLM_FIXTURE
from tests.kube_state_metrics import KSM_LABELS
from tests.promql import metric_names

T = AlertThresholds()
ALERTS = all_alerts(T)
RECORDED = {r.record for r in all_recording_rules(T)}
PROMETHEUS_OWN = {"up", "ALERTS"}
# series of other programs the rules read: vLLM's own (the SLOs) and Alertmanager's
VLLM_NAMES = {
    line.split("{")[0].split(" ")[0]
    for line in VLLM_FIXTURE.read_text().splitlines()
    if line and not line.startswith("#")
}
THIRD_PARTY = VLLM_NAMES | {"alertmanager_notifications_failed_total"} | set(KSM_LABELS)


def exprs(t: AlertThresholds = T) -> list[str]:
    return [a.expr for a in all_alerts(t)] + [r.expr for r in all_recording_rules(t)]


def test_promtool_lint_passes(repo_root):
    r = subprocess.run(
        ["promtool", "check", "rules", "--lint-fatal", str(repo_root / RULES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(ALERTS) + len(RECORDED)} rules found" in r.stdout


@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_promtool_unit_tests_pass(repo_root):
    r = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=repo_root / RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def promtool_on(tmp_path, rules: dict, tests: dict, alert: str) -> subprocess.CompletedProcess:
    """promtool on edited rules and the test cases of one alert only (the full file is slow)."""
    tests = {**tests, "tests": [c for c in tests["tests"] if c["name"].startswith(f"{alert} ")]}
    assert tests["tests"]
    (tmp_path / RULE_TESTS.name).write_text(yaml.safe_dump(tests))
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules))
    return subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )


def load(repo_root) -> tuple[dict, dict]:
    return (
        yaml.safe_load((repo_root / RULES).read_text()),
        yaml.safe_load((repo_root / RULE_TESTS).read_text()),
    )


def test_promtool_unit_tests_can_fail(repo_root, tmp_path):
    """A wrong expectation must make promtool fail: the tests above are not vacuous."""
    rules, tests = load(repo_root)
    for case in tests["tests"]:
        for a in case.get("alert_rule_test", []):
            for e in a["exp_alerts"]:
                desc = e["exp_annotations"]["description"]
                e["exp_annotations"]["description"] = desc.replace("is 95% full", "is 96% full")
    r = promtool_on(tmp_path, rules, tests, "OomguardKVCacheUsageHigh")
    assert r.returncode != 0 and "96% full" in r.stdout + r.stderr


@pytest.mark.parametrize(
    ("alert", "old_expr"),
    [
        # misses the first sample of a counter born at 1 (a process killed by its first OOM)
        ("OomguardCudaOomObserved", "increase(oomguard_allocator_ooms_total[5m]) > 0"),
        # no minimum count: an idle engine's single preemption reads 50 %
        ("OomguardPreemptionRateHigh", "engine:oomguard_vllm_preemption_ratio:rate5m > 0.01"),
        # the remediator's first failed action: its counter is born at 1
        (
            "OomguardRemediationFailing",
            'increase(oomguard_remediator_actions_total{result="failed"}[10m]) > 0 '
            "or increase(oomguard_remediator_reconcile_errors_total[10m]) > 2",
        ),
        ("OomguardHostOomKill", "increase(oomguard_host_oom_kills_total[10m]) > 0"),
        # matched series by series: an exporter rollout (a new `pod` label on the same counter)
        # read as a counter born non-zero: a page and a restart order with no OOM
        (
            "OomguardCudaOomObserved",
            "increase(oomguard_allocator_ooms_total[5m]) > 0 or (oomguard_allocator_ooms_total "
            "> 0 unless oomguard_allocator_ooms_total offset 5m)",
        ),
        (
            "OomguardIncidentClassified",
            "increase(oomguard_incidents_total[15m]) > 0 or (oomguard_incidents_total > 0 "
            "unless oomguard_incidents_total offset 15m)",
        ),
        (
            "OomguardHostOomKill",
            "increase(oomguard_host_oom_kills_total[10m]) > 0 or (oomguard_host_oom_kills_total "
            "> 0 unless oomguard_host_oom_kills_total offset 10m)",
        ),
        # a crashed engine's reload counted as a reconcile error storm (a second page per OOM)
        (
            "OomguardRemediationFailing",
            'increase(oomguard_remediator_actions_total{result="failed"}[10m]) > 0 '
            "or increase(oomguard_remediator_reconcile_errors_total[10m]) > 2",
        ),
        # the single-replica fallback (cap, not drain) paged as a safety limit
        (
            "OomguardRemediationLimited",
            "increase(oomguard_remediator_safety_limited_total[15m]) > 0 or "
            "(oomguard_remediator_safety_limited_total > 0 unless "
            "oomguard_remediator_safety_limited_total offset 15m)",
        ),
        # a restart that a recorded incident or oomguard's own restart explains
        ("OomguardEngineRestarted", "resets(oomguard_vllm_generation_tokens_total[15m]) > 0"),
        # compared by identity but `ignoring` nothing new: an OOM during the rollout (old pod at
        # 1, new at 2) is missed
        (
            "OomguardCudaOomObserved",
            "increase(oomguard_allocator_ooms_total[5m]) > 0 or (oomguard_allocator_ooms_total "
            "> 0 unless ignoring (pod) oomguard_allocator_ooms_total offset 5m)",
        ),
        # an engine's level judged pod by pod: an exporter rollout (maxSurge) is a second alert
        # (a second episode for the remediator), a gap within keep_firing_for starts the `for`
        # again, and a new pod that cannot see the engine yet blinds it
        ("OomguardMemoryPressure", "max without (reason) (oomguard_engine_pressure_level) >= 2"),
        (
            "OomguardFragmentationPressure",
            "max without (reason) "
            '(oomguard_engine_pressure_level{reason="allocator_fragmentation"}) >= 2',
        ),
        ("OomguardMemoryCritical", "max without (reason) (oomguard_engine_pressure_level) >= 3"),
        ("OomguardPressureBlind", "min without (reason) (oomguard_engine_pressure_level) < 0"),
        ("OomguardGpuMemoryPressure", "max without (reason) (oomguard_gpu_pressure_level) == 2"),
        # counters and vLLM's relayed counters judged pod by pod: during the surge one OOM is
        # two restart orders, and a preemption storm's rate starts again from the new pod's
        # few samples; a new pod's first `up` (0, before its first poll) restarts a hold's `for`
        (
            "OomguardCudaOomObserved",
            next(a.expr for a in ALERTS if a.name == "OomguardCudaOomObserved").replace(
                "max without (pod) (", "("
            ),
        ),
        (
            "OomguardPreemptionRateHigh",
            "rate(oomguard_vllm_preemptions_total[5m]) / clamp_min(sum without (finished_reason) "
            "(rate(oomguard_vllm_requests_finished_total[5m])), 1 / 300) > 0.01 "
            "and increase(oomguard_vllm_preemptions_total[5m]) >= 10",
        ),
        (
            "OomguardRemediationHeld",
            'oomguard_remediator_target_mode{mode="held"} == 1 unless on (cluster, target) '
            '(oomguard_vllm_up{job="oomguard-exporter"} == 0)',
        ),
        # the job prometheus-operator gives a PodMonitor without relabeling: never matches
        ("OomguardExporterDown", 'up{job="oomguard/oomguard-exporter"} == 0'),
        # joined on `target` with the names the manifests used to give (vllm vs vllm-llama-3-8b)
        (
            "OomguardRequestsQueueing",
            'oomguard_vllm_requests_waiting{target="vllm"} > 10 and on (target) '
            "(max by (target) (oomguard_remediator_admission_cap) "
            "< max by (target) (oomguard_remediator_startup_max_num_seqs))",
        ),
    ],
)
def test_the_cases_catch_the_old_rules(repo_root, tmp_path, alert, old_expr):
    """Put an old expression back: promtool must fail on the cases written for the fix."""
    rules, tests = load(repo_root)
    rule = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert)
    rule["expr"] = old_expr
    r = promtool_on(tmp_path, rules, tests, alert)
    assert r.returncode != 0 and alert in r.stdout + r.stderr, r.stdout + r.stderr


def _series(text: str) -> tuple[str, dict[str, str]]:
    name, _, inner = text.partition("{")
    return name, dict(re.findall(r'(\w+)="([^"]*)"', inner))


def _counters_read(expr: str) -> set[str]:
    """Counters an expression reads, through the recording rules it uses."""
    recorded = {r.record: r.expr for r in all_recording_rules(T)}
    out = set()
    for name in metric_names(expr):
        if name in recorded:
            out |= _counters_read(recorded[name])
        elif name in CATALOG:
            if CATALOG[name].type == "counter":
                out.add(name)
        elif name.endswith(("_total", "_bucket", "_count")):  # vLLM's, Alertmanager's
            out.add(name)
    return out


@pytest.mark.parametrize(
    "alert", sorted({a.name for a in ALERTS if _counters_read(a.expr)}), ids=str
)
def test_every_counter_based_alert_has_a_rollout_case(alert):
    """A pod replaced with its counters unchanged (a new `pod` label on the same series) is
    a quiet case of every alert that reads a counter: a rollout is no event."""
    counters = _counters_read(next(a.expr for a in ALERTS if a.name == alert))
    rolled = []
    for case in cases(T):
        if case.alert != alert or case.firing:
            continue
        by_metric: dict[str, set[str]] = {}
        for text in case.series:
            name, labels = _series(text)
            by_metric.setdefault(name, set()).add(labels.get("pod", ""))
        if any(len(by_metric.get(c, ())) > 1 for c in counters):
            rolled.append(case.eval_time)
    assert rolled, f"{alert}: no quiet case where a pod of {sorted(counters)} is replaced"


# Alerts about one exporter process (its collector, its polling, its threads), not about what it
# serves: a new pod is a new process, and its `for` rightly starts again.
PER_EXPORTER_PROCESS = {
    "OomguardCollectorDown",
    "OomguardMetricsStale",
    "OomguardThreadRestarting",
}
# Rules that read an exporter series only inside `group by (...)` onto named labels (the model an
# engine serves): no pod in what they keep.
GROUPED_ONTO_NAMED_LABELS = {
    "engine:oomguard_vllm_model:info",
    "model_name:oomguard_capacity_withheld_seqs:sum",
    "OomguardModelUnavailable",
}


def _exporter_series(expr: str) -> set[str]:
    """The exporter's series (gauges and counters) an expression reads itself (not through a
    recording rule), except those that carry a pod of their own (dcgm-exporter's attribution)."""
    return {
        n
        for n in metric_names(expr)
        if n in CATALOG and CATALOG[n].component == "exporter" and "pod" not in CATALOG[n].labels
    }


RULES_ON_EXPORTER_SERIES = {
    **{r.record: r.expr for r in all_recording_rules(T) if _exporter_series(r.expr)},
    **{a.name: a.expr for a in ALERTS if _exporter_series(a.expr)},
}


@pytest.mark.parametrize("rule", sorted(RULES_ON_EXPORTER_SERIES), ids=str)
def test_rules_on_exporter_series_judge_what_they_serve_not_the_pod(rule):
    """The exporter's DaemonSet rolls with a surge (the manifests): a rule on one of its series
    that kept the scraped pod's label would see a new series at every rollout (a `for` started
    again) and, while two pods serve, two of everything (two restart orders for one OOM)."""
    expr = RULES_ON_EXPORTER_SERIES[rule]
    if rule in PER_EXPORTER_PROCESS:
        return
    if rule in GROUPED_ONTO_NAMED_LABELS:
        for name in _exporter_series(expr):
            # each reference is the argument of a `group by (...)` (or a range of one)
            refs = len(re.findall(rf"\b{name}\b", expr))
            grouped = len(
                re.findall(rf"group by \([^)]*\) \(\s*(?:last_over_time\()?{name}\b", expr)
            )
            assert grouped == refs, (name, expr)
        return
    assert re.search(r"\bwithout \([^)]*\bpod\b", expr), expr


def test_every_action_alert_has_a_rollout_case_while_it_fires():
    """An exporter rollout while a work order fires (two pods' series of one engine) is a case
    that expects the one alert, without the pod: the remediator sees one episode."""
    for alert in (a.name for a in ALL_ACTION_ALERTS):
        found = []
        for case in cases(T):
            if case.alert != alert or not case.firing:
                continue
            pods = {_series(text)[1].get("pod") for text in case.series}
            if len(pods) > 1:
                assert all("pod" not in f for f in case.firing), case
                found.append(case.eval_time)
        assert found, f"{alert}: no firing case across an exporter rollout"


def test_every_alert_has_a_firing_and_a_quiet_case():
    firing = Counter((c.alert, f["severity"]) for c in cases() for f in c.firing)
    quiet = Counter(c.alert for c in cases() if not c.firing)
    for a in ALERTS:
        assert firing[(a.name, a.severity)] >= 1, (a.name, a.severity)
        if a.name != "Watchdog":  # it always fires
            assert quiet[a.name] >= 1, a.name
    hysteresis = [a for a in ALERTS if a.keep_firing_for]
    assert hysteresis, "some alerts must have keep_firing_for"
    assert {c.expr for c in expr_cases()} == {
        "target:oomguard_capacity_withheld_seqs:max",
        "model_name:oomguard_capacity_withheld_seqs:sum",
        "engine:oomguard_vllm_model:info",
        "model_name:vllm_request_errors:ratio_rate5m",  # with requests lost in crashes
    }


def test_the_rules_know_the_remediators_fallback_limits():
    """RemediationLimited leaves out the limits under which the remediator caps instead while
    other replicas serve the model; a model's only engine capped instead of drained
    (`single_replica`, a single box) pages on purpose: nothing but a person relieves it."""
    from oomguard.alerts.rules import FALLBACK_LIMITS
    from oomguard.remediator.decision import CAP_INSTEAD
    from oomguard.remediator.decision import FALLBACK_LIMITS as REMEDIATOR

    assert set(REMEDIATOR) == set(FALLBACK_LIMITS)
    assert set(CAP_INSTEAD) - set(FALLBACK_LIMITS) == {"single_replica"}


def test_mixin_conventions():
    keys = [(a.name, a.severity) for a in ALERTS]
    assert len(keys) == len(set(keys))
    for a in ALERTS:
        assert a.name == "Watchdog" or re.fullmatch(r"Oomguard[A-Z][A-Za-z]+", a.name), a.name
        assert a.severity in {"critical", "warning", "info", "none"}
        assert a.summary.endswith(".") and "{{" not in a.summary, a.name
        assert a.description.endswith("."), a.name
        ann = a.annotations(T)
        assert re.fullmatch(rf".*/{a.name}\.md(#.+)?", ann["runbook_url"]), ann["runbook_url"]
        assert a.action in {None, *ALERT_ACTIONS}


def test_recording_rules_are_named_level_metric_operations():
    for name in RECORDED:
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name), name


def test_every_group_sets_its_interval():
    for group in rule_groups(T)["groups"]:  # type: ignore[index]
        assert re.fullmatch(r"[0-9]+(ms|[smh])", group["interval"]), group["name"]
    groups = rule_groups(AlertThresholds(rule_interval="15s", action_rule_interval="1s"))
    intervals = {g["name"]: g["interval"] for g in groups["groups"]}  # type: ignore[index]
    assert intervals == {"oomguard-actions": "1s", "oomguard": "15s", "oomguard-slo": "1m"}


def test_the_fast_group_holds_only_work_orders_on_raw_levels():
    """The quarter-second group: the remediator's work orders on the exporter's level gauge,
    nothing that reads a range or a recording rule (those need the main group's order)."""
    groups = {g["name"]: g for g in rule_groups(T)["groups"]}  # type: ignore[index]
    fast = groups["oomguard-actions"]["rules"]
    assert {r["alert"] for r in fast} == {
        "OomguardMemoryPressure",
        "OomguardFragmentationPressure",
        "OomguardMemoryCritical",
        "OomguardPressureBlind",
    }
    for rule in fast:
        assert metric_names(rule["expr"]) == {"oomguard_engine_pressure_level"}
        assert "[" not in rule["expr"]


def test_every_aggregation_keeps_the_cluster_label():
    """A central ruler sees many clusters: `by (...)` without the cluster label merges them."""
    for expr in exprs(AlertThresholds(cluster_label="k8s_cluster")):
        for labels in re.findall(r"\bby \(([^)]*)\)", expr):
            assert "k8s_cluster" in labels.split(", "), expr
        for labels in re.findall(r"\bon \(([^)]*)\)", expr):
            names = labels.split(", ")
            # joins on a scrape's own identity stay within one target, hence one cluster
            assert "k8s_cluster" in names or {"instance", "job"} <= set(names), expr


def test_alerts_name_the_pressure_reason():
    """On-call reads why: the series' reason label, where to read it (an alert that judges the
    engine whatever its reason), or the one reason it is about."""
    for a in ALERTS:
        if "pressure_level" in a.expr and "gpu:" not in a.expr:
            assert "oomguard_engine_pressure_level" in a.expr, a.name
            fixed = dict(a.extra_labels).get("reason")
            assert (
                "$labels.reason" in a.description
                or "`reason` of its oomguard_engine_pressure_level series" in a.description
                or (fixed is not None and f"reason {fixed}" in a.description)
            ), a.name


def test_action_alerts_use_the_short_hysteresis():
    t = AlertThresholds(action_keep_firing_for="15s", keep_firing_for="3m")
    for a in all_alerts(t):
        if a.action == "hold":  # blind holds at once and clears at once
            assert a.keep_firing_for is None and a.for_ == "0s", a.name
        elif a.action:
            assert a.keep_firing_for == "15s", a.name


def test_kv_usage_alone_never_carries_an_action():
    for a in ALERTS:
        if metric_names(a.expr) <= {"oomguard_vllm_kv_cache_usage_ratio"} and a.expr != "vector(1)":
            assert a.action is None, a.name


def test_every_metric_in_a_rule_is_exported_or_recorded():
    known = exported_names() | RECORDED | PROMETHEUS_OWN | THIRD_PARTY
    for expr in exprs():
        unknown = metric_names(expr) - known
        assert not unknown, f"{expr!r} uses {unknown}"


def test_every_job_the_rules_select_is_scraped_on_kubernetes_and_on_one_box():
    """The same rules on both: every job="..." matcher names a job that the single-box config
    scrapes and that a PodMonitor's relabelings produce."""
    t = AlertThresholds(
        exporter_job="gpu-exporter", remediator_job="gpu-remediator", vllm_job="llm"
    )
    selected = set()
    for expr in exprs(t):
        selected |= set(re.findall(r'\bjob="([^"]+)"', expr))
    selected -= {t.kube_state_metrics_job}  # the cluster's own, which both stock installs run
    assert selected == {"gpu-exporter", "gpu-remediator", "llm"}
    one_box = {job["job_name"] for job in prometheus_config(t)["scrape_configs"]}
    kubernetes = {
        k8s.scrape_labels(k8s.exporter(t), "p")["job"],
        k8s.scrape_labels(k8s.remediator(t), "p")["job"],
        k8s.scrape_labels(k8s.vllm_example(t), "p")["job"],
    }
    assert selected <= one_box
    assert selected == kubernetes


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
    (kv,) = [a for a in all_alerts(t) if a.name == "OomguardKVCacheUsageHigh"]
    assert kv.expr.endswith(f"> {threshold}")


def test_slo_thresholds_flow_into_the_rules():
    t = AlertThresholds(slo_success_objective=0.99, slo_ttft_seconds=1.0)
    text = "\n".join(exprs(t))
    assert 'le="1.0"' in text  # vLLM spells its bucket bounds as floats
    assert "> 0.144 and" in text  # 14.4 x a 1 % budget
    with pytest.raises(ValueError, match="TTFT buckets"):
        AlertThresholds(slo_ttft_seconds=3.0)
