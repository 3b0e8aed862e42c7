"""`oomguard demo` end to end, compressed: real vLLM, exporter, Prometheus and Alertmanager."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tests.vllm_server import require_vllm

pytestmark = pytest.mark.slow


def test_short_demo_detects_the_incident_and_the_remediator_acts(tmp_path):
    require_vllm()
    report = tmp_path / "report"
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "demo", "--duration", "60", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (report / "summary.md").read_text()
    assert "worst GPU 0 pressure level: 3 (CRITICAL)" in summary
    assert (report / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader((report / "timeline.csv").open()))
    assert len(rows) >= 50
    assert rows[0]["gpu0_level"] == "0" and rows[-1]["gpu0_level"] == "0"  # before and after
    assert all(row["gpu1_level"] == "0" for row in rows)  # the other GPU never in danger
    audit = [json.loads(x) for x in (report / "remediator-audit.jsonl").read_text().splitlines()]
    acted = [(e["target"], e["action"]) for e in audit if e["event"] == "acted"]
    # the engine on the GPU in danger is drained, then re-admitted; the other one left alone
    assert ("llama-a", "drain") in acted and ("llama-a", "resume") in acted
    assert not any(target == "llama-b" for target, _ in acted)
    assert any(e["event"] == "received" for e in audit)  # through Alertmanager
    drained = [i for i, row in enumerate(rows) if row["llama-a_mode"] == "draining"]
    assert drained and all(row["llama-b_mode"] == "serving" for row in rows)
    assert "failed: 0" in summary  # the gateway sent drained requests to llama-b


def test_demo_without_prometheus_runs_the_remediator_standalone(tmp_path):
    require_vllm()
    report = tmp_path / "report"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "oomguard",
            "demo",
            "--duration",
            "45",
            "--no-prometheus",
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "standalone mode" in r.stdout
    audit = [json.loads(x) for x in (report / "remediator-audit.jsonl").read_text().splitlines()]
    assert ("llama-a", "drain") in [
        (e["target"], e["action"]) for e in audit if e["event"] == "acted"
    ]


def test_demo_refuses_a_too_short_duration():
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "demo", "--duration", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "at least 10 seconds" in r.stderr
