"""The request-level OOM guard: does this request's own transient memory fit the engine?

vLLM sizes its KV pool after a profiling step of `max_num_batched_tokens` tokens, so a normal
step's activations are already budgeted. What is not: the logits of `prompt_logprobs` (every
prompt token of a prefill chunk x the vocabulary x 10 B for a BF16 model at the peak, the one
formula in oomguard.logits: 8K tokens x 128K vocab = 10.5 GB), a prompt longer than the
profiled step when chunked prefill is off, and top `logprobs` (an FP32 log-softmax row per
sequence, `n`/`best_of` of them). Sampling itself is profiled (a logits row for each of
`max_num_seqs` sequences), so a request with none of these needs nothing extra and is always
admitted while the engine can still run its profiled step. The guard estimates those
from the request and the model, compares them with the engine's live headroom (published by the
engine: free device memory plus allocator cache that is reserved but free and not split into
fragments, minus the profiled step), and decides:

- admit: it fits now;
- defer: it fits on this engine, not now (a neighbour, fragmentation): 503 + Retry-After, the
  gateway retries elsewhere or later;
- defer too: the engine cannot run this request's prefill step now. Its profiled step is budgeted
  only while nothing else holds the memory it was profiled in: when allocator fragmentation or a
  neighbour eats the room the step's activations need (`now` falls towards zero or below), a
  request whose prefill fills the step (a long prompt's chunk, or a short prompt near the budget)
  waits until `now` covers its step plus a margin (`STEP_MARGIN` of the idle headroom, never more
  than the idle headroom itself, so a request that fits an idle engine never waits forever);
- reject: it can never fit on this engine: 400 naming the parameter and the limit (the field
  runbook's gateway input cap, automatic).

Optionally (long-context deployments) a per-request KV budget: the prompt plus `max_tokens` (and
each extra sequence's output) with a safety margin (the field's 15 %) must fit the free KV blocks,
or the request is deferred; more than the whole pool is rejected.

Pure functions over small dataclasses: no vLLM import, no I/O, a few integer operations per
request (bench/guard measures the cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from oomguard.logits import LogitsShape

Action = Literal["admit", "defer", "reject"]
MODES = ("off", "observe", "enforce")

# Activation bytes per token per unit of hidden size, calibrated on a field report for
# Llama-3-8B (hidden 4096; we found no public source to cite): an unchunked 30K-token prefill
# needed 11.2 GB, a 2,048-token chunk 2.1 GB: (11.2e9 - 2.1e9) / (30,000 - 2,048) / 4096 ~ 79.5 B.
ACT_BYTES_PER_TOKEN_PER_HIDDEN = (11.2e9 - 2.1e9) / (30_000 - 2_048) / 4096
# A prefill step is admitted only while `now` leaves this share of the engine's idle headroom
# beyond the step (the field's 15 % margin): the figures are up to a refresh old, fragmentation
# can grow while a long prompt's chunks run, and decode tokens and other prompts share the step.
STEP_MARGIN = 0.15


@dataclass(frozen=True)
class ModelMemory:
    vocab_size: int
    hidden_size: int
    dtype_bytes: int = 2  # the model dtype logits are computed in (oomguard.logits)

    @property
    def logits(self) -> LogitsShape:
        return LogitsShape(self.vocab_size, self.dtype_bytes)


@dataclass(frozen=True)
class EngineShape:
    max_num_batched_tokens: int
    chunked_prefill: bool
    block_size: int
    num_gpu_blocks: int


@dataclass(frozen=True)
class Headroom:
    """One engine's room for a request's extra transient memory, in bytes, and its free KV.

    `now`: what an allocation could get at the next step (device free + reserved-but-free
    allocator cache - the profiled step's activations). `idle`: the same on this engine with
    nothing else on the GPU (its own steady memory only): a request above it can never fit.
    """

    now: int
    idle: int
    free_kv_blocks: int
    total_kv_blocks: int
    measured_at: float = 0.0


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    max_tokens: int = 16
    n: int = 1
    logprobs: int = 0
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class Estimate:
    logits: int  # FP32 prompt logits of the largest prefill chunk
    activation: int  # activations beyond the profiled step (unchunked long prompts)
    sampling: int  # FP32 log-softmax rows for top logprobs, one per n/best_of sequence
    kv_blocks: int  # KV blocks the request reserves over its life (with the margin)
    # its largest prefill step's activations against the profiled step's (negative: smaller)
    step: int = 0
    step_tokens: int = 0

    @property
    def transient(self) -> int:
        return self.logits + self.activation + self.sampling

    @property
    def step_need(self) -> int:
        """What its prefill step needs from `now` (the profiled step already counted)."""
        return self.logits + self.step + self.sampling

    def dominant(self) -> tuple[str, str]:
        """(reason, parameter) of the largest transient part."""
        parts = [
            (self.logits, "prompt_logprobs_logits", "prompt_logprobs"),
            (self.activation, "unchunked_prefill", "prompt"),
            (self.sampling, "sampling_logits", "n"),
        ]
        _, reason, parameter = max(parts, key=lambda p: p[0])
        return reason, parameter


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    parameter: str | None = None
    need_bytes: int = 0
    limit_bytes: int = 0
    message: str = ""
    estimate: Estimate | None = field(default=None, compare=False)


def activation_bytes(tokens: int, model: ModelMemory) -> int:
    return int(ACT_BYTES_PER_TOKEN_PER_HIDDEN * model.hidden_size * max(0, tokens))


def _signed_activation(tokens: int, act_per_token: float) -> int:
    """Activations of `tokens` more (or, negative, fewer) tokens than the profiled step."""
    return int(act_per_token * tokens) if tokens >= 0 else -int(act_per_token * -tokens)


def estimate(
    req: RequestShape, model: ModelMemory, engine: EngineShape, kv_margin: float = 0.0
) -> Estimate:
    chunk = (
        min(req.prompt_tokens, engine.max_num_batched_tokens)
        if engine.chunked_prefill
        else req.prompt_tokens
    )
    logits = model.logits.prompt_logprobs_peak(chunk) if req.prompt_logprobs else 0
    beyond_profile = chunk - engine.max_num_batched_tokens
    activation = activation_bytes(beyond_profile, model) if beyond_profile > 0 else 0
    sequences = max(1, req.n)
    sampling = model.logits.top_logprobs_bytes(sequences) if req.logprobs else 0
    block = max(1, engine.block_size)
    blocks = math.ceil((req.prompt_tokens + req.max_tokens) / block)
    blocks += (sequences - 1) * math.ceil(req.max_tokens / block)  # forks share the prompt
    step = _signed_activation(beyond_profile, ACT_BYTES_PER_TOKEN_PER_HIDDEN * model.hidden_size)
    return Estimate(logits, activation, sampling, math.ceil(blocks * (1 + kv_margin)), step, chunk)


@dataclass(frozen=True)
class TransientCosts:
    """`estimate`'s transient part with its per-model constants computed once (the API server's
    hook pays a few integer operations per request, not the estimate's objects)."""

    prompt_row: int  # prompt_logprobs bytes per prompt token (oomguard.logits)
    logit_row: int  # top-logprobs bytes per sampled sequence: vocab x 4
    act_per_token: float  # activation bytes per token beyond the profiled step
    max_num_batched_tokens: int
    chunked_prefill: bool

    @classmethod
    def of(cls, model: ModelMemory, engine: EngineShape) -> TransientCosts:
        return cls(
            model.logits.prompt_logprobs_bytes_per_token,
            model.logits.top_logprobs_bytes(1),
            ACT_BYTES_PER_TOKEN_PER_HIDDEN * model.hidden_size,
            engine.max_num_batched_tokens,
            engine.chunked_prefill,
        )

    def transient(
        self, prompt_tokens: int, sequences: int, logprobs: bool, prompt_logprobs: bool
    ) -> int:
        """`estimate(...).transient` for the same request (bytes)."""
        return self.needs(prompt_tokens, sequences, logprobs, prompt_logprobs)[0]

    def needs(
        self, prompt_tokens: int, sequences: int, logprobs: bool, prompt_logprobs: bool
    ) -> tuple[int, int]:
        """(`estimate(...).transient`, `estimate(...).step_need`) for the same request."""
        budget = self.max_num_batched_tokens
        chunk = min(prompt_tokens, budget) if self.chunked_prefill else prompt_tokens
        need = chunk * self.prompt_row if prompt_logprobs else 0
        if logprobs:
            need += max(1, sequences) * self.logit_row
        step = _signed_activation(chunk - budget, self.act_per_token)
        return need + max(0, step), need + step


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def max_prompt_for(limit: int, model: ModelMemory) -> int:
    """The longest prompt whose prompt_logprobs logits fit `limit` bytes."""
    return max(0, limit // model.logits.prompt_logprobs_bytes_per_token)


def step_room(step_need: int, h: Headroom, step_margin: float = STEP_MARGIN) -> int:
    """What `h.now` must be for a prefill step needing `step_need` beyond the profiled step:
    the step plus the margin, but never more than the engine offers idle (so what fits an idle
    engine is admitted there eventually). An engine without a positive idle figure cannot say:
    no requirement."""
    if h.idle <= 0:
        return -(2**62)
    return min(step_need + int(step_margin * h.idle), h.idle)


def _short_for_step(
    est: Estimate, headrooms: list[Headroom], step_margin: float
) -> tuple[Headroom, int] | None:
    """The engine (and the room it needs) that cannot run this request's prefill step now."""
    worst: tuple[Headroom, int] | None = None
    for h in headrooms:
        room = step_room(est.step_need, h, step_margin)
        if h.now < room and (worst is None or room - h.now > worst[1] - worst[0].now):
            worst = (h, room)
    return worst


def _defer_step(est: Estimate, short: tuple[Headroom, int], step_margin: float) -> Decision:
    h, room = short
    return Decision(
        "defer",
        "prefill_step",
        "prompt",
        room,
        h.now,
        f"not enough GPU memory for this request's prefill step now (a {est.step_tokens}-token "
        f"step; {_gib(room - h.now)} short with a {step_margin:.0%} margin; allocator "
        "fragmentation or another process holds the rest): retry later or on another replica",
        est,
    )


def decide(
    req: RequestShape,
    model: ModelMemory,
    engine: EngineShape,
    headrooms: list[Headroom],
    kv_margin: float | None = None,
    step_margin: float = STEP_MARGIN,
    reserved: int = 0,
) -> Decision:
    """Admit, defer or reject one request against the engines that may serve it.

    With data parallelism a request may land on any engine: it is rejected only when it fits
    none of them even idle, deferred when it does not fit the tightest one now (its transient,
    or its prefill step with the margin).

    `reserved`: transient memory already admitted for requests whose prefill is not done (the
    ledger, vllm_plugin/ledger.py). A request with a transient of its own may land in the same
    step as those, so it fits only in what they leave of `now` (on every engine: the API server
    does not know which engine each request goes to). It never turns into a rejection: what fits
    idle is deferred until they are done.
    """
    est = estimate(req, model, engine, kv_margin or 0.0)
    if not headrooms:
        return Decision("admit", "no_headroom_data", estimate=est)  # blind: never refuse
    need = est.transient
    held = reserved if need > 0 else 0
    if held > 0:
        headrooms = [replace(h, now=h.now - held) for h in headrooms]
    short = _short_for_step(est, headrooms, step_margin)
    if need == 0 and kv_margin is None:
        if short is not None:  # fragmentation or a neighbour took the profiled step's room
            return _defer_step(est, short, step_margin)
        return Decision("admit", "no_transient", estimate=est)  # the common request: profiled
    best_idle = max(h.idle for h in headrooms)
    if need > best_idle:
        reason, parameter = est.dominant()
        if parameter == "prompt_logprobs":
            limit = max_prompt_for(best_idle, model)
            message = (
                f"prompt_logprobs needs {_gib(need)} of logits for this prompt; this "
                f"engine has at most {_gib(best_idle)}: use prompt_logprobs with prompts of "
                f"at most {limit} tokens"
            )
        else:
            message = (
                f"this request needs {_gib(need)} of transient GPU memory ({reason}); this "
                f"engine has at most {_gib(best_idle)}: lower {parameter}"
            )
        return Decision("reject", reason, parameter, need, best_idle, message, est)
    if kv_margin is not None:
        total = min(h.total_kv_blocks for h in headrooms)
        if est.kv_blocks > total:
            return Decision(
                "reject",
                "kv_reservation",
                "max_tokens",
                est.kv_blocks,
                total,
                f"prompt + max_tokens need {est.kv_blocks} KV blocks with a {kv_margin:.0%} "
                f"margin; the pool has {total}: lower max_tokens or the prompt",
                est,
            )
    tightest = min(headrooms, key=lambda h: h.now)
    if need > 0 and need > tightest.now:
        reason, parameter = est.dominant()
        return Decision(
            "defer",
            reason,
            parameter,
            need,
            tightest.now,
            f"not enough GPU memory for this request now ({_gib(need)} needed, "
            f"{_gib(max(0, tightest.now))} free"
            + (f" beside {_gib(held)} admitted for requests before it" if held else "")
            + "): retry later or on another replica",
            est,
        )
    if short is not None:
        return _defer_step(est, short, step_margin)
    if kv_margin is not None:
        free = min(h.free_kv_blocks for h in headrooms)
        if est.kv_blocks > free:
            return Decision(
                "defer",
                "kv_reservation",
                "max_tokens",
                est.kv_blocks,
                free,
                f"not enough free KV cache now ({est.kv_blocks} blocks needed with a "
                f"{kv_margin:.0%} margin, {free} free): retry later or on another replica",
                est,
            )
    return Decision("admit", "fits", need_bytes=need, limit_bytes=tightest.now, estimate=est)
