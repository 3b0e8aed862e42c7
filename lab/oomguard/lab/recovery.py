"""Recovery in simulated time: from the end of the pressure to full admission, link by link.

The chain a node runs once its memory comes back, each link at its shipped setting:

1. the exporter's level drops (the caller computes the level per tick from the twin GPU through
   the exporter's own evaluator: lab/matrix.py);
2. the action alerts see it, as oomguard.actions.ACTION_ALERTS defines them for the rules and
   the standalone watch: OomguardMemoryPressure (level >= 2 held `pressure_for`, lower_cap) and
   OomguardMemoryCritical (level >= 3 held `critical_for`, drain) each resolve once their
   condition has been false for `keep_firing_for`, checked at each rule evaluation on a level as
   old as the exporter poll plus the scrape;
3. the change reaches the remediator: Alertmanager flushes a group's resolve at its next
   `group_interval` (the remediator route's); standalone mode has no such hop;
4. the remediator's own decision (`decide_fleet`: the policy and the safety limits) runs on each
   delivery and every `reconcile_seconds`, against an engine fed by the trace's requests as the
   twin's gateway sends them (every other one to engine 0; none while it drains): staged
   re-admission at `readmit_start`, full admission after `readmit_successes` clean admissions.

Recovery is the time from the trace's `pressure_ends_s` to engine 0 back at full admission; a
re-trigger is engine 0 drained or capped again after that (oscillation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from oomguard.actions import ACTION_ALERTS, DISRUPTIVE, ActionAlert
from oomguard.remediator.decision import Context, EngineInput, decide_fleet
from oomguard.remediator.flags import FlagLimits
from oomguard.remediator.policy import Observed, PolicyConfig
from oomguard.remediator.safety import SafetyConfig, SafetyState
from oomguard.remediator.webhook import Alert
from oomguard.thresholds import AlertThresholds
from oomguard.twin.physics import Physics, Step
from oomguard.twin.traces import Fragments, Trace, requests
from oomguard.units import parse_duration

EXPORTER_POLL_S = 1.0  # the exporter's default interval_seconds
EXPORTER_SCRAPE_S = 1.0  # Prometheus scrapes the exporters every second (generated config)
RECONCILE_S = 1.0  # the remediator's default reconcile_seconds
DT = 0.1  # simulation tick (s)
T0 = datetime(2026, 1, 1, tzinfo=UTC)  # the alerts' clock origin (only their identity uses it)


@dataclass(frozen=True)
class AlertPath:
    """How an action alert's level reaches the remediator, and its hysteresis."""

    name: str
    staleness_s: float  # how old the level is when a rule reads it
    eval_s: float  # rule evaluation interval
    deliver_s: float  # a change waits for the next flush of this period (0: at once)
    for_s: Mapping[str, float]  # each action alert's `for`, by name (oomguard.actions)
    keep_firing_s: float  # the action alerts' keep_firing_for (those that keep firing at all)


def alertmanager_path(t: AlertThresholds | None = None) -> AlertPath:
    """Prometheus rules + Alertmanager, as `oomguard generate` writes them from `t`."""
    t = t or AlertThresholds()
    return AlertPath(
        "prometheus+alertmanager",
        staleness_s=EXPORTER_POLL_S + EXPORTER_SCRAPE_S,
        eval_s=parse_duration(t.action_rule_interval),  # the work orders' own rule group
        # every alert is its own group on the remediator route; a re-fire within its group's
        # life waits at most the route's group_interval
        deliver_s=parse_duration(t.remediator_group_interval),
        for_s={a.name: a.for_seconds(t) for a in ACTION_ALERTS},
        keep_firing_s=parse_duration(t.action_keep_firing_for),
    )


def standalone_path() -> AlertPath:
    """The remediator polling the exporters itself, at StandaloneConfig's defaults."""
    from oomguard.remediator.config import StandaloneConfig
    from oomguard.remediator.standalone import durations

    d = StandaloneConfig(exporters=["http://exporter/metrics"])
    held = {a.name: durations(d, a) for a in ACTION_ALERTS}
    return AlertPath(
        "standalone",
        staleness_s=EXPORTER_POLL_S,
        eval_s=d.interval_seconds,
        deliver_s=0.0,
        for_s={name: hold for name, (hold, _) in held.items()},
        keep_firing_s=d.keep_firing_seconds,
    )


@dataclass
class _Rule:
    alert: ActionAlert
    hold_s: float
    keep_s: float
    pending: float | None = None
    last_true: float | None = None
    firing_since: float | None = None

    @property
    def name(self) -> str:
        return self.alert.name

    @property
    def action(self) -> str:
        return self.alert.action

    def evaluate(self, level: int, now: float) -> None:
        if self.alert.condition(level):
            self.last_true = now
            self.pending = now if self.pending is None else self.pending
            if self.firing_since is None and now - self.pending >= self.hold_s:
                self.firing_since = now
        else:
            self.pending = None
            if self.firing_since is not None and now - (self.last_true or now) >= self.keep_s:
                self.firing_since = None


