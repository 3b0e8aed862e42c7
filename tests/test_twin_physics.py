"""The twin's memory and time models against hand-computed cases, and the traces' format."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from oomguard.sizing.model import ModelShape
from oomguard.twin.gpu import MIB
from oomguard.twin.physics import Physics, Step, TwinOutOfMemory
from oomguard.twin.traces import TRACES, Fragments, Trace, names, requests
from tests.vllm_server import require_vllm

H100 = 81559 * MIB
H100_USABLE = (81559 - 567) * MIB  # vLLM plans against the CUDA total: NVML's less reserved
LLAMA = Physics.for_model("llama-3-8b", gpu="H100")


def test_llama_3_8b_shapes_by_hand():
    # 32 x (4096*4096*2 + 2*4096*1024 + 3*4096*14336) + 2*128256*4096
    assert LLAMA.shape.parameter_count() == 8_029_995_008
    assert LLAMA.weights == 16_059_990_016
    assert LLAMA.kv_bytes_per_token == 131_072


def test_activations_hit_the_field_calibration_and_logits_the_reference():
    assert LLAMA.activation(2048) == pytest.approx(2.1e9, abs=1)
    assert LLAMA.activation(30_000) == pytest.approx(11.2e9, abs=1)
    assert LLAMA.activation(0) == 0
    # BF16 logits 2 + FP32 copy 4 + FP32 log-softmax 4 (oomguard.logits): 10.5 GB at 8K tokens
    assert LLAMA.logits(8192) == 8192 * 128_256 * 10


def test_kv_pool_is_what_vllm_profiling_leaves():
    expected = int(0.9 * H100_USABLE - LLAMA.weights - LLAMA.activation(8192) - 1024 * MIB)
    assert LLAMA.kv_pool == expected
    assert LLAMA.kv_blocks == expected // (16 * 131_072)
    with pytest.raises(TwinOutOfMemory):
        # 15 GiB of weights and the profile do not fit in 0.7 x 24 GiB: a type-1 startup OOM
        _ = Physics.for_model("llama-3-8b", gpu="RTX4090", gpu_memory_utilization=0.7).kv_pool


def test_step_time_roofline_by_hand():
    decode = Step(tokens=64, attention=64 * 8192, context=64 * 8192)
    traffic = 16_059_990_016 + 131_072 * 64 * 8192
    assert LLAMA.step_seconds(decode) == pytest.approx(traffic / (3.35e12 * 0.8))  # memory bound
    prefill = Step(tokens=8192, attention=8192 * 8193 // 2, context=8192)
    flops = 2 * 8_029_995_008 * 8192 + 4 * 32 * 4096 * (8192 * 8193 // 2)
    assert LLAMA.step_seconds(prefill) == pytest.approx(flops / (989e12 * 0.5))  # compute bound
    assert LLAMA.step_seconds(Step()) == 0.0


def test_peak_and_the_exact_byte_where_a_step_stops_fitting():
    chunk = Step(tokens=8192)
    headroom = LLAMA.total - LLAMA.peak(chunk)
    # a full chunk is the peak vLLM profiled: what stays free is exactly the plan's slack
    assert headroom == pytest.approx(0.1 * H100_USABLE, abs=16)  # ~7.9 GiB
    assert LLAMA.fits(chunk, neighbour=headroom)
    assert not LLAMA.fits(chunk, neighbour=headroom + 1)
    # decoding only (64 tokens) leaves more room than a full chunk: draining helps
    assert LLAMA.total - LLAMA.peak(Step(tokens=64)) > headroom + 2 * 2**30


def test_the_executor_raises_a_cuda_oom_at_exactly_that_step(tmp_path):
    require_vllm()
    import torch

    from oomguard.twin.executor import GpuTwin

    state = tmp_path / "gpu.json"
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9, block_size=16),
    )
    twin = GpuTwin(
        vllm_config, {"gpu": "H100", "state_file": str(state), "allocator_dir": str(tmp_path)}
    )
    chunk = Step(tokens=8192)
    headroom = LLAMA.total - LLAMA.peak(chunk)
    state.write_text(json.dumps({"neighbour_bytes": headroom}))
    twin._read_at = 0.0
    assert twin.step(chunk) > 0  # fits to the byte
    assert twin.step(Step(tokens=64)) > 0
    state.write_text(json.dumps({"neighbour_bytes": headroom + 1}))
    twin._read_at = 0.0
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        twin.step(chunk)
    assert twin.ooms == 1
    report = json.loads(next(tmp_path.glob("pid-*.json")).read_text())
    assert report["ooms"] == 1  # the exporter sees it through the hand-off
    twin._read_at = 0.0
    assert twin.step(Step(tokens=64)) >= 0  # a decode-only step still fits


def test_an_idle_twin_engine_keeps_publishing_its_allocator_report(tmp_path):
    """As the plugin's publisher thread does on a GPU: an engine that takes no step still
    reports, so fragments that coalesced while it was idle leave the exporter's view (a report
    written only by steps kept the last busy step's fragments until it went stale)."""
    require_vllm()
    import time

    from oomguard.twin.executor import GpuTwin

    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"fragmentation_bytes": 8 * 2**30}))
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9, block_size=16),
    )
    GpuTwin(vllm_config, {"gpu": "H100", "state_file": str(state), "allocator_dir": str(tmp_path)})

    def inactive_split(want: int) -> int:
        deadline = time.monotonic() + 10
        seen = -1
        while time.monotonic() < deadline:
            found = list(tmp_path.glob("pid-*.json"))
            if found:
                seen = json.loads(found[0].read_text())["inactive_split_bytes"]
                if seen == want:
                    break
            time.sleep(0.1)
        return seen

    assert inactive_split(8 * 2**30) == 8 * 2**30  # no step taken: the thread wrote it
    state.write_text(json.dumps({"fragmentation_bytes": 0}))  # the fragments coalesced
    assert inactive_split(0) == 0


