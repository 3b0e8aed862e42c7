"""Convergence: one reconcile pass. Read the engines that need attention, decide the fleet
(decision.decide_fleet: the same call `explain` makes), and carry each verdict out through the
actuator: every step through the safety limits and into the audit log, restarts handed to
restarting.Restarts, each target's status and metrics published for the API and dashboards.

Every step is write-ahead: its intent is recorded durably (and counted against the safety
limits) before the engine is called, and its outcome (acted, failed) after; a step whose intent
cannot be recorded (the audit disk is full) is not taken. Intents a killed remediator left
uncommitted are reconciled by reading the engine (`reconcile_intents`).

Other audit entries record changes, not passes: a decision, a hold, a withheld step is audited
when it differs from the last one noted for that target; they are best-effort (a full disk
does not stop a pass), unlike intents.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from oomguard.actions import BY_NAME, DISRUPTIVE
from oomguard.engine_state import EngineState, StateError
from oomguard.engine_state import parse as parse_state
from oomguard.remediator import crashpoints
from oomguard.remediator.actuator import Actuator, ActuatorError, Target, read_states
from oomguard.remediator.attention import Attention
from oomguard.remediator.audit import AuditLog, new_intent
from oomguard.remediator.config import RemediatorConfig
from oomguard.remediator.decision import (
    Context,
    EngineInput,
    Unreadable,
    Verdict,
    decide_fleet,
    needs_flags,
)
from oomguard.remediator.fleet import Fleet
from oomguard.remediator.intake import Intake
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.policy import Desired, Observed
from oomguard.remediator.restarting import Restarts
from oomguard.remediator.safety import Safety
from oomguard.remediator.targets import TargetConfig
from oomguard.remediator.webhook import Alert

log = logging.getLogger("oomguard.remediator")


def observe(state: EngineState | dict[str, Any] | ActuatorError) -> Observed | Unreadable:
    """The plugin's state document as the decision reads it, or why it cannot be used."""
    if isinstance(state, ActuatorError):
        return Unreadable(state.reason, str(state))
    try:
        return Observed.from_state(state)
    except StateError as exc:
        return Unreadable("bad_state", f"unexpected state from the plugin: {exc}")


def checked(state: object, name: str) -> EngineState | ActuatorError:
    """What the actuator read, checked against the contract: a malformed state becomes an
    ActuatorError `bad_state` naming the field (the engine is held), never an exception."""
    if isinstance(state, ActuatorError):
        return state
    try:
        return parse_state(state)
    except StateError as exc:
        return ActuatorError("bad_state", f"{name}: {exc}")


@dataclass
class PassPlan:
    """A pass between its phases: the engines it reads, when it began, its reads' epoch."""

    due: list[str]
    targets: list[Target]
    started: float
    epoch: int
    focused: bool = False  # the focus lane's (controller.py)


@dataclass
class TargetStatus:
    name: str
    url: str
    model: str
    mode: str = "unknown"
    reason: str = "not reconciled yet"
    observed: dict[str, Any] | None = None
    desired: dict[str, Any] | None = None
    alerts: dict[str, int] = field(default_factory=dict)  # firing alert name -> how many
    error: str | None = None
    last_action: dict[str, Any] | None = None
    updated: float | None = None
    # an action the decision wanted and a safety limit withheld this pass (oomguard status)
    limited: dict[str, Any] | None = None
    # an elective action a limit holds back this pass (the flags' walk-back): no one's to answer
    waiting: str | None = None


