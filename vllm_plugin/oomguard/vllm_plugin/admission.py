"""The request guard in vLLM's API server: per-request decisions against cached headroom.

Every request vLLM accepts passes `InputProcessor.assign_request_id(request)` once, after
tokenization and parameter processing, before it is sent to an engine: completions, chat,
responses, `/invocations` and any other route alike. The guard wraps that function, so it sees
the exact prompt length and the final `n`, `logprobs`, `prompt_logprobs` and `max_tokens`.

A streamed response has already begun (HTTP 200) by then: vLLM's routes call
`AsyncLLM.generate` before they return the stream, but its body (and so `assign_request_id`)
runs only when the stream is read, and an error there reaches the client as an SSE error event,
not as 400 / 503. So the guard also wraps `generate` itself and decides at the call, from the
rendered prompt's token ids, whenever the route passes them (completions and chat do); such a
request is not decided again at `assign_request_id`.

Headroom comes from the engines (`oomguard_headroom`, every `refresh` seconds, in the background);
a decision reads only the cached figures (bench/guard_cost.py measures it). Stale or missing
figures mean blind: the guard admits (blind is not a reason to refuse traffic).

Modes (`OOMGUARD_GUARD_MODE`): `off` (no hook, no refresh), `observe` (default: decide, count and
log; never refuse), `enforce` (defer answers 429 + Retry-After, or 503: refusals.py; reject
answers 400 naming the parameter and the limit). `OOMGUARD_GUARD_KV_MARGIN` (e.g. 0.15) turns
on the per-request KV budget.
`OOMGUARD_GUARD_STEP_MARGIN` (default 0.15, a share of the engine's idle headroom) is what a
prefill step must leave free to be admitted while fragmentation or a neighbour holds memory.

Decisions are exported on vLLM's /metrics as
`oomguard_guard_decisions_total{mode, action, reason}`, and the headroom each engine reported as
`oomguard_guard_headroom_bytes{engine, kind="now"|"idle"}`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter, Gauge

from oomguard import vllm_seam as vllm
from oomguard.catalog import spec
from oomguard.vllm_plugin.envvars import env_float
from oomguard.vllm_plugin.guard import (
    MODES,
    STEP_MARGIN,
    Decision,
    EngineShape,
    Headroom,
    ModelMemory,
    RequestShape,
    TransientCosts,
    decide,
    step_room,
)
from oomguard.vllm_plugin.ledger import Ledger
from oomguard.vllm_plugin.refusals import defer_status

log = logging.getLogger("oomguard.vllm_plugin.admission")

# What `decide` answers for a request with no transient need (the same reasons as decide's).
ADMIT_PROFILED = Decision("admit", "no_transient")
ADMIT_BLIND = Decision("admit", "no_headroom_data")

_DECISIONS = spec("oomguard_guard_decisions_total")
_HEADROOM = spec("oomguard_guard_headroom_bytes")
_RESERVED = spec("oomguard_guard_reserved_bytes")
_RELEASES = spec("oomguard_guard_reservations_released_total")
# A reservation no path released ends after this long (seconds): the last resort, counted.
RESERVATION_TTL = 120.0
# prometheus_client adds `_total` to a counter's name itself.
DECISIONS = Counter(
    _DECISIONS.name.removesuffix("_total"), _DECISIONS.help, list(_DECISIONS.labels)
)
HEADROOM = Gauge(_HEADROOM.name, _HEADROOM.help, list(_HEADROOM.labels), multiprocess_mode="min")
RESERVED = Gauge(_RESERVED.name, _RESERVED.help, multiprocess_mode="livesum")
RELEASES = Counter(_RELEASES.name.removesuffix("_total"), _RELEASES.help, list(_RELEASES.labels))


class Guard:
    """Cached engine figures plus the decision hook."""

    def __init__(
        self,
        mode: str = "observe",
        refresh: float = 0.5,
        stale_after: float = 5.0,
        kv_margin: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        step_margin: float = STEP_MARGIN,
        reservation_ttl: float = RESERVATION_TTL,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"OOMGUARD_GUARD_MODE must be one of {MODES}, not {mode!r}")
        self.mode, self.refresh, self.stale_after = mode, refresh, stale_after
        self.kv_margin, self.clock, self.step_margin = kv_margin, clock, step_margin
        self.model: ModelMemory | None = None
        self.engine: EngineShape | None = None
        self.headrooms: list[Headroom] = []
        self.last: Decision | None = None
        # cached at each update for the per-request fast path (bench/guard.py measures it):
        # the model's constants, the oldest figure's time, the best idle and tightest now, the
        # largest step margin, and whether every engine can run a full profiled step now
        self._costs: TransientCosts | None = None
        self._oldest = self._newest = float("-inf")
        self._best_idle = self._tightest_now = self._margin_max = 0
        self._roomy = True
        self._counters: dict[tuple[str, str], Any] = {}  # labelled children: no lookup per request
        # transient memory admitted, not yet prefilled (vllm_plugin/ledger.py)
        self.ledger = Ledger(reservation_ttl, clock)

    @classmethod
    def from_env(cls) -> Guard:
        """The guard as the environment configures it; a ValueError names the bad variable."""
        margin = os.environ.get("OOMGUARD_GUARD_KV_MARGIN", "").strip()
        return cls(
            mode=os.environ.get("OOMGUARD_GUARD_MODE", "observe").strip() or "observe",
            refresh=env_float("OOMGUARD_GUARD_REFRESH_SECONDS", 0.5, 0.01, 3600.0),
            kv_margin=env_float("OOMGUARD_GUARD_KV_MARGIN", 0.0, 0.0, 10.0) if margin else None,
            step_margin=env_float("OOMGUARD_GUARD_STEP_MARGIN", STEP_MARGIN, 0.0, 1.0),
            reservation_ttl=env_float(
                "OOMGUARD_GUARD_RESERVATION_TTL_SECONDS", RESERVATION_TTL, 1.0, 86_400.0
            ),
        )

    # -- engine figures ------------------------------------------------------------------------
    def update(self, reports: list[dict[str, Any]]) -> None:
        """Take what `oomguard_headroom` returned from each engine."""
        now = self.clock()
        headrooms = []
        for r in reports:
            model = ModelMemory(int(r["vocab_size"]), int(r["hidden_size"]))
            engine = EngineShape(
                int(r["max_num_batched_tokens"]),
                bool(r["chunked_prefill"]),
                int(r["block_size"]),
                int(r["total_kv_blocks"]),
            )
            if model != self.model or engine != self.engine or self._costs is None:
                self._costs = TransientCosts.of(model, engine)
            self.model, self.engine = model, engine
            memory = r.get("memory")
            if not memory:
                continue  # an engine that cannot measure its memory: no figures, no refusals
            headrooms.append(
                Headroom(
                    int(memory["now"]),
                    int(memory["idle"]),
                    int(r["free_kv_blocks"]),
                    int(r["total_kv_blocks"]),
                    now,
                )
            )
            label = str(r.get("engine", 0))
            HEADROOM.labels(label, "now").set(int(memory["now"]))
            HEADROOM.labels(label, "idle").set(int(memory["idle"]))
        self.headrooms = headrooms
        if headrooms:
            self._oldest = min(h.measured_at for h in headrooms)
            self._newest = max(h.measured_at for h in headrooms)
            self._best_idle = max(h.idle for h in headrooms)
            self._tightest_now = min(h.now for h in headrooms)
            self._margin_max = max(int(self.step_margin * max(0, h.idle)) for h in headrooms)
            # a prompt that fills the step (step need 0) fits every engine: so does any
            # request without extra transient (its step is at most the profiled one)
            self._roomy = all(h.now >= step_room(0, h, self.step_margin) for h in headrooms)

    def fresh(self) -> list[Headroom]:
        now = self.clock()
        return [h for h in self.headrooms if now - h.measured_at <= self.stale_after]

    def _any_fresh(self) -> bool:
        return bool(self.headrooms) and self.clock() - self._newest <= self.stale_after

    def _needs_nothing_extra(self, params: Any, prompt_tokens: int, engine: EngineShape) -> bool:
        """True when `decide` would find no transient need and no KV budget applies."""
        return (
            self.kv_margin is None
            and params.prompt_logprobs is None
            and not params.logprobs
            and (engine.chunked_prefill or prompt_tokens <= engine.max_num_batched_tokens)
        )

    def _admits(self, params: Any, prompt_tokens: int, reserved: int) -> Decision | None:
        """`decide`'s admit for a request that fits every engine now, from the cached figures
        (all of them fresh) and constants; None when `decide` must look (a refusal, a KV
        budget, stale figures), so every refusal carries `decide`'s full reasons. `reserved`:
        what the ledger holds (a request with a transient of its own fits only beside it)."""
        costs = self._costs
        if (
            costs is None
            or self.kv_margin is not None
            or not self.headrooms
            or self.clock() - self._oldest > self.stale_after
        ):
            return None
        n = int(params.n or 1)
        best_of = getattr(params, "best_of", None)
        if best_of:
            n = max(n, int(best_of))
        need, step = costs.needs(
            prompt_tokens, n, bool(params.logprobs), params.prompt_logprobs is not None
        )
        if need == 0 and self._roomy:
            return ADMIT_PROFILED
        now = self._tightest_now - reserved
        if (
            need == 0
            or need > now
            or need > self._best_idle
            or step + self._margin_max > now  # its step may not fit: decide looks
        ):
            return None
        return Decision("admit", "fits", need_bytes=need, limit_bytes=now)

    async def run(self, fetch: Callable[[], Awaitable[list[dict[str, Any]]]]) -> None:
        """Refresh the figures forever (a background task of the API server)."""
        while True:
            try:
                self.sweep()
                self.update(await fetch())
            except asyncio.CancelledError:
                raise
            except Exception:  # an engine restarting or busy: keep the last figures, go stale
                log.debug("oomguard guard: headroom refresh failed", exc_info=True)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # a cancel something below swallowed: the server is shutting down, and a loop
                # that outlives it keeps vLLM from exiting (its supervisor never restarts it)
                raise asyncio.CancelledError
            await asyncio.sleep(self.refresh)

    # -- decisions -----------------------------------------------------------------------------
    def check(self, request: Any, hold_as: str | None = None) -> Decision | None:
        """Decide one EngineCoreRequest; raise in enforce mode. None: not a generate request.
        An admitted request with a transient of its own is held in the ledger under
        `hold_as` (when given; else the caller holds it once it knows its key: `hold`)."""
        params = getattr(request, "sampling_params", None)
        if params is None or self.model is None or self.engine is None:
            return None
        prompt = getattr(request, "prompt_token_ids", None)
        prompt_tokens = len(prompt) if prompt is not None else 0
        fast: Decision | None = None
        reserved = self.ledger.held()
        if self._needs_nothing_extra(params, prompt_tokens, self.engine):
            # The common request (no logprobs, fits the profiled step): what `decide` answers
            # without building its estimate, which is most of a decision's cost (bench/guard.py),
            # unless an engine cannot run a full profiled step now (fragmentation, a neighbour).
            if not self._any_fresh():
                fast = ADMIT_BLIND
            elif self._roomy:
                fast = ADMIT_PROFILED
        else:
            fast = self._admits(params, prompt_tokens, reserved)
        if fast is not None:
            decision = fast
        else:
            shape = RequestShape(
                prompt_tokens=prompt_tokens,
                max_tokens=int(params.max_tokens or 0),
                n=max(int(params.n or 1), int(getattr(params, "best_of", None) or 1)),
                logprobs=int(params.logprobs or 0) if params.logprobs is not None else 0,
                prompt_logprobs=params.prompt_logprobs is not None,
            )
            decision = decide(
                shape,
                self.model,
                self.engine,
                self.fresh(),
                self.kv_margin,
                self.step_margin,
                reserved,
            )
        self.last = decision
        key = (decision.action, decision.reason)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = DECISIONS.labels(self.mode, *key)
        counter.inc()
        if decision.action != "admit":
            log.info(
                "oomguard guard (%s): %s request %s: %s",
                self.mode,
                decision.action,
                getattr(request, "request_id", "?"),
                decision.message,
            )
        if self.mode == "enforce":
            raise_for(decision)
        if hold_as is not None:
            self.hold(hold_as, decision)
        return decision

    def hold(self, key: str, decision: Decision | None) -> None:
        """Hold what an admitted request's transient needs until its prefill is done."""
        if decision is not None and decision.action == "admit" and decision.need_bytes > 0:
            self.ledger.reserve(key, decision.need_bytes)
            RESERVED.set(self.ledger.held())

    def released(self, key: str, how: str) -> None:
        """The request held under `key` is prefilled or gone (vllm_plugin/ledger.py)."""
        if self.ledger.release(key, how):
            RESERVED.set(self.ledger.held())
            RELEASES.labels(how).inc()

    def ended(self, external: str, how: str = "ended") -> None:
        """`generate(external)` ended (served, aborted, failed) or its stream was dropped."""
        if self.ledger.release_request(external, how):
            RESERVED.set(self.ledger.held())
            RELEASES.labels(how).inc()

    def sweep(self) -> None:
        """Expire what no path released (counted: a non-zero count says a path leaks)."""
        expired = self.ledger.released["expired"]
        held = self.ledger.held()
        gone = self.ledger.released["expired"] - expired
        if gone:
            RELEASES.labels("expired").inc(gone)
            log.warning("oomguard guard: %d reservation(s) expired unreleased", gone)
        RESERVED.set(held)


