"""The request guard's ledger (issue 25, item 5): what it admitted is held until the request's
prefill is done, every decision sees it, and no path leaks a reservation.

The property test drives the guard (its real hook, `Guard.check`) through arbitrary
interleavings of admissions, prefills completing, generate ending, streams dropped, clock steps
and headroom refreshes, and checks after every step that what the ledger holds never exceeds the
room the guard admitted it against."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from oomguard.vllm_plugin.admission import Guard
from oomguard.vllm_plugin.guard import RequestShape, estimate
from oomguard.vllm_plugin.ledger import Ledger
from tests.test_vllm_plugin_guard import ENGINE, GIB, LLAMA3, engine_request, reports

ROOM_GIB = 3.16  # the room beyond a full step (twin H100 at gmu 0.96)
# prompt_logprobs bytes per prompt token, as the guard counts them (the shared logits formula)
ROW = estimate(RequestShape(1000, prompt_logprobs=True), LLAMA3, ENGINE).logits // 1000
# a prompt whose logits take 60 % of the room: one fits, two do not
PAIR = int(0.6 * ROOM_GIB * GIB) // ROW


def plp_request(prompt: int, rid: str = "cmpl-1", logprobs: int | None = None):
    request = engine_request(prompt, prompt_logprobs=1)
    request.request_id = rid
    request.sampling_params.logprobs = logprobs
    return request


def test_a_decision_sees_what_was_admitted_before_it():
    """The issue's reproduction, decided in the hook: 3.16 GiB of room, two prompt_logprobs
    requests (4,000 tokens, 1.91 GiB each at 4 B a logit) a moment apart: the first is admitted
    and held, the second deferred; once the first's prefill is done, the second is admitted."""
    guard = Guard("observe")
    guard.update(reports(ROOM_GIB, ROOM_GIB))
    first = guard.check(plp_request(PAIR, "a"), hold_as="a")
    assert first is not None and first.action == "admit"
    assert guard.ledger.held() == PAIR * ROW
    second = guard.check(plp_request(PAIR, "b"), hold_as="b")
    assert second is not None and second.action == "defer"
    assert second.reason == "prompt_logprobs_logits"
    assert "admitted for requests before it" in second.message
    assert guard.ledger.held() == PAIR * ROW  # a deferred request holds nothing
    guard.released("a", "prefilled")
    assert guard.ledger.held() == 0
    third = guard.check(plp_request(PAIR, "b"), hold_as="b")
    assert third is not None and third.action == "admit"


def test_reservations_never_turn_into_rejections_and_plain_requests_ignore_them():
    guard = Guard("observe")
    guard.update(reports(ROOM_GIB, ROOM_GIB))
    big = int(0.9 * ROOM_GIB * GIB) // ROW
    guard.check(plp_request(big, "a"), hold_as="a")  # 90 % of the room held
    # fits idle: deferred while the first is held, never rejected
    assert guard.check(plp_request(big, "b"), hold_as="b").action == "defer"
    # a request without a transient of its own adds nothing to the step beyond the profile
    assert guard.check(engine_request(8000), hold_as="c").action == "admit"
    assert guard.ledger.held() == big * ROW


def test_every_path_releases_and_an_expiry_is_counted():
    clock = [0.0]
    ledger = Ledger(ttl=60, clock=lambda: clock[0])
    ledger.reserve("ext-1", 100)  # decided when generate was called
    ledger.rekey("ext-1", "ext-1-abcd1234")  # assign_request_id made its internal id
    assert ledger.held() == 100 and "ext-1-abcd1234" in ledger and "ext-1" not in ledger
    assert ledger.release("ext-1-abcd1234", "prefilled") == 100
    assert ledger.release_request("ext-1") == 0  # generate ends after: nothing twice
    ledger.reserve("ext-2-i", 50)
    ledger.alias("ext-2", "ext-2-i")
    assert ledger.release_request("ext-2", "ended") == 50  # aborted before its prefill
    ledger.reserve("ext-3", 70)
    assert ledger.release_request("ext-3", "dropped") == 70  # a stream never read
    ledger.reserve("leak", 30)
    clock[0] = 59
    assert ledger.held() == 30
    clock[0] = 61
    assert ledger.held() == 0 and len(ledger) == 0
    assert ledger.released == {"prefilled": 1, "ended": 1, "dropped": 1, "expired": 1}


