"""The request guard's estimate and decision (pure), and its hook's behaviour per mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.vllm_plugin.guard import (
    STEP_MARGIN,
    EngineShape,
    Headroom,
    ModelMemory,
    RequestShape,
    TransientCosts,
    decide,
    estimate,
    max_prompt_for,
    step_room,
)

GIB = 2**30
LLAMA3 = ModelMemory(vocab_size=128_256, hidden_size=4096)  # Llama-3-8B config.json
ENGINE = EngineShape(
    max_num_batched_tokens=8192, chunked_prefill=True, block_size=16, num_gpu_blocks=26_000
)


def room(now: float, idle: float, free_kv: int = 20_000) -> Headroom:
    return Headroom(int(now * GIB), int(idle * GIB), free_kv, 26_000)


def test_prompt_logprobs_logits_match_the_field_figure():
    # 8K prompt tokens x 128K vocabulary x 10 B (BF16 logits 2 + their FP32 copy 4 + the FP32
    # log-softmax 4, oomguard.logits) = 10.5 GB at the peak
    est = estimate(RequestShape(8192, prompt_logprobs=True), LLAMA3, ENGINE)
    assert est.logits == 8192 * 128_256 * 10 and est.logits == pytest.approx(10.5e9, rel=0.01)
    # chunked prefill bounds the logits by the chunk, not the prompt
    long = estimate(RequestShape(30_000, prompt_logprobs=True), LLAMA3, ENGINE)
    assert long.logits == est.logits and long.activation == 0
    # without chunked prefill a 30K prompt materialises everything, beyond the profiled step
    unchunked = EngineShape(8192, False, 16, 26_000)
    big = estimate(RequestShape(30_000, prompt_logprobs=True), LLAMA3, unchunked)
    assert big.logits == 30_000 * 128_256 * 10
    assert big.activation == pytest.approx(11.2e9 - 2.1e9 - (8192 - 2048) * 325_600, rel=0.02)


def test_admit_defer_reject():
    req = RequestShape(3000, prompt_logprobs=True)  # needs ~3.6 GiB
    assert decide(req, LLAMA3, ENGINE, [room(6, 7)]).action == "admit"
    deferred = decide(req, LLAMA3, ENGINE, [room(2, 7)])  # a neighbour holds memory now
    assert deferred.action == "defer" and deferred.parameter == "prompt_logprobs"
    rejected = decide(req, LLAMA3, ENGINE, [room(2, 3)])  # never fits on this engine
    assert rejected.action == "reject" and rejected.parameter == "prompt_logprobs"
    limit = max_prompt_for(3 * GIB, LLAMA3)
    assert f"at most {limit} tokens" in rejected.message and limit == 2511
    # the limit it names does fit
    assert (
        decide(RequestShape(limit, prompt_logprobs=True), LLAMA3, ENGINE, [room(3, 3)]).action
        == "admit"
    )


def test_top_logprobs_scale_with_n():
    req = RequestShape(100, n=64, logprobs=20)
    assert estimate(req, LLAMA3, ENGINE).sampling == 64 * 128_256 * 4
    decision = decide(req, LLAMA3, ENGINE, [room(0.01, 0.02)])
    assert decision.action == "reject" and decision.parameter == "n"


def test_data_parallel_rejects_only_what_fits_no_engine_and_defers_on_the_tightest():
    req = RequestShape(3000, prompt_logprobs=True)  # ~3.6 GiB
    assert decide(req, LLAMA3, ENGINE, [room(1, 3), room(1, 5)]).action == "defer"
    assert decide(req, LLAMA3, ENGINE, [room(5, 5), room(1, 5)]).action == "defer"
    assert decide(req, LLAMA3, ENGINE, [room(5, 5), room(6, 6)]).action == "admit"
    assert decide(req, LLAMA3, ENGINE, [room(1, 3), room(1, 3.5)]).action == "reject"


def test_blind_means_admit():
    req = RequestShape(60_000, prompt_logprobs=True)
    assert decide(req, LLAMA3, ENGINE, []).action == "admit"


def test_kv_budget_with_the_field_margin():
    req = RequestShape(30_000, max_tokens=2_000)  # 2,000 blocks, 2,300 with 15 %
    assert estimate(req, LLAMA3, ENGINE, 0.15).kv_blocks == 2300
    assert decide(req, LLAMA3, ENGINE, [room(5, 5, free_kv=2300)], 0.15).action == "admit"
    d = decide(req, LLAMA3, ENGINE, [room(5, 5, free_kv=2299)], 0.15)
    assert d.action == "defer" and d.reason == "kv_reservation"
    small_pool = Headroom(5 * GIB, 5 * GIB, 2000, 2000)
    assert decide(req, LLAMA3, ENGINE, [small_pool], 0.15).action == "reject"
    # off by default: vLLM queues for KV by itself
    assert decide(req, LLAMA3, ENGINE, [room(5, 5, free_kv=0)]).action == "admit"


requests = st.builds(
    RequestShape,
    prompt_tokens=st.integers(0, 8192),
    max_tokens=st.integers(0, 4096),
    n=st.integers(1, 8),
)
headroom = st.builds(
    Headroom,
    st.integers(-80 * GIB, 80 * GIB),
    st.integers(-80 * GIB, 80 * GIB),
    st.integers(0, 10**6),
    st.integers(1, 10**6),
)


@given(requests, st.lists(headroom, min_size=1, max_size=4))
def test_do_no_harm_requests_without_extra_transient_are_always_admitted(req, rooms):
    """Sampling and the profiled step are vLLM's own budget: never a reason to refuse while
    every engine can still run its profiled step with the margin (only fragmentation or a
    neighbour taking that room defers a prefill, test_a_long_prompt_waits_...)."""
    rooms = [h for h in rooms if h.now >= step_room(0, h)] or [Headroom(GIB, GIB, 0, 1)]
    assert decide(req, LLAMA3, ENGINE, rooms).action == "admit"


@given(
    st.integers(0, 70_000),
    st.booleans(),
    st.integers(0, 20),
    st.integers(1, 8),
    st.booleans(),
    st.integers(1, 80 * GIB),
)
def test_a_healthy_engine_never_defers(prompt, plp, logprobs, n, chunked, idle):
    """Nothing else on the GPU (now == idle): admit or reject, never a 503 that could only be
    retried forever; a request that fits an idle engine is never kept waiting by the margin."""
    req = RequestShape(prompt, prompt_logprobs=plp, logprobs=logprobs, n=n)
    engine = EngineShape(8192, chunked, 16, 26_000)
    assert decide(req, LLAMA3, engine, [Headroom(idle, idle, 0, 1)]).action != "defer"


# The long-context-burst incident on the twin H100 (llama-3-8b, gpu_memory_utilization 0.9,
# max_num_batched_tokens 8192): the guard admitted a 63,773-token prompt (no transient beyond
# the profiled step, chunked prefill) while allocator fragmentation (8.55e9 B, inactive split)
# had taken more than the 7.91 GiB the engine keeps beyond its profiled step; its first
# 8,192-token chunk asked for 4.10e9 B of activations with 4.04e9 B free: CUDA OOM
# (bench/results/guard.json, oom-*.json of the 15:43 UTC run).
H100_IDLE = 8_492_626_740  # the twin's idle headroom there (twin/physics.py)
INCIDENT_FRAGMENTATION = 8_550_990_510


def twin_room(fragmentation: int) -> Headroom:
    """What the twin's engine reports with this much fragmentation (GpuTwin.headroom)."""
    return Headroom(H100_IDLE - fragmentation, H100_IDLE, 20_000, 26_321)


