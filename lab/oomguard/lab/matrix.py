"""The GPU matrix: every common GPU x gpu_memory_utilization, steady load and incidents.

Each cell runs in simulated time, without a vLLM server: the twin's memory physics decide what
the GPU holds and whether a step fits; the exporter's own NVML collector reads that GPU through
`TwinNvml`, and its own pressure evaluator computes the level, from the same inputs a real node
gives it (device memory, per-process memory, vLLM's gpu_memory_utilization, the plugin's
allocator report). The remediation is the rule the alert routes carry: a level-3 engine is
drained after `detection_s` (exporter poll, Prometheus, Alertmanager, the remediator), so it
stops starting prefills; a drained engine's running requests decode for `drain_s`, then it holds
its memory idle. docs/pressure.md describes the model; bench/matrix.py runs the whole matrix.

Steady cells: heavy load at max_num_seqs, every step a full prefill chunk, the allocator cache
grown to the engine's planned peak. Incident cells: a trace's neighbour and fragmentation curve,
scaled so that its peak takes `overshoot` x the plan's slack ((1 - gmu) x usable memory): the
memory the incident takes always ends up beyond what vLLM left free, on every GPU.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from oomguard import vllm_seam
from oomguard.exporter.collectors.nvml import NvmlCollector
from oomguard.exporter.collectors.vllm import EngineReading
from oomguard.exporter.pressure import EngineSource, PressureEvaluator
from oomguard.handoff import AllocatorReport
from oomguard.lab.recovery import on_gpu, simulate_recovery
from oomguard.thresholds import PressureThresholds
from oomguard.twin.gpu import GPU_MODELS, TwinGpu, TwinNvml
from oomguard.twin.physics import Physics, Step, TwinOutOfMemory
from oomguard.twin.traces import Fragments, Phase, Trace
from oomguard.vllm_plugin import step_guard
from oomguard.vllm_plugin.step_guard import Room, StepCosts, margin_for, plan

GMUS = (0.85, 0.90, vllm_seam.GPU_MEMORY_UTILIZATION, 0.95)  # vLLM's default among them
# Largest first: each GPU serves the largest of these that starts at the lowest gmu of the matrix.
MODEL_LADDER = ("llama-3-8b", "llama-3.2-3b", "llama-3.2-1b")
# The traces whose incident is GPU memory taken away from the engine (a neighbour, fragmentation):
# what the pressure level predicts. prompt-logprobs and prefill-during-decode are one request's own
# transient peak; the request guard (vllm_plugin/guard.py) answers those, not the level.
INCIDENT_TRACES = ("neighbour-growth", "fragmentation-creep", "long-context-burst")
# Memory taken within seconds under heavy prefill load (issue 27): no alert outruns the next full
# chunk, so the remediation the alerts carry loses the race; the plugin's step guard, which looks
# before every step, is what holds. Simulated at STEP_DT.
STEP_TRACES = (
    "neighbour-2s-24gb",
    "neighbour-8s-48gb",
    "neighbour-30s-80gb",
    "fragmentation-spike",
    "long-prompt-burst",
)
STEP_DT = 0.1  # simulated seconds per tick for STEP_TRACES (a 2 s ramp is 20 ticks)
ENGINE_PID, NEIGHBOUR_PID = 4242, 7777
MAX_NUM_SEQS = 256


def model_for(gpu: str, max_num_batched_tokens: int = 8192) -> str:
    for model in MODEL_LADDER:
        try:
            _ = Physics.for_model(
                model,
                gpu=gpu,
                gpu_memory_utilization=min(GMUS),
                max_num_batched_tokens=max_num_batched_tokens,
            ).kv_pool  # raises when the model does not start
        except TwinOutOfMemory:
            continue
        return model
    raise TwinOutOfMemory(f"no twin model starts on {gpu}")


@dataclass
class Cell:
    gpu: str
    gmu: float
    model: str
    scenario: str  # "steady" or a trace name
    max_level: int = 0
    max_reason: str = "ok"
    first_pressure_s: float | None = None  # first tick at level >= 2
    first_critical_s: float | None = None
    oom_without_s: float | None = None  # when the engine would hit a CUDA OOM on its own
    oom_with_s: float | None = None  # ... and with oomguard acting on the level
    actions: int = 0  # remediator actions (cap lowered at level 2 after pressure_for, drains)
    # the end of the pressure -> full admission, through the shipped alerting path and the
    # remediator's own decision (lab/recovery.py); None where the trace has no end
    recovery_s: float | None = None
    retriggered: bool | None = None  # drained or capped again after full admission
    # the plugin's step guard on top of the remediation (vllm_plugin/step_guard.py: the same
    # plan, the twin's room, the margin and the room's trend): ticks it shrank the step, and
    # when (if ever) the step it allowed did not fit at the step's start or end
    step_guard_shrinks: int = 0
    oom_with_step_guard_s: float | None = None

    @property
    def lead_s(self) -> float | None:
        """How long before the OOM the level reached 2."""
        if self.oom_without_s is None or self.first_pressure_s is None:
            return None
        return self.oom_without_s - self.first_pressure_s

    def record(self) -> dict[str, object]:
        return {**asdict(self), "lead_s": self.lead_s}


def _reader(gpu: TwinGpu) -> tuple[TwinNvml, NvmlCollector]:
    nvml = TwinNvml([gpu])
    return nvml, NvmlCollector("matrix", backend=nvml)


def simulate(
    gpu_name: str,
    gmu: float,
    trace: Trace | None = None,
    *,
    dt: float = 1.0,
    detection_s: float = 5.0,
    pressure_for_s: float = 30.0,
    drain_s: float = 10.0,
    overshoot: float = 1.1,
    thresholds: PressureThresholds | None = None,
    duration_s: float = 120.0,
    levels: list[int] | None = None,
    release: bool = True,
) -> Cell:
    """One cell (see the module's docstring). `levels`: append the level of each tick to it;
    `release`: fragments that the trace's requests made (`fragments: requests`) coalesce once
    the drained engine is idle (False: the curve as it is, for `trace_levels`)."""
    model = model_for(gpu_name)
    p = Physics.for_model(model, gpu=gpu_name, gpu_memory_utilization=gmu)
    spec = GPU_MODELS[gpu_name]
    gpu = TwinGpu(f"GPU-matrix-{gpu_name}", gpu_name)
    nvml, collector = _reader(gpu)
    evaluator = PressureEvaluator(thresholds)
    # A MIG instance's rank reports its MIG UUID; the exporter maps it through its PID instead.
    device_uuid = f"MIG-matrix-{gpu_name}" if spec.mig_profile else gpu.uuid
    cell = Cell(gpu_name, gmu, model, trace.name if trace else "steady")

    slack = (1.0 - gmu) * p.usable
    scale = 0.0
    if trace is not None:
        scale = _scale(trace, slack, overshoot)
        duration_s = trace.duration_s
    guard = _StepGuardSim(p, trace, scale)
    full = Step(tokens=p.max_num_batched_tokens)
    decode = Step(tokens=MAX_NUM_SEQS)
    critical_since: float | None = None
    pressure_since: float | None = None
    drained_at: float | None = None
    capped = False
    ticks: list[int] = [] if levels is None else levels  # the level per tick, for the recovery
    fragments = None if trace is None else Fragments(trace)
    idle = False  # the drained engine holds its memory idle (the last tick's step was none)
    t = 0.0
    while t <= duration_s:
        neighbour, frag = 0, 0
        if fragments is not None:
            neighbour = fragments.trace.gpu_at(t)[0]
            frag = fragments.at(t, idle=idle and release)
        neighbour, frag = int(neighbour * scale), int(frag * scale)
        # Heavy load: the allocator cache holds the planned activation peak; fragmentation
        # grows the engine's reserved memory beyond it.
        nvml.set_process(0, ENGINE_PID, int(gmu * p.usable) + frag)
        nvml.set_process(0, NEIGHBOUR_PID, neighbour or None)

        # What the exporter sees, through its own collector and evaluator.
        reading = collector.collect()
        report = _report(t, device_uuid, p, frag)
        engine = EngineReading(model, "0", gpu_memory_utilization=gmu)
        evaluator.observe_allocator([report], t)
        ev = evaluator.evaluate(
            reading.gpus, [EngineSource("llm", engine)], [report], t, reading.processes
        )
        level = ev.engines[0].level
        ticks.append(level.level)
        if level.level > cell.max_level:
            cell.max_level, cell.max_reason = level.level, level.reason
        if level.level >= 2 and cell.first_pressure_s is None:
            cell.first_pressure_s = t
        if level.level >= 3 and cell.first_critical_s is None:
            cell.first_critical_s = t

        # The remediation the alerts carry: cap at level 2 after pressure_for, drain at 3.
        pressure_since = (
            (pressure_since if pressure_since is not None else t) if level.level >= 2 else None
        )
        critical_since = (
            (critical_since if critical_since is not None else t) if level.level >= 3 else None
        )
        if not capped and pressure_since is not None and t - pressure_since >= pressure_for_s:
            capped, cell.actions = True, cell.actions + 1
        if drained_at is None and critical_since is not None and t - critical_since >= detection_s:
            drained_at, cell.actions = t, cell.actions + 1

        # Does this tick's step fit? Without oomguard: a full chunk every step.
        if cell.oom_without_s is None and not p.fits(full, frag, neighbour):
            cell.oom_without_s = t
        if drained_at is None:
            step: Step | None = full
        elif t - drained_at < drain_s:
            step = decode
        else:
            step = None  # drained and idle: no allocation, nothing to fail
        idle = step is None
        if cell.oom_with_s is None and step is not None and not p.fits(step, frag, neighbour):
            cell.oom_with_s = t
        # ... and with the step guard looking before that step
        if guard.step(t, step, neighbour, frag) and cell.oom_with_step_guard_s is None:
            cell.oom_with_step_guard_s = t
        t += dt
    cell.step_guard_shrinks = guard.shrinks
    if trace is not None and trace.pressure_ends_s is not None:
        r = simulate_recovery(on_gpu(trace, gpu_name, gmu, model), ticks, dt)
        cell.recovery_s, cell.retriggered = r.recovery_s, r.retriggered
    return cell


def trace_levels(trace: Trace, dt: float = 1.0, released: bool = False) -> list[int]:
    """Engine 0's pressure level per `dt` over the trace, on its own GPU and gmu, with its GPU
    events as they are (not scaled): the exporter's evaluator on the twin GPU (`simulate` above).
    `released`: without the fragments that the trace's requests made (`fragments: requests`),
    as an engine that ran idle holds it (the recovery's idle engine)."""
    if released and trace.fragments == "requests":
        events = [e.model_copy(update={"fragmentation_gib": 0.0}) for e in trace.gpu_events]
        trace = trace.model_copy(update={"gpu_events": events})
    gmu = trace.engine.gpu_memory_utilization
    p = Physics.for_model(model_for(trace.gpu), gpu=trace.gpu, gpu_memory_utilization=gmu)
    worst = max(sum(trace.gpu_at(t)) for t in range(int(trace.duration_s) + 1))
    if not worst:
        return [0] * (int(trace.duration_s / dt) + 1)
    levels: list[int] = []
    # simulate scales the events to peak at overshoot x the plan's slack: this overshoot is 1:1
    overshoot = worst / ((1 - gmu) * p.usable)
    levels_only = trace.model_copy(update={"pressure_ends_s": None})  # no recovery inside
    simulate(trace.gpu, gmu, levels_only, dt=dt, overshoot=overshoot, levels=levels, release=False)
    return levels


class _StepGuardSim:
    """The step guard's plan before each tick's step, on the twin's room (what the plugin reads
    from the twin's worker), with its margin and the room's trend; whether the step it allows
    fits at its start and at its end (memory taken while it runs meets its activations)."""

    def __init__(self, p: Physics, trace: Trace | None, scale: float) -> None:
        self.p, self.trace, self.scale = p, trace, scale
        self.idle = p.total - p.driver_reserved - p.resident
        full = p.max_num_batched_tokens
        self.costs = StepCosts.calibrated(
            p.activation(full), full, p.shape.hidden_size, p.shape.vocab_size
        )
        # a full chunk of a long prompt (the slowest step): what the trend's loss is scaled by
        self.full_s = p.step_seconds(Step(tokens=full, attention=full * full, context=full))
        self.rooms: deque[tuple[float, int]] = deque()
        self.shrinks = 0

    def _memory(self, t: float) -> tuple[int, int]:
        if self.trace is None:
            return 0, 0
        n, f = self.trace.gpu_at(t)
        return int(n * self.scale), int(f * self.scale)

    def step(self, t: float, step: Step | None, neighbour: int, frag: int) -> bool:
        """True when the step the guard allows does not fit (a CUDA OOM despite it)."""
        room = Room(
            self.idle - neighbour - frag, self.idle, self.p.activation(self.costs.max_tokens)
        )
        self.rooms.append((t, room.available))
        while len(self.rooms) > 2 and t - self.rooms[1][0] >= step_guard.TREND_WINDOW_S:
            self.rooms.popleft()
        rate = max(
            (
                (r - room.available) / (t - at)
                for at, r in self.rooms
                if t - at >= step_guard.TREND_SPAN_S
            ),
            default=0.0,
        )
        trend = max(0.0, rate) * self.full_s * step_guard.TREND_SAFETY
        margin = margin_for(room, self.costs, step_guard.MARGIN) + trend
        if step is None:
            return False
        budget = plan(self.costs, room, margin).budget
        tokens = min(step.tokens, budget)
        if tokens < step.tokens:
            self.shrinks += 1
        if tokens <= 0:
            return False  # waits: nothing allocated
        run = Step(tokens=tokens)
        n_end, f_end = self._memory(t + self.p.step_seconds(run))
        return not (
            self.p.fits(run, frag, neighbour)
            and self.p.fits(run, max(frag, f_end), max(neighbour, n_end))
        )


def _report(t: float, device_uuid: str, p: Physics, frag: int) -> AllocatorReport:
    allocated = p.weights + p.kv_pool + p.graph_pool_bytes
    return AllocatorReport(
        timestamp=t,
        pid=ENGINE_PID,
        rank=0,
        target="llm",
        engine="0",
        device_index=0,
        device_uuid=device_uuid,
        allocated_bytes=allocated,
        reserved_bytes=allocated + p.activation(p.max_num_batched_tokens) + frag,
        allocated_peak_bytes=allocated + p.activation(p.max_num_batched_tokens),
        reserved_peak_bytes=allocated + p.activation(p.max_num_batched_tokens) + frag,
        inactive_split_bytes=frag,
        alloc_retries=0,
        ooms=0,
    )


def _scale(trace: Trace, slack: float, overshoot: float) -> float:
    """The factor that makes the trace's memory events peak at `overshoot` x the plan's slack."""
    worst = max(n + f for n, f in (trace.gpu_at(t) for t in range(int(trace.duration_s) + 1)))
    return overshoot * slack / worst if worst else 0.0


def scaled_trace(trace: Trace, gpu_name: str, gmu: float, overshoot: float = 1.1) -> Trace:
    """The trace on another GPU and gmu as `simulate` sees it: the same cell, for the real vLLM
    twin (lab/oomguard/lab/runner.py).

    Its memory events are scaled as `simulate` scales them, and its load is the simulation's:
    every prompt one full prefill chunk, so that each prefill step allocates the activation peak
    vLLM profiled (the memory a trace's long prompts take is in its memory events). With the
    trace's own prompt mix (6-8K tokens against an 8K chunk) whether vLLM alone crashes in the
    few seconds its incident overshoots depends on which prompts arrive then, and the real run
    could not agree or disagree with the simulation reliably.
    """
    model = model_for(gpu_name)
    p = Physics.for_model(model, gpu=gpu_name, gpu_memory_utilization=gmu)
    scale = _scale(trace, (1.0 - gmu) * p.usable, overshoot)
    events = [
        e.model_copy(
            update={
                "neighbour_gib": e.neighbour_gib * scale,
                "fragmentation_gib": e.fragmentation_gib * scale,
            }
        )
        for e in trace.gpu_events
    ]
    engine = trace.engine.model_copy(update={"gpu_memory_utilization": gmu})
    phases = [
        _full_chunks(ph, engine.max_num_batched_tokens, engine.max_model_len) for ph in trace.phases
    ]
    return trace.model_copy(
        update={
            "gpu": gpu_name,
            "model": model,
            "engine": engine,
            "gpu_events": events,
            "phases": phases,
        }
    )


def _full_chunks(phase: Phase, max_num_batched_tokens: int, max_model_len: int) -> Phase:
    """The phase with prompts as long as one prefill chunk allows (and the outputs still fit)."""
    # Long prompts too: a 64K prompt's chunks are full, but its KV blocks fill the pool, and an
    # engine waiting for blocks decodes without prefilling, which the simulation does not model.
    chunk = min(max_num_batched_tokens, max_model_len - phase.output_tokens[1])
    return phase.model_copy(update={"prompt_tokens": (max(1, chunk - 64), chunk)})


# The real twin's clock: the simulated time from level 3 to the OOM must last at least this long
# on the wall, so that the harness's own delays on a loaded 2-core machine (vLLM steps, exporter
# polls, the remediator's pass) are not what decides the cell. A real GPU has all of it.
MIN_WALL_LEAD_S = 6.0
MIN_WALL_TAIL_S = 15.0  # wall seconds of replay after the simulated OOM
WINDOW_MARGIN_S = 60.0  # simulated seconds of load before the first level 2 and after the OOM


def real_trace(trace: Trace, cell: Cell) -> tuple[Trace, float]:
    """The scaled trace as the real vLLM twin replays it, and where in the trace it starts: the
    window around the incident that `cell` (its simulation) found, on a clock slow enough for
    the lead to be seen."""
    if cell.oom_without_s is None or cell.first_pressure_s is None:
        return trace, 0.0
    # Fragmentation lives in the engine's process (a restart starts it from zero, replaying the
    # curve from the window's start): the window starts where there is none yet.
    start = max(0.0, cell.first_pressure_s - WINDOW_MARGIN_S)
    while start > 0 and trace.gpu_at(start)[1] > 0:
        start = max(0.0, start - 1.0)
    critical = cell.first_critical_s if cell.first_critical_s is not None else cell.oom_without_s
    lead = max(1.0, cell.oom_without_s - critical)
    compression = min(trace.time_compression, lead / MIN_WALL_LEAD_S)
    # ... and the replay goes on long enough after the simulated OOM for a crash to be seen
    end = cell.oom_without_s + max(WINDOW_MARGIN_S, MIN_WALL_TAIL_S * compression)
    windowed = trace.window(start, end)
    tail = windowed.duration_s - (cell.oom_without_s - start)
    compression = min(compression, tail / MIN_WALL_TAIL_S)
    return windowed.model_copy(update={"time_compression": compression}), start


def run(
    gpus: tuple[str, ...] = tuple(GPU_MODELS),
    gmus: tuple[float, ...] = GMUS,
    traces: tuple[str, ...] = INCIDENT_TRACES + STEP_TRACES,
    steady_s: float = 120.0,
) -> list[Cell]:
    loaded = [Trace.load(name) for name in traces]
    cells: list[Cell] = []
    for gpu in gpus:
        for gmu in gmus:
            cells.append(simulate(gpu, gmu, duration_s=steady_s))
            cells.extend(
                simulate(gpu, gmu, trace, dt=STEP_DT if trace.name in STEP_TRACES else 1.0)
                for trace in loaded
            )
    return cells
