"""Durable safety: the pause switch, cooldowns and the action budget survive kill -9 of the real
`oomguard remediator` process at any point of an action, and a full audit disk (found: a pause
set through the API was lost on restart; `max_actions: 2` per hour allowed 12 actions across 5
restarts in 90 s; with kill -9 as the engine answered, 5 caps were applied and none audited; on
a full audit disk 3 caps were applied, none audited, /healthz 200). Also the payloads that once
answered 500, against the real process. One real vLLM engine serves the module's tests."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from oomguard.lab.processes import RemediatorProcess, free_port
from oomguard.remediator.crashpoints import POINTS
from tests.faults import fill, free, pad, small_fs
from tests.remediator_helpers import alert, payload
from tests.vllm_server import TOKEN, VllmServer, require_vllm

RTOKEN = "durable-remediator-token"
BEARER = {"Authorization": f"Bearer {RTOKEN}"}
PLUGIN = {"Authorization": f"Bearer {TOKEN}"}
STEPS = [100, 80, 64, 51, 40, 32, 25]  # the cap after each lowering step from 100 (factor 0.8)
pytestmark = pytest.mark.xdist_group("durable-vllm")  # one engine for the module's tests


def post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/alertmanager", content=body, headers=BEARER, timeout=10)


def events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if kind is None or e["event"] == kind]


def acted(path: Path) -> list[dict[str, Any]]:
    return events(path, "acted")


def base_config(work: Path, targets: list[dict], **extra: Any) -> dict:
    (work / "rtoken").write_text(RTOKEN)
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "auth": {"bearer_token_file": str(work / "rtoken")},
        "targets": targets,
        "audit_log": str(work / "audit.jsonl"),
        "actuation_attempts": 1,
        "actuation_timeout_seconds": 5,
        **extra,
    }


def until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


class Engine:
    """The module's real vLLM engine (twin executor, plugin), its cap reset between tests."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.url = server.url

    def cap(self) -> int:
        state = httpx.get(f"{self.url}/oomguard/v1/state", headers=PLUGIN, timeout=10).json()
        return int(state["admission_cap"])

    def reset(self) -> None:
        r = httpx.put(
            f"{self.url}/oomguard/v1/admission", json={"cap": 100}, headers=PLUGIN, timeout=10
        )
        assert r.status_code == 200, r.text
        assert self.cap() == 100

    def target(self, work: Path, url: str | None = None) -> dict[str, Any]:
        (work / "ptoken").write_text(TOKEN)
        return {"name": "llama", "url": url or self.url, "token_file": str(work / "ptoken")}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    require_vllm()
    work = tmp_path_factory.mktemp("engine")
    server = VllmServer("--max-num-seqs", "100", "--max-model-len", "2048", log=work / "vllm.log")
    try:
        yield Engine(server)
    finally:
        server.stop()


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


BUDGET = {"cooldown_seconds": 0, "max_actions": 2, "window_seconds": 3600}


@pytest.mark.slow
def test_cooldowns_and_the_action_budget_survive_kill_9(tmp_path, engine):
    engine.reset()
    config = base_config(
        tmp_path,
        [engine.target(tmp_path)],
        policy={"step_seconds": 0},
        safety=BUDGET,
        reconcile_seconds=0.2,
    )
    proc = None
    try:
        proc = RemediatorProcess(tmp_path, config)
        body = payload(alert("OomguardMemoryPressure", "llama"))
        assert post(proc.url, body).status_code == 200
        assert until(lambda: len(acted(tmp_path / "audit.jsonl")) >= 2, 30)
        assert engine.cap() == 64  # 100 -> 80 -> 64, then the budget of 2 per hour is spent
        for _ in range(3):  # crash, come back, hear the same alert again (Alertmanager repeats)
            proc.kill()
            proc = RemediatorProcess(tmp_path, config)
            assert post(proc.url, body).status_code == 200
            time.sleep(2)  # ten passes
            assert engine.cap() == 64
        assert len(acted(tmp_path / "audit.jsonl")) == 2
        metrics = httpx.get(f"{proc.url}/metrics").text
        assert 'oomguard_remediator_safety_limited_total{limit="rate_limit",target="llama"}' in (
            metrics
        )
    finally:
        if proc is not None:
            proc.kill()


def lowered(cap: int) -> int:
    """How many lowering steps took the engine from 100 to `cap`."""
    return STEPS.index(cap)


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_kill_9_at_each_crash_point_of_an_action_keeps_the_budget(tmp_path, engine, point):
    """Write-ahead: the remediator is killed (SIGKILL, crashpoints.py) at one point of its
    first action, twice, then runs on. At every point the engine was lowered no more than the
    budget allows and every step in force on it has a durable intent; intents never committed
    are reconciled with the engine by the next process."""
    engine.reset()
    audit = tmp_path / "audit.jsonl"
    config = base_config(
        tmp_path,
        [engine.target(tmp_path)],
        policy={"step_seconds": 0},
        safety=BUDGET,
        reconcile_seconds=0.2,
    )
    body = payload(alert("OomguardMemoryPressure", "llama"))
    for _ in range(2):
        proc = RemediatorProcess(tmp_path, config, env={"OOMGUARD_CRASH_AT": point})
        try:
            assert post(proc.url, body).status_code == 200
            assert until(lambda p=proc: p.proc.poll() is not None, 20), "not killed at " + point
            assert proc.proc.returncode == -signal.SIGKILL
        finally:
            proc.kill()
    proc = RemediatorProcess(tmp_path, config)
    try:
        assert post(proc.url, body).status_code == 200
        time.sleep(2.5)  # a dozen passes: whatever the budget still allows is done
        view = httpx.get(f"{proc.url}/v1/targets", headers=BEARER).json()
    finally:
        proc.kill()
    steps = lowered(engine.cap())
    intents = events(audit, "intent")
    expected = {"before_intent": 2, "after_intent": 0, "after_engine": 2, "after_commit": 2}
    assert steps == expected[point], (point, steps, events(audit))
    assert len(intents) == 2  # the budget: two intents, whether or not they were committed
    assert {e["after"]["cap"] for e in intents} >= set(STEPS[1 : steps + 1])
    reconciled = events(audit, "reconciled")
    if point == "after_intent":  # recorded, never sent: the engine says not applied
        assert [e["result"] for e in reconciled] == ["not_applied", "not_applied"]
    elif point == "after_engine":  # sent, never committed: the engine says applied
        assert [e["result"] for e in reconciled] == ["applied", "applied"]
    else:
        assert reconciled == []
    assert view["audit"]["uncommitted_intents"] == 0


