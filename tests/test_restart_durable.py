"""Write-ahead restarts: the real `oomguard remediator` process is killed (SIGKILL,
crashpoints.py) at each crash point of a restart action, against a real vLLM (twin executor)
under the real supervisor (`oomguard serve`), and a fresh remediator on the same audit log
carries on. The same alert episode never restarts the engine twice, an intent never committed
counts against the restart budget and is reconciled with the supervisor's flags, and the engine
is never left drained. One supervised engine serves the module's four cases (a restart of the
twin costs 20-60 s here; at most two of the cases restart it)."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oomguard.lab.processes import RemediatorProcess, SupervisedVllm, free_port
from oomguard.remediator.crashpoints import POINTS
from tests.remediator_helpers import alert, payload
from tests.vllm_server import TOKEN, require_vllm

RTOKEN = "restart-durable-remediator-token"
BEARER = {"Authorization": f"Bearer {RTOKEN}"}
pytestmark = pytest.mark.xdist_group("restart-durable-vllm")  # one engine for the module


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if e["event"] == kind]


def until(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass  # the engine or the remediator is between processes
        time.sleep(0.3)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def withheld(audit: Path) -> list[dict[str, Any]]:
    """The restarts the safety limits refused."""
    return [e for e in events(audit, "withheld") if e["action"] == "restart"]


def plugin_state(engine: SupervisedVllm) -> dict[str, Any]:
    r = httpx.get(f"{engine.url}/oomguard/v1/state", timeout=5)
    r.raise_for_status()
    return dict(r.json())


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisedVllm]:
    require_vllm()
    work = tmp_path_factory.mktemp("supervised")
    (work / "stoken").write_text("restart-durable-supervisor-token")
    gpu = work / "gpu.json"
    gpu.write_text(json.dumps({"neighbour_bytes": 0}))
    proc = SupervisedVllm(
        work,
        "--max-num-seqs",
        "16",
        "--gpu-memory-utilization",
        "0.9",
        "--max-model-len",
        "2048",
        plugin_token=TOKEN,
        supervisor_token_file=work / "stoken",
        env={"OOMGUARD_TWIN_GPU": "H100", "OOMGUARD_TWIN_STATE_FILE": str(gpu)},
    )
    try:
        yield proc
    finally:
        proc.stop()


def remediator_config(work: Path, engine: SupervisedVllm) -> dict[str, Any]:
    (work / "rtoken").write_text(RTOKEN)
    (work / "ptoken").write_text(TOKEN)
    (work / "stoken").write_text(engine.token)
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "auth": {"bearer_token_file": str(work / "rtoken")},
        "targets": [
            {
                "name": "llama",
                "url": engine.url,
                "token_file": str(work / "ptoken"),
                "restart": {
                    "supervisor": {"url": engine.api, "token_file": str(work / "stoken")},
                    "drain_timeout_seconds": 30,
                    "ready_timeout_seconds": 240,
                },
            }
        ],
        "audit_log": str(work / "audit.jsonl"),
        # one restart per hour: an uncommitted restart intent must use it up; a single box
        "safety": {
            "cooldown_seconds": 0,
            "max_actions": 1,
            "window_seconds": 3600,
            "allow_last_replica": True,
        },
        "actuation_attempts": 1,
        "actuation_timeout_seconds": 5,
        "reconcile_seconds": 0.2,
    }


def post(url: str, body: bytes) -> None:
    r = httpx.post(f"{url}/v1/alertmanager", content=body, headers=BEARER, timeout=10)
    assert r.status_code == 200, r.text


def post_before_kill(url: str, body: bytes) -> None:
    """Post to a remediator told to die: the reconciler acts on its own thread as soon as the
    webhook is recorded, so the SIGKILL may land before the 200 is written. Either is a delivery
    (Alertmanager would retry the lost answer); the audit log, checked after, says what happened."""
    with contextlib.suppress(httpx.RemoteProtocolError, httpx.ReadError):
        post(url, body)


@pytest.mark.slow  # a real engine restarted under a supervisor: minutes
@pytest.mark.parametrize("point", POINTS)
def test_kill_9_at_each_crash_point_of_a_restart_restarts_once_per_episode(
    tmp_path: Path, engine: SupervisedVllm, point: str
) -> None:
    """A CUDA OOM alert asks for a restart; the remediator dies by SIGKILL at `point` of that
    restart action; a fresh remediator hears the same alert again, then a new episode of it.

    Expected: before_intent (nothing recorded) - the fresh process restarts the engine once;
    after_intent (intent durable, sequence not started) - no restart, ever, for that episode, and
    the intent is reconciled `not_applied`; after_engine (sequence thread started, commit not
    recorded) - at most one restart (the dead process's thread may or may not have reached the
    supervisor), reconciled `applied` exactly when it did; after_commit - committed, so nothing to
    reconcile, at most one restart. At every point the replayed episode is not even wanted (no
    restart withheld for it), the one restart per hour is spent (a new episode is refused by the
    budget), the audit holds exactly one restart intent, nothing is left uncommitted, and the
    engine ends serving, not drained (a sequence killed after its drain is resumed).

    At most once, not exactly once: a restart killed before the supervisor was asked is not
    tried again for its episode (its intent answered the episode, and counts)."""
    until(lambda: engine.status()["ready"] and plugin_state(engine), 300, "the engine serving")
    # the module's engine at full admission: an earlier case's restart brings it back at the
    # first re-admission stage, and a fresh remediator would take its next stage (an action: it
    # would reach this case's crash point before the alert is even sent)
    full = plugin_state(engine)["startup_max_num_seqs"]
    r = httpx.put(
        f"{engine.url}/oomguard/v1/admission",
        json={"cap": full},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    r.raise_for_status()
    before = engine.status()
    audit = tmp_path / "audit.jsonl"
    config = remediator_config(tmp_path, engine)
    body = payload(alert("OomguardCudaOomObserved", "llama", oomguard_action="restart"))

    proc = RemediatorProcess(tmp_path, config, env={"OOMGUARD_CRASH_AT": point})
    try:
        post_before_kill(proc.url, body)
        until(lambda: proc.proc.poll() is not None, 30, f"the kill at {point}")
        assert proc.proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
    restart_intents = [e for e in events(audit, "intent") if e["action"] == "restart"]
    assert len(restart_intents) == (0 if point == "before_intent" else 1), restart_intents

    proc = RemediatorProcess(tmp_path, config)
    try:
        post(proc.url, body)  # Alertmanager repeats the firing alert
        if point == "before_intent":  # nothing recorded: this process restarts the engine
            until(
                lambda: any(
                    e["action"] == "wait_ready" and e["result"] == "ok"
                    for e in events(audit, "restart")
                ),
                300,
                "the fresh remediator's restart",
            )

        def view() -> dict[str, Any]:
            r = httpx.get(f"{proc.url}/v1/targets", headers=BEARER, timeout=10)
            return dict(r.json())

        until(lambda: view()["audit"]["uncommitted_intents"] == 0, 30, "the reconciliation")

        def settled() -> bool:
            # a restart the dead process's thread asked for has saved the new flags before it
            # stops the old engine: settled once the generation agrees with the flags, the
            # supervisor's engine is up and nothing holds it drained
            s = engine.status()
            restarted = s["flags"]["current"] != before["flags"]["current"]
            return (
                s["generation"] == before["generation"] + int(restarted)
                and s["ready"]
                and plugin_state(engine)["mode"] == "serving"
                and view()["targets"]["llama"]["mode"] != "restarting"
            )

        until(settled, 300, "the engine serving again")
        # the same episode again: answered already, so no restart is even wanted (not one
        # withheld by the budget: the episode, not the budget, says no)
        post(proc.url, body)
        time.sleep(2)  # ten passes
        assert withheld(audit) == []
        replayed = engine.status()["generation"]
        # a new episode: wanted, and refused because the one restart per hour is spent
        again = alert("OomguardCudaOomObserved", "llama", start=600, oomguard_action="restart")
        post(proc.url, payload(again))
        until(lambda: withheld(audit), 10, "the new episode's restart withheld")
        time.sleep(2)  # ten passes: a restart the budget still allowed would have started
        metrics = httpx.get(f"{proc.url}/metrics", timeout=10).text
        final = view()
    finally:
        proc.kill()

    after = engine.status()
    restarts = after["generation"] - before["generation"]
    assert after["generation"] == replayed
    assert {e["result"] for e in withheld(audit)} == {"rate_limit"}
    expected = {
        "before_intent": {1},
        "after_intent": {0},
        "after_engine": {0, 1},
        "after_commit": {0, 1},
    }
    assert restarts in expected[point], (point, restarts)
    assert (after["flags"]["current"] != before["flags"]["current"]) == bool(restarts)
    intents = [e for e in events(audit, "intent") if e["action"] == "restart"]
    assert len(intents) == 1, intents  # one restart per hour, whether committed or not
    assert intents[0]["after"]["episodes"] == [intents[0]["after"]["episode"]]
    commits = [e for e in events(audit, "acted") if e["action"] == "restart"]
    # committed by the process that died after its commit, or by the fresh one
    assert len(commits) == (1 if point in ("before_intent", "after_commit") else 0), commits
    assert all(e["intent"] == intents[0]["intent"] for e in commits)
    reconciled = events(audit, "reconciled")
    if point in ("after_intent", "after_engine"):  # never committed: the supervisor says
        assert [(e["action"], e["result"]) for e in reconciled] == [
            ("restart", "applied" if restarts else "not_applied")
        ]
        assert reconciled[0]["intent"] == intents[0]["intent"]
    else:
        assert reconciled == []
    assert final["audit"]["uncommitted_intents"] == 0
    assert 'oomguard_remediator_safety_limited_total{limit="rate_limit",target="llama"}' in (
        metrics
    )
    assert plugin_state(engine)["mode"] == "serving"  # never left drained
