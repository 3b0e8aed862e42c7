"""A pass reads many engines at once (PluginActuator.states, aiohttp on its own loop): in
parallel, each engine's answer or its own error, with the same retry rules as a single read."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from oomguard.engine_state import parse
from oomguard.remediator.actuator import (
    ActuatorError,
    DryRunActuator,
    PluginActuator,
    Target,
    read_states,
)
from tests.conftest import free_port
from tests.remediator_helpers import Engines

# a serving engine's state document (the plugin's GET /oomguard/v1/state)
STATE = {
    "startup_max_num_seqs": 16,
    "admission_cap": 16,
    "mode": "serving",
    "running": 0,
    "waiting": 0,
    "since_cap_change": {"seconds": 60.0, "admitted": 0, "finished": 0, "preemptions": 0},
}
SERVING = json.dumps(STATE).encode()


def base(server) -> str:  # type: ignore[no-untyped-def]
    return server.url.removesuffix("/metrics")


@pytest.fixture
def actuator():  # type: ignore[no-untyped-def]
    act = PluginActuator(backoff=0.01, timeout=2)
    yield act
    act.close()


def test_each_engine_gets_its_own_answer_or_its_own_error(local_server, actuator):
    server = local_server()
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def respond(handler):  # type: ignore[no-untyped-def]
        who = handler.path.split("/")[1]  # /<who>/oomguard/v1/state
        with lock:
            calls[who] = calls.get(who, 0) + 1
            n = calls[who]
        assert handler.headers["Authorization"] == f"Bearer token-{who}"
        if who == "flaky" and n < 3:
            return 503, b"engine call failed", "text/plain"
        if who == "refused":
            return 400, b"bad", "text/plain"
        if who == "proxy":
            return 200, b"<html>proxy error</html>", "text/html"
        if who == "list":
            return 200, b"[1, 2]", "application/json"
        if who == "garbled":  # JSON, but not a state: refused like any unusable answer
            return 200, b'{"mode": "serving"}', "application/json"
        # each engine its own answer: its cap is the length of its name
        return 200, json.dumps({**STATE, "admission_cap": len(who)}).encode(), "application/json"

    server.responder = respond
    names = ["ok", "flaky", "refused", "proxy", "list", "garbled"]
    targets = [Target(n, f"{base(server)}/{n}", f"token-{n}") for n in names]
    down = Target("down", f"http://127.0.0.1:{free_port()}", "x")
    got = actuator.states([*targets, down])
    assert got[0] == parse({**STATE, "admission_cap": 2})  # parsed into the state model
    assert got[1] == parse({**STATE, "admission_cap": 5}) and calls["flaky"] == 3  # 5xx retried
    reasons = [g.reason if isinstance(g, ActuatorError) else None for g in got[2:]]
    assert reasons == ["rejected", "bad_response", "bad_response", "bad_state", "unreachable"]
    assert "since_cap_change" in str(got[5])  # the missing field is named
    assert calls["refused"] == 1 and calls["garbled"] == 1  # 4xx and bad states: not retried
    # the single-read path says the same about the same engine
    with pytest.raises(ActuatorError) as exc:
        actuator.state(targets[3])
    assert exc.value.reason == "bad_response"


def test_reads_run_in_parallel_up_to_the_concurrency_limit(local_server):
    server = local_server()
    inflight, most = [0], [0]
    lock = threading.Lock()

    def slow(_handler):  # type: ignore[no-untyped-def]
        with lock:
            inflight[0] += 1
            most[0] = max(most[0], inflight[0])
        time.sleep(0.2)
        with lock:
            inflight[0] -= 1
        return 200, SERVING, "application/json"

    server.responder = slow
    act = PluginActuator(concurrency=8, timeout=5)
    try:
        targets = [Target(f"e{i}", f"{base(server)}/e{i}") for i in range(32)]
        started = time.monotonic()
        got = act.states(targets)
        took = time.monotonic() - started
    finally:
        act.close()
    assert got == [parse(STATE)] * 32
    assert most[0] <= 8  # bounded
    assert took < 32 * 0.2 / 2, took  # one at a time would take 6.4 s; 8 at once about 0.8 s


def timed_states(act: PluginActuator, server: Any, *names: str) -> tuple[list, float]:
    """One batch read of the named engines on `server` (each at /NAME), its results and its
    wall time; the actuator is closed after."""
    try:
        started = time.monotonic()
        got = act.states([Target(n, f"{base(server)}/{n}") for n in names])
        return got, time.monotonic() - started
    finally:
        act.close()


def test_a_read_that_hangs_times_out_without_holding_up_the_others(local_server):
    server = local_server()

    def respond(handler):  # type: ignore[no-untyped-def]
        if "/hang/" in handler.path:
            time.sleep(3)
        return 200, SERVING, "application/json"

    server.responder = respond
    act = PluginActuator(attempts=1, timeout=0.5)
    got, took = timed_states(act, server, "hang", "ok")
    assert isinstance(got[0], ActuatorError) and got[0].reason == "timeout"
    assert got[1] == parse(STATE)
    assert took < 2.5


def test_a_slow_engine_holds_a_pass_for_one_timeout_not_one_per_attempt(local_server):
    """The fleet bench's 9.6 s pass beside a 3 s engine: a read that timed out was retried,
    so a pass waited attempts x timeout + backoffs (3 + 0.2 + 3 + 0.4 + 3 s). All attempts
    together now get one timeout; the next pass reads the engine again."""
    server = local_server()
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def respond(handler):  # type: ignore[no-untyped-def]
        who = handler.path.split("/")[1]
        with lock:
            calls[who] = calls.get(who, 0) + 1
            n = calls[who]
        if who == "slow":
            time.sleep(1.5)
        if who == "flaky" and n < 3:  # a fast failure is still retried within the timeout
            return 503, b"engine call failed", "text/plain"
        return 200, SERVING, "application/json"

    server.responder = respond
    act = PluginActuator(attempts=3, timeout=0.6, backoff=0.05)
    got, took = timed_states(act, server, "slow", "flaky")
    assert isinstance(got[0], ActuatorError) and got[0].reason == "timeout"
    assert calls["slow"] == 1  # not asked again within the pass
    assert got[1] == parse(STATE) and calls["flaky"] == 3
    # before: 0.6 + 0.05 + 0.6 + 0.1 + 0.6 = 1.95 s at the least
    assert took < 1.3, took


def test_actuators_without_a_batch_read_are_read_one_by_one():
    engines = Engines.of("a", "b", "c")
    engines.down.add("c")
    targets = [Target("a", "http://a"), Target("b", "http://b"), Target("c", "http://c")]
    got = read_states(engines, targets)
    assert [g["admission_cap"] for g in got[:2]] == [100, 100]
    assert isinstance(got[2], ActuatorError) and got[2].reason == "unreachable"
    # a dry run reads through the real reader's batch path
    dry = DryRunActuator(engines)
    assert read_states(dry, targets[:1])[0]["admission_cap"] == 100
