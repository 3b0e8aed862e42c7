"""The whole path with real parts: Alertmanager 0.25 with the shipped config -> `oomguard
remediator` -> a real vLLM 0.33 server with the plugin (model-free executor), under load."""

from __future__ import annotations

import itertools
import json
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from oomguard.catalog import exported_names
from oomguard.lab.processes import Alertmanager, RemediatorProcess, free_port
from tests.vllm_server import PLAIN_GROUP, TOKEN, SteadyLoad

# the engine is the session's plain one (tests/vllm_server.py), shared with
# tests/test_remediator_actuator.py and handed over serving at its startup cap of 16
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(PLAIN_GROUP)]

REMEDIATOR_TOKEN = "am-to-remediator-7"
LABELS = {
    "alertname": "OomguardMemoryPressure",
    "severity": "warning",
    "oomguard_action": "lower_cap",
    "instance": "node-1:9840",
    "job": "oomguard-exporter",
    "target": "llama",
    "engine": "0",
}


def fire(am: Alertmanager, resolved: bool = False) -> None:
    now = datetime.now(UTC)
    body = [
        {
            "labels": LABELS,
            "annotations": {"summary": "test"},
            "startsAt": (now - timedelta(seconds=5)).isoformat(),
            "endsAt": (now if resolved else now + timedelta(minutes=30)).isoformat(),
        }
    ]
    httpx.post(f"{am.url}/api/v2/alerts", json=body, timeout=10).raise_for_status()


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def test_alerts_lower_the_cap_and_resolution_readmits_to_startup_across_restarts(
    tmp_path, plain_vllm
):
    engine = plain_vllm
    procs: list = []
    load = None
    try:
        (tmp_path / "rtoken").write_text(REMEDIATOR_TOKEN)
        (tmp_path / "ptoken").write_text(TOKEN)
        listen = f"127.0.0.1:{free_port()}"
        am = Alertmanager(
            tmp_path / "am",
            f"http://127.0.0.1:{free_port()}",
            tmp_path / "rtoken",
            remediator=f"http://{listen}",
        )
        procs.append(am)
        config = {
            "listen": listen,
            "auth": {"bearer_token_file": str(tmp_path / "rtoken")},
            "targets": [
                {
                    "name": "llama",
                    "url": engine.url,
                    "model": "tiny",
                    "token_file": str(tmp_path / "ptoken"),
                }
            ],
            "policy": {"step_seconds": 2},
            "safety": {"cooldown_seconds": 1},
            "alertmanager": {"url": am.url, "resync_seconds": 5},
            "audit_log": str(tmp_path / "audit.jsonl"),
            "reconcile_seconds": 0.5,
        }

        def remediator() -> RemediatorProcess:
            proc = RemediatorProcess(tmp_path / "rem", config)
            procs.append(proc)
            return proc

        rem = remediator()
        load = SteadyLoad(engine.url, clients=6, max_tokens=4)

        def cap() -> int:
            return engine.state()["admission_cap"]

        # 1. fires: Alertmanager (group_wait 0s) -> webhook -> the cap drops, step by step
        fire(am)
        wait(lambda: cap() == 12, 20, "the first 20 % step (16 -> 12)")
        wait(lambda: cap() <= 9, 20, "a second step while the alert keeps firing")

        # 2. the remediator dies mid-incident; the new one rebuilds from Alertmanager's API
        #    (no webhook is resent for minutes) and keeps stepping down
        rem.kill()
        before = cap()
        rem = remediator()
        wait(lambda: cap() < before, 20, "a step by the restarted remediator")
        wait(lambda: cap() <= 3, 30, "the cap stepping down to 3")
        floor = cap()

        # 3. resolves -> staged re-admission; the remediator dies again half-way
        fire(am, resolved=True)
        wait(lambda: cap() > floor, 40, "re-admission to start")
        wait(lambda: cap() >= 6, 20, "a second re-admission stage")
        rem.kill()
        held = cap()
        time.sleep(1.5)
        assert cap() == held  # nobody raises it while the remediator is down
        rem = remediator()
        wait(lambda: cap() == 16, 40, "re-admission to the startup cap")

        view = httpx.get(
            f"{rem.url}/v1/targets", headers={"Authorization": f"Bearer {REMEDIATOR_TOKEN}"}
        ).json()["targets"]["llama"]
        assert view["mode"] == "serving" and view["observed"]["admission_cap"] == 16

        # nothing was lost: every request of the steady load completed
        load.close()
        assert load.statuses and set(load.statuses) == {200}, set(load.statuses)

        audit = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
        acted = [e for e in audit if e["event"] == "acted"]
        caps = [e["after"]["cap"] for e in acted]
        lowered = [e for e in acted if e["action"] == "lower_cap"]
        raised = [e for e in acted if e["action"] == "raise_cap"]
        assert lowered and raised and caps[-1] == 16
        assert all(e["result"] == "ok" and e["fingerprints"] for e in lowered)
        assert all(b > a for a, b in itertools.pairwise(caps[len(lowered) :]))
        assert any(e["event"] == "resynced" for e in audit)
        metrics = httpx.get(f"{rem.url}/metrics").text
        for name in exported_names("remediator"):
            assert f"# HELP {name} " in metrics, name
    finally:
        if load:
            load.close()
        for proc in reversed(procs):
            proc.stop()