def raise_for(decision: Decision) -> None:
    """vLLM's own exceptions, so its handlers answer 400 (with `param`) or the deferral status
    (vllm_plugin/refusals.py: 429 by default)."""
    if decision.action == "reject":
        raise vllm.load(vllm.VALIDATION_ERROR)(
            decision.message, parameter=decision.parameter, value=decision.limit_bytes
        )
    if decision.action == "defer":
        # 429 unless configured otherwise: what routers retry without ejecting the engine
        raise vllm.load(vllm.GRACEFUL_HTTP_ERROR)(decision.message, defer_status())


_guard: Guard | None = None
# request ids decided when `generate` was called (their `assign_request_id` skips the guard);
# bounded: a stream never read leaves its id behind
_decided_early: collections.OrderedDict[str, None] = collections.OrderedDict()
_EARLY_KEPT = 4096


def install(guard: Guard) -> bool:
    """Wrap `InputProcessor.assign_request_id` once per process; `guard` decides from now on."""
    global _guard
    _guard = guard
    if guard.mode == "off":
        return False
    try:
        InputProcessor = vllm.load(vllm.INPUT_PROCESSOR)
    except ImportError:
        log.warning("oomguard guard: vLLM's InputProcessor is not importable; guard inactive")
        return False
    original = InputProcessor.__dict__["assign_request_id"]
    assign = original.__func__ if isinstance(original, staticmethod) else original
    if getattr(assign, "_oomguard_wrapper", False):
        return True  # already hooked in this process; the hook reads the current guard

    def assign_request_id(request: Any) -> None:
        rid = getattr(request, "request_id", None)
        decided = isinstance(rid, str) and _decided_early.pop(rid, False) is None
        decision = None
        if _guard is not None and not decided:
            with _not_a_guard_failure():
                decision = _guard.check(request)
        result = assign(request)
        if _guard is not None and isinstance(rid, str):
            with _not_a_guard_failure():
                # held under vLLM's internal id, the one the engine's outputs carry
                internal = str(request.request_id)
                if decided:
                    _guard.ledger.rekey(rid, internal)
                else:
                    _guard.hold(internal, decision)
                    _guard.ledger.alias(rid, internal)
        return result

    assign_request_id._oomguard_wrapper = True  # type: ignore[attr-defined]
    InputProcessor.assign_request_id = staticmethod(assign_request_id)  # type: ignore[method-assign]
    _install_early()
    _install_prefilled()
    return True


