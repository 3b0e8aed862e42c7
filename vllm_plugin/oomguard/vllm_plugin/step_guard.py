"""The step guard: vLLM never runs a step that cannot fit the memory it can get now.

Every other protection acts at one of two moments: when a pressure signal has travelled to the
remediator (seconds), or when a request is admitted (the request guard). Neither sees the moment
that kills an engine: the next scheduler step. When another process takes a few GiB of the GPU
within seconds, or fragmentation spikes, or a burst of prompts admitted one by one lands in one
step, the next full prefill chunk raises a CUDA OOM in milliseconds. vLLM already chooses each
step's token budget; here it chooses a smaller one when the full one would not fit.

Before each `Scheduler.schedule()` the guard compares the step's planned transient peak with
what the engine can get now:

    need(T) = activations(T) + prompt-logprobs logits(min(T, P)) + top-logprobs rows
    room    = device free + the allocator's reserved-but-free cache (not split into fragments)
              - margin

- activations(T): the field calibration (a per-step workspace plus a per-token part; guard.py,
  twin/physics.py) scaled so that a full step of `max_num_batched_tokens` equals the transient
  peak vLLM's own profile measured at start-up (`Worker.peak_activation_memory`);
- P: prompt tokens still to compute of the requests that asked for `prompt_logprobs` (their
  logits per chunk token: `prompt_logits_bytes_per_token`, the shared logits formula);
- top-logprobs: when a request in the engine asked for `logprobs`, the sampler's FP32
  log-softmax of every sampled row (beyond the profiled sampler);
- margin: `OOMGUARD_STEP_GUARD_MARGIN` (0.1) of the engine's idle slack (what a full step leaves
  free on a GPU with nothing else on it: a full step on a healthy engine always fits, whatever
  `gpu_memory_utilization`), plus the memory the trend says will be gone by the end of the step
  (how fast the room shrank over the last second x the longest recent step x 1.5): a neighbour
  that grows while the step runs meets the step's activations at their peak.

If the full step fits, nothing changes (the common case: one memory reading and a few float
operations). Otherwise the step gets the largest token budget that fits, through vLLM's own
knob, `Scheduler.max_num_scheduled_tokens`, set for that one `schedule()` call and restored
after it. vLLM's scheduler then does what it does with any budget: running requests first (in
order: decodes, then chunks of prefills in progress), then waiting ones, prompts chunked to what
is left (or left waiting when chunked prefill is off), every invariant it asserts intact
(`total <= max_num_scheduled_tokens`, budgets >= 0, running <= max_num_seqs). No request is
dropped or starved: each keeps its place and gets tokens as memory allows. Actions, by what the
budget leaves:

- `fewer_prefill_tokens`: prefill chunks shrink (decodes still run);
- `decode_only`: the budget covers decodes only;
- `wait`: not even a step of one token fits: the step is empty, and the engine waits
  `OOMGUARD_STEP_GUARD_WAIT_SECONDS` (0.01) before the next look (aborts, a drain and new
  requests are still processed between looks).

Each shrink is counted by action and reason (what the full step needed beyond the room:
`activations`, `prompt_logprobs_logits`, `sampling_logits`), published at once in the allocator
hand-off (the exporter raises the engine's pressure level from it: `step_guard_shrink` at level
2, `step_guard_stall` at level 3) and logged (at most once a second). A shrink is counted only
when it holds back work (the step's demand exceeds the budget).

Modes (`OOMGUARD_STEP_GUARD_MODE`): `off` (no reading at all), `observe` (default: decide and
count, change nothing), `enforce`. The memory is read in the engine's own process, from the
worker that runs there (vLLM's default single-GPU executor, and the twin); with workers in other
processes (tensor parallelism) the guard is inactive and says so once.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from oomguard.handoff import STEP_ACTIONS as ACTIONS
from oomguard.handoff import STEP_REASONS as REASONS
from oomguard.logits import LogitsShape
from oomguard.vllm_plugin.envvars import env_float

log = logging.getLogger("oomguard.vllm_plugin.step_guard")

MODES = ("off", "observe", "enforce")
__all__ = ["ACTIONS", "MODES", "REASONS", "StepCosts", "StepGuard", "plan"]
MARGIN = 0.1  # share of the engine's idle slack kept free
WAIT_SECONDS = 0.01
TREND_WINDOW_S = 1.0  # how far back the room's decline is measured
TREND_SAFETY = 1.5  # the trend's loss over the longest recent step, times this
STEP_TIMES_KEPT = 16  # recent step durations; the longest is the next step's estimate
TREND_NOISE = 64 * 2**20  # a decline this small is the allocator's cache moving, not a trend
TREND_EVERY_S = 0.02  # readings kept for the trend at most this often
TREND_SPAN_S = 0.2  # a decline measured over less than this is not a rate yet
LISTENER_EVERY_S = 0.2  # the hand-off is rewritten after a shrink at most this often

# Activations: the field calibration for Llama-3-8B (hidden 4096; no public source found), as in
# guard.py and twin/physics.py: an unchunked 30K-token prefill 11.2 GB, a 2,048-token chunk
# 2.1 GB: a per-token part (scaled by hidden size) and a per-step workspace.
_CAL_HIDDEN = 4096
ACT_PER_TOKEN = (11.2e9 - 2.1e9) / (30_000 - 2_048)
ACT_BASE = 2.1e9 - 2_048 * ACT_PER_TOKEN


def prompt_logits_bytes_per_token(vocab_size: int, dtype_bytes: int = 2) -> int:
    """Bytes a prefill chunk holds per prompt token with `prompt_logprobs` at its peak: the
    shared logits formula (oomguard.logits) that budget, preflight, the request guard and the
    twin use."""
    return LogitsShape(vocab_size, dtype_bytes).prompt_logprobs_bytes_per_token


def top_logprobs_bytes(rows: int, vocab_size: int) -> int:
    """The sampler's FP32 log-softmax of `rows` sampled rows (`logprobs` requested)."""
    return LogitsShape(vocab_size).top_logprobs_bytes(rows)


