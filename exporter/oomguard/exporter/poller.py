"""The poller: collectors run in the background, snapshots are rendered once, scrapes read bytes.

Collectors poll at the configured interval one after another on one thread, and a collector
whose poll outlives a small budget (a slow engine, a hung NVML call) goes on on its own thread,
so it holds the others back once, briefly, and then only itself (lanes.py). A render pass, also
at the interval, takes each collector's latest result, merges GPU sources, computes pressure
levels, and renders the exposition text once. A result older than `stale_after` is not served:
its collector reports up 0, reason "timeout".
"""

from __future__ import annotations

import gzip
import logging
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

from oomguard import supervised
from oomguard.errors import CollectorError
from oomguard.exporter.collectors.allocator import AllocatorReading
from oomguard.exporter.collectors.base import (
    Collector,
    GpuIdentity,
    GpuMemory,
    GpuReading,
    Reading,
)
from oomguard.exporter.collectors.vllm import VllmReading
from oomguard.exporter.lanes import LANE, Lanes, thread_name
from oomguard.exporter.pressure import NO_GPU_SOURCE, EngineSource, PressureEvaluator
from oomguard.exporter.render import (
    GZIP_LEVEL,
    Family,
    FamilyBuilder,
    Parts,
    PartsBytes,
    PartsGzip,
    TextRenderer,
    join_parts,
    render_openmetrics_parts,
)
from oomguard.supervised import Supervised
from oomguard.thresholds import PressureThresholds
from oomguard.version import __version__

log = logging.getLogger("oomguard.exporter")

_IDENTITY = operator.itemgetter(0)  # of a (GpuIdentity, pid, bytes) process entry
_KEY = operator.attrgetter("key")

# GPU memory sources in order of preference: a GPU seen by both is reported from the first.
GPU_SOURCE_PRIORITY = ("nvml", "dcgm")


@dataclass
class Result:
    seq: int
    finished_at: float
    duration: float
    reading: Reading | None
    error: str | None = None


@dataclass
class CollectorState:
    collector: Collector
    result: Result | None = None
    running_since: float | None = None
    errors: Counter[str] = field(default_factory=Counter)
    invalid: Counter[str] = field(default_factory=Counter)
    last_success: float | None = None
    seq: int = 0
    stuck_counted: bool = False
    observed_seq: int = 0  # last result fed into the pressure history
    last_error: str | None = None
    # Guards the counters against the render thread reading them mid-update.
    lock: threading.Lock = field(default_factory=threading.Lock)


class Forms:
    """The forms of a poller's snapshots made after its text's pieces (the plain text joined,
    gzip, OpenMetrics), and who asks for them.

    Each form is made once per snapshot, on first request, from cached pieces (PartsGzip). A
    form that scrapes keep asking for (Prometheus asks for gzipped OpenMetrics) is made in the
    render pass, before the snapshot is published, when the next scrape is expected while it is
    the latest (from the gap between the last two requests): that scrape then only writes
    bytes. A form nobody asks for is never made; one asked for rarely is made on request, plus
    at most a few snapshots around each expected scrape.
    """

    FORMS = ("text", "text_gzip", "openmetrics", "openmetrics_gzip")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.text_gzip = PartsGzip()
        self.openmetrics = PartsBytes()
        self.openmetrics_gzip = PartsGzip()
        self._last: dict[str, float] = {}  # form -> when last requested (monotonic)
        self._gap: dict[str, float] = {}  # form -> time between its last two requests

    def asked(self, form: str) -> None:
        now = self.clock()
        last = self._last.get(form)
        if last is not None:
            self._gap[form] = now - last
        self._last[form] = now

    def expected(self, interval: float) -> list[str]:
        """The forms a scrape is expected to ask for within `interval` from now."""
        now = self.clock()
        out = []
        for form in self.FORMS:
            last, gap = self._last.get(form), self._gap.get(form)
            if last is None or gap is None:
                continue
            if now - last > 2 * max(gap, interval) + interval:
                continue  # the scraper stopped: stop making it
            if last + gap < now + interval:
                out.append(form)
        return out


