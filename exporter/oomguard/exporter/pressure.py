"""Pressure levels: how close a GPU or an engine is to a CUDA out-of-memory error.

Levels: -1 blind, 0 ok, 1 caution, 2 pressure, 3 critical; the `reason` says which signal set
it. The derivation and every threshold are in docs/pressure.md. In short:

vLLM plans its memory. Each engine may use `gpu_memory_utilization x usable` bytes of a GPU at
its peak (weights, KV pool, profiled activations, CUDA graphs); it leaves the rest free by design.
So free memory alone says nothing: what matters is the free memory left once every engine on the
GPU reaches its planned peak,

    need     = what the engines may still take per their plan  = sum(max(0, plan_e - used_e))
    headroom = free - need

A neighbour process, a leak or fragmentation eats the headroom; a healthy engine keeps
`(1 - gmu) x usable` of it. Levels compare the headroom with small shares of usable memory:

  3 critical  headroom < headroom_critical_ratio        reason headroom_exhausted
              a rank on the GPU reported a new OOM       reason allocator_oom
              the engine's step guard could not run a prefill step at all (decode only,
              or waiting)                                reason step_guard_stall
  2 pressure  headroom < headroom_pressure_ratio         reason headroom_low
              a rank on the GPU retried an allocation    reason allocator_retries
              the engine's step guard shrank a step      reason step_guard_shrink
  1 caution   headroom < headroom_caution_ratio          reason headroom_caution

An engine at pressure or critical on its headroom whose own allocator fragmentation is what takes
it (the GPU would be out of pressure if its ranks' `inactive_split_bytes` were free, as a restart
of its process makes them) carries reason allocator_fragmentation instead: only a restart helps
there, and the remediator restarts it at a quiet moment instead of capping it.

A GPU with no engine, or whose engines' plan is unknown, keeps a plain free-memory floor and goes
no further than caution (reason free_below_floor). An engine takes the worst level of the GPUs
it runs on and of its own allocator events.

What cannot be read is blind (-1), never "ok", from the first poll on: a GPU or an engine that
was never read is blind exactly as one that stopped being readable, and the reason says why
(BLIND_REASONS below; docs/pressure.md, "Blind is not healthy").
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter
from typing import Any

from oomguard.contract import FRAGMENTATION_REASON
from oomguard.exporter.collectors.base import GpuIdentity, GpuMemory
from oomguard.exporter.collectors.vllm import EngineReading
from oomguard.handoff import AllocatorReport
from oomguard.thresholds import PressureThresholds

BLIND, OK, CAUTION, PRESSURE, CRITICAL = -1, 0, 1, 2, 3
# How long a step guard shrink holds the engine's level (seconds): it is counted on every step
# that shrinks, so the level stays while memory stays short and falls soon after it returns.
STEP_GUARD_HOLD_S = 15.0
_STEP_REASONS = ("step_guard_shrink", "step_guard_stall")
_HEADROOM_REASONS = ("headroom_low", "headroom_exhausted")

# Engines known at once, at most: upstream /metrics is untrusted, and an endpoint inventing new
# engine labels every poll must not grow the exporter's memory without bound.
MAX_REMEMBERED = 4096

EngineKey = tuple[str, str, str]  # target, model_name, engine
GpuKey = tuple[str, str]  # parent UUID, GPU instance id ("" for a whole GPU)


@dataclass(frozen=True)
class Level:
    level: int
    reason: str

    def worse(self, other: Level) -> Level:
        return other if other.level > self.level else self


LEVEL_OK = Level(OK, "ok")
# Why a GPU or an engine is blind (level -1). Besides these, an engine is blind with the reason
# of its GPU source when no GPU could be read at all: `<collector>_<error>` such as
# `nvml_library_not_found` (NVML absent from the start), `nvml_timeout`, `dcgm_unreachable`.
GPU_UNREADABLE = Level(BLIND, "gpu_unreadable")  # listed by its source without numbers
GPU_LOST = Level(BLIND, "gpu_lost")  # read before, missing now
ENGINE_UNREACHABLE = Level(BLIND, "engine_unreachable")  # its endpoint is down or stale
ENGINE_MISSING = Level(BLIND, "engine_missing")  # its endpoint answers without this engine
NO_GPU_SOURCE = "no_gpu_source"  # NVML off and no dcgm-exporter: nothing to judge against
NO_GPUS_LISTED = "no_gpus_listed"  # the sources answer and list no GPU
GPU_NOT_FOUND = "gpu_not_found"  # a GPU the engine runs on (configured, reported) is not listed
BLIND_REASONS = (
    GPU_UNREADABLE.reason,
    GPU_LOST.reason,
    ENGINE_UNREACHABLE.reason,
    ENGINE_MISSING.reason,
    NO_GPU_SOURCE,
    NO_GPUS_LISTED,
    GPU_NOT_FOUND,
)


@dataclass
class GpuPressure:
    identity: GpuIdentity
    level: Level
    free_bytes: float | None = None
    planned_bytes: float | None = None  # sum of the engines' plans; None without a plan
    headroom_bytes: float | None = None  # free memory left at the planned peak
    floor_bytes: float | None = None  # the free-memory floor, for GPUs without a plan


@dataclass(frozen=True)
class EngineGpu:
    """Where an engine runs, and how oomguard learned it."""

    gpu: GpuIdentity
    source: str  # config | allocator | single_gpu


@dataclass
class EnginePressure:
    key: EngineKey
    level: Level
    engine: EngineReading | None = None  # None when blind (no fresh reading)
    gpus: list[EngineGpu] = field(default_factory=list)
    preemption_ratio: float | None = None
    projected_kv_ratio: float | None = None

    @property
    def target(self) -> str:
        return self.key[0]


@dataclass
class EngineSource:
    """A fresh engine reading with its target and the engine's configured overrides."""

    target: str
    engine: EngineReading
    gpus: Sequence[str] = ()  # configured GPU indices or UUIDs; empty: learn from the data
    gpu_memory_utilization: float | None = None  # configured plan; else vLLM's own figure

    @property
    def key(self) -> EngineKey:
        return (self.target, self.engine.model_name, self.engine.engine)