@dataclass(frozen=True)
class StepCosts:
    """Bytes of a step's transient peak, per part."""

    act_base: float
    act_per_token: float
    logits_per_token: int
    sample_row: int
    max_tokens: int

    @classmethod
    def calibrated(
        cls,
        profiled: int,
        max_tokens: int,
        hidden_size: int,
        vocab_size: int,
        dtype_bytes: int = 2,
    ) -> StepCosts:
        """The calibration's shape scaled to the profile vLLM measured for a full step
        (`profiled` <= 0: unmeasured, the calibration as it is)."""
        per_token = ACT_PER_TOKEN * hidden_size / _CAL_HIDDEN
        full = ACT_BASE + per_token * max_tokens
        scale = profiled / full if profiled > 0 else 1.0
        return cls(
            ACT_BASE * scale,
            per_token * scale,
            prompt_logits_bytes_per_token(vocab_size, dtype_bytes),
            top_logprobs_bytes(1, vocab_size),
            max_tokens,
        )

    def activation(self, tokens: int) -> float:
        return self.act_base + self.act_per_token * tokens if tokens > 0 else 0.0

    def need(self, tokens: int, plp_tokens: int = 0, sample_rows: int = 0) -> float:
        """The step's transient peak with `tokens` scheduled, `plp_tokens` of prompts with
        prompt_logprobs among them at most, and `sample_rows` rows of top logprobs."""
        if tokens <= 0:
            return 0.0
        return (
            self.activation(tokens)
            + self.logits_per_token * min(tokens, max(0, plp_tokens))
            + self.sample_row * max(0, sample_rows)
        )

    def tokens_within(self, room: float, plp_tokens: int = 0, sample_rows: int = 0) -> int:
        """The most tokens (up to a full step) whose step fits `room` bytes: the prompt-logprobs
        tokens counted first (the worst order)."""
        left = room - self.act_base - self.sample_row * max(0, sample_rows)
        if left < self.act_per_token:
            return 0
        plp = max(0, plp_tokens)
        both = self.act_per_token + self.logits_per_token
        if plp > 0 and left <= both * plp:
            tokens = math.floor(left / both)
        else:
            tokens = plp + math.floor((left - both * plp) / self.act_per_token)
        tokens = min(tokens, self.max_tokens)
        while tokens > 0 and self.need(tokens, plp, sample_rows) > room:  # float rounding
            tokens -= 1
        return max(0, tokens)