def test_the_twin_headroom_figure_is_the_physics():
    from oomguard.twin.physics import Physics

    p = Physics.for_model("llama-3-8b", gpu="H100", gpu_memory_utilization=0.9)
    idle = p.total - p.driver_reserved - p.resident - p.activation(p.max_num_batched_tokens)
    assert idle == H100_IDLE


def test_a_long_prompt_waits_while_fragmentation_holds_its_chunks_room():
    long = RequestShape(63_773, max_tokens=64)
    at_crash = decide(long, LLAMA3, ENGINE, [twin_room(INCIDENT_FRAGMENTATION)])
    assert at_crash.action == "defer" and at_crash.reason == "prefill_step"
    assert at_crash.parameter == "prompt" and "8192-token step" in at_crash.message
    assert "retry later or on another replica" in at_crash.message
    # admitted again once fragmentation recedes below the margin (15 % of the idle headroom)
    assert decide(long, LLAMA3, ENGINE, [twin_room(0)]).reason == "no_transient"
    recovered = int(H100_IDLE * (1 - STEP_MARGIN)) - 1
    assert decide(long, LLAMA3, ENGINE, [twin_room(recovered)]).action == "admit"
    assert decide(long, LLAMA3, ENGINE, [twin_room(recovered + 2)]).action == "defer"
    # a short prompt's step is smaller than the profiled one: it may still run
    assert decide(
        RequestShape(1000), LLAMA3, ENGINE, [twin_room(INCIDENT_FRAGMENTATION)]
    ).action == ("admit")
    # with data parallelism the pressed engine defers; its healthy peer alone admits
    assert decide(
        long, LLAMA3, ENGINE, [twin_room(0), twin_room(INCIDENT_FRAGMENTATION)]
    ).action == ("defer")


