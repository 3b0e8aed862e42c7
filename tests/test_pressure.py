from __future__ import annotations

import pytest
from oomguard.exporter.collectors.base import GpuIdentity, GpuMemory
from oomguard.exporter.collectors.vllm import EngineReading
from oomguard.exporter.pressure import EngineSource, PressureEvaluator

from oomguard.handoff import AllocatorReport
from oomguard.thresholds import GIB, PressureThresholds

GB = 10**9


def gpu(free: float, total: float = 80 * GB, uuid: str = "GPU-a", index: str = "0") -> GpuMemory:
    ident = GpuIdentity(index, uuid, "bus", "nvidia0", "H100", "h")
    return GpuMemory(ident, total, total - free, free, 0)


def engine(preemptions=0.0, finished=0.0, kv=0.5, **kw) -> EngineReading:
    return EngineReading(
        "m", "0", kv_usage=kv, preemptions=preemptions, finished={"stop": finished}, **kw
    )


def alloc(ooms=0, retries=0, free_after_gc=None, uuid="GPU-a") -> AllocatorReport:
    return AllocatorReport(
        timestamp=0,
        pid=1,
        rank=0,
        target="t",
        engine="0",
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
        gc_timestamp=None,
    )


def test_floor_scales_with_device_size():
    t = PressureThresholds()
    assert t.floor_for(80 * GB) == 2 * GIB  # 2 GiB on an 80 GB GPU
    assert t.floor_for(24 * GB) == pytest.approx(0.08 * 24 * GB)  # about 8 % on a 24 GB card
    assert t.floor_for(141 * GB) == 2 * GIB


@pytest.mark.parametrize(
    ("free", "level", "reason"),
    [
        (1.5 * GIB, 3, "free_below_floor"),
        (3 * GIB, 2, "free_low"),
        (5 * GIB, 1, "free_caution"),
        (7 * GIB, 0, "ok"),
    ],
)
def test_gpu_levels_by_free_memory(free, level, reason):
    (gp,) = PressureEvaluator().gpu_levels([gpu(free)], [], now=0)
    assert (gp.level.level, gp.level.reason) == (level, reason)


def test_free_after_gc_is_preferred_when_published():
    # NVML says 1 GiB free, but after emptying the cache 10 GiB are free: not critical
    (gp,) = PressureEvaluator().gpu_levels([gpu(1 * GIB)], [alloc(free_after_gc=10 * GIB)], 0)
    assert gp.level.level == 0 and gp.free_bytes == 10 * GIB


def test_new_allocator_oom_is_critical_and_held_then_released():
    ev = PressureEvaluator(PressureThresholds(event_hold_seconds=60))
    ev.observe_allocator([alloc(ooms=0)], now=0)
    ev.observe_allocator([alloc(ooms=1)], now=10)
    (gp,) = ev.gpu_levels([gpu(50 * GB)], [], now=20)
    assert (gp.level.level, gp.level.reason) == (3, "allocator_oom")
    (gp,) = ev.gpu_levels([gpu(50 * GB)], [], now=71)
    assert gp.level.level == 0


def test_oom_count_seen_first_time_is_history_not_news():
    ev = PressureEvaluator()
    ev.observe_allocator([alloc(ooms=4)], now=0)
    assert ev.gpu_levels([gpu(50 * GB)], [], now=1)[0].level.level == 0


def test_alloc_retries_rising_is_pressure():
    ev = PressureEvaluator()
    ev.observe_allocator([alloc(retries=1)], now=0)
    ev.observe_allocator([alloc(retries=2)], now=1)
    assert ev.gpu_levels([gpu(50 * GB)], [], now=2)[0].level.reason == "allocator_retries"


def run_engine(ev: PressureEvaluator, samples):
    for t, (pre, fin) in enumerate(samples):
        ev.observe_engine("t", engine(pre, fin), now=t * 10.0)
    e = engine(*samples[-1])
    (ep,) = ev.engine_levels([EngineSource("t", e, [])], [], now=len(samples) * 10.0)
    return ep


@pytest.mark.parametrize(
    ("samples", "level"),
    [
        ([(0, 0), (10, 100)], 2),  # 10 % of requests preempted
        ([(0, 0), (6, 300)], 1),  # 2 %
        ([(0, 0), (5, 1000)], 0),  # 0.5 %
        ([(0, 0), (3, 10)], 0),  # 30 %, but fewer than min_preemptions
    ],
)
def test_engine_preemption_ratio_levels(samples, level):
    ep = run_engine(PressureEvaluator(), samples)
    assert ep.level.level == level


def test_counter_reset_clears_history():
    ev = PressureEvaluator()
    ep = run_engine(ev, [(0, 0), (100, 200), (1, 1)])  # engine restarted
    assert ep.preemption_ratio is None and ep.level.level == 0


def test_full_kv_cache_alone_never_raises_the_level():
    ev = PressureEvaluator()
    ev.observe_engine("t", engine(kv=1.0, running=256, waiting=500), 0)
    e = engine(kv=1.0, running=256, waiting=500)
    (ep,) = ev.engine_levels([EngineSource("t", e, [])], [], now=1)
    assert ep.level.level == 0


def test_engine_takes_the_worst_level_of_its_own_gpus_only():
    ev = PressureEvaluator()
    levels = ev.gpu_levels(
        [gpu(1 * GIB, uuid="GPU-a", index="0"), gpu(60 * GB, uuid="GPU-b", index="1")], [], 0
    )
    on_b = EngineSource("t", engine(), ["1"])
    on_a = EngineSource("u", engine(), ["GPU-a"])
    anywhere = EngineSource("v", engine(), [])
    got = {ep.target: ep.level.level for ep in ev.engine_levels([on_a, on_b, anywhere], levels, 0)}
    assert got == {"t": 0, "u": 3, "v": 3}


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
    with pytest.raises(ValueError, match="caution_multiple"):
        PressureThresholds(pressure_multiple=3, caution_multiple=2)


def test_history_stays_bounded_at_any_poll_rate():
    ev = PressureEvaluator(PressureThresholds(rate_window_seconds=60))
    for i in range(10_000):  # 10,000 scrapes 1 ms apart
        ev.observe_engine("t", engine(i, 10 * i), now=i / 1000)
    (history,) = ev._history.values()
    assert len(history) <= 125
    assert history[-1][1] == 9_999  # the newest counters are always kept
