"""The reconcile loop: alerts firing now + each engine's observed state -> converge, safely.

Level-triggered, like a Kubernetes controller. Webhooks only update the set of firing alerts (the
AlertBook) and wake the loop; every pass then reads the state of each allowlisted engine that
needs attention (in a fleet, the rest on a slow resync: attention.py) through the actuator, asks
the policy for its desired state, and takes the steps between the two, each one
through the safety limits and into the audit log. Nothing depends on which webhook arrived when,
so retries, duplicates, restarts and a second replica all converge to the same place.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from oomguard.remediator.actuator import Actuator, ActuatorError, DryRunActuator, Target
from oomguard.remediator.alertbook import AlertBook
from oomguard.remediator.attention import Attention
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import RemediatorConfig, SecretFile, TargetConfig
from oomguard.remediator.decision import (
    Context,
    EngineInput,
    Step,
    Unreadable,
    Verdict,
    decide_fleet,
    needs_flags,
    plan,
)
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.policy import Desired, Observed, PolicyConfig, actions_for, decide
from oomguard.remediator.restart import FlagView, RestartBackend, RestartResult, RestartSequence
from oomguard.remediator.safety import DISRUPTIVE, Safety
from oomguard.remediator.webhook import (
    Alert,
    PayloadError,
    Webhook,
    labels_field,
    start_field,
    text_field,
)

log = logging.getLogger("oomguard.remediator")

SEEN_LIMIT = 20_000  # dedup keys remembered (FIFO): retries and HA copies come within minutes
RESTARTED_LIMIT = 64  # restart episodes remembered per target

__all__ = ["Controller", "decide_for", "make_target", "plan", "route", "select"]


def decide_for(alerts: Iterable[Alert], observed: Observed, policy: PolicyConfig) -> Desired:
    return decide(actions_for(alerts, policy), observed, policy)


def select(alert: Alert, targets: Iterable[TargetConfig]) -> list[str]:
    """Names of the allowlisted targets whose selector labels the alert carries exactly."""
    labels = alert.labels
    return [t.name for t in targets if all(labels.get(k) == v for k, v in t.selector().items())]


def route(alert: Alert, targets: Iterable[TargetConfig]) -> tuple[str | None, str | None]:
    """(the one target the alert selects, None) or (None, why it selects none or several)."""
    names = select(alert, targets)
    if len(names) == 1:
        return names[0], None
    if not names:
        shown = {k: alert.labels.get(k, "") for k in ("target", "instance")}
        return None, f"no allowlisted target matches {shown}"
    return None, f"ambiguous: matches targets {', '.join(names)}"


def make_target(cfg: TargetConfig, secret: SecretFile | None) -> Target:
    """The actuator's view of an allowlisted engine, with its token as the file says now."""
    return Target(cfg.name, cfg.url, secret.get() if secret else None, cfg.model)


def observe(state: dict[str, Any] | ActuatorError) -> Observed | Unreadable:
    """The plugin's state document as the decision reads it, or why it cannot be used."""
    if isinstance(state, ActuatorError):
        return Unreadable(state.reason, str(state))
    try:
        return Observed.from_state(state)
    except (KeyError, TypeError, ValueError, AssertionError, OverflowError) as exc:
        return Unreadable("bad_state", f"unexpected state from the plugin: {exc!r}")