class Convergence:
    def __init__(
        self,
        config: RemediatorConfig,
        fleet: Fleet,
        actuator: Actuator,
        audit: AuditLog,
        metrics: RemediatorMetrics,
        safety: Safety,
        intake: Intake,
        restarts: Restarts,
        dry_run: bool,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.actuator = actuator
        self.audit = audit
        self.metrics = metrics
        self.safety = safety
        self.intake = intake
        self.restarts = restarts
        self.dry_run = dry_run
        self.status = {t.name: TargetStatus(t.name, t.url, t.model) for t in config.targets}
        self._idle_since: dict[str, float] = {}  # (safety clock) first read drained and idle
        self._noted: dict[tuple[str, str], Any] = {}  # (target, topic) -> last audited value
        self._pool = ThreadPoolExecutor(max_workers=min(16, max(1, len(fleet.targets))))
        # which engines each pass reads (attention.py); the rest keep their last state
        self.attention = Attention(config.attention)
        self.attention.track({t.name: t.model for t in config.targets})

    def retarget(self, old: Mapping[str, TargetConfig]) -> None:
        """After the allowlist changed: a target whose configuration is unchanged keeps its
        status; the rest start over."""
        self.status = {
            name: self.status[name]
            if name in self.status and old.get(name) == t
            else TargetStatus(t.name, t.url, t.model)
            for name, t in self.fleet.targets.items()
        }
        self._idle_since = {n: t for n, t in self._idle_since.items() if n in self.fleet.targets}
        self.attention.track({t.name: t.model for t in self.fleet.targets.values()})

    def inputs(
        self,
        firing: Mapping[str, list[Alert]],
        states: Mapping[str, Any],
        names: Iterable[str] | None = None,
    ) -> list[EngineInput]:
        """What the decision needs for every target in `names` (default: all; the restart
        backends' flags read only where a restart may be wanted)."""
        out = []
        restarts = self.restarts
        now = self.safety.clock()
        for name in self.fleet.targets if names is None else names:
            cfg = self.fleet.targets[name]
            state = observe(states[name])
            engine = EngineInput(
                name,
                cfg.model,
                tuple(firing.get(name, ())),
                state,
                restartable=name in restarts.backends and not self.dry_run,
                restarted=restarts.answered(name),
                restarting=name in restarts.running,
                idle_for=self._idle_for(name, state, now),
            )
            if needs_flags(engine, self.config.policy):
                engine = EngineInput(**{**engine.__dict__, "flags": restarts.flags(name)})
            out.append(engine)
        return out

    def _idle_for(self, name: str, state: Observed | Unreadable, now: float) -> float:
        """Seconds `name` has been read drained and idle without a break (0 otherwise). Kept in
        memory only: a new leader starts counting again, which only waits longer."""
        if isinstance(state, Observed) and state.draining and state.idle:
            return now - self._idle_since.setdefault(name, now)
        self._idle_since.pop(name, None)
        return 0.0

    def context(self) -> Context:
        c = self.config
        s = self.safety
        return Context(c.policy, c.safety, c.flags, s.state(), s.clock(), s.wall())

    def run_pass(self) -> bool:
        """One pass over the fleet; True when another pass is wanted at once (a quiet engine,
        decided on its last state, turned out to need a step). The controller runs the same
        three phases with its decision lock held around `begin` and `finish` only."""
        plan = self.begin()
        return self.finish(plan, self.read(plan)) if plan is not None else False

    def begin(self, focused: bool = False) -> PassPlan | None:
        """Which engines this pass reads (the focus lane's: what a webhook just changed, None
        when that needs no read)."""
        started = time.monotonic()
        att = self.attention
        firing = self.intake.firing_by_target()
        if focused:
            due = att.focused(firing, self.config.policy, started)
            if not due:
                return None
        else:
            due = att.due(
                self.fleet.targets,
                firing,
                self.config.policy,
                started,
                self.restarts.running,
                None,
                time.time(),
            )
        targets = [self.fleet.target(n) for n in due]
        return PassPlan(due, targets, started, att.begin(), focused)

    def read(self, plan: PassPlan) -> list[Any]:
        """The engines' answers, read all at once (actuator.read_states: a pass waits for its
        slowest read, not their sum); no lock is held, so a slow engine delays only this pass."""
        return read_states(self.actuator, plan.targets, self._pool)

    def finish(self, plan: PassPlan, read: list[Any]) -> bool:
        """Decide on the newest state known of each engine read, with the alerts firing now,
        and act."""
        again = False
        started = plan.started
        firing = self.intake.firing_by_target()
        att = self.attention
        answered = {  # discovery may have removed a target while it was read
            n: checked(state, n)
            for n, state in zip(plan.due, read, strict=True)
            if n in self.fleet.targets
        }
        states = att.read(answered, plan.epoch)
        due = list(states)
        peers = att.peers(due)  # quiet engines the fleet-wide limits still need to see
        names = att.in_order([*due, *peers]) if peers else due
        seen = {**{p: att.last(p) for p in peers}, **states}
        verdicts = decide_fleet(self.inputs(firing, seen, names), self.context())
        for verdict in verdicts:
            name = verdict.target
            if name not in states:  # a quiet peer, decided on its last state: never acted on
                if verdict.steps:
                    att.wake(name)
                    again = True
                continue
            try:
                self._carry_out(verdict, states[name], firing[name])
                att.settle(verdict, started)
                action = self.status[name].last_action
                if action and isinstance(action.get("time"), float):
                    att.acted(name, action["time"])  # read every pass for a while
            except Exception as exc:  # one target's surprise never stops the others
                att.wake(name)
                log.exception("reconciling %s failed", name)
                self._hold(name, "internal", f"{type(exc).__name__}: {exc}", verdict)
        if plan.focused:  # the pass duration and engines read are the full passes'
            self.metrics.reads.inc(len(states))
        else:
            self.metrics.observe_pass(
                time.monotonic() - started,
                len(states),
                len(self.fleet.targets),
                att.quiet,
                att.resync_period(),
            )
        return again

    def _carry_out(
        self, v: Verdict, state: EngineState | ActuatorError, alerts: list[Alert]
    ) -> None:
        name = v.target
        self.status[name].limited = None  # set again below while a limit still withholds
        self.status[name].waiting = v.waiting
        if self._note(name, "waiting", v.waiting) and v.waiting is not None:
            log.info("%s: %s", name, v.waiting)
        if v.held == "restarting":
            self.status[name].mode = "restarting"
            self.metrics.set_mode(name, "restarting")
            return
        if v.observed is None or v.desired is None:
            self._hold(name, v.held or "unknown", v.message, v)
            return
        assert isinstance(state, EngineState)  # observed: it was read and parsed
        if v.held is not None:  # blind: the engine's state is read, nothing is changed
            self._hold(name, v.held, v.message, v, error=False)
            self._publish(name, state, v.desired, alerts, mode="held")
            return
        self._note(name, "held", None)
        observed, desired = v.observed, v.desired
        decision = (desired.phase, desired.cap, desired.draining, desired.reason)
        prev = self._noted.get((name, "decision"))
        if self._note(name, "decision", decision) and (
            v.steps or desired.phase != "serving" or (prev is not None and prev[0] != "serving")
        ):  # a change worth explaining; not "full admission" for every target at start
            self.audit.try_record(
                "decided",
                target=name,
                before=_brief(observed),
                after={"cap": desired.cap, "draining": desired.draining, "phase": desired.phase},
                reason=desired.reason,
                fingerprints=v.fingerprints,
            )
        last = state
        for step in v.steps:
            if step.withheld is not None:
                # the decision adds nothing after a withheld step but a fallback (cap, not drain)
                self._withheld(name, step.kind, step.withheld, v)
                continue
            self._note(name, "withheld", None)
            if step.kind == "restart":
                entry = self.restarts.start(name, step, list(v.fingerprints), self.safety)
                if entry is None:  # its intent could not be recorded: nothing was started
                    self._unrecorded(name, "restart")
                    break
                self.status[name].last_action = entry
                self.status[name].mode = "restarting"
                return
            result = self._act(
                name,
                step.kind,
                step.cap,
                observed,
                desired,
                list(v.fingerprints),
                last,
                step.params,
            )
            if result is None:
                break
            last = result
        self._publish(name, last, desired, alerts)

    def _note(self, target: str, topic: str, value: Any) -> bool:
        """True when `value` differs from the last one noted (audit changes, not every pass)."""
        key = (target, topic)
        if self._noted.get(key) == value:
            return False
        self._noted[key] = value
        return True

    def _hold(self, name: str, reason: str, message: str, v: Verdict, error: bool = True) -> None:
        st = self.status[name]
        st.mode, st.reason = "held", f"{reason}: {message}"
        st.error = message if error else None
        st.updated = time.time()
        if error:
            self.metrics.reconcile_errors.labels(name).inc()
        self.metrics.set_mode(name, "held")
        if self._note(name, "held", reason):
            why = (
                f"no action while the engine cannot be read: {message}"
                if error
                else f"no action while the exporter is blind to the engine: {message}"
            )
            self.audit.try_record(
                "held", target=name, result=reason, reason=why, fingerprints=v.fingerprints
            )
            log.warning("holding %s: %s", name, message)

    def _withheld(self, name: str, kind: str, limit: str, v: Verdict) -> None:
        self.status[name].limited = {"action": kind, "limit": limit}
        if self._note(name, "withheld", (kind, limit)):
            self.metrics.safety_limited.labels(name, limit).inc()
            self.audit.try_record(
                "withheld",
                target=name,
                action=kind,
                result=limit,
                reason=f"{kind} withheld by the {limit} limit",
                fingerprints=v.fingerprints,
            )
            log.warning("%s on %s withheld by the %s limit", kind, name, limit)

    def _act(
        self,
        name: str,
        kind: str,
        cap: int | None,
        observed: Observed,
        desired: Desired,
        fps: list[str],
        before: EngineState,
        params: dict[str, Any] | None = None,
    ) -> EngineState | None:
        """Take one step, write-ahead: its intent is durable before the engine is called, and
        counted against the safety limits from then on; the answer commits it. Returns the
        engine's state after the step (`before` when the answer cannot be read), or None when
        the step was not taken or failed."""
        if self.dry_run and not self._note(name, "dry_run", (kind, cap)):
            return None  # the engine does not change in a dry run: say it once, not every pass
        target = self.fleet.target(name)
        brief = _brief(observed)
        crashpoints.reach("before_intent")
        key = new_intent()
        try:
            self.audit.record(
                "intent",
                target=name,
                action=kind,
                before=brief,
                after=_intended(cap, params),
                result="pending",
                reason=desired.reason,
                fingerprints=fps,
                intent=key,
            )
        except OSError:  # no action without a durable intent
            self._unrecorded(name, kind)
            return None
        self._note(name, "unrecorded", None)
        if kind in DISRUPTIVE:
            self.safety.record(name, kind, key=key)
        crashpoints.reach("after_intent")
        try:
            spec = BY_NAME[kind]  # the registry's call, or the generic one with its route
            if spec.call is None:
                response = self.actuator.act(target, kind, params)
            else:
                call = getattr(self.actuator, spec.call)
                response = call(target) if cap is None else call(target, cap)
        except ActuatorError as exc:
            self.safety.forget(name, key)  # refused or unreachable: nothing was done
            self.metrics.actions.labels(name, kind, "failed").inc()  # why: the audit log
            self.metrics.reconcile_errors.labels(name).inc()
            self.status[name].error = str(exc)
            # the intent's outcome is always recorded; the log line once, not every pass
            self.audit.try_record(
                "failed",
                target=name,
                action=kind,
                before=brief,
                after=_intended(cap, params),
                result=exc.reason,
                reason=f"{desired.reason}: {exc}",
                fingerprints=fps,
                intent=key,
            )
            if self._note(name, "failed", (kind, cap, exc.reason)):
                log.error("%s on %s failed (retrying every pass): %s", kind, name, exc)
            return None
        crashpoints.reach("after_engine")
        self._note(name, "failed", None)
        try:  # a cap change answers {"admission_cap", ..., "state": {...}}; the others the state
            raw = response.get("state", response) if isinstance(response, dict) else response
            state = parse_state(raw)
        except StateError as exc:  # done, but the answer is unreadable: the next pass reads it
            log.warning("%s on %s: unreadable answer: %s", kind, name, exc)
            state = before
        else:
            self.attention.wrote(name, state)  # newer than a read another pass has in flight
        result = "dry_run" if self.dry_run else "ok"
        self.metrics.actions.labels(name, kind, result).inc()
        fields: dict[str, Any] = {
            "target": name,
            "action": kind,
            "before": brief,
            "after": {"cap": state.admission_cap, "mode": state.mode},
            "result": result,
            "reason": desired.reason,
            "fingerprints": fps,
            "intent": key,
        }
        entry = self.audit.try_record("acted", **fields)
        crashpoints.reach("after_commit")
        if entry is None:  # done, not committed: the intent counts and is reconciled later
            log.error("%s on %s done, but its commit cannot be recorded", kind, name)
            entry = {"time": time.time(), "event": "acted", **fields}
        self.status[name].last_action = entry
        self.status[name].error = None
        log.info("%s on %s (%s): %s", kind, name, result, desired.reason)
        return state

    def _unrecorded(self, name: str, kind: str) -> None:
        """An action not taken because its intent could not be made durable (disk full)."""
        why = self.audit.last_error or "cannot write"
        self.metrics.actions.labels(name, kind, "unrecorded").inc()
        self.status[name].error = f"audit log unavailable ({why}): {kind} not taken"
        if self._note(name, "unrecorded", (kind, why)):
            log.error("%s on %s not taken: its intent cannot be recorded (%s)", kind, name, why)

    def reconcile_intents(self, pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Settle intents a previous run recorded but never committed (it died in between):
        read each engine, record whether the step is in force (`reconciled`, result applied or
        not_applied), and return those whose engine could not be read (tried again later).
        They count against the safety limits either way (Safety.restore)."""
        left = []
        for intent in pending:
            name, kind = str(intent.get("target")), str(intent.get("action"))
            key = intent.get("intent")
            if name not in self.fleet.targets:
                self.audit.try_record(
                    "reconciled", target=name, action=kind, result="target_gone", intent=key
                )
                continue
            applied, seen = self._in_force(name, kind, intent.get("after"))
            if applied is None:
                left.append(intent)
                continue
            entry = self.audit.try_record(
                "reconciled",
                target=name,
                action=kind,
                before=intent.get("before"),
                after=seen,
                result="applied" if applied else "not_applied",
                reason="the remediator stopped between this intent and its commit; the "
                "engine read since says whether it was done",
                intent=key,
            )
            if entry is None:
                left.append(intent)
            else:
                log.warning(
                    "intent %s (%s on %s) was never committed: %s",
                    key,
                    kind,
                    name,
                    "applied" if applied else "not applied",
                )
        return left

    def _in_force(self, name: str, kind: str, after: Any) -> tuple[bool | None, Any]:
        """Whether an uncommitted step is in force on the engine now (None: cannot tell)."""
        want = after if isinstance(after, dict) else {}
        if kind == "restart":
            view = self.restarts.flags(name)
            if view is None:
                return None, None
            now = {
                "gpu_memory_utilization": view.current.gpu_memory_utilization,
                "max_num_seqs": view.current.max_num_seqs,
            }
            return all(want.get(k) == v for k, v in now.items()), now
        try:
            state = checked(self.actuator.state(self.fleet.target(name)), name)
        except Exception as exc:  # an actuator surprise: cannot tell
            state = ActuatorError("internal", str(exc))
        if isinstance(state, ActuatorError):
            return None, None
        seen = {"cap": state.admission_cap, "mode": state.mode, "draining": state.draining}
        draining = BY_NAME[kind].draining if kind in BY_NAME else None
        if draining is not None:
            return state.draining == draining, seen
        cap = want.get("cap")
        if isinstance(cap, int) and not isinstance(cap, bool):
            return state.admission_cap == cap, seen
        return None, seen

    def _publish(
        self,
        name: str,
        state: EngineState,
        desired: Desired,
        alerts: list[Alert],
        mode: str | None = None,
    ) -> None:
        st = self.status[name]
        # the mode the engine is in now (an action may have been withheld, failed or dry run)
        cap, startup = state.admission_cap, state.startup_max_num_seqs
        if mode is not None:
            pass
        elif state.draining:
            mode = "draining"
        elif cap >= startup:
            mode = "serving"
        else:
            mode = desired.phase if desired.phase in ("capped", "readmitting") else "capped"
        st.mode, st.reason, st.updated = mode, desired.reason, time.time()
        st.observed = state.model_dump(
            include={
                "admission_cap",
                "startup_max_num_seqs",
                "mode",
                "running",
                "waiting",
                "kv_cache_usage",
            }
        )
        st.desired = {"cap": desired.cap, "draining": desired.draining, "phase": desired.phase}
        names: dict[str, int] = {}
        for a in alerts:
            names[a.name] = names.get(a.name, 0) + 1
        st.alerts = names
        m = self.metrics  # series updated on change only (metrics.py)
        m.set_mode(name, mode)
        m.set_target(name, cap, startup, cap if mode == "readmitting" else 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _brief(observed: Observed) -> dict[str, Any]:
    return {
        "cap": observed.admission_cap,
        "mode": "draining" if observed.draining else "serving",
        "startup": observed.startup_max_num_seqs,
    }


def _intended(cap: int | None, params: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a step asks of the engine, for its intent in the audit log."""
    after: dict[str, Any] = {}
    if cap is not None:
        after["cap"] = cap
    if params:
        after["params"] = params
    return after or None
