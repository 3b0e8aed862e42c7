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


def test_a_page_groups_every_rank_and_engine_of_a_target(repo_root):
    """Two ranks of one engine hitting OOMs at once are one incident: one group, one page."""
    config = yaml.safe_load((repo_root / ALERTMANAGER).read_text())
    pager = next(r for r in config["route"]["routes"] if r["receiver"] == PAGER)
    group_by = pager.get("group_by", config["route"]["group_by"])
    assert "target" in group_by and T.cluster_label in group_by
    assert not {"rank", "pid", "engine", "instance", "gpu", "UUID"} & set(group_by)


def test_inhibition_never_hides_a_work_order():
    """The remediator's resync asks Alertmanager for inhibited=false: an inhibited action-
    carrying alert would vanish from it. Every inhibition's targets exclude them."""
    config = alertmanager_config(T)
    assert config["inhibit_rules"]
    for rule in config["inhibit_rules"]:
        assert NOT_AN_ACTION in rule["target_matchers"], rule
        assert T.cluster_label in rule["equal"], rule


def test_the_remediator_route_paces_with_rule_evaluation():
    config = alertmanager_config(AlertThresholds(rule_interval="15s"))
    routes = [r for r in config["route"]["routes"] if r["receiver"] == "remediator"]
    assert routes and all(r["group_interval"] == "15s" for r in routes)
    assert all(r["group_wait"] == "0s" for r in routes)


def test_a_wrong_expectation_fails(repo_root):
    r = routes_test(repo_root, [PAGER], ["alertname=OomguardKVCacheUsageHigh", "severity=info"])
    assert r.returncode != 0


@pytest.mark.slow
def test_a_real_alertmanager_inhibits_tickets_but_never_hides_work_orders(tmp_path):
    """One CUDA OOM incident posted to the real Alertmanager with the shipped config: the GPU
    ticket is inhibited, while every work order stays in the list the remediator's resync reads
    (receiver remediator, inhibited=false, silenced=false)."""
    import httpx

    from oomguard.twin.processes import Alertmanager
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
        incident = [
            posted("OomguardCudaOomObserved", **rank),
            posted("OomguardMemoryCritical", **engine, reason="allocator_oom"),
            posted("OomguardMemoryPressure", **engine, reason="allocator_oom"),
            posted("OomguardGpuMemoryCritical", **gpu),
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
    finally:
        am.stop()