def test_memory_taken_while_a_step_runs_kills_it_at_its_end_and_the_step_guard_reads_it(
    tmp_path,
):
    """A step that fits when it starts still dies when a neighbour grows while it runs (its
    activations are held to its end); the room the step guard reads is the same physics."""
    require_vllm()
    import time

    import torch

    from oomguard.twin.executor import GpuTwin

    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"neighbour_bytes": 0}))
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9, block_size=16),
    )
    twin = GpuTwin(vllm_config, {"gpu": "H100", "state_file": str(state)})
    chunk = Step(tokens=8192)
    room = twin.step_room()
    assert (
        room["available"]
        == room["idle"]
        == LLAMA.total - LLAMA.peak(chunk) + LLAMA.activation(8192)
    )
    assert room["profiled"] == LLAMA.activation(8192)
    twin._read_at = 0.0
    assert twin.step(chunk) > 0  # fits when it starts
    headroom = LLAMA.total - LLAMA.peak(chunk)
    state.write_text(json.dumps({"neighbour_bytes": headroom + 1}))  # grows while it runs
    time.sleep(0.03)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        twin.step_end(chunk)
    assert twin.step_room()["available"] == LLAMA.activation(8192) - 1


@pytest.mark.parametrize(
    ("name", "ramp_s"),
    [
        ("neighbour-2s-24gb", 2),
        ("neighbour-8s-48gb", 8),
        ("neighbour-30s-80gb", 30),
        ("fragmentation-spike", 3),
        ("long-prompt-burst", 6),
    ],
)
def test_the_step_traces_take_a_full_chunks_room_within_seconds_not_a_decode_step_s(name, ramp_s):
    """Issue 27's traces: on their own GPU and model, the memory taken within `ramp_s` leaves
    no room for a full prefill chunk but room for smaller steps, at real time."""
    from oomguard.twin.gpu import GPU_MODELS

    trace = Trace.load(name)
    assert trace.time_compression == 1 and trace.pressure_ends_s is not None
    p = Physics.for_model(
        trace.model,
        gpu=trace.gpu,
        gpu_memory_utilization=trace.engine.gpu_memory_utilization,
        max_num_batched_tokens=trace.engine.max_num_batched_tokens,
    )
    points = sorted(trace.gpu_events, key=lambda e: e.at_s)
    start, top = points[0], points[1]
    assert top.at_s - start.at_s == ramp_s
    neighbour, frag = trace.gpu_at(top.at_s)
    assert not p.fits(Step(tokens=trace.engine.max_num_batched_tokens), frag, neighbour)
    assert p.fits(Step(tokens=1024), frag, neighbour)
    if name.endswith("gb"):  # the GPU size its name says (nominal GB, NVML's MiB)
        nominal = int(name.rsplit("-", 1)[1].removesuffix("gb"))
        assert 0.9 * nominal <= GPU_MODELS[trace.gpu].total_mib * MIB / 1e9 <= 1.1 * nominal