class Snapshot:
    """One rendered snapshot. Gzip and OpenMetrics forms are made on first request (or in the
    render pass, when a scrape is expected to ask: Forms). The plain text may come in pieces
    (`text`, a list of bytes: the render pass encoded them), joined on first request: at node
    scale that is a 2 MB copy each snapshot, which Prometheus (it asks for OpenMetrics) never
    reads."""

    def __init__(
        self,
        timestamp: float,
        families: list[Family],
        text: bytes | list[bytes],
        parts: Parts | None = None,
        forms: Forms | None = None,
    ) -> None:
        self.timestamp = timestamp
        self.families = families
        self._text = text if isinstance(text, bytes) else None
        self._text_pieces = None if isinstance(text, bytes) else text
        self._parts = parts  # the text in pieces, when rendered by a Poller
        self._forms = forms
        self._gzip: bytes | None = None
        self._openmetrics_parts: Parts | None = None
        self._openmetrics: bytes | None = None
        self._openmetrics_gzip: bytes | None = None
        self._lock = threading.RLock()  # one making of each form, however many scrapes wait

    @property
    def text(self) -> bytes:
        self._asked("text")
        return self._make_text()

    def _make_text(self) -> bytes:
        text = self._text
        if text is None:
            with self._lock:
                if self._text is None:
                    self._text = b"".join(self._text_pieces or ())
                    self._text_pieces = None
                text = self._text
        return text

    def _asked(self, form: str) -> None:
        if self._forms is not None:
            self._forms.asked(form)

    def prepare(self, form: str) -> None:
        """Make a form now (the render pass, before publishing), without counting a request."""
        getattr(self, f"_make_{form}")()

    @property
    def text_gzip(self) -> bytes:
        self._asked("text_gzip")
        return self._make_text_gzip()

    @property
    def openmetrics(self) -> bytes:
        self._asked("openmetrics")
        return self._make_openmetrics()

    @property
    def openmetrics_gzip(self) -> bytes:
        self._asked("openmetrics_gzip")
        return self._make_openmetrics_gzip()

    def _make_text_gzip(self) -> bytes:
        if self._gzip is None:
            with self._lock:
                if self._gzip is None:
                    if self._parts is None or self._forms is None:
                        self._gzip = gzip.compress(self._make_text(), compresslevel=GZIP_LEVEL)
                    else:
                        self._gzip = self._forms.text_gzip.compress(self._parts)
        return self._gzip

    def _openmetrics_pieces(self) -> Parts:
        if self._openmetrics_parts is None:
            self._openmetrics_parts = render_openmetrics_parts(self.families)
        return self._openmetrics_parts

    def _make_openmetrics(self) -> bytes:
        if self._openmetrics is None:
            with self._lock:
                if self._openmetrics is None:
                    parts = self._openmetrics_pieces()
                    if self._forms is None:
                        self._openmetrics = join_parts(parts)
                    else:
                        self._openmetrics = self._forms.openmetrics.join(parts)
        return self._openmetrics

    def _make_openmetrics_gzip(self) -> bytes:
        if self._openmetrics_gzip is None:
            with self._lock:
                if self._openmetrics_gzip is None:
                    parts = self._openmetrics_pieces()
                    if self._forms is None:
                        self._openmetrics_gzip = gzip.compress(
                            join_parts(parts), compresslevel=GZIP_LEVEL
                        )
                    else:
                        self._openmetrics_gzip = self._forms.openmetrics_gzip.compress(parts)
        return self._openmetrics_gzip


