"""The remediator's one decision: firing alerts + engine states + safety state -> steps.

Pure (no I/O, no clock of its own): the reconcile loop (controller.py) and `explain` (main.py)
both call `decide_fleet`, so what `explain` prints is what the loop does, withheld steps and
their limits included. Per target, in this order:

1. hold when the restart sequence owns the engine, when its state cannot be read, or when an
   alert says the exporter is blind to it (`hold`): blind is not healthy, so nothing is changed
   in either direction, re-admission included;
2. restart with lower memory flags (targets with a restart backend): when an alert asks for one,
   or when memory stays critical after a drain (the engine is drained and idle and the drain
   alert still fires `restart_after_drain_seconds` after the drain: only a restart with a lower
   gpu_memory_utilization gives KV-pool memory back); once per alert episode. Or, when the
   alert's reason is the engine's own allocator fragmentation (`FRAGMENTATION_REASON`: free
   blocks stranded in its segments, which only a new process gives back, and capping does not
   slow), restart it with the same flags at the first quiet moment: drained and idle for
   `fragmentation_settle_seconds` (fragments that the finished requests made coalesce once the
   engine is idle, and then the alert resolves and the engine resumes without a reload), into
   full admission (the new process has none of the fragments).
   Or walk the flags back after a quiet period: an elective restart, which nothing needs now,
   so it never takes the model's last ready engine (whatever `allow_last_replica` says) and a
   limit that holds it back is not a withheld step (no page, nothing for on-call): it waits
   (`Verdict.waiting`). Any other restart held back by a safety limit falls through to capping;
3. the policy's desired state, planned into steps; a drain refused by the disruption budget or
   the last-ready rule caps instead; every step goes through the safety limits. An engine under
   fragmentation pressure that a restart may answer (a restart backend, its episode not yet
   answered, the restart's own limits clear now) is drained instead of capped: the drain is
   what makes the quiet moment.

Targets are decided in order, and each drain or restart decided counts against the next targets'
disruption budget and its own cooldown, as the loop will have executed it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.actions import ACTION_ALERTS, BY_NAME, DISRUPTIVE
from oomguard.contract import FRAGMENTATION_REASON
from oomguard.remediator.flags import FlagLimits, Flags
from oomguard.remediator.policy import Desired, Observed, PolicyConfig, actions_for, decide
from oomguard.remediator.restart import FlagView
from oomguard.remediator.safety import EngineView, SafetyConfig, SafetyState, limit
from oomguard.remediator.webhook import Alert

# drain refused: cap instead. FALLBACK_LIMITS is the designed fallback that pages nobody (the
# rules leave it out of OomguardRemediationLimited); on a model's only engine the cap is all
# the remediator may do and nothing but a person relieves it, so that limit pages.
FALLBACK_LIMITS = frozenset({"disruption_budget", "last_ready"})
CAP_INSTEAD = FALLBACK_LIMITS | {"single_replica"}
# The alerts on the engine's pressure level (not a rate alert's cap): what a fragmentation restart
# answers besides its own alert
LEVEL_ALERTS = frozenset(a.name for a in ACTION_ALERTS)


@dataclass(frozen=True)
class Unreadable:
    """Why an engine's state is not known this pass (the engine is held)."""

    reason: str  # a short label: unreachable, timeout, auth, bad_state, ...
    message: str


@dataclass(frozen=True)
class EngineInput:
    name: str
    model: str
    alerts: tuple[Alert, ...]  # the firing alerts routed to this engine
    state: Observed | Unreadable
    restartable: bool = False  # a restart backend is configured (and not a dry run)
    flags: FlagView | None = None  # the backend's flags, when a restart may be wanted
    restarted: frozenset[str] = frozenset()  # alert episodes a restart already answered
    restarting: bool = False  # a restart sequence owns the engine now
    idle_for: float = 0.0  # seconds the engine has been seen drained and idle, without a break


@dataclass(frozen=True)
class Context:
    policy: PolicyConfig
    safety: SafetyConfig
    limits: FlagLimits
    state: SafetyState
    now: float  # the safety history's time base (Safety.clock: monotonic in the remediator)
    wall: float | None = None  # wall time, for the backends' wall-clock stamps (default: now)