def test_traces_are_valid_seeded_and_reproducible():
    assert len(names()) == 11
    for name in names():
        trace = Trace.load(name)
        first, again = requests(trace), requests(trace)
        assert first == again and first, name
        assert all(0 <= r.at_s < trace.duration_s for r in first)
        assert all(r.prompt_tokens + r.output_tokens <= trace.engine.max_model_len for r in first)
    t = Trace.load("neighbour-growth")
    other = requests(t.model_copy(update={"seed": 99}))
    assert other != requests(t)


def test_gpu_events_interpolate_linearly():
    t = Trace.load("neighbour-growth")  # 0 GiB at 150 s, 8.6 GiB at 450 s, 0 again at 720 s
    assert t.gpu_at(0) == (0, 0)
    assert t.gpu_at(300)[0] == int(4.3 * 2**30)
    assert t.gpu_at(600)[0] == int(8.6 * 2**30)
    assert t.gpu_at(900) == (0, 0)


def test_gpu_events_in_any_order_are_read_in_time_order():
    """A trace file may list its GPU events in any order: gpu_at reads them by time."""
    raw = json.loads((TRACES / "neighbour-growth.json").read_text())
    shuffled = Trace.model_validate({**raw, "gpu_events": raw["gpu_events"][::-1]})
    ordered = Trace.load("neighbour-growth")
    assert [e.at_s for e in shuffled.gpu_events] == sorted(e.at_s for e in ordered.gpu_events)
    for t in (0, 150, 300, 449.5, 600, 720, 900):
        assert shuffled.gpu_at(t) == ordered.gpu_at(t), t


def _frag(trace: Trace, t: float, started_at: float, idle: bool = False) -> int:
    f = Fragments(trace)
    if started_at:
        f.restarted(started_at)
    return f.at(t, idle)


def test_a_restarted_process_carries_only_the_fragmentation_grown_since_its_start():
    spike = Trace.load("fragmentation-spike")  # 8.6 GiB of fragments for about 80 s
    top = max(spike.gpu_events, key=lambda e: e.fragmentation_gib).at_s
    assert _frag(spike, top, 0.0) == spike.gpu_at(top)[1] > 0
    # restarted inside the spike: the new process has none of it, then or after
    for t in range(int(top), int(spike.duration_s) + 1):  # not the timeline from its start
        assert _frag(spike, t, top) == 0, t
    # restarted before it: it meets the spike like the first process did
    assert _frag(spike, top, 1.0) == spike.gpu_at(top)[1]
    # the slow creep grows again from zero after a restart, at the same rate
    creep = Trace.load("fragmentation-creep")
    grown = creep.gpu_at(6000)[1] - creep.gpu_at(5000)[1]
    assert grown > 0
    assert _frag(creep, 6000, 5000) == pytest.approx(grown, abs=2)


@pytest.mark.parametrize("name", ["fragmentation-spike", "long-prompt-burst", "long-context-burst"])
def test_request_made_fragments_coalesce_once_the_engine_runs_none(name: str):
    """The spikes' fragments are their requests' (on a real H200 the inactive split went to 0
    the moment the last request finished): an engine that goes idle inside the spike holds
    none of them after, while busy it holds the curve; a new rise after the curve fell is new
    requests' fragments again."""
    trace = Trace.load(name)
    assert trace.fragments == "requests"
    top = max(trace.gpu_events, key=lambda e: e.fragmentation_gib)
    end = max(e.at_s for e in trace.gpu_events)
    f = Fragments(trace)
    assert f.at(top.at_s) == trace.gpu_at(top.at_s)[1] > 0  # busy: all of it
    assert f.at(top.at_s, idle=True) == 0  # idle: given back
    for t in range(int(top.at_s), int(end) + 1):  # busy again: none of it comes back
        assert f.at(t) == 0, t
    # after the curve is back at zero, the next spike's fragments are new requests' again
    again = trace.model_copy(
        update={
            "gpu_events": [
                *trace.gpu_events,
                *(e.model_copy(update={"at_s": e.at_s + end}) for e in trace.gpu_events),
            ],
            "duration_s": trace.duration_s + end,
        }
    )
    g = Fragments(again)
    g.at(top.at_s, idle=True)
    assert g.at(top.at_s + end) == again.gpu_at(top.at_s + end)[1] > 0