@dataclass(frozen=True)
class Room:
    """What the engine can get now for a step's transient memory, in bytes."""

    available: int  # device free + reserved-but-free allocator cache (no fragments)
    idle: int  # the same on this GPU with nothing else on it (the engine's own memory only)
    profiled: int = 0  # the transient peak vLLM profiled for a full step (0: unknown)


@dataclass(frozen=True)
class Plan:
    budget: int  # tokens the step may schedule; >= max_tokens: no change
    action: str | None  # None: the full step fits
    reason: str
    need: int  # bytes the full step would need
    room: int  # bytes it may use (available - margin)


def plan(
    costs: StepCosts,
    room: Room,
    margin: float,
    plp_tokens: int = 0,
    sample_rows: int = 0,
    decode_tokens: int = 0,
) -> Plan:
    """The step's budget: a full one if it fits `room.available - margin`, else the most tokens
    that fit (pure: the hook and the tests call the same function)."""
    usable = room.available - margin
    full = costs.need(costs.max_tokens, plp_tokens, sample_rows)
    if full <= usable:
        return Plan(costs.max_tokens, None, "fits", int(full), int(usable))
    budget = costs.tokens_within(usable, plp_tokens, sample_rows)
    plain = costs.need(costs.max_tokens)
    if plain + costs.sample_row * max(0, sample_rows) <= usable:
        reason = "prompt_logprobs_logits"
    elif plain <= usable and sample_rows > 0:
        reason = "sampling_logits"
    else:
        reason = "activations"
    if budget <= 0:
        action = "wait"
    elif budget <= decode_tokens:
        action = "decode_only"
    else:
        action = "fewer_prefill_tokens"
    return Plan(budget, action, reason, int(full), int(usable))


def margin_for(room: Room, costs: StepCosts, share: float) -> float:
    """`share` of the engine's idle slack: what a full step leaves free on this GPU with nothing
    else on it. A full step on a healthy engine therefore always fits."""
    return share * max(0.0, room.idle - costs.need(costs.max_tokens))


# -- what the hand-off publishes (one scheduler per process) -----------------------------------
_lock = threading.Lock()
_shrinks: dict[str, int] = {}  # "action/reason" -> count, since the process started
_listeners: list[Callable[[], object]] = []
_notified = [0.0]
_probe: Callable[[], dict[str, int] | None] | None = None


def shrinks() -> dict[str, int]:
    """Shrinks so far by "action/reason" (what the allocator hand-off carries)."""
    with _lock:
        return dict(_shrinks)


def on_shrink(listener: Callable[[], object]) -> None:
    """Call `listener` (a hand-off publisher) after each counted shrink."""
    with _lock:
        _listeners.append(listener)


def register_probe(probe: Callable[[], dict[str, int] | None]) -> None:
    """An in-process worker offers its memory reading (the twin's worker, a GPU worker)."""
    global _probe
    _probe = probe


def registered_probe() -> Callable[[], dict[str, int] | None] | None:
    return _probe


def _count(action: str, reason: str) -> None:
    with _lock:
        key = f"{action}/{reason}"
        _shrinks[key] = _shrinks.get(key, 0) + 1
        now = time.monotonic()
        if now - _notified[0] < LISTENER_EVERY_S:
            return  # the next periodic report carries it
        _notified[0] = now
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener()
        except Exception:  # a publisher's trouble never reaches the step
            log.debug("oomguard step guard: a shrink listener failed", exc_info=True)


def _reset_for_tests() -> None:
    global _probe
    with _lock:
        _shrinks.clear()
        _listeners.clear()
        _notified[0] = 0.0
    _probe = None


