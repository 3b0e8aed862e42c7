"""The shipped Alertmanager config, checked and routed by the real amtool: work orders reach the
remediator only, on-call gets one page per incident, info alerts go nowhere."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from oomguard.alerts.cases import Labels
from oomguard.alerts.generate import ALERTMANAGER, NOT_AN_ACTION, PAGER, alertmanager_config
from oomguard.alerts.rules import Alert, all_alerts
from oomguard.thresholds import AlertThresholds

T = AlertThresholds()
ALERTS = all_alerts(T)
# What pages on-call: one alert per incident type (issue: a CUDA OOM, remediation failed or
# limited, a model with no ready engine, an SLO burning fast; and the remediator down).
PAGES = {
    "OomguardCudaOomObserved",
    "OomguardRemediationFailing",
    "OomguardRemediationLimited",
    "OomguardModelUnavailable",
    "OomguardRemediatorDown",
    "OomguardRemediatorNoLeader",
    "OomguardRemediatorCrashLooping",
    "OomguardRemediatorAuditFailing",
    "OomguardRequestErrorBudgetBurn",
    "OomguardTTFTBudgetBurn",
}


def test_amtool_check_config(repo_root):
    r = subprocess.run(
        ["amtool", "check-config", str(repo_root / ALERTMANAGER)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def expected_receivers(alert: Alert) -> list[str]:
    if alert.name == "Watchdog":
        return ["watchdog"]
    if alert.action:  # a work order: the remediator; a CUDA OOM is also the page
        return ["remediator", PAGER] if alert.severity == "critical" else ["remediator"]
    return {"critical": [PAGER], "warning": ["oncall-ticket"]}.get(alert.severity, ["nowhere"])


def k8s_labels(alert: Alert) -> list[str]:
    """The alert's labels as the rule would produce them from Kubernetes-scraped series."""
    L = Labels(T)
    labels = {**L.engine, "alertname": alert.name, **alert.labels()}
    return [f"{k}={v}" for k, v in labels.items()]


