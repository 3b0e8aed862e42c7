"""The pressure model: levels measured against the engines' memory plan (docs/pressure.md)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.exporter.collectors.base import GpuIdentity, GpuMemory
from oomguard.exporter.collectors.nvml import NvmlCollector
from oomguard.exporter.collectors.vllm import EngineReading
from oomguard.exporter.pressure import MAX_REMEMBERED, EngineSource, PressureEvaluator
from oomguard.handoff import AllocatorReport
from oomguard.lab.matrix import GMUS, model_for, simulate
from oomguard.thresholds import GIB, PressureThresholds
from oomguard.twin.gpu import GPU_MODELS, MIB, TwinGpu, TwinNvml
from oomguard.twin.physics import Physics
from oomguard.twin.traces import Trace

GB = 10**9


def ident(uuid: str = "GPU-a", index: str = "0", instance: str = "") -> GpuIdentity:
    return GpuIdentity(index, uuid, "bus", "nvidia0", "H100", "h", instance, "")


def gpu(
    free: float, total: float = 80 * GB, reserved: float = 0.0, uuid="GPU-a", index="0"
) -> GpuMemory:
    return GpuMemory(ident(uuid, index), total, total - reserved - free, free, reserved)


def engine(gmu: float | None = 0.9, name: str = "0", **kw) -> EngineReading:
    return EngineReading("m", name, gpu_memory_utilization=gmu, **kw)


def alloc(
    ooms=0, retries=0, uuid="GPU-a", pid=1, rank=0, target="t", engine="0", free_after_gc=None
) -> AllocatorReport:
    return AllocatorReport(
        timestamp=0,
        pid=pid,
        rank=rank,
        target=target,
        engine=engine,
        device_index=0,
        device_uuid=uuid,
        allocated_bytes=0,
        reserved_bytes=0,
        allocated_peak_bytes=0,
        reserved_peak_bytes=0,
        inactive_split_bytes=0,
        alloc_retries=retries,
        ooms=ooms,
        free_after_gc_bytes=free_after_gc,
    )


def levels(ev: PressureEvaluator, gpus, engines, reports=(), now=0.0, processes=(), blind=()):
    out = ev.evaluate(gpus, engines, list(reports), now, list(processes), blind)
    return (
        {gp.identity.key: (gp.level.level, gp.level.reason) for gp in out.gpus},
        {ep.key: (ep.level.level, ep.level.reason) for ep in out.engines},
    )


def nvml_gpus(*twins: TwinGpu):
    """Read twin GPUs through the exporter's real NVML collector."""
    reading = NvmlCollector("h", backend=TwinNvml(list(twins))).collect()
    return reading.gpus, reading.processes


# -- do no harm: every common GPU at every sane gpu_memory_utilization ----------------------
@pytest.mark.parametrize("gpu_name", sorted(GPU_MODELS))
@pytest.mark.parametrize("gmu", GMUS)
@pytest.mark.parametrize("warm", [True, False], ids=["cache-warm", "cache-empty"])
def test_a_healthy_engine_is_level_0_on_every_gpu(gpu_name, gmu, warm):
    p = Physics.for_model(model_for(gpu_name), gpu=gpu_name, gpu_memory_utilization=gmu)
    twin = TwinGpu("GPU-x", gpu_name)
    # Warm: the allocator cache grew to the planned activation peak; empty: just after start.
    used = int(gmu * p.usable) - (0 if warm else p.activation(p.max_num_batched_tokens))
    twin.processes[42] = used
    gpus, processes = nvml_gpus(twin)
    gpu_levels, engine_levels = levels(
        PressureEvaluator(),
        gpus,
        [EngineSource("t", engine(gmu))],
        [alloc(uuid="GPU-x", pid=42)],
        processes=processes,
    )
    assert set(gpu_levels.values()) == {(0, "ok")}
    assert set(engine_levels.values()) == {(0, "ok")}


def test_the_landed_floor_model_would_have_paged_an_l4_at_the_default():
    """The defect this model replaces: an L4 at 0.92 has under min(2 GiB, 8 %) free by design."""
    p = Physics.for_model(model_for("L4"), gpu="L4", gpu_memory_utilization=0.92)
    free = p.total - p.driver_reserved - int(0.92 * p.usable)
    assert free < PressureThresholds().floor_for(p.total)  # the old level 3
    twin = TwinGpu("GPU-x", "L4", processes={42: int(0.92 * p.usable)})
    gpus, processes = nvml_gpus(twin)
    _, got = levels(
        PressureEvaluator(), gpus, [EngineSource("t", engine(0.92))], processes=processes
    )
    assert got == {("t", "m", "0"): (0, "ok")}