@dataclass(frozen=True)
class Step:
    kind: str  # drain | resume | lower_cap | raise_cap | readmit | restart
    cap: int | None = None
    reason: str = ""
    withheld: str | None = None  # the safety limit holding it back (not executed)
    flags: Flags | None = None  # restart: the flags to restart with
    episode: str | None = None  # restart: the episode it answers
    covers: tuple[str, ...] = ()  # restart: every drain/restart episode it answers
    # restart: come back at the re-admission start (staged) or, False, at full admission (a
    # restart that gives back what took the memory: the engine starts as it first did)
    staged: bool = True
    # a generic action's parameters: the body its `body` model in oomguard.actions allows
    params: dict[str, Any] | None = None
    # restart: wanted, not needed (the flags' walk-back): a limit makes it wait, not withheld
    elective: bool = False

    def describe(self) -> str:
        what = self.kind
        if self.cap is not None:
            what += f" {self.cap}"
        if self.flags is not None:
            what += (
                f" gpu_memory_utilization={self.flags.gpu_memory_utilization:g}"
                f" max_num_seqs={self.flags.max_num_seqs}"
            )
        return what + (f" (withheld: {self.withheld})" if self.withheld else "")


@dataclass(frozen=True)
class Verdict:
    target: str
    observed: Observed | None
    desired: Desired | None
    steps: tuple[Step, ...] = ()
    held: str | None = None  # restarting | blind | the reason the state cannot be read
    message: str = ""
    fingerprints: tuple[str, ...] = field(default=())
    waiting: str | None = None  # an elective step a limit holds back: what it waits for

    @property
    def taken(self) -> list[Step]:
        """The steps the loop executes (the withheld ones are only recorded)."""
        return [s for s in self.steps if s.withheld is None]


def plan(observed: Observed, desired: Desired) -> list[tuple[str, int | None]]:
    """The writes that take an engine from `observed` to `desired`, in a safe order."""
    if desired.draining:
        return [] if observed.draining else [("drain", None)]
    steps: list[tuple[str, int | None]] = []
    if desired.cap != observed.admission_cap:
        if observed.draining:
            kind = "readmit"  # the first stage's cap, set while still drained: costs nothing
        else:
            kind = "lower_cap" if desired.cap < observed.admission_cap else "raise_cap"
        steps.append((kind, desired.cap))
    if observed.draining:
        steps.append(("resume", None))  # after the cap: never resume at the old, higher cap
    return steps


def _newest_last(alerts: Iterable[Alert]) -> list[str]:
    """The alerts' episodes (fingerprint@startsAt), newest last."""
    return [a.episode for a in sorted(alerts, key=lambda a: (a.starts_at, a.key))]


def episodes(alerts: Iterable[Alert], action: str, policy: PolicyConfig) -> list[str]:
    """The episodes of the alerts asking for `action`, newest last."""
    return _newest_last(a for a in alerts if action in actions_for([a], policy))


def fragmentation(alerts: Iterable[Alert], policy: PolicyConfig) -> list[str]:
    """The episodes of the action alerts (drain, lower_cap) whose reason is the engine's own
    allocator fragmentation, newest last; none when the policy answers fragmentation like any
    other pressure (`restart_on_fragmentation: false`)."""
    if not policy.restart_on_fragmentation:
        return []
    return _newest_last(
        a
        for a in alerts
        if a.labels.get("reason") == FRAGMENTATION_REASON
        and actions_for([a], policy) & {"drain", "lower_cap"}
    )


def _answered_by_clean_start(alerts: Sequence[Alert], restarted: frozenset[str]) -> set[str]:
    """The episodes a restart for fragmentation answered, while its fragmentation alert still
    fires: they ask for nothing more. The new process has none of the fragments, and the
    engine-wide alerts the fragments set off (the same level, any reason) only lag the exporter
    as that alert does; once it has resolved, an alert still firing asks as usual (a covered
    drain episode for no more than a cap), so pressure on the new process is never ignored."""
    answered = [a for a in alerts if a.episode in restarted]
    if any(a.labels.get("reason") == FRAGMENTATION_REASON for a in answered):
        return {a.episode for a in answered}
    return set()