class Interleavings(RuleBasedStateMachine):
    """Admissions, prefills, ends, drops, refreshes and time, in any order."""

    @initialize(now=st.floats(0.5, 12), idle=st.floats(0, 6))
    def start(self, now: float, idle: float) -> None:
        self.clock = [1000.0]
        self.guard = Guard("observe", clock=lambda: self.clock[0], reservation_ttl=30)
        self.now_gib, self.idle_gib = now, now + idle
        self.guard.update(reports(self.now_gib, self.idle_gib))
        self.n = 0
        self.held: dict[str, int] = {}  # what the model says each live request holds
        self.at: dict[str, float] = {}

    def room(self) -> int:
        """The tightest engine's `now` the guard decides against (bytes)."""
        return min(h.now for h in self.guard.fresh())

    @rule(
        prompt=st.integers(1, 20_000),
        plp=st.booleans(),
        logprobs=st.sampled_from([None, 0, 1, 5]),
        n=st.integers(1, 4),
    )
    def admit(self, prompt: int, plp: bool, logprobs: int | None, n: int) -> None:
        self.n += 1
        key = f"r{self.n}"
        request = engine_request(prompt, prompt_logprobs=1 if plp else None, n=n)
        request.request_id = key
        request.sampling_params.logprobs = logprobs
        before = self.guard.ledger.held()
        room = self.room()
        decision = self.guard.check(request, hold_as=key)
        assert decision is not None
        after = self.guard.ledger.held()
        if decision.action == "admit" and decision.need_bytes > 0:
            # the property: what is admitted, with everything held before it, fits the room
            assert after == before + decision.need_bytes
            assert after <= room, (after, room, decision)
            self.held[key] = decision.need_bytes
            self.at[key] = self.clock[0]
        else:
            assert after == before

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), how=st.sampled_from(["prefilled", "ended", "dropped"]))
    def finish(self, data: st.DataObject, how: str) -> None:
        key = data.draw(st.sampled_from(sorted(self.held)))
        if how == "prefilled":
            self.guard.released(key, how)
        else:
            self.guard.ended(key, how)
        del self.held[key]

    @rule(key=st.sampled_from(["r1", "nobody"]))
    def release_twice_or_unknown(self, key: str) -> None:
        """A second release (generate ending after the prefill released it), or one for a
        request never held, changes nothing."""
        if key in self.held:
            return
        before = self.guard.ledger.held()
        self.guard.released(key, "prefilled")
        self.guard.ended(key)
        assert self.guard.ledger.held() == before

    @rule(seconds=st.floats(0, 40))
    def time_passes(self, seconds: float) -> None:
        self.clock[0] += seconds
        self.guard.update(reports(self.now_gib, self.idle_gib))  # figures kept fresh
        self.guard.sweep()
        for key in [k for k, at in self.at.items() if self.clock[0] - at > 30]:
            self.held.pop(key, None)
            self.at.pop(key)

    @rule(now=st.floats(0, 12))
    def refresh(self, now: float) -> None:
        """The engine reports a new headroom (a neighbour came or left)."""
        self.now_gib = now
        self.idle_gib = max(self.idle_gib, now)
        self.guard.update(reports(self.now_gib, self.idle_gib))

    @invariant()
    def ledger_matches(self) -> None:
        if not hasattr(self, "guard"):
            return
        assert self.guard.ledger.held() == sum(v for k, v in self.held.items() if k in self.at)


Interleavings.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_interleavings_never_admit_beyond_the_room = Interleavings.TestCase


def test_the_hooks_release_on_prefill_on_end_and_on_a_dropped_stream():
    """On vLLM's own classes: a streamed request decided when `generate` is called is held
    under its external id, re-keyed by `assign_request_id`, released by the engine's first
    output in the OutputProcessor; a stream dropped unread releases what it held; a stream
    that ends (here: fails at once) releases too."""
    pytest.importorskip("vllm")
    import asyncio

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor

    from oomguard.vllm_plugin import admission

    guard = admission.Guard("observe")
    guard.update(reports(ROOM_GIB, ROOM_GIB))
    assert admission.install(guard)
    params = plp_request(PAIR).sampling_params
    rendered = {"type": "token", "prompt_token_ids": list(range(PAIR))}

    # 1. decided at the call, re-keyed at assign, released by the engine's first output
    stream = AsyncLLM.generate(object(), rendered, params, "cmpl-x")
    assert guard.ledger.held() == PAIR * ROW and "cmpl-x" in guard.ledger
    request = plp_request(PAIR, "cmpl-x")
    request.external_req_id = None
    InputProcessor.assign_request_id(request)
    internal = request.request_id
    assert internal != "cmpl-x" and internal in guard.ledger
    processor = OutputProcessor(None, log_stats=False)
    processor.process_outputs([SimpleNamespace(request_id=internal)])  # no state: ignored
    assert guard.ledger.held() == 0
    assert guard.ledger.released["prefilled"] == 1
    del stream
    gc.collect()
    assert guard.ledger.released["dropped"] == 0  # nothing left to drop

    # 2. a stream never read: dropped, released
    stream = AsyncLLM.generate(object(), rendered, params, "cmpl-y")
    assert guard.ledger.held() == PAIR * ROW
    del stream
    gc.collect()
    assert guard.ledger.held() == 0 and guard.ledger.released["dropped"] == 1

    # 3. a stream that ends (vLLM's generate fails at once on this stand-in engine)
    stream = AsyncLLM.generate(object(), rendered, params, "cmpl-z")
    assert guard.ledger.held() == PAIR * ROW

    async def read() -> None:
        async for _ in stream:
            pass

    with pytest.raises(Exception):  # noqa: B017 - whatever vLLM raises without an engine
        asyncio.run(read())
    assert guard.ledger.held() == 0 and guard.ledger.released["ended"] == 1

    # 4. a request that holds nothing is vLLM's own generator, untouched
    plain = engine_request(100).sampling_params
    plain.logprobs = None
    untouched = AsyncLLM.generate(object(), {"prompt_token_ids": [1, 2]}, plain, "cmpl-p")
    assert untouched.__qualname__ == "AsyncLLM.generate"