# -- properties of the model ---------------------------------------------------------------
plans = st.lists(st.floats(0.05, 0.95), min_size=1, max_size=3).filter(lambda g: sum(g) <= 0.95)


@settings(max_examples=200, deadline=None)
@given(
    gmus=plans,
    total_gib=st.floats(9.0, 192.0),
    reserved_mib=st.integers(0, 1024),
    warm=st.booleans(),
)
def test_any_plan_in_range_without_incident_is_level_0(gmus, total_gib, reserved_mib, warm):
    total, reserved = int(total_gib * GIB), reserved_mib * MIB
    usable = total - reserved
    used = sum(int(g * usable) for g in gmus)
    if not warm:  # the engines have not reached their peaks yet
        used = int(used * 0.9)
    g = GpuMemory(ident(), total, used, total - reserved - used, reserved)
    sources = [EngineSource(f"t{i}", engine(gm), ["GPU-a"]) for i, gm in enumerate(gmus)]
    gpu_levels, engine_levels = levels(PressureEvaluator(), [g], sources)
    assert set(gpu_levels.values()) == {(0, "ok")}
    assert {lv for lv, _ in engine_levels.values()} == {0}


@settings(max_examples=200, deadline=None)
@given(
    gmus=plans,
    total_gib=st.floats(9.0, 192.0),
    taken=st.floats(0.0, 1.0),
    neighbour_share=st.floats(0.0, 1.0),
)
def test_losing_the_headroom_of_the_next_peak_is_at_least_level_2(
    gmus, total_gib, taken, neighbour_share
):
    """Whatever eats the plan's slack (a neighbour or the engines' own growth) so that the
    engines' next planned peak would not fit: level 2 or worse."""
    total = int(total_gib * GIB)
    slack = total - sum(int(g * total) for g in gmus)
    eaten = int(slack * (1.0 + taken * 0.5)) + 1  # beyond the slack
    neighbour = int(eaten * neighbour_share)
    growth = eaten - neighbour  # the engines' reserved beyond their plan (fragmentation)
    used = sum(int(g * total) for g in gmus) + growth + neighbour
    g = GpuMemory(ident(), total, used, max(0, total - used), 0)
    sources = [EngineSource(f"t{i}", engine(gm), ["0"]) for i, gm in enumerate(gmus)]
    gpu_levels, engine_levels = levels(PressureEvaluator(), [g], sources)
    assert all(lv >= 2 for lv, _ in gpu_levels.values())
    assert all(lv >= 2 for lv, _ in engine_levels.values())


def test_levels_follow_the_headroom_thresholds():
    t = PressureThresholds()
    total = 80 * GB
    plan = int(0.9 * total)
    got = []
    for headroom_share in (0.05, 0.02, 0.01, 0.001, -0.01):
        free = int(headroom_share * total)
        g = GpuMemory(ident(), total, plan, free, 0)  # engines at their peak: need 0
        (gp,) = PressureEvaluator(t).evaluate([g], [EngineSource("t", engine(0.9))], [], 0).gpus
        got.append((gp.level.level, gp.level.reason))
    assert got == [
        (0, "ok"),
        (1, "headroom_caution"),
        (2, "headroom_low"),
        (3, "headroom_exhausted"),
        (3, "headroom_exhausted"),
    ]


def test_engine_not_yet_at_its_peak_keeps_room_for_it():
    # Plan 72 GB, engine uses 60 GB now: 12 GB are its own, not free for anyone else.
    total = 80 * GB
    g = GpuMemory(ident(), total, 60 * GB + 7 * GB, 13 * GB, 0)  # a 7 GB neighbour
    (gp,) = PressureEvaluator().evaluate([g], [EngineSource("t", engine(0.9))], [], 0).gpus
    assert gp.planned_bytes == pytest.approx(72 * GB)
    assert gp.headroom_bytes == pytest.approx(13 * GB - 5 * GB)  # aggregate: used counts as plan
    assert gp.level.level == 0