def needs_flags(engine: EngineInput, policy: PolicyConfig) -> bool:
    """Whether deciding this engine may need its restart backend's flags (read them only then:
    a backend call per engine per pass would be wasted)."""
    if not engine.restartable or not isinstance(engine.state, Observed):
        return False
    o, done = engine.state, engine.restarted
    actions = actions_for(engine.alerts, policy)
    if "hold" in actions:
        return False
    if any(e not in done for e in episodes(engine.alerts, "restart", policy)):
        return True
    critical = episodes(engine.alerts, "drain", policy) + fragmentation(engine.alerts, policy)
    if o.draining and o.idle and any(e not in done for e in critical):
        return True
    return not actions and not o.draining and o.admission_cap >= o.startup_max_num_seqs


def _restart(engine: EngineInput, o: Observed, ctx: Context) -> Step | None:
    """The restart this engine needs now, if any (before safety limits)."""
    view, done, policy = engine.flags, engine.restarted, ctx.policy
    if not engine.restartable or view is None:
        return None
    asked = [e for e in episodes(engine.alerts, "restart", policy) if e not in done]
    critical = [e for e in episodes(engine.alerts, "drain", policy) if e not in done]
    fragmented = [e for e in fragmentation(engine.alerts, policy) if e not in done]
    covers = tuple(dict.fromkeys(asked + critical + fragmented))
    if asked:
        reason = "restart with lower memory flags"
        return Step(
            "restart",
            reason=reason,
            flags=view.current.lower(ctx.limits),
            episode=asked[-1],
            covers=covers,
        )
    drained_at = max(
        (t for t, kind in ctx.state.history.get(engine.name, ()) if kind == "drain"), default=None
    )
    if (
        fragmented
        and o.draining
        and o.idle
        and drained_at is not None
        and engine.idle_for >= policy.fragmentation_settle_seconds
    ):
        # it answers the engine-wide level alerts firing now too: the pressure the fragments
        # set off (OomguardMemoryPressure, any reason) goes with them (not a rate alert's)
        pressure = [
            e
            for e in _newest_last(a for a in engine.alerts if a.name in LEVEL_ALERTS)
            if e not in done
        ]
        covers = tuple(dict.fromkeys(asked + critical + fragmented + pressure))
        # the engine's own allocator fragmentation, still there after the engine sat idle
        # long enough for the fragments of its finished requests to coalesce and the alert to
        # resolve: only a new process gives it back, and a lower gpu_memory_utilization is not
        # needed (a new process starts with none). Drained and idle: the quiet moment, where a
        # restart loses no request.
        return Step(
            "restart",
            reason="allocator fragmentation that stays while idle: restart on a clean allocator",
            flags=view.current,
            episode=fragmented[-1],
            covers=covers,
            # the new process has none of the fragments that took the headroom, and the rest
            # of the GPU was out of pressure without them (the exporter's reason says so):
            # it starts as it first did, at full admission; if pressure comes back, the
            # alerts act again
            staged=False,
        )
    if (
        critical
        and o.draining
        and o.idle
        # the alert has kept firing well past its own hysteresis since this remediator drained
        # the engine (an engine drained by someone else is theirs to restart)
        and drained_at is not None
        and ctx.now - drained_at >= policy.restart_after_drain_seconds
    ):
        reason = "memory stays critical after the drain: restart with lower memory flags"
        return Step(
            "restart",
            reason=reason,
            flags=view.current.lower(ctx.limits),
            episode=critical[-1],
            covers=covers,
        )
    wall = ctx.now if ctx.wall is None else ctx.wall
    quiet = wall - view.changed_at >= ctx.limits.walk_back_after_seconds
    if (
        not actions_for(engine.alerts, policy)
        and not o.draining
        and o.admission_cap >= o.startup_max_num_seqs
        and view.current != view.original
        and quiet
    ):
        flags = view.current.toward(view.original, ctx.limits)
        if flags != view.current:
            episode = f"walk-back@{view.changed_at}"
            return Step(
                "restart",
                reason="walk flags back",
                flags=flags,
                episode=episode,
                covers=(episode,),
                elective=True,
            )
    return None