def restarted_from(entries: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """Per target, the alert episodes a restart already answered (from the audit log)."""
    out: dict[str, set[str]] = {}
    for entry in entries:
        if entry.get("event") == "acted" and entry.get("action") == "restart":
            after = entry.get("after") or {}
            if not isinstance(after, dict):
                continue
            eps = after.get("episodes") or [after.get("episode")]
            target = entry.get("target")
            if isinstance(target, str) and isinstance(eps, list):
                out.setdefault(target, set()).update(e for e in eps if isinstance(e, str))
    return out


@dataclass
class Receipt:
    alerts: int
    new: int
    duplicates: int
    ignored: dict[str, str]  # fingerprint -> why
    changed: bool


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


class Controller:
    def __init__(
        self,
        config: RemediatorConfig,
        actuator: Actuator,
        audit: AuditLog,
        metrics: RemediatorMetrics | None = None,
        clock: Callable[[], float] = time.time,
        backends: Mapping[str, RestartBackend] | None = None,
    ) -> None:
        self.config = config
        self.dry_run = config.dry_run or isinstance(actuator, DryRunActuator)
        self.actuator = actuator
        self.audit = audit
        self.metrics = metrics or RemediatorMetrics()
        self.safety = Safety(config.safety, clock)
        self.targets = {t.name: t for t in config.targets}
        self._tokens = {t.name: SecretFile(t.token_file) for t in config.targets if t.token_file}
        self.book = AlertBook()
        self.status = {t.name: TargetStatus(t.name, t.url, t.model) for t in config.targets}
        self.wake: Callable[[], None] = lambda: None  # the runner points this at its scheduler
        self.resync_soon: Callable[[], None] = lambda: None  # and this at the resync job
        self._book_lock = threading.Lock()
        self._pass_lock = threading.Lock()
        self._dirty = False
        self._seen: OrderedDict[tuple[str, datetime, str], None] = OrderedDict()
        self._routes: dict[str, str | None] = {}  # alert key -> target (its labels are fixed)
        self._pruned = time.monotonic()
        self._noted: dict[tuple[str, str], Any] = {}  # (target, topic) -> last audited value
        self._pool = ThreadPoolExecutor(max_workers=min(16, max(1, len(self.targets))))
        # which engines each pass reads (attention.py); the rest keep their last state
        self.attention = Attention(config.attention)
        self.attention.track({t.name: t.model for t in config.targets})
        self.backends: dict[str, RestartBackend] = dict(backends or {})
        self._restarting: dict[str, threading.Thread] = {}
        self._flag_views: dict[str, tuple[float, FlagView]] = {}
        self.failed_passes = 0  # consecutive passes that raised (/healthz degrades on these)
        # what survives a remediator restart: the pause switch, each target's recent actions
        # (cooldowns, rate limits) and the episodes already answered by a restart
        entries = audit.entries()
        self.safety.restore(entries)
        self._restarted = restarted_from(entries)
        self.metrics.paused.set(1 if self.paused else 0)

    # -- input ---------------------------------------------------------------------------------
    def _route(self, alert: Alert) -> str | None:
        """Under the book lock: the alert's target (cached by alert key: labels never change)."""
        if alert.key not in self._routes:
            self._routes[alert.key] = route(alert, self.targets.values())[0]
        return self._routes[alert.key]

    def receive(self, webhook: Webhook, source: str = "webhook") -> Receipt:
        """Record a payload durably, then apply it. Raises OSError when the audit log cannot be
        written: the caller answers 5xx and Alertmanager retries; nothing was applied."""
        with self._book_lock:
            new = [a for a in webhook.alerts if a.dedup_key not in self._seen]
            routes = {a.key: route(a, self.targets.values()) for a in new}
            ignored = {a.fingerprint: why for a in new if (why := routes[a.key][1])}
            if new:
                self.audit.record(
                    "received",
                    result="ignored" if len(ignored) == len(new) else "accepted",
                    reason=f"{source} {webhook.group_key}".strip(),
                    after={
                        "firing": sorted(a.fingerprint for a in new if a.status == "firing"),
                        "resolved": sorted(a.fingerprint for a in new if a.status == "resolved"),
                        "ignored": ignored,
                        "duplicates": len(webhook.alerts) - len(new),
                    },
                    fingerprints=[a.fingerprint for a in new],
                )
            if webhook.truncated_alerts:
                # Alertmanager left alerts out of this payload: what is firing is only known
                # from its API, so read it now rather than at the next periodic resync
                self.audit.record(
                    "truncated",
                    result="resync",
                    reason=f"{source} {webhook.group_key}: {webhook.truncated_alerts} alerts "
                    "left out of the payload; resyncing from Alertmanager".strip(),
                )
            routable = []
            for a in new:  # selectors are evaluated once per alert, not once per pass
                name = routes[a.key][0]
                self._routes[a.key] = name
                if name is not None:
                    routable.append(a)
            changed = self.book.apply_all(routable)
            for a in new:
                self._seen[a.dedup_key] = None
            while len(self._seen) > SEEN_LIMIT:
                self._seen.popitem(last=False)
        for fp, why in ignored.items():
            log.warning("ignoring alert %r: %s", fp, why)
        if webhook.truncated_alerts:
            log.warning("%d alerts left out of a payload: resyncing", webhook.truncated_alerts)
            self.resync_soon()
        if changed:
            self.request()
        total = len(webhook.alerts)
        return Receipt(total, len(new), total - len(new), ignored, changed)

    def resync(self) -> bool:
        """Rebuild the firing set from Alertmanager's API (at start and periodically). Raises
        httpx.HTTPError or ValueError when Alertmanager cannot be read; the book is kept."""
        source = self.config.alertmanager
        if source is None:
            return False
        as_of = time.monotonic()
        r = httpx.get(
            f"{source.url.rstrip('/')}/api/v2/alerts",
            params={
                "active": "true",
                "silenced": "false",
                "inhibited": "false",
                "receiver": f"^{re.escape(source.receiver)}$",
            },
            timeout=5.0,
        )
        r.raise_for_status()
        listed = _am_alerts(r.json())
        with self._book_lock:
            active = [a for a in listed if self._route(a) is not None]
            before = {a.fingerprint for a in self.book.current()}
            changed = self.book.sync(active, as_of)
            after = {a.fingerprint for a in self.book.current()}
        if changed:
            self.audit.record(
                "resynced",
                reason=f"alertmanager {source.url}",
                before=sorted(before),
                after=sorted(after),
                fingerprints=before ^ after,
            )
            self.request()
        return changed

    def set_paused(self, paused: bool, reason: str) -> None:
        # audited first: the audit log is where a restarted remediator finds the switch again
        self.audit.record("paused" if paused else "unpaused", reason=reason)
        self.safety.paused = paused
        self.metrics.paused.set(1 if paused else 0)
        log.warning("remediator %s: %s", "paused" if paused else "unpaused", reason)
        self.request()

    @property
    def paused(self) -> bool:
        return self.safety.paused

    # -- the loop ------------------------------------------------------------------------------
    def request(self) -> None:
        """Ask for a pass as soon as possible (a pass in progress runs once more)."""
        self._dirty = True
        self.wake()

    def reconcile(self) -> None:
        if not self._pass_lock.acquire(blocking=False):
            self._dirty = True
            return
        try:
            while True:
                self._dirty = False
                try:
                    self._pass()
                except Exception:  # a pass that fails is counted and visible, never silent
                    self.failed_passes += 1
                    self.metrics.pass_failures.inc()
                    log.exception("reconcile pass failed (%d in a row)", self.failed_passes)
                    break
                self.failed_passes = 0
                self.metrics.last_pass.set(time.time())
                if not self._dirty:
                    break
        finally:
            self._pass_lock.release()

    def restore(self) -> None:
        """Rebuild the safety state from the audit log (on taking over as the leader: the
        previous leader's cooldowns, budgets and answered restart episodes hold here too)."""
        with self._pass_lock:  # a pass from an earlier term may still be finishing
            entries = self.audit.entries()
            safety = Safety(self.config.safety, self.safety.clock)
            safety.restore(entries)
            self.safety = safety
            self._restarted = restarted_from(entries)
        self.metrics.paused.set(1 if self.paused else 0)

    def set_targets(self, targets: Iterable[TargetConfig]) -> None:
        """Replace the allowlist (discovered targets come and go): between passes, with the
        alert routes recomputed. An alert that came before its pod was discovered selected
        nothing then; the resync from Alertmanager finds it."""
        targets = list(targets)
        with self._pass_lock, self._book_lock:
            old = self.targets
            files = {s.path: s for s in self._tokens.values()}  # one reader per token file
            self.targets = {t.name: t for t in targets}
            self._tokens = {
                t.name: files.get(Path(t.token_file)) or SecretFile(t.token_file)
                for t in targets
                if t.token_file
            }
            self.status = {
                t.name: self.status[t.name]
                if t.name in self.status and old.get(t.name) == t
                else TargetStatus(t.name, t.url, t.model)
                for t in targets
            }
            self._routes = {}
            self.attention.track({t.name: t.model for t in targets})
        if old.keys() != self.targets.keys():
            self.resync_soon()

    def target(self, name: str) -> Target:
        return make_target(self.targets[name], self._tokens.get(name))

    def _read(self, name: str) -> dict[str, Any] | ActuatorError:
        try:
            return self.actuator.state(self.target(name))
        except ActuatorError as exc:
            return exc

    def firing_by_target(self) -> dict[str, list[Alert]]:
        """Each target's firing alerts, derived from the book (never a counter kept beside it,
        which a reused fingerprint could drive out of step)."""
        with self._book_lock:
            out: dict[str, list[Alert]] = {name: [] for name in self.targets}
            for a in self.book.current():
                name = self._route(a)
                if name is not None:
                    out[name].append(a)
            if time.monotonic() - self._pruned > 60:
                self.book.prune(datetime.now(UTC))
                self._pruned = time.monotonic()
            if len(self._routes) > 2 * len(self.book) + 1000:  # forget resolved alerts' routes
                self._routes = {a.key: self._routes.get(a.key) for a in self.book.current()}
        return out

    def inputs(
        self,
        firing: Mapping[str, list[Alert]],
        states: Mapping[str, Any],
        names: Iterable[str] | None = None,
    ) -> list[EngineInput]:
        """What the decision needs for every target in `names` (default: all; the restart
        backends' flags read only where a restart may be wanted)."""
        out = []
        for name in self.targets if names is None else names:
            cfg = self.targets[name]
            engine = EngineInput(
                name,
                cfg.model,
                tuple(firing.get(name, ())),
                observe(states[name]),
                restartable=name in self.backends and not self.dry_run,
                restarted=frozenset(self._restarted.get(name, ())),
                restarting=name in self._restarting,
            )
            if needs_flags(engine, self.config.policy):
                engine = EngineInput(**{**engine.__dict__, "flags": self._flags(name)})
            out.append(engine)
        return out

    def context(self) -> Context:
        c = self.config
        return Context(c.policy, c.safety, c.flags, self.safety.state(), self.safety.clock())

    def _pass(self) -> None:
        started = time.monotonic()
        firing = self.firing_by_target()
        att = self.attention
        acted = {
            n: st.last_action["time"]
            for n, st in self.status.items()
            if st.last_action and isinstance(st.last_action.get("time"), float)
        }
        due = att.due(
            self.targets, firing, self.config.policy, started, self._restarting, acted, time.time()
        )
        states = dict(zip(due, self._pool.map(self._read, due), strict=True))
        att.read(states)
        peers = att.peers(due)  # quiet engines the fleet-wide limits still need to see
        names = att.in_order([*due, *peers]) if peers else due
        seen = {**{p: att.last(p) for p in peers}, **states}
        verdicts = decide_fleet(self.inputs(firing, seen, names), self.context())
        for verdict in verdicts:
            name = verdict.target
            if name not in states:  # a quiet peer, decided on its last state: never acted on
                if verdict.steps:
                    att.wake(name)
                    self._dirty = True
                continue
            try:
                self._carry_out(verdict, states[name], firing[name])
                att.settle(verdict, started)
            except Exception as exc:  # one target's surprise never stops the others
                att.wake(name)
                log.exception("reconciling %s failed", name)
                self._hold(name, "internal", f"{type(exc).__name__}: {exc}", verdict)
        self.metrics.observe_pass(
            time.monotonic() - started, len(states), len(self.targets), att.quiet
        )

    def _carry_out(self, v: Verdict, state: Any, alerts: list[Alert]) -> None:
        name = v.target
        if v.held == "restarting":
            self.status[name].mode = "restarting"
            self.metrics.set_mode(name, "restarting")
            return
        if v.observed is None or v.desired is None:
            self._hold(name, v.held or "unknown", v.message, v)
            return
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
            self.audit.record(
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
                self._start_restart(name, step, list(v.fingerprints))
                return
            result = self._act(name, step.kind, step.cap, observed, desired, list(v.fingerprints))
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
            self.audit.record(
                "held", target=name, result=reason, reason=why, fingerprints=v.fingerprints
            )
            log.warning("holding %s: %s", name, message)

    def _flags(self, name: str) -> FlagView | None:
        cached = self._flag_views.get(name)
        if cached and time.monotonic() - cached[0] < 30:
            return cached[1]
        try:
            view = self.backends[name].flags()
        except (ActuatorError, KeyError, TypeError, ValueError) as exc:
            log.warning("cannot read the flags of %s: %s", name, exc)
            return None
        self._flag_views[name] = (time.monotonic(), view)
        return view

    def _start_restart(self, name: str, step: Step, fps: list[str]) -> None:
        assert step.flags is not None and step.episode is not None
        flags, reason = step.flags, step.reason
        view = self._flag_views.get(name)
        done = self._restarted.setdefault(name, set())
        done.update(step.covers or (step.episode,))
        while len(done) > RESTARTED_LIMIT:
            done.pop()
        self.safety.record(name, "restart")
        self.metrics.actions.labels(name, "restart", "started").inc()
        self.status[name].last_action = self.audit.record(
            "acted",
            target=name,
            action="restart",
            before={
                "gpu_memory_utilization": view[1].current.gpu_memory_utilization,
                "max_num_seqs": view[1].current.max_num_seqs,
            }
            if view
            else None,
            after={
                "gpu_memory_utilization": flags.gpu_memory_utilization,
                "max_num_seqs": flags.max_num_seqs,
                "episode": step.episode,
                "episodes": sorted(step.covers or (step.episode,)),
            },
            result="started",
            reason=reason,
            fingerprints=fps,
        )
        cfg = self.targets[name].restart
        assert cfg is not None
        sequence = RestartSequence(
            self.actuator,
            self.backends[name],
            self.audit,
            drain_timeout=cfg.drain_timeout_seconds,
            ready_timeout=cfg.ready_timeout_seconds,
            readmit_start=self.config.policy.readmit_start,
        )
        covers = set(step.covers or (step.episode,))

        def run() -> None:
            try:
                result = sequence.run(self.target(name), flags, reason, fps)
            except Exception as exc:  # never let a sequence thread die silently
                log.exception("restart of %s failed", name)
                result = RestartResult(False, "internal", str(exc))
            self.metrics.actions.labels(name, "restart", "ok" if result.ok else "failed").inc()
            if not result.ok and result.step in ("drain", "wait_idle", "restart"):
                self._restarted.get(name, set()).difference_update(covers)  # may be tried again
            self._flag_views.pop(name, None)
            log.log(
                logging.INFO if result.ok else logging.ERROR,
                "restart of %s: %s (%s)",
                name,
                result.message,
                result.step,
            )
            self._restarting.pop(name, None)
            self.request()

        thread = threading.Thread(target=run, name=f"restart-{name}", daemon=True)
        self._restarting[name] = thread
        self.status[name].mode = "restarting"
        self.metrics.set_mode(name, "restarting")
        log.warning("restarting %s: %s", name, reason)
        thread.start()

    def _withheld(self, name: str, kind: str, limit: str, v: Verdict) -> None:
        if self._note(name, "withheld", (kind, limit)):
            self.metrics.safety_limited.labels(name, limit).inc()
            self.audit.record(
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
    ) -> dict[str, Any] | None:
        if self.dry_run and not self._note(name, "dry_run", (kind, cap)):
            return None  # the engine does not change in a dry run: say it once, not every pass
        target = self.target(name)
        try:
            if kind == "drain":
                response = self.actuator.drain(target)
            elif kind == "resume":
                response = self.actuator.resume(target)
            else:
                assert cap is not None
                response = self.actuator.set_cap(target, cap)
        except ActuatorError as exc:
            self.metrics.actions.labels(name, kind, "failed").inc()  # why: the audit log
            self.metrics.reconcile_errors.labels(name).inc()
            self.status[name].error = str(exc)
            if self._note(name, "failed", (kind, cap, exc.reason)):  # once, not every pass
                self.audit.record(
                    "failed",
                    target=name,
                    action=kind,
                    before=_brief(observed),
                    after={"cap": cap} if cap is not None else None,
                    result=exc.reason,
                    reason=f"{desired.reason}: {exc}",
                    fingerprints=fps,
                )
                log.error("%s on %s failed (retrying every pass): %s", kind, name, exc)
            return None
        self._note(name, "failed", None)
        state = response.get("state", response)
        result = "dry_run" if self.dry_run else "ok"
        if kind in DISRUPTIVE:
            self.safety.record(name, kind)
        self.metrics.actions.labels(name, kind, result).inc()
        entry = self.audit.record(
            "acted",
            target=name,
            action=kind,
            before=_brief(observed),
            after={"cap": state.get("admission_cap"), "mode": state.get("mode")},
            result=result,
            reason=desired.reason,
            fingerprints=fps,
        )
        self.status[name].last_action = entry
        self.status[name].error = None
        log.info("%s on %s (%s): %s", kind, name, result, desired.reason)
        return state

    def _publish(
        self,
        name: str,
        state: dict[str, Any],
        desired: Desired,
        alerts: list[Alert],
        mode: str | None = None,
    ) -> None:
        st = self.status[name]
        # the mode the engine is in now (an action may have been withheld, failed or dry run)
        cap, startup = state.get("admission_cap"), state.get("startup_max_num_seqs")
        if mode is not None:
            pass
        elif state.get("mode") == "draining":
            mode = "draining"
        elif isinstance(cap, int) and isinstance(startup, int) and cap >= startup:
            mode = "serving"
        else:
            mode = desired.phase if desired.phase in ("capped", "readmitting") else "capped"
        st.mode, st.reason, st.updated = mode, desired.reason, time.time()
        st.observed = {
            k: state.get(k)
            for k in ("admission_cap", "startup_max_num_seqs", "mode", "running", "waiting")
        }
        st.observed["kv_cache_usage"] = state.get("kv_cache_usage")
        st.desired = {"cap": desired.cap, "draining": desired.draining, "phase": desired.phase}
        names: dict[str, int] = {}
        for a in alerts:
            names[a.name] = names.get(a.name, 0) + 1
        st.alerts = names
        m = self.metrics
        if isinstance(cap, int):
            m.cap.labels(name).set(cap)
        if isinstance(startup, int):
            m.startup.labels(name).set(startup)
        m.set_mode(name, mode)
        m.stage.labels(name).set(cap if mode == "readmitting" and isinstance(cap, int) else 0)

    # -- views ---------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        with self._book_lock:
            firing = len(self.book)
        return {
            "paused": self.paused,
            "dry_run": self.dry_run,
            "firing_alerts": firing,
            "targets": {name: asdict(st) for name, st in self.status.items()},
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _brief(observed: Observed) -> dict[str, Any]:
    return {
        "cap": observed.admission_cap,
        "mode": "draining" if observed.draining else "serving",
        "startup": observed.startup_max_num_seqs,
    }


def _am_alerts(body: Any) -> list[Alert]:
    """Alerts from Alertmanager's GET /api/v2/alerts; entries it cannot read are skipped."""
    if not isinstance(body, list):
        raise ValueError("Alertmanager /api/v2/alerts did not return a list")
    out = []
    for i, raw in enumerate(body):
        where = f"/api/v2/alerts[{i}]"
        try:
            if not isinstance(raw, dict) or (raw.get("status") or {}).get("state") != "active":
                continue
            labels = labels_field(raw.get("labels"), f"{where}.labels")
            starts = start_field(raw.get("startsAt"), f"{where}.startsAt")
            fingerprint = text_field(raw.get("fingerprint"), f"{where}.fingerprint")
            out.append(Alert(fingerprint, "firing", labels, starts, None))
        except (AttributeError, PayloadError) as exc:
            log.warning("skipping an alert Alertmanager listed that cannot be read: %s", exc)
    return out