def test_per_process_memory_separates_a_neighbour_from_the_engine():
    total = 80 * GB
    g = GpuMemory(ident(), total, 60 * GB + 7 * GB, 13 * GB, 0)
    processes = [(ident(), 1, 60 * GB), (ident(), 99, 7 * GB)]
    out = PressureEvaluator().evaluate(
        [g], [EngineSource("t", engine(0.9))], [alloc(pid=1)], 0, processes
    )
    # The engine may still grow by 12 GB: 13 GB free leaves 1 GB (1.25 %) at its peak.
    assert out.gpus[0].headroom_bytes == pytest.approx(1 * GB)
    assert (out.gpus[0].level.level, out.engines[0].level.level) == (2, 2)


def frag(split: float, pid=1, uuid="GPU-a") -> AllocatorReport:
    return dataclasses.replace(alloc(pid=pid, uuid=uuid), inactive_split_bytes=int(split))


def test_the_engines_own_fragmentation_is_named_as_the_reason():
    # The engine (plan 72 GB) holds 79.5 GB: 7 GB of it stranded in split blocks, which a
    # restart of its process gives back. 0.5 GB free: critical, and the fragments are the cause.
    total = 80 * GB
    g = GpuMemory(ident(), total, 79.5 * GB, 0.5 * GB, 0)
    processes = [(ident(), 1, 79.5 * GB)]
    e = [EngineSource("t", engine(0.9))]
    _, eng = levels(PressureEvaluator(), [g], e, [frag(7 * GB)], processes=processes)
    assert eng[("t", "m", "0")] == (3, "allocator_fragmentation")
    # the same without per-process figures (used counts against the plan)
    _, eng = levels(PressureEvaluator(), [g], e, [frag(7 * GB)])
    assert eng[("t", "m", "0")] == (3, "allocator_fragmentation")
    # a rank that names no device (the twin's) is on the engine's only GPU
    _, eng = levels(PressureEvaluator(), [g], e, [frag(7 * GB, uuid="")], processes=processes)
    assert eng[("t", "m", "0")] == (3, "allocator_fragmentation")


def test_fragments_that_would_not_relieve_the_gpu_are_not_the_reason():
    total = 80 * GB
    e = [EngineSource("t", engine(0.9))]
    # a 6.5 GB neighbour and 1 GB of fragments: without them, 1.5 GB free (under 2 %)
    g = GpuMemory(ident(), total, 79.5 * GB, 0.5 * GB, 0)
    processes = [(ident(), 1, 73 * GB), (ident(), 99, 6.5 * GB)]
    _, eng = levels(PressureEvaluator(), [g], e, [frag(1 * GB)], processes=processes)
    assert eng[("t", "m", "0")] == (3, "headroom_exhausted")
    # another engine's fragments are not this engine's to restart
    processes = [(ident(), 1, 79.5 * GB)]
    other = dataclasses.replace(frag(7 * GB, pid=2), target="u")
    _, eng = levels(PressureEvaluator(), [g], e, [alloc(pid=1), other], processes=processes)
    assert eng[("t", "m", "0")] == (3, "headroom_exhausted")
    # no fragments: the level's own reason
    _, eng = levels(PressureEvaluator(), [g], e, [frag(0)], processes=processes)
    assert eng[("t", "m", "0")] == (3, "headroom_exhausted")


def test_a_healthy_engine_with_fragments_stays_level_0():
    total = 80 * GB
    g = GpuMemory(ident(), total, 72 * GB, 8 * GB, 0)
    processes = [(ident(), 1, 72 * GB)]
    _, eng = levels(
        PressureEvaluator(),
        [g],
        [EngineSource("t", engine(0.9))],
        [frag(5 * GB)],
        processes=processes,
    )
    assert eng[("t", "m", "0")] == (0, "ok")