def routes_test(repo_root, receivers: list[str], labels: list[str]) -> subprocess.CompletedProcess:
    """amtool's route test: exit 0 only when exactly these receivers get the alert."""
    return subprocess.run(
        [
            "amtool",
            "config",
            "routes",
            "test",
            f"--config.file={repo_root / ALERTMANAGER}",
            f"--verify.receivers={','.join(receivers)}",
            *labels,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.name}-{a.severity}")
def test_each_alert_reaches_its_receivers(repo_root, alert):
    r = routes_test(repo_root, expected_receivers(alert), k8s_labels(alert))
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_page_per_incident_type():
    """Exactly the incident alerts page, each under its own name: a CUDA OOM no longer also
    pages as MemoryCritical, GpuMemoryCritical and EngineDown."""
    paging = {a.name for a in ALERTS if PAGER in expected_receivers(a)}
    assert paging == PAGES
    oom_incident = {
        "OomguardCudaOomObserved",
        "OomguardMemoryCritical",
        "OomguardGpuMemoryCritical",
        "OomguardEngineDown",
        "OomguardEngineRestarted",
    }
    assert paging & oom_incident == {"OomguardCudaOomObserved"}


def test_a_page_groups_every_alert_of_a_models_incident(repo_root):
    """One pager group per model: a CUDA OOM on any rank or engine, the model unavailable while
    it reloads, its budget burning and its engines' remediation are one incident, one page."""
    config = yaml.safe_load((repo_root / ALERTMANAGER).read_text())
    pager = next(r for r in config["route"]["routes"] if r["receiver"] == PAGER)
    group_by = pager.get("group_by", config["route"]["group_by"])
    assert set(group_by) == {T.cluster_label, "model_name"}


def test_every_page_about_an_engine_carries_its_model():
    """The pager groups by model_name: an engine's page without it would be its own incident."""
    from tests.series_labels import labels

    for alert in ALERTS:
        if PAGER not in expected_receivers(alert):
            continue
        carried = labels(alert.expr, best=True)
        if carried & {"target", "model_name"}:
            assert "model_name" in carried, alert.name


def test_every_inhibition_and_grouping_names_labels_the_alerts_carry():
    """An `equal` label missing on either side never matches (ModelUnavailable carries no
    `instance`, so a CUDA OOM could not inhibit it by instance)."""
    from tests.series_labels import labels

    config = alertmanager_config(T)
    carried = {a.name: labels(a.expr, best=True) | set(a.labels()) | {"alertname"} for a in ALERTS}

    def matching(matchers: list[str]) -> list[str]:
        import re

        names = [m for m in matchers if m.startswith("alertname")]
        (m,) = names
        op, value = re.fullmatch(r'alertname(=~|=)"(.*)"', m).groups()  # type: ignore[union-attr]
        pattern = value if op == "=~" else re.escape(value)
        return [n for n in carried if re.fullmatch(pattern, n)]

    for rule in config["inhibit_rules"]:
        sources, targets = matching(rule["source_matchers"]), matching(rule["target_matchers"])
        assert sources and targets, rule
        for name in sources + targets:
            missing = set(rule["equal"]) - carried[name]
            assert not missing, (name, missing, rule["equal"])


def test_inhibition_never_hides_a_work_order():
    """The remediator's resync asks Alertmanager for inhibited=false: an inhibited action-
    carrying alert would vanish from it. Every inhibition's targets exclude them."""
    config = alertmanager_config(T)
    assert config["inhibit_rules"]
    for rule in config["inhibit_rules"]:
        assert NOT_AN_ACTION in rule["target_matchers"], rule
        assert T.cluster_label in rule["equal"], rule


def test_the_remediator_gets_every_alert_as_its_own_group_at_once():
    """Alertmanager sends a group's first notification after group_wait, later changes only at
    group_interval ticks: one group per alert and group_wait 0 send each new alert at once."""
    config = alertmanager_config(AlertThresholds(remediator_group_interval="250ms"))
    routes = [r for r in config["route"]["routes"] if r["receiver"] == "remediator"]
    assert len(routes) == 2
    for r in routes:
        assert r["group_by"] == ["..."] and r["group_wait"] == "0s"
        assert r["group_interval"] == "250ms"


def test_a_wrong_expectation_fails(repo_root):
    r = routes_test(repo_root, [PAGER], ["alertname=OomguardKVCacheUsageHigh", "severity=info"])
    assert r.returncode != 0


@pytest.mark.slow
def test_a_real_alertmanager_inhibits_tickets_but_never_hides_work_orders(tmp_path):
    """One CUDA OOM incident posted to the real Alertmanager with the shipped config: the GPU
    ticket is inhibited, while every work order stays in the list the remediator's resync reads
    (receiver remediator, inhibited=false, silenced=false)."""
    import httpx

    from oomguard.lab.processes import Alertmanager
    from tests.conftest import free_port

    (tmp_path / "token").write_text("t\n")
    am = Alertmanager(tmp_path / "am", f"http://127.0.0.1:{free_port()}", tmp_path / "token")
    try:
        L = Labels(T)
        by_name = {a.name: a for a in ALERTS}

        def posted(name: str, **extra: str) -> dict:
            return {"labels": {"alertname": name, **by_name[name].labels(), **extra}}

        rank = {**L.rank}
        engine = {**L.engine}
        gpu = {**L.gpu}
        model = {T.cluster_label: L.cluster[T.cluster_label], "model_name": engine["model_name"]}
        incident = [
            # the OOM page carries its engine's model (engine:oomguard_vllm_model:info)
            posted("OomguardCudaOomObserved", **rank, model_name=engine["model_name"]),
            posted("OomguardMemoryCritical", **engine, reason="allocator_oom"),
            posted("OomguardMemoryPressure", **engine, reason="allocator_oom"),
            posted("OomguardGpuMemoryCritical", **gpu),
            # no instance on these: the OOM inhibits them by model
            posted("OomguardModelUnavailable", **model),
            {
                "labels": {
                    "alertname": "OomguardRequestErrorBudgetBurn",
                    "severity": "critical",
                    **model,
                }
            },
        ]
        httpx.post(f"{am.url}/api/v2/alerts", json=incident, timeout=10).raise_for_status()

        def listed(**params: str) -> set[str]:
            r = httpx.get(
                f"{am.url}/api/v2/alerts", params={"active": "true", **params}, timeout=10
            )
            r.raise_for_status()
            return {a["labels"]["alertname"] for a in r.json()}

        resync = listed(silenced="false", inhibited="false", receiver="^remediator$")
        assert resync == {
            "OomguardCudaOomObserved",
            "OomguardMemoryCritical",
            "OomguardMemoryPressure",
        }
        visible = listed(silenced="false", inhibited="false")
        assert "OomguardGpuMemoryCritical" not in visible  # the OOM's page covers its GPU
        assert "OomguardGpuMemoryCritical" in listed()  # inhibited, not lost
        # the model left without an engine and its budget are the OOM's incident too
        assert not {"OomguardModelUnavailable", "OomguardRequestErrorBudgetBurn"} & visible
        assert {"OomguardModelUnavailable", "OomguardRequestErrorBudgetBurn"} <= listed()
    finally:
        am.stop()