@dataclass
class Evaluation:
    gpus: list[GpuPressure]
    engines: list[EnginePressure]


@dataclass
class _Plan:
    """The engines planned on one GPU, with what they use now when that is known per engine."""

    engines: list[EngineSource] = field(default_factory=list)
    unknown: bool = False  # an engine's gpu_memory_utilization is not known
    planned: float = 0.0
    need: float = 0.0
    per_engine: bool = True  # every engine's usage on the GPU is known from its processes
    own: dict[EngineKey, tuple[float, float]] = field(default_factory=dict)  # plan, used


class PressureEvaluator:
    """Keeps the short history that levels need (rates, held events, what was seen) and
    computes levels. Every table is bounded: entries not seen for `blind_retention_seconds`,
    or beyond MAX_REMEMBERED, are forgotten."""

    def __init__(self, thresholds: PressureThresholds | None = None) -> None:
        self.t = thresholds or PressureThresholds()
        self._history: dict[EngineKey, deque[tuple[float, float, float]]] = {}
        self._last_counts: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._held_gpu: dict[str, tuple[float, Level]] = {}
        self._held_engine: dict[tuple[str, str], tuple[float, Level]] = {}
        self._seen_gpus: dict[GpuKey, tuple[float, GpuIdentity]] = {}
        self._seen_engines: dict[EngineKey, float] = {}
        # (process list, ranks, their index) of the last evaluation: _process_index
        self._last_index: tuple[list[Any], set[int], _ProcessIndex] | None = None

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
            shrunk, stalled = _step_shrinks(r)
            self._last_counts[key] = (r.ooms, r.alloc_retries, shrunk, stalled)
            if previous is None:
                continue  # first sight of this process: its history is not news
            event: Level | None = None
            if r.ooms > previous[0]:
                event = Level(CRITICAL, "allocator_oom")
            elif stalled > previous[3]:
                event = Level(CRITICAL, "step_guard_stall")
            elif r.alloc_retries > previous[1]:
                event = Level(PRESSURE, "allocator_retries")
            elif shrunk > previous[2]:
                event = Level(PRESSURE, "step_guard_shrink")
            if event is not None:
                # a shrink says memory is short at this moment, and the step guard keeps
                # counting while it stays short: held briefly, so the level falls with it
                until = now + STEP_GUARD_HOLD_S if event.reason in _STEP_REASONS else hold_until
                self._hold(self._held_gpu, r.device_uuid, until, event)
                self._hold(self._held_engine, (r.target, r.engine), until, event)
        for key in list(self._last_counts):
            if key not in seen:
                del self._last_counts[key]

    @staticmethod
    def _hold(table: dict[Any, tuple[float, Level]], key: Any, until: float, event: Level) -> None:
        held = table.get(key)
        if held is not None and event.level == held[1].level:
            until = max(until, held[0])  # a shorter hold never cuts a longer one short
        if held is None or event.level >= held[1].level:
            table[key] = (until, event)

    @staticmethod
    def _held(table: dict[Any, tuple[float, Level]], key: Any) -> Level:
        held = table.get(key)
        return LEVEL_OK if held is None else held[1]

    # -- signals that are not levels ---------------------------------------------------------
    def preemption_ratio(self, key: EngineKey) -> float | None:
        history = self._history.get(key)
        if not history or len(history) < 2:
            return None
        _, pre0, fin0 = history[0]
        _, pre1, fin1 = history[-1]
        return (pre1 - pre0) / max(fin1 - fin0, 1.0)

    def projected_kv_ratio(self, e: EngineReading) -> float | None:
        """Per-request KV budget: (running + waiting) x (avg prompt + avg output) x (1 + margin)."""
        if not e.kv_capacity_tokens or e.running is None or e.waiting is None:
            return None
        if not e.prompt_count or not e.generation_count or e.prompt_sum is None:
            return None
        per_request = e.prompt_sum / e.prompt_count + (e.generation_sum or 0.0) / e.generation_count
        demand = (e.running + e.waiting) * per_request * (1.0 + self.t.kv_budget_margin)
        return demand / e.kv_capacity_tokens

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(
        self,
        gpus: Sequence[GpuMemory],
        engines: Sequence[EngineSource],
        reports: Sequence[AllocatorReport],
        now: float,
        processes: Sequence[tuple[GpuIdentity, int, float]] = (),
        blind_targets: Iterable[str] = (),
        gpu_problem: str | None = None,
    ) -> Evaluation:
        """Levels of every GPU and engine from one snapshot of fresh readings.

        `gpus`, `engines`, `reports` and `processes` are what could be read now;
        `blind_targets` are vLLM targets whose reading is missing or stale: their engines, as
        last seen, are reported blind for `blind_retention_seconds`, and a target never read
        is one blind engine (model and engine labels empty) until it answers. `gpu_problem` is
        why a GPU may be missing from `gpus` (the GPU source's error, or that there is none;
        None while every source reads): the reason of an engine that has no GPU to be judged on.
        """
        self._expire(now)
        readable = [g for g in gpus if g.total is not None and g.free is not None]
        for g in readable:
            self._seen_gpus[g.identity.key] = (now, g.identity)
        # Listed without numbers, or seen before and missing now: blind, not healthy.
        readable_keys = {g.identity.key for g in readable}
        unreadable: dict[GpuKey, tuple[GpuIdentity, Level]] = {
            g.identity.key: (g.identity, GPU_UNREADABLE)
            for g in gpus
            if g.identity.key not in readable_keys
        }
        for key, (_, ident) in self._seen_gpus.items():
            if key not in readable_keys:
                unreadable.setdefault(key, (ident, GPU_LOST))
        known = [g.identity for g in readable] + [ident for ident, _ in unreadable.values()]
        per_target = Counter(src.target for src in engines)
        on_gpus = self._process_index(processes, {r.pid for r in reports})
        ranks_of: dict[tuple[str, str], list[AllocatorReport]] = {}  # by (target, engine)
        for r in reports:
            ranks_of.setdefault((r.target, r.engine), []).append(r)
        located = {
            src.key: self._locate(src, known, ranks_of, on_gpus, per_target[src.target] == 1)
            for src in engines
        }
        mapping = {key: where for key, (where, _) in located.items()}
        plans = self._plans(readable, engines, mapping, ranks_of, on_gpus)

        gpu_out = [self._gpu_level(g, plans.get(g.identity.key), reports) for g in readable]
        memory = {g.identity.key: g for g in readable}
        gpu_out.extend(GpuPressure(ident, level) for ident, level in unreadable.values())
        by_key = {gp.identity.key: gp for gp in gpu_out}

        engine_out: list[EnginePressure] = []
        fresh_keys = {src.key for src in engines}
        for src in engines:
            self._seen_engines[src.key] = now
            where, missing = located[src.key]
            level = self._held(self._held_engine, (src.target, src.engine.engine))
            on = [by_key[eg.gpu.key] for eg in where] if where else list(by_key.values())
            for gp in on:
                level = level.worse(gp.level)
            blind = [gp.level for gp in on if gp.level.level == BLIND]
            if not on:  # no GPU at all: nothing to judge it on
                level = Level(BLIND, gpu_problem or NO_GPUS_LISTED)
            elif missing:  # a GPU it runs on was never read
                level = Level(BLIND, gpu_problem or GPU_NOT_FOUND)
            elif blind:
                level = blind[0]  # a GPU it may run on cannot be read: say so, do not guess
            elif level.reason in _HEADROOM_REASONS + _STEP_REASONS and self._fragmented(
                src,
                # the GPUs whose headroom sets the level (a step guard shrink at the same level
                # is the same shortage, seen by the engine)
                [gp for gp in on if gp.level.level == level.level],
                len(on) == 1,
                memory,
                plans,
                reports,
            ):
                level = Level(level.level, FRAGMENTATION_REASON)
            engine_out.append(
                EnginePressure(
                    src.key,
                    level,
                    src.engine,
                    where,
                    self.preemption_ratio(src.key),
                    self.projected_kv_ratio(src.engine),
                )
            )
        _trim(self._seen_engines)
        _trim(self._seen_gpus)
        # Seen before, not in this snapshot: its target is down, or it vanished from the output.
        down = set(blind_targets)
        watched = down | {k[0] for k in fresh_keys}
        reported = {k[0] for k in fresh_keys}
        for engine_key in self._seen_engines:
            if engine_key not in fresh_keys and engine_key[0] in watched:
                why = ENGINE_UNREACHABLE if engine_key[0] in down else ENGINE_MISSING
                engine_out.append(EnginePressure(engine_key, why))
                reported.add(engine_key[0])
        # Never read (down since the start, or forgotten after blind_retention_seconds): one
        # series for the target, blind, so that "cannot see it" is never an absent series.
        for target in sorted(down - reported):
            engine_out.append(EnginePressure((target, "", ""), ENGINE_UNREACHABLE))
        self._forget_history(fresh_keys)
        return Evaluation(gpu_out, engine_out)

    # -- mapping engines to GPUs -------------------------------------------------------------
    def _process_index(
        self, processes: Sequence[tuple[GpuIdentity, int, float]], ranks: set[int]
    ) -> _ProcessIndex:
        """The index of the last evaluation while the process list and the ranks are the same
        (a node's list mostly holds still; equal lists of the same entries compare in C)."""
        last = self._last_index
        if last is not None and last[1] == ranks and last[0] == processes:
            return last[2]
        index = _ProcessIndex(processes, ranks)
        self._last_index = (list(processes), ranks, index)
        return index

    @staticmethod
    def _locate(
        src: EngineSource,
        gpus: Sequence[GpuIdentity],
        ranks_of: dict[tuple[str, str], list[AllocatorReport]],
        on_gpus: _ProcessIndex,
        alone: bool,
    ) -> tuple[list[EngineGpu], bool]:
        """The GPUs an engine runs on: configured, else learned from its ranks' reports (device
        UUID, or its PIDs in the GPU's process list for MIG), else the node's only GPU for the
        only engine of its endpoint (data-parallel engines never share one GPU). The flag says
        a GPU it runs on is not among `gpus` (never read): configured, or a whole GPU a rank
        reported by UUID."""
        if src.gpus:
            wanted = set(src.gpus)
            found = [EngineGpu(g, "config") for g in gpus if g.gpu in wanted or g.uuid in wanted]
            named = {g.gpu.gpu for g in found} | {g.gpu.uuid for g in found}
            return found, not wanted <= named
        ranks = ranks_of.get((src.target, src.engine.engine))
        if ranks:
            uuids = {r.device_uuid for r in ranks}
            pids = {r.pid for r in ranks}
            on_pids = on_gpus.gpus_of(pids)
            found = [
                EngineGpu(g, "allocator")
                for g in gpus
                if g.key in on_pids or (not g.gpu_instance_id and g.uuid in uuids)
            ]
            # a MIG rank reports its MIG UUID, which no GPU series carries: only whole GPUs count
            listed = {g.uuid for g in gpus}
            unseen = any(u.startswith("GPU-") and u not in listed for u in uuids)
            if found or unseen:
                return found, unseen
        if len(gpus) == 1 and alone:
            return [EngineGpu(gpus[0], "single_gpu")], False
        return [], False  # unknown: the engine takes the worst level of the node's GPUs

    def _plans(
        self,
        gpus: Sequence[GpuMemory],
        engines: Sequence[EngineSource],
        mapping: dict[EngineKey, list[EngineGpu]],
        ranks_of: dict[tuple[str, str], list[AllocatorReport]],
        on_gpus: _ProcessIndex,
    ) -> dict[GpuKey, _Plan]:
        memory = {g.identity.key: g for g in gpus}
        plans: dict[GpuKey, _Plan] = {}
        for src in engines:
            for eg in mapping[src.key]:
                if eg.gpu.key in memory:  # an unreadable GPU has no plan to measure
                    plans.setdefault(eg.gpu.key, _Plan()).engines.append(src)
        for key, plan in plans.items():
            g = memory[key]
            usable = _usable(g)
            per_engine_need = 0.0
            for src in plan.engines:
                gmu = src.gpu_memory_utilization or src.engine.gpu_memory_utilization
                if gmu is None or not 0 < gmu <= 1:
                    plan.unknown = True
                    continue
                own = self._engine_usage(src, key, ranks_of, on_gpus)
                plan.planned += gmu * usable
                if own is None:
                    plan.per_engine = False
                else:
                    plan.own[src.key] = (gmu * usable, own)
                    per_engine_need += max(0.0, gmu * usable - own)
            if plan.per_engine:
                plan.need = per_engine_need
            else:
                # Usage per engine unknown: every used byte counts as the engines' own, so a
                # neighbour shows once the GPU's use passes the engines' plan.
                plan.need = max(0.0, plan.planned - (g.used or 0.0))
        return plans

    @staticmethod
    def _engine_usage(
        src: EngineSource,
        key: GpuKey,
        ranks_of: dict[tuple[str, str], list[AllocatorReport]],
        on_gpus: _ProcessIndex,
    ) -> float | None:
        """Device memory the engine's own processes use on this GPU, when the driver lists them."""
        pids = {r.pid for r in ranks_of.get((src.target, src.engine.engine), ())}
        used = [b for pid, b in on_gpus.on_gpu(key) if pid in pids]
        return sum(used) if used else None

    # -- levels ------------------------------------------------------------------------------
    def _gpu_level(
        self, g: GpuMemory, plan: _Plan | None, reports: Sequence[AllocatorReport]
    ) -> GpuPressure:
        assert g.total is not None and g.free is not None
        ident = g.identity
        held = LEVEL_OK if ident.gpu_instance_id else self._held(self._held_gpu, ident.uuid)
        if plan is None or plan.unknown:
            # No plan to measure against: a plain floor, never past caution.
            free = g.free
            if not ident.gpu_instance_id:
                for r in reports:
                    if r.device_uuid == ident.uuid and r.free_after_gc_bytes is not None:
                        free = max(free, float(r.free_after_gc_bytes))
            floor = self.t.floor_for(g.total)
            level = Level(CAUTION, "free_below_floor") if free < floor else LEVEL_OK
            if plan is not None:
                level = Level(level.level, "plan_unknown" if level.level == OK else level.reason)
            return GpuPressure(ident, level.worse(held), free, floor_bytes=floor)
        usable = _usable(g)
        headroom = g.free - plan.need
        if headroom < self.t.headroom_critical_ratio * usable:
            level = Level(CRITICAL, "headroom_exhausted")
        elif headroom < self.t.headroom_pressure_ratio * usable:
            level = Level(PRESSURE, "headroom_low")
        elif headroom < self.t.headroom_caution_ratio * usable:
            level = Level(CAUTION, "headroom_caution")
        else:
            level = LEVEL_OK
        return GpuPressure(ident, level.worse(held), g.free, plan.planned, headroom)

    def _fragmented(
        self,
        src: EngineSource,
        worst: Sequence[GpuPressure],
        one: bool,
        memory: dict[GpuKey, GpuMemory],
        plans: dict[GpuKey, _Plan],
        reports: Sequence[AllocatorReport],
    ) -> bool:
        """Whether this engine's own allocator fragments are what holds it at its level: on every
        GPU at that level, the headroom with its ranks' `inactive_split_bytes` given back (as a
        restart of its process does: the device gets them back, and the engine may grow into
        its plan again) is out of pressure. Whole GPUs only (a MIG rank's report names no GPU
        series)."""
        if not worst:
            return False
        ranks = [r for r in reports if (r.target, r.engine) == (src.target, src.engine.engine)]
        for gp in worst:
            g, plan = memory.get(gp.identity.key), plans.get(gp.identity.key)
            if (
                g is None
                or plan is None
                or plan.unknown
                or gp.identity.gpu_instance_id
                or gp.level.reason not in _HEADROOM_REASONS
            ):
                return False
            assert g.free is not None
            # a rank that names no device (the twin's) is on the engine's only GPU
            frag = float(
                sum(
                    r.inactive_split_bytes
                    for r in ranks
                    if r.device_uuid == gp.identity.uuid or (one and not r.device_uuid)
                )
            )
            if frag <= 0:
                return False
            if plan.per_engine:
                planned, own = plan.own.get(src.key, (0.0, 0.0))
                need = plan.need - max(0.0, planned - own) + max(0.0, planned - (own - frag))
            else:
                need = max(0.0, plan.planned - ((g.used or 0.0) - frag))
            if g.free + frag - need < self.t.headroom_pressure_ratio * _usable(g):
                return False
        return True

    # -- bounded memory ----------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        # the tables differ only in their key type, which these loops never look into
        held: tuple[dict[Any, tuple[float, Level]], ...] = (self._held_gpu, self._held_engine)
        for table in held:
            for key in [k for k, (until, _) in table.items() if until < now]:
                del table[key]
        horizon = now - self.t.blind_retention_seconds
        seen_tables: tuple[dict[Any, Any], ...] = (self._seen_gpus, self._seen_engines)
        for seen in seen_tables:
            for key in [k for k, v in seen.items() if _seen_at(v) < horizon]:
                del seen[key]
            _trim(seen)

    def _forget_history(self, fresh: set[EngineKey]) -> None:
        for key in [k for k in self._history if k not in fresh]:
            del self._history[key]