def decide_fleet(engines: Sequence[EngineInput], ctx: Context) -> list[Verdict]:
    """Every engine's verdict, in order (see the module's docstring)."""
    fleet = {
        e.name: EngineView(
            e.model,
            draining=e.restarting or (isinstance(e.state, Observed) and e.state.draining),
            reachable=isinstance(e.state, Observed),
        )
        for e in engines
    }
    safety = ctx.state
    verdicts: list[Verdict] = []
    # an elective restart takes an engine out only while a peer serves its model: the opt-in to
    # take the last replica is for relieving memory, not for restoring flags
    elective_config = ctx.safety.model_copy(update={"allow_last_replica": False})

    def check(name: str, kind: str, elective: bool = False) -> str | None:
        config = elective_config if elective else ctx.safety
        return limit(config, safety, ctx.now, name, kind, fleet)

    for e in engines:
        fps = tuple(sorted({a.fingerprint for a in e.alerts}))
        o = e.state if isinstance(e.state, Observed) else None
        if e.restarting:
            verdicts.append(Verdict(e.name, o, None, held="restarting", fingerprints=fps))
            continue
        if isinstance(e.state, Unreadable):
            verdicts.append(
                Verdict(
                    e.name,
                    None,
                    None,
                    held=e.state.reason,
                    message=e.state.message,
                    fingerprints=fps,
                )
            )
            continue
        assert o is not None
        actions = actions_for(e.alerts, ctx.policy)
        if "hold" in actions:
            desired = decide(actions, o, ctx.policy)
            verdicts.append(
                Verdict(e.name, o, desired, held="blind", message=desired.reason, fingerprints=fps)
            )
            continue
        steps: list[Step] = []
        waiting: str | None = None
        restart = _restart(e, o, ctx)
        if restart is not None:
            why = check(e.name, "restart", restart.elective)
            if why is None:
                safety = safety.with_action(e.name, ctx.now, "restart")
                fleet[e.name] = EngineView(e.model, draining=True, reachable=True)
                desired = Desired(True, o.admission_cap, "draining", restart.reason)
                verdicts.append(Verdict(e.name, o, desired, (restart,), fingerprints=fps))
                continue
            if restart.elective:
                waiting = f"{restart.reason}: waits for the {why} limit"
            else:
                steps.append(replace(restart, withheld=why))
        # A restart asked for but not possible here (none configured, done, or withheld) caps;
        # an episode a restart already answered asks for no more than a cap, and the episodes
        # a restart for fragmentation answered ask for nothing (_answered_by_clean_start).
        clean = _answered_by_clean_start(e.alerts, e.restarted)
        acting = [a for a in e.alerts if a.episode not in clean]
        acting_actions = actions_for(acting, ctx.policy)
        wanted = set(acting_actions) - {"restart"}
        if "restart" in acting_actions:
            wanted.add("lower_cap")
        drains = episodes(acting, "drain", ctx.policy)
        if drains and all(ep in e.restarted for ep in drains):
            wanted.discard("drain")
            wanted.add("lower_cap")
        quiet = (
            e.restartable
            and restart is None
            and any(ep not in e.restarted for ep in fragmentation(e.alerts, ctx.policy))
            and check(e.name, "restart") is None
        )
        if quiet:
            wanted.add("drain")  # a quiet moment for the restart: capping does not help
        desired = decide(wanted, o, ctx.policy)
        if quiet and desired.draining:
            desired = replace(
                desired, reason="allocator fragmentation: drain for a restart on a clean allocator"
            )
        planned = plan(o, desired)
        if planned and planned[0][0] == "drain":
            why = check(e.name, "drain")
            if why in CAP_INSTEAD:
                # draining would take the model's last capacity: hold it at a lower cap instead
                steps.append(Step("drain", reason=desired.reason, withheld=why))
                capped = decide((wanted - {"drain"}) | {"lower_cap"}, o, ctx.policy)
                desired = Desired(False, capped.cap, "capped", f"{why}: capping, not draining")
                planned = plan(o, desired)
        for kind, cap in planned:
            why = check(e.name, kind)
            if why is not None:
                steps.append(Step(kind, cap, desired.reason, withheld=why))
                break
            steps.append(Step(kind, cap, desired.reason))
            if kind in DISRUPTIVE:
                safety = safety.with_action(e.name, ctx.now, kind)
            draining = BY_NAME[kind].draining
            if draining is not None:
                fleet[e.name] = EngineView(e.model, draining=draining, reachable=True)
        verdicts.append(
            Verdict(e.name, o, desired, tuple(steps), fingerprints=fps, waiting=waiting)
        )
    return verdicts
