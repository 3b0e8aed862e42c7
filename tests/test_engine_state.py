"""The engine state the plugin reports: one typed model (oomguard.engine_state) for the plugin
that writes it, the remediator that acts on it and the twin that watches it. Read strictly, as
untrusted input: a malformed state is refused with the field named, never a crash, and the
remediator holds that engine while the others go on."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.engine_state import EngineCoreState, EngineState, StateError, parse, parse_core
from oomguard.remediator.actuator import Target
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import Controller
from oomguard.remediator.webhook import parse as parse_webhook
from oomguard.vllm_plugin.api import aggregate
from tests.remediator_helpers import Engines, alert, config, payload

# One engine core's answer to the `oomguard_state` utility call, as vLLM 0.33 with the plugin
# sent it on this machine (tests/test_vllm_plugin.py reads the same from the real server).
CORE = {
    "engine": 0,
    "startup_max_num_seqs": 16,
    "gpu_memory_utilization": 0.9,
    "admission_cap": 12,
    "mode": "serving",
    "drained": False,
    "running": 3,
    "waiting": 1,
    "kv_cache_usage": 0.41,
    "admitted_total": 120,
    "finished_total": 116,
    "preemptions_total": 2,
    "shed_total": 0,
    "since_cap_change": {"seconds": 42.125, "admitted": 9, "finished": 8, "preemptions": 0},
}


def test_the_plugins_document_round_trips_through_the_model():
    doc = aggregate([CORE, {**CORE, "engine": 1, "admission_cap": 8, "mode": "draining"}])
    state = parse(json.loads(json.dumps(doc)))
    assert (state.admission_cap, state.startup_max_num_seqs, state.mode) == (8, 16, "draining")
    assert (state.running, state.waiting, state.preemptions_total) == (6, 2, 4)
    assert state.since_cap_change.admitted == 18 and len(state.engines) == 2
    assert not state.drained and not state.idle  # requests still run and wait
    assert state.document() == doc


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"admission_cap": 8.0}, "admission_cap"),  # a float is not an integer
        ({"admission_cap": "8"}, "admission_cap"),  # nor a string
        ({"admission_cap": True}, "admission_cap"),  # nor a boolean
        ({"admission_cap": 0}, "admission_cap"),  # a cap is at least 1
        ({"admission_cap": 2**64}, "admission_cap"),
        ({"mode": "paused"}, "mode"),
        ({"running": -1}, "running"),
        ({"drained": "false"}, "drained"),
        ({"kv_cache_usage": float("nan")}, "kv_cache_usage"),
        ({"since_cap_change": {"seconds": 1.0}}, "since_cap_change.admitted"),
        ({"since_cap_change": [1, 2]}, "since_cap_change"),
        ({"startup_max_num_seqs": None}, "startup_max_num_seqs"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(change, field):
    with pytest.raises(StateError, match=rf"\b{field}\b"):
        parse({**CORE, **change})


def test_what_a_reader_may_not_assume_stays_unknown():
    # a hand-written state for `explain --state`: the decision's fields only
    minimal = {k: CORE[k] for k in ("startup_max_num_seqs", "admission_cap", "mode")}
    state = parse({**minimal, "since_cap_change": CORE["since_cap_change"], "mode": "draining"})
    assert state.running is None and not state.idle  # a restart never assumes nothing runs
    assert parse({**CORE, "future_field": {"x": 1}}).admission_cap == 12  # newer plugins


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(sorted(CORE)),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(),
            st.text(max_size=4),
            st.lists(st.integers(), max_size=2),
            st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
        ),
    )
)
def test_any_json_is_a_state_or_a_state_error(overrides: dict[str, Any]):
    try:
        state = parse({**CORE, **overrides})
    except StateError as exc:
        assert str(exc).startswith("bad engine state")
    else:
        assert isinstance(state, EngineState)


def test_the_remediator_holds_an_engine_with_a_malformed_state_and_acts_on_the_others(tmp_path):
    class Broken(Engines):
        def state(self, target: Target) -> dict[str, Any]:
            good = super().state(target)
            if target.name == "a":
                return {**good, "admission_cap": "all of them"}
            return good

    engines = Broken(Engines.of("a", "b").engines)
    c = Controller(config(tmp_path, "a", "b"), engines, AuditLog(tmp_path / "audit.jsonl"))
    try:
        c.receive(
            parse_webhook(
                payload(alert("OomguardMemoryPressure", "a"), alert("OomguardMemoryPressure", "b"))
            )
        )
        c.reconcile()
        assert c.failed_passes == 0
        assert c.status["a"].mode == "held"
        assert "admission_cap" in (c.status["a"].error or "")
        assert [call for call in engines.calls if call[0] == "a"] == []
        assert ("b", "set_cap", 80) in engines.calls
        held = [e for e in c.audit.entries() if e["event"] == "held"]
        assert held[0]["target"] == "a" and held[0]["result"] == "bad_state"
    finally:
        c.close()


def test_the_engine_side_builds_its_answer_from_the_model():
    core = parse_core(CORE)
    assert isinstance(core, EngineCoreState)
    assert EngineCoreState.model_validate(core.model_dump(mode="json")) == core