@dataclass
class Recovery:
    """The recovery of one trace (trace seconds); the timeline says where the time went."""

    path: str
    pressure_ends_s: float
    level_clear_s: float | None = None  # the level last fell below 2 (for good)
    resolved_s: float | None = None  # the last action alert resolved at its rule
    delivered_s: float | None = None  # ... and the remediator heard it
    resumed_s: float | None = None  # the first re-admission stage
    full_s: float | None = None  # back at full admission
    recovery_s: float | None = None  # full_s - pressure_ends_s
    from_level_clear_s: float | None = None  # full admission after the level fell below 2
    retriggered: bool = False
    actions: list[str] = field(default_factory=list)  # "t kind [cap]": engine 0's steps

    def record(self) -> dict[str, object]:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class _Engine:
    startup: int
    cap: int
    draining: bool = False
    counts_prefills: bool = True
    changed_at: float = 0.0
    admitted: int = 0
    finished: int = 0
    prefilled: int = 0
    running: list[list[float]] = field(default_factory=list)  # [prefill left, work left] (s)
    waiting: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output) tokens

    def observed(self, now: float) -> Observed:
        return Observed(
            self.startup,
            self.cap,
            self.draining,
            now - self.changed_at,
            self.admitted,
            self.finished,
            0,
            len(self.running),
            len(self.waiting),
            self.prefilled if self.counts_prefills else 0,
        )

    def set_cap(self, cap: int, now: float) -> None:
        if cap != self.cap:  # the plugin resets its counters on a change only
            self.cap, self.changed_at = cap, now
            self.admitted = self.finished = self.prefilled = 0

    def tick(self, dt: float) -> None:
        """`dt` seconds of work on every running request; count prefills and finishes."""
        for r in self.running:
            if r[0] > 0 >= r[0] - dt:
                self.prefilled += 1
            r[0], r[1] = r[0] - dt, r[1] - dt
        self.finished += sum(1 for r in self.running if r[1] <= 0)
        self.running = [r for r in self.running if r[1] > 0]