_PID = itemgetter(1)  # of a (GpuIdentity, pid, bytes) process entry


class _ProcessIndex:
    """The engines' processes in the GPUs' process lists, indexed once per evaluation.

    Only the ranks' PIDs (from their allocator reports) are ever looked up. A node lists
    thousands of processes (MIG instances, per-process series); scanning the whole list for
    every engine and GPU made an evaluation quadratic (0.5 s at 8,700 processes).
    """

    def __init__(
        self, processes: Sequence[tuple[GpuIdentity, int, float]], ranks: set[int]
    ) -> None:
        self._by_gpu: dict[GpuKey, list[tuple[int, float]]] = {}
        self._gpus_of_pid: dict[int, set[GpuKey]] = {}
        # a node lists thousands of processes and a few dozen ranks: the filter runs in C
        listed = compress(processes, map(ranks.__contains__, map(_PID, processes)))
        for ident, pid, used in listed:
            key = ident.key
            self._by_gpu.setdefault(key, []).append((pid, used))
            self._gpus_of_pid.setdefault(pid, set()).add(key)

    def on_gpu(self, key: GpuKey) -> list[tuple[int, float]]:
        """(pid, bytes) of ranks listed on this GPU or MIG instance, in the driver's order."""
        return self._by_gpu.get(key, [])

    def gpus_of(self, pids: Iterable[int]) -> set[GpuKey]:
        """The GPUs and MIG instances that list any of these PIDs."""
        found: set[GpuKey] = set()
        for pid in pids:
            found |= self._gpus_of_pid.get(pid, set())
        return found


def _step_shrinks(r: AllocatorReport) -> tuple[int, int]:
    """(steps the step guard shrank, steps it could not run a prefill in at all)."""
    shrunk = stalled = 0
    for kind, count in (r.step_shrinks or {}).items():
        if kind.startswith(("decode_only/", "wait/")):
            stalled += count
        else:
            shrunk += count
    return shrunk, stalled


def _trim(seen: dict[Any, Any]) -> None:
    """Forget the oldest entries beyond MAX_REMEMBERED."""
    if len(seen) > MAX_REMEMBERED:
        oldest = sorted(seen, key=lambda k: _seen_at(seen[k]))
        for key in oldest[: len(seen) - MAX_REMEMBERED]:
            del seen[key]


def _seen_at(value: float | tuple[float, Any]) -> float:
    return value[0] if isinstance(value, tuple) else value


def _usable(g: GpuMemory) -> float:
    """What vLLM calls the device's total: NVML's total less driver-reserved memory (the CUDA
    runtime's total excludes it). vLLM plans `gmu x` this."""
    assert g.total is not None
    return g.total - (g.reserved or 0.0)