# -- several engines, tensor parallel, MIG ---------------------------------------------------
def test_two_engines_at_045_on_one_gpu_share_the_plan():
    twin = TwinGpu("GPU-s", "H100")
    twin.processes = {pid: int(0.45 * (twin.total - twin.reserved)) for pid in (1, 2)}
    gpus, processes = nvml_gpus(twin)
    sources = [EngineSource("a", engine(0.45)), EngineSource("b", engine(0.45))]
    reports = [alloc(uuid="GPU-s", pid=1, target="a"), alloc(uuid="GPU-s", pid=2, target="b")]
    ev = PressureEvaluator()
    _, engine_levels = levels(ev, gpus, sources, reports, processes=processes)
    assert set(engine_levels.values()) == {(0, "ok")}
    (gp,) = ev.evaluate(gpus, sources, reports, 0, processes).gpus
    assert gp.planned_bytes == pytest.approx(0.9 * (twin.total - twin.reserved), rel=1e-6)
    # A neighbour takes the slack: both engines are in danger.
    twin.processes[99] = int(0.1 * twin.total)
    gpus, processes = nvml_gpus(twin)
    _, engine_levels = levels(ev, gpus, sources, reports, processes=processes)
    assert {lv for lv, _ in engine_levels.values()} == {3}


def test_tensor_parallel_engine_is_judged_on_each_of_its_gpus():
    a = TwinGpu("GPU-a", "A100-80GB", minor=0)
    b = TwinGpu("GPU-b", "A100-80GB", minor=1)
    c = TwinGpu("GPU-c", "A100-80GB", minor=2)  # another engine's
    for i, g in enumerate((a, b, c)):
        g.processes[10 + i] = int(0.9 * (g.total - g.reserved))
    b.processes[99] = int(0.1 * b.total)  # a neighbour on rank 1's GPU only
    gpus, processes = nvml_gpus(a, b, c)
    reports = [alloc(uuid="GPU-a", pid=10, rank=0), alloc(uuid="GPU-b", pid=11, rank=1)]
    reports.append(alloc(uuid="GPU-c", pid=12, target="other"))
    sources = [EngineSource("t", engine(0.9)), EngineSource("other", engine(0.9))]
    out = PressureEvaluator().evaluate(gpus, sources, reports, 0, processes)
    by_uuid = {gp.identity.uuid: gp.level.level for gp in out.gpus}
    assert by_uuid == {"GPU-a": 0, "GPU-b": 3, "GPU-c": 0}
    got = {ep.target: (ep.level.level, sorted(g.gpu.uuid for g in ep.gpus)) for ep in out.engines}
    assert got == {"t": (3, ["GPU-a", "GPU-b"]), "other": (0, ["GPU-c"])}
    assert {g.source for ep in out.engines for g in ep.gpus} == {"allocator"}


def test_mig_slice_is_planned_on_its_own_memory_and_mapped_by_pid():
    twin = TwinGpu("GPU-m", "H100-MIG-1g.10gb")
    twin.processes[7] = int(0.92 * twin.total)
    gpus, processes = nvml_gpus(twin)
    mig = [g for g in gpus if g.identity.gpu_instance_id]
    assert len(mig) == 1 and mig[0].total == 9984 * MIB
    # The rank reports its MIG device UUID, which no NVML series carries: the PID maps it.
    reports = [alloc(uuid="MIG-6f1e", pid=7)]
    out = PressureEvaluator().evaluate(
        gpus, [EngineSource("t", engine(0.92))], reports, 0, processes
    )
    (ep,) = out.engines
    assert [g.gpu.gpu_instance_id for g in ep.gpus] == [mig[0].identity.gpu_instance_id]
    assert ep.level.level == 0
    twin.processes[99] = int(0.09 * twin.total)
    gpus, processes = nvml_gpus(twin)
    out = PressureEvaluator().evaluate(
        gpus, [EngineSource("t", engine(0.92))], reports, 0, processes
    )
    assert out.engines[0].level.level == 3


def test_a_reused_evaluator_follows_the_process_list_and_the_ranks():
    # The processes' index is kept while the list and the ranks stay the same: an engine's
    # usage moves with its process (even in a list changed in place), and a new rank counts.
    g = GpuMemory(ident(), 80 * GB, 67 * GB, 13 * GB, 0)
    processes = [(ident(), 1, 60 * GB), (ident(), 99, 7 * GB)]
    ev = PressureEvaluator()
    src = [EngineSource("t", engine(0.9))]

    def headroom(reports: list) -> float:
        (gp,) = ev.evaluate([g], src, reports, 0, processes).gpus
        assert gp.headroom_bytes is not None
        return gp.headroom_bytes

    assert headroom([alloc(pid=1)]) == pytest.approx(1 * GB)
    assert headroom([alloc(pid=1)]) == pytest.approx(1 * GB)  # the same: the index kept
    processes[0] = (ident(), 1, 65 * GB)  # in place: the engine grew by 5 GB of its plan
    assert headroom([alloc(pid=1)]) == pytest.approx(6 * GB)
    # pid 99 is a second rank of the engine now: its 7 GB are the engine's own, not a neighbour
    assert headroom([alloc(pid=1), alloc(pid=99, rank=1)]) == pytest.approx(13 * GB)
    assert headroom([alloc(pid=1)]) == pytest.approx(6 * GB)