def _install_prefilled() -> None:
    """Wrap `OutputProcessor.process_outputs` once: the engine's first output for a request
    means its prefill is done (EngineCore sends none for a partial prefill), so what the ledger
    holds for it is released. Costs one length check per batch while nothing is held."""
    try:
        OutputProcessor = vllm.load(vllm.OUTPUT_PROCESSOR)
    except ImportError:
        return
    process = OutputProcessor.__dict__.get("process_outputs")
    if process is None or getattr(process, "_oomguard_wrapper", False):
        return

    def process_outputs(self: Any, engine_core_outputs: Any, *a: Any, **k: Any) -> Any:
        guard = _guard
        if guard is not None and len(guard.ledger):
            with _not_a_guard_failure():
                for output in engine_core_outputs:
                    if output.request_id in guard.ledger:
                        guard.released(output.request_id, "prefilled")
        return process(self, engine_core_outputs, *a, **k)

    process_outputs._oomguard_wrapper = True  # type: ignore[attr-defined]
    OutputProcessor.process_outputs = process_outputs  # type: ignore[method-assign]


def _might_hold(params: Any) -> bool:
    """Whether a request with these parameters may be held in the ledger (a transient of its
    own: prompt or top logprobs, or a prompt beyond an unchunked engine's step)."""
    guard = _guard
    if guard is None or params is None:
        return False
    engine = guard.engine
    return (
        getattr(params, "prompt_logprobs", None) is not None
        or bool(getattr(params, "logprobs", None))
        or (engine is not None and not engine.chunked_prefill)
    )


