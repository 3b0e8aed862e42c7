"""`oomguard demo` end to end, compressed: real vLLM, exporter, Prometheus and Alertmanager."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tests.vllm_server import require_vllm

pytestmark = pytest.mark.slow


def test_short_demo_detects_the_incident_and_alerts_reach_the_remediator_webhook(tmp_path):
    require_vllm()
    report = tmp_path / "report"
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "demo", "--duration", "30", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (report / "summary.md").read_text()
    assert "worst GPU 0 pressure level: 3 (CRITICAL)" in summary
    rows = list(csv.DictReader((report / "timeline.csv").open()))
    assert len(rows) >= 25
    assert rows[0]["gpu0_level"] == "0" and rows[-1]["gpu0_level"] == "0"  # before and after
    assert all(row["gpu1_level"] == "0" for row in rows)  # the other GPU never in danger
    webhooks = json.loads((report / "webhooks.json").read_text())
    to_remediator = [
        a for w in webhooks if w["receiver"] == "remediator" for a in w["payload"]["alerts"]
    ]
    assert any(
        a["labels"]["alertname"] == "OomguardMemoryCritical"
        and a["labels"]["oomguard_action"] == "drain"
        and a["labels"]["target"] == "llama-a"
        for a in to_remediator
    )
    assert all(w["auth"].startswith("Bearer ") for w in webhooks if w["receiver"] == "remediator")
    assert not any(a["labels"].get("target") == "llama-b" for a in to_remediator)


def test_demo_refuses_a_too_short_duration():
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "demo", "--duration", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "at least 10 seconds" in r.stderr