def test_configured_gpus_override_the_data():
    gpus = [gpu(40 * GB, uuid="GPU-a", index="0"), gpu(1 * GB, uuid="GPU-b", index="1")]
    src = EngineSource("t", engine(0.5), ["1"])
    out = PressureEvaluator().evaluate(gpus, [src], [alloc(uuid="GPU-a")], 0)
    assert [(g.gpu.uuid, g.source) for g in out.engines[0].gpus] == [("GPU-b", "config")]


def test_configured_plan_overrides_vllms_figure():
    g = gpu(5 * GB)  # 75 GB used: right for a 0.94 plan, far beyond a 0.5 one
    ev = PressureEvaluator()
    (gp,) = ev.evaluate([g], [EngineSource("t", engine(None), (), 0.94)], [], 0).gpus
    assert gp.planned_bytes == pytest.approx(0.94 * 80 * GB) and gp.level.level == 0


# -- GPUs without a plan ---------------------------------------------------------------------
def test_gpu_without_engine_keeps_a_floor_and_goes_no_further_than_caution():
    (gp,) = PressureEvaluator().evaluate([gpu(0.1 * GB)], [], [], 0).gpus
    assert (gp.level.level, gp.level.reason) == (1, "free_below_floor")
    (gp,) = PressureEvaluator().evaluate([gpu(30 * GB)], [], [], 0).gpus
    assert gp.level.level == 0 and gp.floor_bytes == 2 * GIB


def test_engine_with_unknown_plan_is_not_guessed():
    # vLLM did not report gpu_memory_utilization and none is configured.
    out = PressureEvaluator().evaluate([gpu(0.5 * GB)], [EngineSource("t", engine(None))], [], 0)
    assert (out.gpus[0].level.level, out.gpus[0].level.reason) == (1, "free_below_floor")
    out = PressureEvaluator().evaluate([gpu(30 * GB)], [EngineSource("t", engine(None))], [], 0)
    assert (out.gpus[0].level.level, out.gpus[0].level.reason) == (0, "plan_unknown")


# -- allocator events ------------------------------------------------------------------------
def test_new_allocator_oom_is_critical_and_held_then_released():
    ev = PressureEvaluator(PressureThresholds(event_hold_seconds=60))
    src = [EngineSource("t", engine(0.9))]
    healthy = gpu(8 * GB, reserved=0)
    ev.observe_allocator([alloc(ooms=0)], now=0)
    ev.observe_allocator([alloc(ooms=1)], now=10)
    g, e = levels(ev, [healthy], src, [alloc(ooms=1)], now=20)
    assert set(g.values()) == set(e.values()) == {(3, "allocator_oom")}
    g, e = levels(ev, [healthy], src, [alloc(ooms=1)], now=71)
    assert set(g.values()) == set(e.values()) == {(0, "ok")}


def test_oom_count_seen_first_time_is_history_not_news():
    ev = PressureEvaluator()
    ev.observe_allocator([alloc(ooms=4)], now=0)
    g, _ = levels(ev, [gpu(8 * GB)], [EngineSource("t", engine(0.9))], now=1)
    assert set(g.values()) == {(0, "ok")}


def test_alloc_retries_rising_is_pressure():
    ev = PressureEvaluator()
    ev.observe_allocator([alloc(retries=1)], now=0)
    ev.observe_allocator([alloc(retries=2)], now=1)
    g, _ = levels(ev, [gpu(8 * GB)], [EngineSource("t", engine(0.9))], now=2)
    assert set(g.values()) == {(2, "allocator_retries")}


def test_free_after_gc_counts_only_without_a_plan():
    out = PressureEvaluator().evaluate([gpu(1 * GB)], [], [alloc(free_after_gc=10 * GIB)], 0)
    assert out.gpus[0].free_bytes == 10 * GIB and out.gpus[0].level.level == 0


