"""The plugin actuator against the real vLLM server, and its error handling against stand-ins."""

from __future__ import annotations

import json

import pytest

from oomguard.engine_state import parse
from oomguard.remediator.actuator import ActuatorError, DryRunActuator, PluginActuator, Target
from oomguard.remediator.policy import Observed
from tests.conftest import free_port
from tests.test_engine_state import CORE as STATE
from tests.vllm_server import PLAIN_GROUP, TOKEN

# the real engine is the session's plain one (tests/vllm_server.py), shared with
# tests/test_remediator_e2e.py: one start for both files, on one worker
pytestmark = pytest.mark.xdist_group(PLAIN_GROUP)


@pytest.fixture
def engine(plain_vllm):
    return Target("llama", plain_vllm.url, TOKEN, model="tiny")


@pytest.mark.slow
def test_reads_and_changes_a_real_engine(engine):
    act = PluginActuator()
    observed = Observed.from_state(act.state(engine))
    assert (observed.startup_max_num_seqs, observed.admission_cap) == (16, 16)
    assert act.set_cap(engine, 5)["admission_cap"] == 5
    assert act.drain(engine)["mode"] == "draining"
    assert act.drain(engine)["mode"] == "draining"  # idempotent
    assert act.resume(engine)["mode"] == "serving"
    assert act.set_cap(engine, 16)["admission_cap"] == 16


@pytest.mark.slow
def test_dry_run_reads_but_never_writes(engine):
    dry = DryRunActuator(PluginActuator())
    dry.set_cap(engine, 2)
    dry.drain(engine)
    state = PluginActuator().state(engine)
    assert state.admission_cap == 16 and state.mode == "serving"
    assert dry.intended == [("llama", "set_cap", 2), ("llama", "drain", None)]


@pytest.mark.slow
def test_a_wrong_token_is_an_auth_error_at_once(engine):
    with pytest.raises(ActuatorError) as exc:
        PluginActuator().set_cap(Target("llama", engine.url, "wrong"), 3)
    assert exc.value.reason == "auth"


def test_server_errors_are_retried_and_client_errors_are_not(local_server):
    server = local_server()
    calls = []

    def respond(handler):
        calls.append(handler.path)
        if len(calls) < 3:
            return 503, b"engine call failed", "text/plain"
        return 200, json.dumps(STATE).encode(), "application/json"

    server.responder = respond
    target = Target("t", server.url.removesuffix("/metrics"), "x")
    assert PluginActuator(backoff=0.01).state(target) == parse(STATE)
    assert len(calls) == 3 and calls[0] == "/oomguard/v1/state"

    calls.clear()
    server.responder = lambda h: calls.append(h.path) or (400, b"bad", "text/plain")
    with pytest.raises(ActuatorError) as exc:
        PluginActuator(backoff=0.01).state(target)
    assert exc.value.reason == "rejected" and len(calls) == 1


def test_unreachable_after_the_retries():
    target = Target("t", f"http://127.0.0.1:{free_port()}", "x")
    with pytest.raises(ActuatorError) as exc:
        PluginActuator(attempts=2, backoff=0.01, timeout=1).state(target)
    assert exc.value.reason == "unreachable"


def test_a_state_outside_the_contract_is_a_bad_state_naming_the_field(local_server):
    server = local_server(json.dumps({**STATE, "admission_cap": 16.5}))
    with pytest.raises(ActuatorError) as exc:
        PluginActuator().state(Target("t", server.url.removesuffix("/metrics")))
    assert exc.value.reason == "bad_state" and "admission_cap" in str(exc.value)


def test_a_non_json_answer_is_a_bad_response(local_server):
    server = local_server("<html>proxy error</html>")
    target = Target("t", server.url.removesuffix("/metrics"))
    with pytest.raises(ActuatorError) as exc:
        PluginActuator().state(target)
    assert exc.value.reason == "bad_response"
