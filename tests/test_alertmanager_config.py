"""The shipped Alertmanager config, checked and routed by the real amtool."""

from __future__ import annotations

import subprocess

import pytest
from oomguard.alerts.generate import ALERTMANAGER
from oomguard.alerts.rules import alerts

from oomguard.thresholds import AlertThresholds


def test_amtool_check_config(repo_root):
    r = subprocess.run(
        ["amtool", "check-config", str(repo_root / ALERTMANAGER)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def expected_receivers(severity: str, action: str | None, name: str) -> list[str]:
    out = ["remediator"] if action else []
    if name == "Watchdog":
        out.append("watchdog")
    elif severity == "critical":
        out.append("oncall-pager")
    else:
        out.append("oncall-ticket")
    return out


@pytest.mark.parametrize("alert", alerts(AlertThresholds()), ids=lambda a: a.name)
def test_each_alert_reaches_its_receivers(repo_root, alert):
    labels = [
        f"alertname={alert.name}",
        *(f"{k}={v}" for k, v in alert.labels().items()),
        "instance=n1:9848",
        "target=llama",
        "engine=0",
    ]
    want = expected_receivers(alert.severity, alert.action, alert.name)
    r = routes_test(repo_root, want, labels)
    assert r.returncode == 0, r.stdout + r.stderr


def routes_test(repo_root, receivers: list[str], labels: list[str]):
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


def test_a_wrong_expectation_fails(repo_root):
    r = routes_test(
        repo_root, ["oncall-pager"], ["alertname=OomguardKVCacheUsageHigh", "severity=info"]
    )
    assert r.returncode != 0