# -- blind is not healthy --------------------------------------------------------------------
def test_a_gpu_that_vanishes_is_blind_then_forgotten():
    ev = PressureEvaluator(PressureThresholds(blind_retention_seconds=60))
    src = [EngineSource("t", engine(0.9), ["GPU-a"])]
    levels(ev, [gpu(8 * GB)], src, now=0)
    g, e = levels(ev, [], src, now=10)
    assert g == {("GPU-a", ""): (-1, "gpu_lost")}
    assert e == {("t", "m", "0"): (-1, "gpu_lost")}  # its only GPU cannot be read
    g, _ = levels(ev, [], src, now=100)
    assert g == {}


def test_gpu_listed_without_numbers_is_blind():
    broken = GpuMemory(ident(), None, None, None, None)
    g, e = levels(PressureEvaluator(), [broken], [EngineSource("t", engine(0.9))])
    assert g == {("GPU-a", ""): (-1, "gpu_unreadable")}
    assert e == {("t", "m", "0"): (-1, "gpu_unreadable")}


def test_engines_of_a_target_that_cannot_be_read_are_blind():
    ev = PressureEvaluator(PressureThresholds(blind_retention_seconds=60))
    two = [EngineSource("t", engine(0.9, "0")), EngineSource("t", engine(0.9, "1"))]
    levels(ev, [gpu(8 * GB)], two, now=0)
    _, e = levels(ev, [gpu(8 * GB)], [], now=5, blind=["t"])
    blind = (-1, "engine_unreachable")
    assert e == {("t", "m", "0"): blind, ("t", "m", "1"): blind}
    # An engine that vanishes from a target still read is blind too.
    _, e = levels(ev, [gpu(8 * GB)], two[:1], now=6)
    assert e == {("t", "m", "0"): (0, "ok"), ("t", "m", "1"): (-1, "engine_missing")}
    _, e = levels(ev, [gpu(8 * GB)], two[:1], now=200)
    assert e == {("t", "m", "0"): (0, "ok")}


@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_memory_stays_bounded_when_upstream_invents_engines():
    """500 new engine label sets per poll (hostile /metrics) for 400 polls."""
    ev = PressureEvaluator()
    for poll in range(400):
        sources = [
            EngineSource("t", engine(0.9, f"{poll}-{i}", preemptions=1.0, finished={"stop": 1.0}))
            for i in range(500)
        ]
        for s in sources:
            ev.observe_engine("t", s.engine, poll)
        ev.evaluate([gpu(8 * GB)], sources, [], poll)
    assert len(ev._history) == 500  # only the engines of the last snapshot
    assert len(ev._seen_engines) <= MAX_REMEMBERED


# -- signals beside the level ----------------------------------------------------------------
def test_full_kv_cache_and_preemptions_never_raise_the_level():
    ev = PressureEvaluator()
    for t, (pre, fin) in enumerate([(0, 0), (50, 100)]):
        e = engine(
            0.9, kv_usage=1.0, running=256, waiting=500, preemptions=pre, finished={"s": fin}
        )
        ev.observe_engine("t", e, t * 10.0)
    (ep,) = ev.evaluate([gpu(8 * GB)], [EngineSource("t", e)], [], 20).engines
    assert ep.level.level == 0 and ep.preemption_ratio == pytest.approx(0.5)


def test_counter_reset_clears_history():
    ev = PressureEvaluator()
    for t, (pre, fin) in enumerate([(0, 0), (100, 200), (1, 1)]):
        ev.observe_engine("t", engine(preemptions=pre, finished={"s": fin}), t * 10.0)
    assert ev.preemption_ratio(("t", "m", "0")) is None


def test_projected_kv_demand_ratio():
    e = EngineReading(
        "m",
        "0",
        running=10,
        waiting=10,
        kv_capacity_tokens=100_000,
        prompt_sum=3000 * 4,
        prompt_count=4,
        generation_sum=1000 * 4,
        generation_count=4,
    )
    ratio = PressureEvaluator(PressureThresholds(kv_budget_margin=0.15)).projected_kv_ratio(e)
    assert ratio == pytest.approx(20 * 4000 * 1.15 / 100_000)


def test_threshold_order_is_validated():
    with pytest.raises(ValueError, match="ordered"):
        PressureThresholds(headroom_pressure_ratio=0.03, headroom_caution_ratio=0.02)