@settings(deadline=None)  # the first example loads the twin model's config
@given(st.integers(1, 65_536), st.floats(0, 10).map(lambda gib: int(gib * GIB)))
def test_what_the_guard_admits_fits_the_twin_s_physics(prompt, fragmentation):
    """Soundness against the twin: a plain prompt admitted at this fragmentation runs its
    largest prefill step (its chunk) without a CUDA OOM in the twin's physics; one deferred
    would not have run with the margin's worth more fragmentation."""
    from oomguard.twin.physics import Physics, Step

    p = Physics.for_model("llama-3-8b", gpu="H100", gpu_memory_utilization=0.9)
    decision = decide(RequestShape(prompt), LLAMA3, ENGINE, [twin_room(fragmentation)])
    chunk = min(prompt, ENGINE.max_num_batched_tokens)
    if decision.action == "admit":
        assert p.fits(Step(tokens=chunk), fragmentation=fragmentation)
    else:
        assert decision.action == "defer" and decision.reason == "prefill_step"
        assert not p.fits(Step(tokens=chunk), fragmentation=fragmentation + int(0.15 * H100_IDLE))


def test_a_pressed_engine_is_read_by_the_hook_not_its_shortcut():
    """The hook's shortcut for plain requests must not admit what the decision defers."""
    from oomguard.vllm_plugin.admission import Guard

    guard = Guard("observe")
    figures = reports(now=(H100_IDLE - INCIDENT_FRAGMENTATION) / GIB, idle=H100_IDLE / GIB)
    guard.update(figures)
    decision = guard.check(engine_request(63_773))
    assert decision is not None and decision.action == "defer" and decision.reason == "prefill_step"
    assert guard.check(engine_request(1000)).action == "admit"
    guard.update(reports(now=H100_IDLE / GIB, idle=H100_IDLE / GIB))  # the fragments coalesced
    assert guard.check(engine_request(63_773)).reason == "no_transient"


@given(
    st.integers(1, 60_000),
    st.booleans(),
    st.integers(0, 20),
    st.integers(-10 * GIB, 80 * GIB),
    st.integers(0, 20 * GIB),
)
def test_more_headroom_never_turns_an_admission_into_a_refusal(prompt, plp, logprobs, now, more):
    req = RequestShape(prompt, prompt_logprobs=plp, logprobs=logprobs)
    base = decide(req, LLAMA3, ENGINE, [Headroom(now, now, 0, 1)])
    roomier = decide(req, LLAMA3, ENGINE, [Headroom(now + more, now + more, 0, 1)])
    order = {"admit": 0, "defer": 1, "reject": 2}
    assert order[roomier.action] <= order[base.action]
    if base.action == "admit":
        assert base.need_bytes <= now or base.need_bytes == 0


def engine_request(prompt: int, prompt_logprobs: int | None = None, n: int = 1):
    """The fields of vLLM's EngineCoreRequest the guard reads."""
    return SimpleNamespace(
        request_id="cmpl-1",
        prompt_token_ids=list(range(prompt)),
        sampling_params=SimpleNamespace(
            n=n, best_of=None, logprobs=None, prompt_logprobs=prompt_logprobs, max_tokens=8
        ),
    )


def reports(now: float, idle: float) -> list[dict]:
    return [
        {
            "engine": 0,
            "vocab_size": LLAMA3.vocab_size,
            "hidden_size": LLAMA3.hidden_size,
            "max_num_batched_tokens": 8192,
            "chunked_prefill": True,
            "block_size": 16,
            "total_kv_blocks": 26_000,
            "free_kv_blocks": 20_000,
            "memory": {"now": int(now * GIB), "idle": int(idle * GIB)},
        }
    ]


