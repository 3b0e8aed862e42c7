"""Durable safety: the pause switch, cooldowns and the action budget survive kill -9 of the real
`oomguard remediator` process (found: a pause set through the API was lost on restart, and
`max_actions: 2` per hour allowed 12 actions across 5 restarts in 90 s). Also the payloads that
once answered 500, against the real process."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from oomguard.twin.processes import RemediatorProcess, free_port
from tests.remediator_helpers import alert, payload
from tests.vllm_server import TOKEN, VllmServer, require_vllm

RTOKEN = "durable-remediator-token"
BEARER = {"Authorization": f"Bearer {RTOKEN}"}


def post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/alertmanager", content=body, headers=BEARER, timeout=10)


def acted(path) -> list[dict]:
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if e["event"] == "acted"]


def base_config(work, targets: list[dict], **extra) -> dict:
    (work / "rtoken").write_text(RTOKEN)
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "auth": {"bearer_token_file": str(work / "rtoken")},
        "targets": targets,
        "audit_log": str(work / "audit.jsonl"),
        "actuation_attempts": 1,
        "actuation_timeout_seconds": 2,
        **extra,
    }


@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_the_pause_switch_survives_kill_9(tmp_path):
    config = base_config(tmp_path, [{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}])
    proc = RemediatorProcess(tmp_path, config)
    try:
        r = httpx.put(
            f"{proc.url}/v1/pause", json={"paused": True, "reason": "drill"}, headers=BEARER
        )
        assert r.status_code == 200 and r.json()["paused"]
        proc.kill()
        proc = RemediatorProcess(tmp_path, config)
        view = httpx.get(f"{proc.url}/v1/targets", headers=BEARER).json()
        assert view["paused"] is True
        assert "oomguard_remediator_paused 1.0" in httpx.get(f"{proc.url}/metrics").text
        httpx.put(f"{proc.url}/v1/pause", json={"paused": False, "reason": "done"}, headers=BEARER)
        proc.kill()
        proc = RemediatorProcess(tmp_path, config)
        assert httpx.get(f"{proc.url}/v1/targets", headers=BEARER).json()["paused"] is False
    finally:
        proc.kill()


def test_poison_payloads_are_400_and_counted_by_the_real_process(tmp_path):
    config = base_config(
        tmp_path,
        [{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}],
        max_body_bytes=2 * 1024 * 1024,
    )
    proc = RemediatorProcess(tmp_path, config)
    try:
        deep = b"[" * 100_000 + b"]" * 100_000
        r = post(proc.url, deep)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
        huge = b'{"version": "4", "alerts": [], "n": ' + b"7" * 5000 + b"}"
        assert post(proc.url, huge).status_code == 400
        surrogate = json.loads(payload(alert("OomguardMemoryPressure", "a")))
        surrogate["alerts"][0]["fingerprint"] = "\ud800"
        r = post(proc.url, json.dumps(surrogate).encode())
        assert r.status_code == 400 and "fingerprint" in r.json()["error"]
        assert post(proc.url, b" " * (2 * 1024 * 1024 + 1)).status_code == 413
        view = httpx.get(f"{proc.url}/v1/targets", headers=BEARER).json()
        assert view["firing_alerts"] == 0  # nothing was applied
        metrics = httpx.get(f"{proc.url}/metrics").text
        assert 'oomguard_remediator_webhook_requests_total{outcome="invalid"} 3.0' in metrics
        assert 'oomguard_remediator_webhook_requests_total{outcome="too_large"} 1.0' in metrics
        assert httpx.get(f"{proc.url}/healthz").status_code == 200
    finally:
        proc.kill()


@pytest.mark.slow
def test_cooldowns_and_the_action_budget_survive_kill_9(tmp_path):
    require_vllm()
    engine = VllmServer(
        "--max-num-seqs", "100", "--max-model-len", "2048", log=tmp_path / "vllm.log"
    )
    (tmp_path / "ptoken").write_text(TOKEN)
    target = {"name": "llama", "url": engine.url, "token_file": str(tmp_path / "ptoken")}
    config = base_config(
        tmp_path,
        [target],
        policy={"step_seconds": 0},
        safety={"cooldown_seconds": 0, "max_actions": 2, "window_seconds": 3600},
        reconcile_seconds=0.2,
    )
    proc = None

    def cap() -> int:
        state = httpx.get(
            f"{engine.url}/oomguard/v1/state",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=5,
        ).json()
        return int(state["admission_cap"])

    try:
        proc = RemediatorProcess(tmp_path, config)
        body = payload(alert("OomguardMemoryPressure", "llama"))
        assert post(proc.url, body).status_code == 200
        deadline = time.monotonic() + 30
        while len(acted(tmp_path / "audit.jsonl")) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cap() == 64  # 100 -> 80 -> 64, then the budget of 2 per hour is spent
        for _ in range(3):  # crash, come back, hear the same alert again (Alertmanager repeats)
            proc.kill()
            proc = RemediatorProcess(tmp_path, config)
            assert post(proc.url, body).status_code == 200
            time.sleep(2)  # ten passes
            assert cap() == 64
        assert len(acted(tmp_path / "audit.jsonl")) == 2
        metrics = httpx.get(f"{proc.url}/metrics").text
        assert 'oomguard_remediator_safety_limited_total{limit="rate_limit",target="llama"}' in (
            metrics
        )
    finally:
        if proc is not None:
            proc.kill()
        engine.stop()