class KillingProxy:
    """An HTTP proxy in front of the engine that kills the remediator (SIGKILL to its process
    group) the moment the engine has applied a cap change, before the answer is relayed: a
    crash between the engine call and anything the remediator does after it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.victim: int | None = None
        self.kills = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization",)}
                if body is not None:
                    headers["Content-Type"] = "application/json"
                r = httpx.request(
                    self.command, proxy.upstream + self.path, content=body, headers=headers
                )
                if self.command == "PUT" and self.path.endswith("/admission"):
                    proxy.kill()
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_PUT = do_POST = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kill(self) -> None:
        if self.victim is not None:
            try:
                os.killpg(os.getpgid(self.victim), signal.SIGKILL)
                self.kills += 1
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_kill_9_as_the_engine_answers_never_exceeds_the_budget(tmp_path, engine):
    """Defect 4 as found: kill -9 each time the engine has applied a cap, 5 restarts, max_actions
    2 per hour. Before: 5 caps applied, 0 audited (the engine was called before anything was
    recorded). Now: 2 caps, each with its intent on disk before the engine was called."""
    engine.reset()
    proxy = KillingProxy(engine.url)
    audit = tmp_path / "audit.jsonl"
    config = base_config(
        tmp_path,
        [engine.target(tmp_path, proxy.url)],
        policy={"step_seconds": 0},
        safety=BUDGET,
        reconcile_seconds=0.2,
    )
    body = payload(alert("OomguardMemoryPressure", "llama"))
    try:
        for _ in range(5):
            proc = RemediatorProcess(tmp_path, config)
            proxy.victim = proc.proc.pid
            try:
                assert post(proc.url, body).status_code == 200
                until(lambda p=proc: p.proc.poll() is not None, 4)  # killed, or out of budget
            finally:
                proc.kill()
    finally:
        proxy.close()
    steps = lowered(engine.cap())
    assert steps <= 2, f"{steps} caps applied with a budget of 2"
    intents = events(audit, "intent")
    assert steps == 2 and len(intents) == 2 and proxy.kills == 2
    assert [e["after"]["cap"] for e in intents] == [80, 64]


@pytest.mark.slow
def test_a_full_audit_disk_stops_actions_and_degrades_healthz(tmp_path, engine):
    """Defect 4, full disk: no action without a durable intent. While the audit file system is
    full the next cap step is not taken, /healthz is 503 degraded and the metrics say why; when
    space comes back the remediator carries on where it stopped."""
    engine.reset()
    with small_fs(tmp_path / "auditfs", 512 * 1024) as fs:
        config = base_config(
            tmp_path,
            [engine.target(tmp_path)],
            policy={"step_seconds": 3},
            safety={"cooldown_seconds": 0, "max_actions": 10, "window_seconds": 3600},
            reconcile_seconds=0.2,
            audit_log=str(fs / "audit.jsonl"),
        )
        proc = RemediatorProcess(tmp_path, config)
        filler = None
        try:
            assert post(proc.url, payload(alert("OomguardMemoryPressure", "llama"))).status_code
            assert until(lambda: len(acted(fs / "audit.jsonl")) >= 1, 20)
            filler = fill(fs)
            pad(fs / "audit.jsonl")
            time.sleep(5)  # past the next step's time: it would have been taken by now
            assert engine.cap() == 80
            health = httpx.get(f"{proc.url}/healthz", timeout=5)
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            assert "audit log not writable" in " ".join(health.json()["problems"])
            metrics = httpx.get(f"{proc.url}/metrics", timeout=5).text
            assert "oomguard_remediator_audit_writable 0.0" in metrics
            assert (
                'oomguard_remediator_actions_total{action="lower_cap",result="unrecorded",'
                'target="llama"}' in metrics
            )
            # a webhook that cannot be recorded is refused: Alertmanager retries it
            r = post(proc.url, payload(alert("OomguardMemoryPressure", "llama", start=60)))
            assert r.status_code == 503
            free(filler)
            filler = None
            assert until(lambda: engine.cap() == 64, 20)
            assert until(lambda: httpx.get(f"{proc.url}/healthz").status_code == 200, 10)
            intents = events(fs / "audit.jsonl", "intent")
            assert [e["after"]["cap"] for e in intents][:2] == [80, 64]
        finally:
            if filler is not None:
                free(filler)
            proc.kill()