def test_history_stays_bounded_at_any_poll_rate():
    ev = PressureEvaluator(PressureThresholds(rate_window_seconds=60))
    for i in range(10_000):  # 10,000 scrapes 1 ms apart
        ev.observe_engine("t", engine(preemptions=i, finished={"s": 10 * i}), now=i / 1000)
    (history,) = ev._history.values()
    assert len(history) <= 125
    assert history[-1][1] == 9_999  # the newest counters are always kept


# -- the matrix, quick subset (bench/matrix.py runs it all) -----------------------------------
@pytest.mark.parametrize(
    ("gpu_name", "trace_name"),
    [
        *((g, "neighbour-growth") for g in ("L4", "L40S", "H100", "H100-MIG-1g.10gb")),
        *((g, "long-context-burst") for g in ("L4", "A100-40GB", "H200")),
        ("L40S", "fragmentation-creep"),  # 7,200 simulated seconds: one GPU here, all in bench
    ],
)
def test_matrix_subset_steady_is_left_alone_and_the_incident_is_caught_in_time(
    gpu_name, trace_name
):
    steady = simulate(gpu_name, 0.92, duration_s=30)
    assert (steady.max_level, steady.actions, steady.oom_without_s) == (0, 0, None)
    cell = simulate(gpu_name, 0.92, Trace.load(trace_name))
    assert cell.oom_without_s is not None  # the scaled incident does kill vLLM alone
    assert cell.lead_s is not None and cell.lead_s >= 30  # level 2 well before the OOM
    assert cell.first_critical_s is not None and cell.first_critical_s < cell.oom_without_s
    assert cell.oom_with_s is None  # drained before its next full chunk no longer fit
    assert cell.oom_with_step_guard_s is None and steady.step_guard_shrinks == 0


@pytest.mark.parametrize("gpu_name", ["RTX4090", "L40S", "H100", "H100-MIG-3g.40gb"])
def test_matrix_memory_taken_within_seconds_only_the_step_guard_holds(gpu_name):
    """Memory taken within seconds under heavy prefill (issue 27): vLLM alone dies, the alerts'
    drain lands after the next full chunk, the step guard looking before each step holds; a
    steady GPU is never shrunk."""
    from oomguard.lab.matrix import STEP_DT, STEP_TRACES

    assert simulate(gpu_name, 0.92, duration_s=30).step_guard_shrinks == 0
    lost_race = 0
    for name in STEP_TRACES:
        cell = simulate(gpu_name, 0.92, Trace.load(name), dt=STEP_DT)
        assert cell.oom_without_s is not None, name
        assert cell.oom_with_step_guard_s is None and cell.step_guard_shrinks > 0, name
        lost_race += cell.oom_with_s is not None
    assert lost_race >= 1


def test_matrix_covers_every_trace_that_takes_memory_away():
    """A trace with GPU memory events is a pressure-model incident: the matrix must run it."""
    from oomguard.lab.matrix import INCIDENT_TRACES, STEP_TRACES
    from oomguard.twin.traces import TRACES

    with_events = {p.stem for p in TRACES.glob("*.json") if Trace.load(p.stem).gpu_events}
    assert with_events == set(INCIDENT_TRACES) | set(STEP_TRACES)


def test_the_real_twins_trace_has_the_simulations_load():
    """Every prefill step a full chunk in the real run too, so the two can agree or disagree."""
    from oomguard.lab.matrix import scaled_trace

    base = Trace.load("fragmentation-creep")
    real = scaled_trace(base, "L40S", 0.92)
    for each in (real, scaled_trace(Trace.load("long-context-burst"), "L4", 0.92)):
        chunk, longest = each.engine.max_num_batched_tokens, each.engine.max_model_len
        for phase in each.phases:
            assert phase.prompt_tokens[1] <= min(chunk, longest - phase.output_tokens[1])
            assert phase.prompt_tokens[0] >= chunk - 64 - phase.output_tokens[1]
    assert real.engine.gpu_memory_utilization == 0.92 and real.gpu == "L40S"
    peak = max(f for _n, f in (real.gpu_at(t) for t in range(int(real.duration_s) + 1)))
    assert peak > 0 and peak != max(f for _n, f in (base.gpu_at(t) for t in range(7201)))