class Poller:
    def __init__(
        self,
        collectors: Sequence[Collector],
        interval: float = 1.0,
        thresholds: PressureThresholds | None = None,
        engine_gpus: dict[str, Sequence[str]] | None = None,
        engine_gmu: dict[str, float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.interval = interval
        self.states = [CollectorState(c) for c in collectors]
        self.pressure = PressureEvaluator(thresholds)
        self.engine_gpus = engine_gpus or {}
        self.engine_gmu = engine_gmu or {}
        self.clock = clock
        self.renderer = TextRenderer()
        self._text_bytes = PartsBytes()  # the text's large bodies, encoded once each
        self.forms = Forms()
        self.render_dropped: Counter[str] = Counter()  # samples refused while building
        self.polls = 0
        self._stop = threading.Event()
        self._threads: list[Supervised] = []  # the render loop's
        self.lanes = Lanes(self.states, interval, self.poll, self._died)
        self.thread_restarts: Counter[str] = Counter()
        self._render_lock = threading.Lock()
        self.latest: Snapshot = Snapshot(0.0, [], b"")
        self._last_render_seconds = 0.0

    # -- collecting ----------------------------------------------------------------------------
    def stale_after(self, collector: Collector) -> float:
        return max(3 * self.interval, collector.timeout + self.interval)

    def poll(self, state: CollectorState) -> Result:
        """Run one poll of one collector and record its result. Never raises."""
        c = state.collector
        start = self.clock()
        state.running_since = start
        t0 = time.perf_counter()
        reading: Reading | None = None
        error: str | None = None
        message = ""
        try:
            reading = c.collect()
        except CollectorError as exc:
            error, message = exc.reason, str(exc)
        except Exception as exc:
            error, message = "unexpected", f"{type(exc).__name__}: {exc}"
            log.exception("collector %s %s raised unexpectedly", c.name, c.target)
        # Log transitions only: a collector that stays down must not flood the log every poll.
        if error != state.last_error:
            if error is None:
                log.info("collector %s %s recovered", c.name, c.target)
            else:
                log.warning("collector %s %s failed (%s): %s", c.name, c.target, error, message)
            state.last_error = error
        duration = time.perf_counter() - t0
        now = self.clock()
        with state.lock:
            state.seq += 1
            result = Result(state.seq, now, duration, reading, error)
            if error is not None:
                state.errors[error] += 1
            elif reading is not None:
                state.errors.update(reading.errors)
                state.invalid.update(reading.invalid)
                if not reading.errors:
                    state.last_success = now
            state.result = result
            state.running_since = None
            state.stuck_counted = False
        return result

    def _render_loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.lanes.watch()  # a poll past its budget gets its own thread
                self.render()
            except Exception:
                log.exception("render failed; serving the previous snapshot")
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self, first_results_within: float = 5.0) -> None:
        """Start the collectors' lane, wait (bounded) for first results, render once.

        A collector that hangs on its first poll (a wedged driver) is left to its own thread
        once past the lanes' budget, delays start-up by at most `first_results_within` seconds
        and is then reported stuck, like at any other time.
        """
        # every thread's restart series from the start (daemon threads: a hung NVML call
        # must not block process exit)
        for name in (LANE, *(thread_name(s) for s in self.states), "render"):
            self.thread_restarts[name] = 0
        self.lanes.start()
        deadline = time.monotonic() + first_results_within
        while time.monotonic() < deadline and any(s.result is None for s in self.states):
            self.lanes.watch()
            time.sleep(0.01)
        self.render()
        t = Supervised("render", self._render_loop, self._stop, self._died)
        self.thread_restarts[t.name] = 0
        t.start()
        self._threads.append(t)

    def _died(self, name: str) -> None:
        self.thread_restarts[name] += 1

    def problems(self) -> list[str]:
        """The supervised threads that make the exporter degraded now (its /healthz)."""
        return supervised.problems([*self.lanes.threads, *self._threads])

    def threads(self) -> list[Supervised]:
        """Every live supervised thread: the lane's, the collectors' own, the render loop's."""
        return [*self.lanes.threads, *self._threads]

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in [*self.lanes.stop(), *self._threads]:
            t.join(max(0.0, deadline - time.monotonic()))
        for state in self.states:
            close = getattr(state.collector, "close", None)
            if close is not None:
                close()

    # -- rendering -----------------------------------------------------------------------------
    def _fresh(self, state: CollectorState, now: float) -> Reading | None:
        result = state.result
        c = state.collector
        if state.running_since is not None and now - state.running_since > c.timeout:
            if not state.stuck_counted:
                with state.lock:
                    state.errors["timeout"] += 1
                    state.stuck_counted = True
                log.warning("collector %s %s is stuck for over %ss", c.name, c.target, c.timeout)
            return None
        if result is None or result.reading is None:
            return None
        if now - result.finished_at > self.stale_after(c):
            return None
        return result.reading

    def render(self) -> Snapshot:
        with self._render_lock:
            return self._render()

    def _render(self) -> Snapshot:
        now = self.clock()
        out = FamilyBuilder(self.render_dropped)
        fresh: list[tuple[CollectorState, Any]] = []
        for state in self.states:
            reading = self._fresh(state, now)
            if reading is not None:
                fresh.append((state, reading))
                try:
                    state.collector.families(reading, out)
                except Exception:
                    # A bug in one collector's families must not take every metric down.
                    with state.lock:
                        state.errors["unexpected"] += 1
                    log.exception("collector %s %s failed to render", *_names(state))
        fresh_ids = {id(state) for state, _ in fresh}

        gpus, processes = self._merge_gpus(fresh)
        reports = [r for _, rd in fresh if isinstance(rd, AllocatorReading) for r in rd.reports]
        engines: list[EngineSource] = []
        fresh_targets: set[str] = set()
        for state, reading in fresh:
            if isinstance(reading, VllmReading):
                target = state.collector.target
                fresh_targets.add(target)
                gpus_of = self.engine_gpus.get(target, ())
                gmu = self.engine_gmu.get(target)
                engines.extend(EngineSource(target, e, gpus_of, gmu) for e in reading.engines)
                if state.result and state.result.seq != state.observed_seq:
                    for e in reading.engines:
                        self.pressure.observe_engine(target, e, state.result.finished_at)
            elif (
                isinstance(reading, AllocatorReading)
                and state.result
                and state.result.seq != state.observed_seq
            ):
                self.pressure.observe_allocator(reading.reports, now)
            if state.result:
                state.observed_seq = state.result.seq

        blind_targets = {
            s.collector.target
            for s in self.states
            if s.collector.name == "vllm" and s.collector.target not in fresh_targets
        }
        levels = self.pressure.evaluate(
            [g for g, _ in gpus],
            engines,
            reports,
            now,
            processes,
            blind_targets,
            self._gpu_problem(fresh_ids),
        )
        for g, source in gpus:
            g.add_to(out)
            out.add("oomguard_gpu_info", (*g.identity.labels(), source), 1)
        for gp in levels.gpus:
            labels = gp.identity.labels()
            out.add("oomguard_gpu_free_floor_bytes", labels, gp.floor_bytes)
            out.add("oomguard_gpu_planned_bytes", labels, gp.planned_bytes)
            out.add("oomguard_gpu_headroom_bytes", labels, gp.headroom_bytes)
            out.add("oomguard_gpu_pressure_level", (*labels, gp.level.reason), gp.level.level)
        for ep in levels.engines:
            labels = ep.key
            out.add("oomguard_engine_pressure_level", (*labels, ep.level.reason), ep.level.level)
            out.add("oomguard_vllm_preemption_ratio", labels, ep.preemption_ratio)
            out.add("oomguard_vllm_kv_projected_demand_ratio", labels, ep.projected_kv_ratio)
            for eg in ep.gpus:
                ident = eg.gpu
                where = (ident.gpu, ident.uuid, ident.gpu_instance_id, eg.source)
                out.add("oomguard_engine_gpu_info", (*labels, *where), 1)

        self._self_metrics(out, now, fresh_ids)
        self.polls += 1
        families = out.families()
        t0 = time.perf_counter()
        parts = self.renderer.render_parts(families)
        text = self._text_bytes.pieces(parts)  # joined when a scrape asks for plain text
        render_seconds = time.perf_counter() - t0
        self._last_render_seconds = render_seconds
        snapshot = Snapshot(now, families, text, parts, self.forms)
        for form in self.forms.expected(self.interval):
            snapshot.prepare(form)  # before publishing: the expected scrape only writes bytes
        self.latest = snapshot  # one reference swap: scrapes never see half a snapshot
        return snapshot

    def _gpu_problem(self, fresh_ids: set[int]) -> str | None:
        """Why GPUs may be missing from this snapshot: when no GPU source read, the first one's
        failure (in order of preference) as `<collector>_<reason>` (nvml_library_not_found: NVML
        is absent; nvml_timeout: stuck or stale); `no_gpu_source` when none is configured; None
        while a source reads. Engines with no GPU to be judged on are blind with it."""
        sources = [s for s in self.states if s.collector.name in GPU_SOURCE_PRIORITY]
        if not sources:
            return NO_GPU_SOURCE
        sources.sort(key=lambda s: GPU_SOURCE_PRIORITY.index(s.collector.name))
        failures: list[str] = []
        for state in sources:
            result = state.result
            if result is not None and result.error is not None:
                reason = result.error
            elif result is None or id(state) not in fresh_ids or result.reading is None:
                reason = "timeout"  # stuck, stale, or no first result yet
            elif result.reading.errors:
                reason = sorted(result.reading.errors)[0]  # a GPU it lists cannot be read
            else:
                return None  # this one reads: a GPU it does not list is not its failure
            failures.append(f"{state.collector.name}_{reason}")
        return failures[0]

    def _merge_gpus(
        self, fresh: list[tuple[CollectorState, Any]]
    ) -> tuple[list[tuple[GpuMemory, str]], list[tuple[GpuIdentity, int, float]]]:
        """Each GPU once, from the most preferred source that has it, with that source's
        per-process memory of it."""
        by_source: dict[str, list[GpuReading]] = {}
        for state, reading in fresh:
            if isinstance(reading, GpuReading):
                by_source.setdefault(state.collector.name, []).append(reading)
        merged: dict[tuple[str, str], tuple[GpuMemory, str]] = {}
        processes: list[tuple[GpuIdentity, int, float]] = []
        for source in (*GPU_SOURCE_PRIORITY, *sorted(set(by_source) - set(GPU_SOURCE_PRIORITY))):
            for reading in by_source.get(source, ()):
                taken = {g.identity.key for g in reading.gpus if g.identity.key not in merged}
                for g in reading.gpus:
                    merged.setdefault(g.identity.key, (g, source))
                runs = reading.process_runs
                if runs is not None and _covers(runs, reading.processes):
                    # listed device by device: each device's processes taken whole, a slice
                    for key, start, end in runs:
                        if key in taken:
                            processes.extend(reading.processes[start:end])
                    continue
                # thousands of processes a render: the filter runs in C
                keys = map(_KEY, map(_IDENTITY, reading.processes))
                processes.extend(compress(reading.processes, map(taken.__contains__, keys)))
        return list(merged.values()), processes

    def _self_metrics(self, out: FamilyBuilder, now: float, fresh_ids: set[int]) -> None:
        out.add("oomguard_exporter_build_info", (__version__,), 1)
        for state in self.states:
            c = state.collector
            labels = (c.name, c.target)
            result = state.result
            with state.lock:
                errors = sorted(state.errors.items())
                invalid = sorted(state.invalid.items())
            up = 0.0
            if result is not None and result.reading is not None and id(state) in fresh_ids:
                up = 0.0 if result.reading.errors else 1.0
            out.add("oomguard_exporter_collector_up", labels, up)
            if result is not None:
                out.add("oomguard_exporter_collector_duration_seconds", labels, result.duration)
            out.add(
                "oomguard_exporter_collector_last_success_timestamp_seconds",
                labels,
                state.last_success,
            )
            for reason, count in errors:
                out.add("oomguard_exporter_collector_errors_total", (*labels, reason), count)
            for reason, count in invalid:
                out.add("oomguard_exporter_invalid_samples_total", (*labels, reason), count)
            if c.name == "vllm":
                out.add("oomguard_vllm_up", (c.target,), up)
                if result is not None:
                    out.add("oomguard_vllm_scrape_duration_seconds", (c.target,), result.duration)
        for reason, count in sorted((self.render_dropped + self.renderer.dropped).items()):
            out.add("oomguard_exporter_invalid_samples_total", ("render", "", reason), count)
        out.add("oomguard_exporter_snapshot_timestamp_seconds", (), now)
        out.add("oomguard_exporter_polls_total", (), self.polls)
        for name, count in sorted(self.thread_restarts.items()):
            out.add("oomguard_exporter_thread_restarts_total", (name,), count)
        out.add("oomguard_exporter_render_duration_seconds", (), self._last_render_seconds)


def _covers(runs: list[tuple[tuple[str, str], int, int]], processes: list[Any]) -> bool:
    """Whether the runs follow each other from the list's start to its end (nothing added to
    the list after them, none left out); a spot check of each run's first process's key."""
    at = 0
    for key, start, end in runs:
        if start != at or end <= start or processes[start][0].key != key:
            return False
        at = end
    return at == len(processes)


def _names(state: CollectorState) -> tuple[str, str]:
    return state.collector.name, state.collector.target