def test_process_held_fragments_stay_while_idle():
    """fragmentation-creep's fragments are pinned by tensors that outlive requests (a real
    allocator keeps them while idle): only a restart gives them back."""
    creep = Trace.load("fragmentation-creep")
    assert creep.fragments == "process" and creep.pressure_ends_with_restart
    f = Fragments(creep)
    assert f.at(6000, idle=True) == creep.gpu_at(6000)[1] > 0
    assert f.at(6100, idle=True) == creep.gpu_at(6100)[1]
    # a request-bound copy of it ends without a restart, and gives its fragments back when
    # idle once its curve stops rising (at its end)
    held = creep.model_copy(update={"fragments": "requests"})
    assert not held.pressure_ends_with_restart
    assert Fragments(held).at(6000, idle=True) > 0
    assert Fragments(held).at(7200, idle=True) == 0


def test_every_restart_after_the_first_start_pays_the_model_reload(tmp_path, monkeypatch):
    """Crashed or requested alike (the supervisor's restart_delay waited for crashes only, so
    the remediator's own restarts came back without a reload): the twin's worker waits
    reload_seconds on each start after the first on its GPU's state file."""
    pytest.importorskip("torch")  # the twin's executor raises torch's OOM type
    from oomguard.twin import executor

    slept: list[float] = []
    monkeypatch.setattr(executor.time, "sleep", slept.append)
    state = str(tmp_path / "gpu0.json")
    executor._emulate_reload(state, 36.0)  # the first start loads no model twice
    assert slept == []
    executor._emulate_reload(state, 36.0)  # a restart, whatever asked for it
    executor._emulate_reload(state, 36.0)
    assert slept == [36.0, 36.0]
    executor._emulate_reload(state, 3600.0)  # inside vLLM's engine handshake
    assert slept[-1] == executor.RELOAD_MAX_S
    executor._emulate_reload(str(tmp_path / "gpu1.json"), 0.0)  # off by default
    executor._emulate_reload("", 36.0)
    assert len(slept) == 3


def test_an_idle_moment_while_the_curve_rises_gives_nothing_back():
    """A rising curve is the trace's requests arriving: an engine idle for a moment before the
    burst reached it has not had them (long-prompt-burst's vLLM alone still meets the top of
    the ramp); idle once the curve stopped rising, it gives all of it back."""
    burst = Trace.load("long-prompt-burst")  # 0 at 60 s, 8 GiB at 66 s, held to 110 s
    f = Fragments(burst)
    assert f.at(61, idle=True) == burst.gpu_at(61)[1] > 0  # rising: nothing given back
    assert f.at(66) == burst.gpu_at(66)[1]  # busy at the top: all of it
    assert f.at(80, idle=True) == 0  # idle on the plateau: gone
    assert f.at(100) == 0


def test_the_engines_fixed_sizes_are_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # the twin and the step guard ask for them at every step: a model's parameter count walks
    # its layers, and per step that was ~3 % of a twin engine core's CPU (not spent on a GPU)
    p = Physics.for_model("llama-3-8b")
    expected = (p.resident, p.kv_blocks, p.step_seconds(Step(64, 6400, 6400)))
    again = Physics.for_model("llama-3-8b")
    calls: list[int] = []
    count = ModelShape.parameter_count

    def counted(shape: ModelShape) -> int:
        calls.append(1)
        return count(shape)

    monkeypatch.setattr(ModelShape, "parameter_count", counted)
    for _ in range(100):
        again.peak(Step(128), fragmentation=1, neighbour=2)
        again.step_seconds(Step(64, 6400, 6400))
    assert (again.resident, again.kv_blocks, again.step_seconds(Step(64, 6400, 6400))) == expected
    assert len(calls) == 1