# -- end to end through the exporter's own collectors --------------------------------------
def test_l4_at_vllms_default_read_from_dcgm_is_left_alone(local_server, repo_root):
    """The defect from the field: dcgm-exporter on an L4 serving vLLM at 0.92, nothing wrong."""
    from prometheus_client.parser import text_string_to_metric_families

    from oomguard.exporter.collectors.dcgm import DcgmCollector
    from oomguard.exporter.collectors.vllm import VllmCollector
    from oomguard.exporter.poller import Poller

    fixtures = repo_root / "tests" / "fixtures"
    # One engine of the data-parallel capture (gmu 0.92): an L4 serves one engine.
    vllm_text = "\n".join(
        line
        for line in (fixtures / "vllm" / "vllm-dp2-multiproc.constructed.prom")
        .read_text()
        .split("\n")
        if 'engine="1"' not in line
    )
    server = local_server(vllm_text + "\n")
    dcgm = DcgmCollector("node-a", file=str(fixtures / "dcgm" / "l4-vllm-092.constructed.prom"))
    poller = Poller([dcgm, VllmCollector("llama", server.url)])
    for s in poller.states:
        poller.poll(s)
    got = {}
    for fam in text_string_to_metric_families(poller.render().text.decode()):
        for sample in fam.samples:
            if sample.name.endswith("pressure_level") or sample.name == "oomguard_engine_gpu_info":
                got.setdefault(sample.name, []).append((sample.labels, sample.value))
    (gpu_level,) = got["oomguard_gpu_pressure_level"]
    (engine_level,) = got["oomguard_engine_pressure_level"]
    assert (gpu_level[0]["reason"], gpu_level[1]) == ("ok", 0)
    assert (engine_level[0]["reason"], engine_level[1]) == ("ok", 0)
    (where,) = got["oomguard_engine_gpu_info"]
    assert where[0]["source"] == "single_gpu" and where[0]["UUID"].startswith("GPU-5b1e")
    # What the landed floor model said of the same numbers: under two floors free.
    free = 1809 * MIB
    assert free < 2 * PressureThresholds().floor_for(23034 * MIB)


def test_data_parallel_engines_are_never_placed_together_on_the_only_gpu():
    two = [EngineSource("t", engine(0.92, "0")), EngineSource("t", engine(0.92, "1"))]
    out = PressureEvaluator().evaluate([gpu(6 * GB)], two, [], 0)
    assert [ep.gpus for ep in out.engines] == [[], []]
    assert out.gpus[0].planned_bytes is None  # no plan guessed: 2 x 0.92 would read critical
    assert {ep.level.level for ep in out.engines} == {0}


def test_a_trace_window_keeps_the_memory_curve_and_the_load():
    base = Trace.load("neighbour-growth")
    part = base.window(300, 500)
    assert part.duration_s == 200
    for t in range(0, 201, 7):
        assert part.gpu_at(t) == pytest.approx(base.gpu_at(300 + t), abs=2)
    assert [(p.start_s, p.end_s) for p in part.phases] == [(0, 200)]
    assert part.pressure_ends_s is None  # 720 s lies outside the window
    with pytest.raises(ValueError, match="empty window"):
        base.window(1000, 2000)


def test_the_real_twin_replays_the_incident_on_a_clock_that_leaves_a_lead_to_see():
    """A lead of 34 simulated seconds at x20 is 1.7 s on the wall: a loaded 2-core machine's
    own delays, not oomguard, decided such a cell. The real run slows the clock instead."""
    from oomguard.lab.matrix import MIN_WALL_LEAD_S, MIN_WALL_TAIL_S, real_trace, scaled_trace

    for name in ("neighbour-growth", "long-context-burst", "fragmentation-creep"):
        scaled = scaled_trace(Trace.load(name), "H100", 0.92)
        cell = simulate("H100", 0.92, scaled)
        real, start = real_trace(scaled, cell)
        lead = cell.oom_without_s - cell.first_critical_s
        assert lead / real.time_compression >= MIN_WALL_LEAD_S - 1e-9
        # the window starts before the first level 2, with no fragmentation carried into it
        assert start <= cell.first_pressure_s and scaled.gpu_at(start)[1] == 0
        assert real.duration_s >= cell.oom_without_s - start
        tail = real.duration_s - (cell.oom_without_s - start)
        assert tail / real.time_compression >= MIN_WALL_TAIL_S - 1e-9