async def _ending(inner: Any, guard: Guard, external: str) -> Any:
    """`generate`'s stream, passed through; when it ends (served, aborted, cancelled, failed,
    closed) the ledger lets go of what it held for the request."""
    try:
        async for output in inner:
            yield output
    finally:
        guard.ended(external)


class _Rendered:
    """What `Guard.check` reads of a request, from `generate`'s arguments."""

    __slots__ = ("prompt_token_ids", "request_id", "sampling_params")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self.request_id, self.prompt_token_ids, self.sampling_params = (
            request_id,
            prompt_token_ids,
            params,
        )


def _token_ids(prompt: Any) -> list[int] | None:
    """The prompt's token ids when `generate` was given them (a rendered prompt or a request)."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    if ids is None and not isinstance(prompt, (dict, str)):
        ids = getattr(prompt, "prompt_token_ids", None)
    return ids if isinstance(ids, list) else None


def _install_early() -> None:
    """Wrap `AsyncLLM.generate` once: decide before a streamed response begins (see above)."""
    try:
        AsyncLLM = vllm.load(vllm.ASYNC_LLM)
    except ImportError:
        return
    generate = AsyncLLM.__dict__.get("generate")
    if generate is None or getattr(generate, "_oomguard_wrapper", False):
        return

    def early(
        self: Any, prompt: Any, sampling_params: Any, request_id: str, *a: Any, **k: Any
    ) -> Any:
        guard = _guard
        ids = _token_ids(prompt)
        if guard is not None and ids is not None and isinstance(request_id, str):
            with _not_a_guard_failure():
                rendered = _Rendered(request_id, ids, sampling_params)
                if guard.check(rendered, hold_as=request_id) is not None:
                    _decided_early[request_id] = None
                    if len(_decided_early) > _EARLY_KEPT:
                        _decided_early.popitem(last=False)
        stream = generate(self, prompt, sampling_params, request_id, *a, **k)
        if guard is None or not isinstance(request_id, str) or not _might_hold(sampling_params):
            return stream  # nothing it could hold: vLLM's own generator, untouched
        ending = _ending(stream, guard, request_id)
        # a stream never read (its body never runs, so neither does `finally`) lets go when
        # it is dropped
        weakref.finalize(ending, guard.ended, request_id, "dropped")
        return ending

    early._oomguard_wrapper = True  # type: ignore[attr-defined]
    AsyncLLM.generate = early  # type: ignore[method-assign]


@contextlib.contextmanager
def _not_a_guard_failure() -> Any:
    """A bug in the guard must never fail a request: only its own decisions may."""
    refusals = (vllm.load(vllm.VALIDATION_ERROR), vllm.load(vllm.GRACEFUL_HTTP_ERROR))

    try:
        yield
    except refusals:
        raise
    except Exception:
        log.warning("oomguard guard: decision failed; request admitted", exc_info=True)
