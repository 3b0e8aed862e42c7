"""Pressure levels: how close a GPU or an engine is to a CUDA out-of-memory error.

Levels: 0 ok, 1 caution, 2 pressure, 3 critical. They measure the precursors of a real OOM,
which live outside the KV pool (vLLM pre-allocates the pool, so KV usage near 100 % is normal
and never raises a level):

GPU (per device or MIG instance):
  3 critical  free memory < floor                      reason free_below_floor
              a rank on this GPU reported a new OOM     reason allocator_oom
  2 pressure  free memory < pressure_multiple x floor   reason free_low
              a rank on this GPU retried an allocation  reason allocator_retries
  1 caution   free memory < caution_multiple x floor    reason free_caution
Engine: the highest of its GPUs' levels and its own preemption ratio over the rate window
  2 pressure  preemptions > preemption_pressure_ratio of finished requests  reason preemption_rate
  1 caution   preemptions > preemption_caution_ratio                        reason preemption_rate

"Free memory" is the free memory measured right after the plugin emptied the allocator cache,
when a rank on that GPU published one recently, else the free memory NVML or dcgm reports.
OOM and retry events hold their level for `event_hold_seconds`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oomguard.exporter.collectors.base import GpuIdentity, GpuMemory
from oomguard.exporter.collectors.vllm import EngineReading

from oomguard.handoff import AllocatorReport
from oomguard.thresholds import PressureThresholds

OK, CAUTION, PRESSURE, CRITICAL = 0, 1, 2, 3


@dataclass(frozen=True)
class Level:
    level: int
    reason: str

    def worse(self, other: Level) -> Level:
        return other if other.level > self.level else self


LEVEL_OK = Level(OK, "ok")


@dataclass
class GpuPressure:
    identity: GpuIdentity
    level: Level
    floor_bytes: float
    free_bytes: float


@dataclass
class EnginePressure:
    target: str
    engine: EngineReading
    level: Level
    preemption_ratio: float | None
    projected_kv_ratio: float | None


@dataclass
class EngineSource:
    """An engine reading with where it came from: its target and the GPUs it runs on."""

    target: str
    engine: EngineReading
    gpus: Sequence[str]  # GPU indices or UUIDs; empty means every GPU on the node


class PressureEvaluator:
    """Keeps the short history that levels need (rates, held events) and computes levels."""

    def __init__(self, thresholds: PressureThresholds | None = None) -> None:
        self.t = thresholds or PressureThresholds()
        self._history: dict[tuple[str, str, str], deque[tuple[float, float, float]]] = {}
        self._last_counts: dict[tuple[int, int], tuple[int, int]] = {}
        self._held_gpu: dict[str, tuple[float, Level]] = {}
        self._held_engine: dict[tuple[str, str], tuple[float, Level]] = {}

    # -- observations ------------------------------------------------------------------------
    def observe_engine(self, target: str, e: EngineReading, now: float) -> None:
        """Record a new reading of an engine's counters (call once per new scrape)."""
        if e.preemptions is None or e.finished_total is None:
            return
        key = (target, e.model_name, e.engine)
        history = self._history.setdefault(key, deque())
        if history and (e.preemptions < history[-1][1] or e.finished_total < history[-1][2]):
            history.clear()  # counter reset: the engine restarted
        sample = (now, e.preemptions, e.finished_total)
        # At most ~120 samples per window however short the poll interval: a sample closer than
        # window/120 to the one before the newest replaces the newest instead of adding one.
        if len(history) >= 2 and now - history[-2][0] < self.t.rate_window_seconds / 120:
            history[-1] = sample
        else:
            history.append(sample)
        horizon = now - self.t.rate_window_seconds
        # Keep one sample at or before the window's start so the window is fully covered.
        while len(history) > 2 and history[1][0] <= horizon:
            history.popleft()

    def observe_allocator(self, reports: Iterable[AllocatorReport], now: float) -> None:
        """Detect new OOMs and alloc retries since each rank's previous report."""
        hold_until = now + self.t.event_hold_seconds
        seen: set[tuple[int, int]] = set()
        for r in reports:
            key = (r.pid, r.rank)
            seen.add(key)
            previous = self._last_counts.get(key)
            self._last_counts[key] = (r.ooms, r.alloc_retries)
            if previous is None:
                continue  # first sight of this process: its history is not news
            event: Level | None = None
            if r.ooms > previous[0]:
                event = Level(CRITICAL, "allocator_oom")
            elif r.alloc_retries > previous[1]:
                event = Level(PRESSURE, "allocator_retries")
            if event is not None:
                self._hold(self._held_gpu, r.device_uuid, hold_until, event)
                self._hold(self._held_engine, (r.target, r.engine), hold_until, event)
        for key in list(self._last_counts):
            if key not in seen:
                del self._last_counts[key]

    @staticmethod
    def _hold(table: dict[Any, tuple[float, Level]], key: Any, until: float, event: Level) -> None:
        held = table.get(key)
        if held is None or event.level >= held[1].level:
            table[key] = (until, event)

    def _held(self, table: dict[Any, tuple[float, Level]], key: Any, now: float) -> Level:
        held = table.get(key)
        if held is None:
            return LEVEL_OK
        if held[0] < now:
            del table[key]
            return LEVEL_OK
        return held[1]

    # -- evaluation --------------------------------------------------------------------------
    def preemption_ratio(self, target: str, e: EngineReading) -> float | None:
        history = self._history.get((target, e.model_name, e.engine))
        if not history or len(history) < 2:
            return None
        _, pre0, fin0 = history[0]
        _, pre1, fin1 = history[-1]
        return (pre1 - pre0) / max(fin1 - fin0, 1.0)

    def _preemption_level(self, target: str, e: EngineReading) -> Level:
        history = self._history.get((target, e.model_name, e.engine))
        ratio = self.preemption_ratio(target, e)
        if ratio is None or history is None:
            return LEVEL_OK
        if history[-1][1] - history[0][1] < self.t.min_preemptions:
            return LEVEL_OK
        if ratio > self.t.preemption_pressure_ratio:
            return Level(PRESSURE, "preemption_rate")
        if ratio > self.t.preemption_caution_ratio:
            return Level(CAUTION, "preemption_rate")
        return LEVEL_OK

    def projected_kv_ratio(self, e: EngineReading) -> float | None:
        """Per-request KV budget: (running + waiting) x (avg prompt + avg output) x (1 + margin)."""
        if not e.kv_capacity_tokens or e.running is None or e.waiting is None:
            return None
        if not e.prompt_count or not e.generation_count or e.prompt_sum is None:
            return None
        per_request = e.prompt_sum / e.prompt_count + (e.generation_sum or 0.0) / e.generation_count
        demand = (e.running + e.waiting) * per_request * (1.0 + self.t.kv_budget_margin)
        return demand / e.kv_capacity_tokens

    def gpu_levels(
        self, gpus: Iterable[GpuMemory], reports: Sequence[AllocatorReport], now: float
    ) -> list[GpuPressure]:
        gc_free: dict[str, float] = {}
        for r in reports:
            if r.free_after_gc_bytes is not None:
                gc_free[r.device_uuid] = max(gc_free.get(r.device_uuid, 0.0), r.free_after_gc_bytes)
        out: list[GpuPressure] = []
        for g in gpus:
            if g.total is None or g.free is None:
                continue
            ident = g.identity
            # MIG instances have no allocator report of their own UUID; whole GPUs may.
            free = gc_free.get(ident.uuid, g.free) if not ident.gpu_instance_id else g.free
            floor = self.t.floor_for(g.total)
            if free < floor:
                level = Level(CRITICAL, "free_below_floor")
            elif free < floor * self.t.pressure_multiple:
                level = Level(PRESSURE, "free_low")
            elif free < floor * self.t.caution_multiple:
                level = Level(CAUTION, "free_caution")
            else:
                level = LEVEL_OK
            if not ident.gpu_instance_id:
                level = level.worse(self._held(self._held_gpu, ident.uuid, now))
            out.append(GpuPressure(ident, level, floor, free))
        return out

    def engine_levels(
        self, sources: Iterable[EngineSource], gpu_levels: Sequence[GpuPressure], now: float
    ) -> list[EnginePressure]:
        out: list[EnginePressure] = []
        for src in sources:
            e = src.engine
            level = self._preemption_level(src.target, e)
            for gp in gpu_levels:
                if not src.gpus or gp.identity.gpu in src.gpus or gp.identity.uuid in src.gpus:
                    level = level.worse(gp.level)
            level = level.worse(self._held(self._held_engine, (src.target, e.engine), now))
            out.append(
                EnginePressure(
                    src.target,
                    e,
                    level,
                    self.preemption_ratio(src.target, e),
                    self.projected_kv_ratio(e),
                )
            )
        return out