@given(
    prompt=st.integers(0, 40_000),
    prompt_logprobs=st.sampled_from([None, 0, 1, 5]),
    logprobs=st.sampled_from([None, 0, 1, 20]),
    n=st.integers(1, 8),
    chunked=st.booleans(),
    kv_margin=st.sampled_from([None, 0.15]),
    now=st.floats(-2, 20),
    stale=st.booleans(),
)
def test_the_hook_answers_what_decide_answers(
    prompt, prompt_logprobs, logprobs, n, chunked, kv_margin, now, stale
):
    """The hook's shortcut for requests with no transient need changes no decision."""
    from oomguard.vllm_plugin.admission import Guard

    clock = [100.0]
    guard = Guard("observe", kv_margin=kv_margin, clock=lambda: clock[0])
    figures = reports(now, 20)
    figures[0]["chunked_prefill"] = chunked
    guard.update(figures)
    if stale:
        clock[0] += 60
    request = engine_request(prompt, prompt_logprobs, n)
    request.sampling_params.logprobs = logprobs
    shape = RequestShape(
        prompt,
        max_tokens=8,
        n=n,
        logprobs=logprobs or 0,
        prompt_logprobs=prompt_logprobs is not None,
    )
    expected = decide(shape, guard.model, guard.engine, guard.fresh(), kv_margin)
    got = guard.check(request)
    assert got is not None
    assert (got.action, got.reason, got.parameter, got.need_bytes, got.limit_bytes) == (
        expected.action,
        expected.reason,
        expected.parameter,
        expected.need_bytes,
        expected.limit_bytes,
    )


@given(
    prompt=st.integers(0, 200_000),
    n=st.integers(0, 16),
    logprobs=st.integers(0, 20),
    prompt_logprobs=st.booleans(),
    vocab=st.integers(1, 300_000),
    hidden=st.integers(1, 16_384),
    budget=st.integers(16, 65_536),
    chunked=st.booleans(),
)
def test_the_cached_costs_give_the_estimates_transient(
    prompt, n, logprobs, prompt_logprobs, vocab, hidden, budget, chunked
):
    """The hook's per-model constants (computed once) change no estimate."""
    model, engine = ModelMemory(vocab, hidden), EngineShape(budget, chunked, 16, 1000)
    req = RequestShape(prompt, n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    costs = TransientCosts.of(model, engine)
    assert costs.transient(prompt, n, bool(logprobs), prompt_logprobs) == (
        estimate(req, model, engine).transient
    )


def test_the_hook_per_mode():
    pytest.importorskip("vllm")
    from vllm.exceptions import GracefulHTTPError, VLLMValidationError

    from oomguard.vllm_plugin.admission import Guard

    clock = [100.0]
    enforce = Guard("enforce", clock=lambda: clock[0])
    enforce.update(reports(2, 3))
    assert enforce.check(engine_request(100)).action == "admit"
    with pytest.raises(VLLMValidationError) as exc:
        enforce.check(engine_request(3000, prompt_logprobs=1))
    assert exc.value.parameter == "prompt_logprobs"
    enforce.update(reports(2, 7))
    with pytest.raises(GracefulHTTPError) as busy:
        enforce.check(engine_request(3000, prompt_logprobs=1))
    assert busy.value.http_status == 429  # a deferral (vllm_plugin/refusals.py)
    clock[0] += 60  # figures went stale: blind, admit
    assert enforce.check(engine_request(3000, prompt_logprobs=1)).action == "admit"

    observe = Guard("observe", clock=lambda: clock[0])
    observe.update(reports(2, 3))
    assert observe.check(engine_request(3000, prompt_logprobs=1)).action == "reject"  # no raise
    assert observe.check(SimpleNamespace(sampling_params=None)) is None  # pooling requests
    with pytest.raises(ValueError):
        Guard("enforcing")


def test_the_hook_is_installed_once_and_reads_the_current_guard():
    pytest.importorskip("vllm")
    from vllm.v1.engine.input_processor import InputProcessor

    from oomguard.vllm_plugin import admission

    first = admission.Guard("observe")
    assert admission.install(first)
    hooked = InputProcessor.__dict__["assign_request_id"]
    second = admission.Guard("observe")
    second.update(reports(2, 3))
    assert admission.install(second)
    assert InputProcessor.__dict__["assign_request_id"] is hooked  # not wrapped twice
    request = engine_request(8192, prompt_logprobs=1)
    request.external_req_id = None
    InputProcessor.assign_request_id(request)
    assert second.last is not None and second.last.action == "reject" and first.last is None
    assert request.external_req_id == "cmpl-1"  # vLLM's own function still ran


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OOMGUARD_GUARD_REFRESH_SECONDS", "fast"),
        ("OOMGUARD_GUARD_REFRESH_SECONDS", "nan"),
        ("OOMGUARD_GUARD_REFRESH_SECONDS", "-1"),
        ("OOMGUARD_GUARD_KV_MARGIN", "inf"),
        ("OOMGUARD_GUARD_STEP_MARGIN", "1.5"),
        ("OOMGUARD_GUARD_MODE", "panic"),
    ],
)
def test_a_bad_guard_setting_names_the_variable(monkeypatch, name, value):
    from oomguard.vllm_plugin.admission import Guard

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        Guard.from_env()