def _service_s(p: Physics, prompt: int, output: int, batch: int) -> tuple[float, float]:
    """A request's time in the engine: its prefill, and that plus its decode at this batch
    size."""
    prefill = p.step_seconds(Step(tokens=prompt, attention=prompt * prompt // 2, context=prompt))
    ctx = batch * (prompt + output // 2)
    return prefill, prefill + output * p.step_seconds(
        Step(tokens=batch, attention=ctx, context=ctx)
    )


def simulate_recovery(
    trace: Trace,
    levels: Sequence[int],
    dt_levels: float = 1.0,
    path: AlertPath | None = None,
    policy: PolicyConfig | None = None,
    safety: SafetyConfig | None = None,
    model: str | None = None,
    slowdown: float = 1.0,
    counts_prefills: bool = True,
    released_levels: Sequence[int] | None = None,
) -> Recovery:
    """Replay `levels` (engine 0's pressure level per `dt_levels` trace seconds) through the
    alerting `path` and the remediator's decision; see the module's docstring. `slowdown`: the
    engine's steps take that many times as long in trace time (the real twin on a loaded
    2-core machine at `--compression 4` ran about x4 behind its clock). `counts_prefills`
    False: the engine reports no prefill counts (a plugin from before they were counted), so a
    re-admission stage counts finished requests only. `released_levels`: the levels without
    the fragments that the trace's requests made (lab.matrix.trace_levels(released=True)),
    which the engine holds from the moment it runs no request (twin.traces.Fragments, as the
    real twin's GPU driver does); None: the levels as given, whatever the engine does."""
    assert trace.pressure_ends_s is not None, f"{trace.name} has no end of pressure"
    path = path or alertmanager_path()
    policy, safety = policy or PolicyConfig(), safety or SafetyConfig()
    p = Physics.for_model(
        model or trace.model,
        gpu=trace.gpu,
        gpu_memory_utilization=trace.engine.gpu_memory_utilization,
        max_num_batched_tokens=trace.engine.max_num_batched_tokens,
    )
    startup = trace.engine.max_num_seqs
    eng = _Engine(startup, startup, counts_prefills=counts_prefills)
    peer = EngineInput("engine-1", trace.model, (), Observed(startup, startup, False, 1e9, 0, 0, 0))
    # the levels here carry no reason: an alert on one reason's series (the fragmentation
    # alert, answered by a restart this engine has no backend for) is not played
    rules = [
        _Rule(a, path.for_s[a.name], path.keep_firing_s if a.keep else 0.0)
        for a in ACTION_ALERTS
        if a.reason is None
    ]
    heard: dict[str, float | None] = {r.name: None for r in rules}  # firing since, as delivered
    arrivals = [r for k, r in enumerate(requests(trace)) if k % 2 == 0]  # the gateway's share
    out = Recovery(path.name, trace.pressure_ends_s)
    state = SafetyState()
    taken: list[tuple[float, str, int | None]] = []  # engine 0's steps
    end = min(trace.duration_s, trace.pressure_ends_s + 600.0)
    next_eval = next_flush = next_pass = 0.0
    t, a = 0.0, 0
    was_full, became_full = True, [0.0]
    last_level_high = None
    fragments = Fragments(trace)
    released: list[bool] = []  # per tick: the engine's request-made fragments are gone
    while t <= end:
        seen = t - path.staleness_s  # the level a rule reads is this old
        source = levels
        if released_levels is not None and released and released[_tick(seen, len(released))]:
            source = released_levels
        level = source[min(len(source) - 1, max(0, int(seen / dt_levels)))]
        if level >= 2:
            last_level_high = t
        wake = False
        if t >= next_eval:
            next_eval += path.eval_s
            was_firing = any(r.firing_since is not None for r in rules)
            for r in rules:
                r.evaluate(level, t)
                if r.firing_since is not None and heard[r.name] is None:
                    heard[r.name], wake = r.firing_since, True  # a new group: group_wait 0s
            if was_firing and all(r.firing_since is None for r in rules):
                out.resolved_s = t
        if path.deliver_s == 0 or t >= next_flush:
            next_flush += path.deliver_s or DT
            was_heard = any(v is not None for v in heard.values())
            for r in rules:
                if r.firing_since is None and heard[r.name] is not None:
                    heard[r.name], wake = None, True
            if was_heard and all(v is None for v in heard.values()):
                out.delivered_s = t
        if wake or t >= next_pass:
            next_pass = t + RECONCILE_S
            state = _pass(trace, eng, peer, heard, rules, policy, safety, state, t, taken)
        # the engine: arrivals (a draining engine answers 503: the gateway goes to the peer)
        while a < len(arrivals) and arrivals[a].at_s <= t:
            if not eng.draining:
                eng.waiting.append((arrivals[a].prompt_tokens, arrivals[a].output_tokens))
            a += 1
        while not eng.draining and eng.waiting and len(eng.running) < eng.cap:
            prompt, output = eng.waiting.pop(0)
            prefill, total = _service_s(p, prompt, output, len(eng.running) + 1)
            eng.running.append([prefill * slowdown, total * slowdown])
            eng.admitted += 1
        eng.tick(DT)
        if released_levels is not None:
            # all of them gone (levels at a part of the curve are not known: a part counts
            # as all of it, which errs towards pressure)
            released.append(fragments.at(t, idle=not eng.running) == 0)
        full = not eng.draining and eng.cap >= startup
        if full and not was_full:
            became_full.append(t)
        was_full = full
        if t >= trace.pressure_ends_s and full and out.full_s is None:
            out.full_s = t
            out.recovery_s = t - trace.pressure_ends_s
        t = round(t + DT, 6)
    if last_level_high is not None:
        out.level_clear_s = clear = last_level_high + DT
        back = [at for at in became_full if at >= clear]
        out.from_level_clear_s = back[0] - clear if back else None
    lowering = [at for at, kind, _ in taken if kind in ("drain", "lower_cap")]
    # the first step back up after the last step down before full admission
    last_down = max((at for at in lowering if out.full_s is None or at <= out.full_s), default=None)
    if last_down is not None:
        out.resumed_s = min((at for at, _, _ in taken if at > last_down), default=None)
    if out.full_s is not None:
        out.retriggered = any(at > out.full_s for at in lowering)
    out.actions = [f"{at:.1f} {kind}{'' if cap is None else f' {cap}'}" for at, kind, cap in taken]
    return out


def _tick(t: float, ticks: int) -> int:
    """The tick of simulated time `t` among the `ticks` simulated so far."""
    return min(ticks - 1, max(0, round(t / DT)))


def _pass(
    trace: Trace,
    eng: _Engine,
    peer: EngineInput,
    heard: dict[str, float | None],
    rules: list[_Rule],
    policy: PolicyConfig,
    safety: SafetyConfig,
    state: SafetyState,
    now: float,
    taken: list[tuple[float, str, int | None]],
) -> SafetyState:
    """One remediator pass: the real decision on engine 0 (and its healthy peer), applied."""
    firing = tuple(
        Alert(
            r.name,
            "firing",
            {"alertname": r.name, "oomguard_action": r.action},
            T0 + timedelta(seconds=since),
            None,
        )
        for r in rules
        if (since := heard[r.name]) is not None
    )
    me = EngineInput("engine-0", trace.model, firing, eng.observed(now))
    ctx = Context(policy, safety, FlagLimits(), state, now)
    verdict = decide_fleet([me, peer], ctx)[0]
    for step in verdict.taken:
        if step.kind == "drain":
            eng.draining, eng.waiting = True, []  # queued requests go to the peer
        elif step.kind == "resume":
            eng.draining = False
        elif step.cap is not None:
            eng.set_cap(step.cap, now)
        if step.kind in DISRUPTIVE:
            state = state.with_action("engine-0", now, step.kind)
        taken.append((now, step.kind, step.cap))
    return state


def on_gpu(trace: Trace, gpu: str, gmu: float, model: str) -> Trace:
    """The trace's engine on another GPU, model and gmu (a matrix cell), its load unchanged."""
    engine = trace.engine.model_copy(update={"gpu_memory_utilization": gmu})
    return trace.model_copy(update={"gpu": gpu, "model": model, "engine": engine})