# -- the guard one scheduler holds -------------------------------------------------------------
@dataclass
class _Tracked:
    request: Any
    prompt_logprobs: bool
    logprobs: bool


class StepGuard:
    """Per-scheduler state: costs, the room's trend, step times, requests with logprobs."""

    def __init__(
        self,
        mode: str,
        probe: Callable[[], dict[str, int] | None],
        costs: Callable[[int], StepCosts],
        *,
        margin: float = MARGIN,
        wait_seconds: float = WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"OOMGUARD_STEP_GUARD_MODE must be one of {MODES}, not {mode!r}")
        self.mode, self.probe, self._make_costs = mode, probe, costs
        self.margin_share, self.wait_seconds, self.clock = margin, wait_seconds, clock
        self.costs: StepCosts | None = None
        self.tracked: dict[str, _Tracked] = {}
        self._rooms: deque[tuple[float, int]] = deque()  # (time, available)
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._last_look: float | None = None
        self._busy = False  # the last step scheduled tokens (steps run back to back)
        self._last_log = 0.0
        self.last: Plan | None = None
        self.looks = 0
        self.shrunk = 0
        self.cost_ns = 0  # time spent deciding, memory reading included (bench/step_guard.py)
        self.cost_max_ns = 0
        self.decisions = 0
        self.step_s = 0.0  # time of the steps timed (busy steps, look to look)
        self.steps_timed = 0

    @classmethod
    def from_env(
        cls, probe: Callable[[], dict[str, int] | None], costs: Callable[[int], StepCosts]
    ) -> StepGuard:
        return cls(
            os.environ.get("OOMGUARD_STEP_GUARD_MODE", "observe").strip() or "observe",
            probe,
            costs,
            margin=env_float("OOMGUARD_STEP_GUARD_MARGIN", MARGIN, 0.0, 1.0),
            wait_seconds=env_float("OOMGUARD_STEP_GUARD_WAIT_SECONDS", WAIT_SECONDS, 0.0, 1.0),
        )

    # -- requests whose step needs more than activations -----------------------------------------
    def track(self, request: Any) -> None:
        params = getattr(request, "sampling_params", None)
        if params is None:
            return
        plp = getattr(params, "prompt_logprobs", None) is not None
        lp = getattr(params, "logprobs", None) is not None
        if plp or lp:
            self.tracked[str(request.request_id)] = _Tracked(request, plp, lp)

    def _extras(self) -> tuple[int, int]:
        """(prompt tokens still to compute with prompt_logprobs, whether any request in the
        engine asked for top logprobs); finished requests are dropped on the way."""
        plp = 0
        logprobs = False
        for key in [k for k, t in self.tracked.items() if t.request.is_finished()]:
            del self.tracked[key]
        for t in self.tracked.values():
            r = t.request
            if t.prompt_logprobs and r.num_computed_tokens < r.num_prompt_tokens:
                plp += max(0, r.num_tokens - r.num_computed_tokens)
            logprobs = logprobs or t.logprobs
        return plp, logprobs

    # -- the room's trend ----------------------------------------------------------------------
    def _trend_loss(self, now: float, available: int) -> float:
        """Bytes the room may lose before the step ends: how fast it declined lately (the
        steepest decline from any reading of the last TREND_WINDOW_S at least TREND_SPAN_S
        old to now, in bytes/s: a ramp that just began is not averaged away) x the longest
        recent step x TREND_SAFETY."""
        rooms = self._rooms
        if not rooms or now - rooms[-1][0] >= TREND_EVERY_S:
            rooms.append((now, available))
        while len(rooms) > 2 and now - rooms[1][0] >= TREND_WINDOW_S:
            rooms.popleft()
        if self._room_max(rooms) - available <= TREND_NOISE:
            return 0.0  # steady (the common case): nothing declined
        rate = 0.0
        for t, room in rooms:
            span = now - t
            if span < TREND_SPAN_S:
                break
            rate = max(rate, (room - available) / span)
        step = max(self._step_times, default=0.0)
        return rate * step * TREND_SAFETY

    @staticmethod
    def _room_max(rooms: deque[tuple[float, int]]) -> int:
        return max(room for _, room in rooms)

    # -- the hook ------------------------------------------------------------------------------
    def budget(self, scheduler: Any) -> int | None:
        """The token budget for the next step, or None to leave vLLM's own (the full step
        fits, the guard is off or observing, or the memory cannot be read)."""
        if self.mode == "off":
            return None
        started = time.perf_counter_ns()
        try:
            return self._budget(scheduler)
        finally:
            spent = time.perf_counter_ns() - started
            self.cost_ns += spent
            self.cost_max_ns = max(self.cost_max_ns, spent)
            self.decisions += 1

    def stats(self) -> dict[str, Any]:
        """What GET /oomguard/v1/step-guard shows: the guard's own cost against its steps'."""
        last = self.last
        return {
            "looks": self.looks,
            "shrunk": self.shrunk,
            "decisions": self.decisions,
            "cost_ns_total": self.cost_ns,
            "cost_ns_max": self.cost_max_ns,
            "steps_timed": self.steps_timed,
            "step_seconds_total": round(self.step_s, 6),
            "last": None
            if last is None
            else {
                "budget": last.budget,
                "action": last.action,
                "reason": last.reason,
                "need_bytes": last.need,
                "room_bytes": last.room,
            },
        }

    def after(self, scheduled_tokens: int) -> None:
        """What the step scheduled (its time until the next look is a step's time only when
        it ran something: an idle engine waits for requests between looks)."""
        self._busy = scheduled_tokens > 0

    def _budget(self, scheduler: Any) -> int | None:
        now = self.clock()
        if self._last_look is not None and self._busy:
            self._step_times.append(now - self._last_look)
            self.step_s += now - self._last_look
            self.steps_timed += 1
        self._last_look = now
        reading = self.probe()
        if not reading:
            return None
        room = Room(int(reading["available"]), int(reading["idle"]), int(reading["profiled"]))
        if self.costs is None:
            self.costs = self._make_costs(room.profiled)
        costs = self.costs
        self.looks += 1
        plp, logprobs = self._extras() if self.tracked else (0, False)
        rows = 0
        if logprobs:
            running, waiting = scheduler.get_request_counts()
            rows = min(int(scheduler.max_num_running_reqs), running + waiting)
        margin = margin_for(room, costs, self.margin_share) + self._trend_loss(now, room.available)
        step = plan(costs, room, margin, plp, rows)
        if step.action == "fewer_prefill_tokens" and step.budget <= _decoding(scheduler):
            step = replace(step, action="decode_only")  # counted only when shrinking
        self.last = step
        if step.action is None:
            return None
        current = int(scheduler.max_num_scheduled_tokens)
        budget = min(step.budget, current)
        if budget >= current or _demand(scheduler, current) <= budget:
            return budget if self.mode == "enforce" else None  # nothing held back: no shrink
        self.shrunk += 1
        _count(step.action, step.reason)
        if now - self._last_log >= 1.0:
            self._last_log = now
            log.warning(
                "oomguard step guard (%s): %s (%s): a full step needs %.2f GiB, %.2f GiB "
                "available with the margin: budget %d of %d tokens",
                self.mode,
                step.action,
                step.reason,
                step.need / 2**30,
                step.room / 2**30,
                budget,
                current,
            )
        return budget if self.mode == "enforce" else None


def _decoding(scheduler: Any) -> int:
    """Running requests past their prompt (one token each this step)."""
    return sum(1 for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens)


def _demand(scheduler: Any, cap: int) -> int:
    """Tokens the step would schedule with no limit but `cap` (stops counting at `cap`)."""
    total = 0
    queues: Iterable[Any] = (
        scheduler.running,
        scheduler.waiting,
        getattr(scheduler, "kv_holding_waiting", ()),
    )
    for queue in queues:
        for r in queue:
            total += max(0, int(r.num_tokens_with_spec) - int(r.num_computed_tokens))
            if total >= cap:
                return cap
    return total