def test_a_streamed_request_is_decided_when_generate_is_called():
    """vLLM's routes call `AsyncLLM.generate` before they return a stream, but its body (and
    `assign_request_id`) runs only when the stream is read, after HTTP 200: the guard decides at
    the call, so a refusal is a 400 / 429, and does not decide the same request twice."""
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor

    from oomguard.vllm_plugin import admission

    guard = admission.Guard("enforce")
    guard.update(reports(2, 3))
    assert admission.install(guard)
    params = engine_request(8192, prompt_logprobs=0).sampling_params
    rendered = {"type": "token", "prompt_token_ids": list(range(8192))}
    with pytest.raises(VLLMValidationError) as exc:
        AsyncLLM.generate(object(), rendered, params, "cmpl-early-0")  # not iterated
    assert exc.value.parameter == "prompt_logprobs"

    small = engine_request(600, prompt_logprobs=0)
    stream = AsyncLLM.generate(
        object(), {"type": "token", "prompt_token_ids": list(range(600))},
        small.sampling_params, "cmpl-early-1",
    )  # fmt: skip
    assert hasattr(stream, "__anext__")  # vLLM's own generator, not started
    decided = guard.last
    assert decided is not None and decided.action == "admit"
    small.request_id, small.external_req_id = "cmpl-early-1", None
    guard.last = None
    InputProcessor.assign_request_id(small)
    assert guard.last is None  # decided once, at the call
    assert small.external_req_id == "cmpl-early-1"
    # a request generate did not see rendered (a text prompt) is decided at assign_request_id
    other = engine_request(600, prompt_logprobs=0)
    other.request_id, other.external_req_id = "cmpl-late-0", None
    InputProcessor.assign_request_id(other)
    assert guard.last is not None and guard.last.action == "admit"


def test_a_gpu_worker_counts_no_fragments_in_its_headroom(monkeypatch):
    """No GPU here: torch.cuda's two readings give what a fragmented H100 worker would (device
    free, and memory_stats' byte counters) and the worker's formula runs on them unchanged."""
    torch = pytest.importorskip("torch")
    from oomguard.vllm_plugin.engine import worker_memory
    from oomguard.vllm_plugin.guard import activation_bytes

    stats = {
        "reserved_bytes.all.current": 70 * GIB,
        "allocated_bytes.all.current": 60 * GIB,
        "inactive_split_bytes.all.current": 8 * GIB,  # free blocks inside segments in use
    }
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: dict(stats))
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
            model_config=SimpleNamespace(
                get_vocab_size=lambda: 128_256, get_hidden_size=lambda: 4096
            ),
        )
    )
    step = activation_bytes(8192, LLAMA3)
    memory = worker_memory(worker)
    # 10 GiB cached but free, 8 GiB of it fragments: 2 GiB + 2 GiB for the step
    assert memory["now"] == 4 * GIB - step
    assert memory["idle"] == (80 - 60 - 8) * GIB - step  # 8 GiB non-torch at the first reading
    # expandable segments: PyTorch unmaps free pages and maps them where they are needed
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert worker_memory(worker)["now"] == 12 * GIB - step
