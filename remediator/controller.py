"""The reconcile loop: alerts firing now + each engine's observed state -> converge, safely.

Level-triggered, like a Kubernetes controller. Webhooks only update the set of firing alerts (the
AlertBook) and wake the loop; every pass then reads each allowlisted engine's state through the
actuator, asks the policy for its desired state, and takes the steps between the two, each one
through the safety limits and into the audit log. Nothing depends on which webhook arrived when,
so retries, duplicates, restarts and a second replica all converge to the same place.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from oomguard.remediator.actuator import Actuator, ActuatorError, DryRunActuator, Target
from oomguard.remediator.alertbook import AlertBook
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import RemediatorConfig, SecretFile, TargetConfig
from oomguard.remediator.flags import Flags
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.policy import (
    Desired,
    Observed,
    PolicyConfig,
    actions_for,
    decide,
)
from oomguard.remediator.restart import FlagView, RestartBackend, RestartResult, RestartSequence
from oomguard.remediator.safety import EngineView, Safety
from oomguard.remediator.webhook import Alert, PayloadError, Webhook, labels_field, time_field

log = logging.getLogger("oomguard.remediator")

DISRUPTIVE = frozenset({"drain", "lower_cap", "restart"})  # cooldown, rate limit, budget
FALLBACK_LIMITS = frozenset({"disruption_budget", "last_ready"})  # drain refused: cap instead
SEEN_LIMIT = 20_000  # dedup keys remembered (FIFO): retries and HA copies come within minutes

Step = tuple[str, int | None]  # (drain | resume | lower_cap | raise_cap | readmit, cap)


def plan(observed: Observed, desired: Desired) -> list[Step]:
    """The writes that take an engine from `observed` to `desired`, in a safe order."""
    if desired.draining:
        return [] if observed.draining else [("drain", None)]
    steps: list[Step] = []
    if desired.cap != observed.admission_cap:
        if observed.draining:
            kind = "readmit"  # the first stage's cap, set while still drained: costs nothing
        else:
            kind = "lower_cap" if desired.cap < observed.admission_cap else "raise_cap"
        steps.append((kind, desired.cap))
    if observed.draining:
        steps.append(("resume", None))  # after the cap: never resume at the old, higher cap
    return steps


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


@dataclass
class Receipt:
    alerts: int
    new: int
    duplicates: int
    ignored: dict[str, str]  # fingerprint -> why
    changed: bool


@dataclass(frozen=True)
class Firing:
    """What one target's firing alerts amount to in a pass."""

    actions: set[str]  # the action classes they ask for
    fingerprints: list[str]
    names: dict[str, int]  # alert name -> how many
    restart_episode: str | None = None  # the newest episode of an alert asking for a restart


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
        clock: Callable[[], float] = time.monotonic,
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
        self.book = AlertBook(listener=self._indexed)
        self.status = {t.name: TargetStatus(t.name, t.url, t.model) for t in config.targets}
        self.wake: Callable[[], None] = lambda: None  # the runner points this at its scheduler
        self._book_lock = threading.Lock()
        self._pass_lock = threading.Lock()
        self._dirty = False
        self._seen: OrderedDict[tuple[str, datetime, str], None] = OrderedDict()
        self._routes: dict[str, str] = {}  # fingerprint -> target (an alert's labels are fixed)
        # per target: its firing alerts, and how many ask for each action class / carry each name
        self._index: dict[str, dict[str, Alert]] = {n: {} for n in self.targets}
        self._actions: dict[str, Counter[str]] = {n: Counter() for n in self.targets}
        self._names: dict[str, Counter[str]] = {n: Counter() for n in self.targets}
        self._pruned = time.monotonic()
        self._noted: dict[tuple[str, str], Any] = {}  # (target, topic) -> last audited value
        self._pool = ThreadPoolExecutor(max_workers=min(16, len(self.targets)))
        self.backends: dict[str, RestartBackend] = dict(backends or {})
        self._restarting: dict[str, threading.Thread] = {}
        self._restarted: dict[str, str] = {}  # target -> restart episode already handled
        self._flag_views: dict[str, tuple[float, FlagView]] = {}
        for entry in audit.entries():  # what was restarted survives a remediator restart
            if entry.get("event") == "acted" and entry.get("action") == "restart":
                episode = (entry.get("after") or {}).get("episode")
                if episode:
                    self._restarted[entry["target"]] = episode
        self.metrics.paused.set(1 if config.safety.paused else 0)

    def _restart_episode(self, name: str) -> str | None:
        """Under the book lock: the newest (fingerprint@startsAt) asking this target to restart."""
        if self._actions[name]["restart"] <= 0:
            return None
        asking = [
            a
            for a in self._index[name].values()
            if "restart" in actions_for([a], self.config.policy)
        ]
        newest = max(asking, key=lambda a: a.starts_at, default=None)
        return f"{newest.fingerprint}@{newest.starts_at.isoformat()}" if newest else None

    # -- input ---------------------------------------------------------------------------------
    def _indexed(self, alert: Alert, firing: bool) -> None:
        """The book's listener (called under the book lock): keep the per-target index."""
        name = self._routes.get(alert.fingerprint)
        if name is None:
            return
        sign = 1 if firing else -1
        if firing:
            self._index[name][alert.fingerprint] = alert
        else:
            self._index[name].pop(alert.fingerprint, None)
        for action in actions_for([alert], self.config.policy):
            self._actions[name][action] += sign
        self._names[name][alert.name] += sign

    def receive(self, webhook: Webhook, source: str = "webhook") -> Receipt:
        """Record a payload durably, then apply it. Raises OSError when the audit log cannot be
        written: the caller answers 5xx and Alertmanager retries; nothing was applied."""
        with self._book_lock:
            new = [a for a in webhook.alerts if a.dedup_key not in self._seen]
            routes = {a.fingerprint: route(a, self.targets.values()) for a in new}
            ignored = {fp: why for fp, (_, why) in routes.items() if why}
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
            routable = []
            for a in new:  # selectors are evaluated once per alert, not once per pass
                name = routes[a.fingerprint][0]
                if name is not None:
                    self._routes[a.fingerprint] = name
                    routable.append(a)
            changed = self.book.apply_all(routable)
            for a in new:
                self._seen[a.dedup_key] = None
            while len(self._seen) > SEEN_LIMIT:
                self._seen.popitem(last=False)
        for fp, why in ignored.items():
            log.warning("ignoring alert %s: %s", fp, why)
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
        routed = [(a, route(a, self.targets.values())[0]) for a in _am_alerts(r.json())]
        active = [a for a, name in routed if name is not None]
        with self._book_lock:
            for a, name in routed:  # routes first: the book's listener indexes by them
                if name is not None:
                    self._routes[a.fingerprint] = name
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
        self.safety.config.paused = paused
        self.metrics.paused.set(1 if paused else 0)
        self.audit.record("paused" if paused else "unpaused", reason=reason)
        log.warning("remediator %s: %s", "paused" if paused else "unpaused", reason)
        self.request()

    @property
    def paused(self) -> bool:
        return self.safety.config.paused

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
                self._pass()
                if not self._dirty:
                    break
        finally:
            self._pass_lock.release()

    def target(self, name: str) -> Target:
        return make_target(self.targets[name], self._tokens.get(name))

    def _read(self, name: str) -> dict[str, Any] | ActuatorError:
        try:
            return self.actuator.state(self.target(name))
        except ActuatorError as exc:
            return exc

    def _pass(self) -> None:
        with self._book_lock:
            firing = {
                name: Firing(
                    {a for a, n in self._actions[name].items() if n > 0},
                    list(self._index[name]),
                    {k: n for k, n in self._names[name].items() if n > 0},
                    self._restart_episode(name),
                )
                for name in self.targets
            }
            if time.monotonic() - self._pruned > 60:
                self.book.prune(datetime.now(UTC))
                self._pruned = time.monotonic()
            if len(self._routes) > 2 * len(self.book) + 1000:  # forget resolved alerts' routes
                self._routes = {fp: n for n, idx in self._index.items() for fp in idx}
        names = list(self.targets)
        states = dict(zip(names, self._pool.map(self._read, names), strict=True))
        fleet = {
            name: EngineView(
                self.targets[name].model,
                draining=(isinstance(s, dict) and s.get("mode") == "draining")
                or name in self._restarting,
                reachable=isinstance(s, dict),
            )
            for name, s in states.items()
        }
        for name in names:
            if name in self._restarting:
                self.status[name].mode = "restarting"
                self.metrics.set_mode(name, "restarting")
                continue  # the restart sequence owns the engine until it is back
            try:
                self._converge(name, firing[name], states[name], fleet)
            except Exception as exc:  # one target's surprise never stops the others
                log.exception("reconciling %s failed", name)
                self._hold(name, "internal", f"{type(exc).__name__}: {exc}", firing[name])

    def _note(self, target: str, topic: str, value: Any) -> bool:
        """True when `value` differs from the last one noted (audit changes, not every pass)."""
        key = (target, topic)
        if self._noted.get(key) == value:
            return False
        self._noted[key] = value
        return True

    def _hold(self, name: str, reason: str, message: str, firing: Firing) -> None:
        st = self.status[name]
        st.mode, st.reason, st.error = "held", f"{reason}: {message}", message
        st.updated = time.time()
        self.metrics.reconcile_errors.labels(name).inc()
        self.metrics.set_mode(name, "held")
        if self._note(name, "held", reason):
            self.audit.record(
                "held",
                target=name,
                result=reason,
                reason=f"no action while the engine cannot be read: {message}",
                fingerprints=firing.fingerprints,
            )
            log.warning("holding %s: %s", name, message)

    def _converge(
        self,
        name: str,
        firing: Firing,
        state: dict[str, Any] | ActuatorError,
        fleet: dict[str, EngineView],
    ) -> None:
        if isinstance(state, ActuatorError):
            self._hold(name, state.reason, str(state), firing)
            return
        try:
            observed = Observed.from_state(state)
        except (KeyError, TypeError, ValueError, AssertionError) as exc:
            self._hold(name, "bad_state", f"unexpected state from the plugin: {exc!r}", firing)
            return
        self._note(name, "held", None)
        policy = self.config.policy
        wanted = set(firing.actions)
        if name in self.backends and self._maybe_restart(name, firing, observed, fleet):
            return
        wanted.discard("restart")
        if "restart" in firing.actions:
            wanted.add("lower_cap")  # no restart (none configured, done, or withheld): cap
        desired = decide(wanted, observed, policy)
        steps = plan(observed, desired)
        if steps and steps[0][0] == "drain":
            limit = self._limit(name, "drain", fleet)
            if limit in FALLBACK_LIMITS:
                # draining would take the model's last capacity: hold it at a lower cap instead
                self._withheld(name, "drain", limit, firing)
                desired = decide((wanted - {"drain"}) | {"lower_cap"}, observed, policy)
                desired = Desired(False, desired.cap, "capped", f"{limit}: capping, not draining")
                steps = plan(observed, desired)
        fps = firing.fingerprints
        decision = (desired.phase, desired.cap, desired.draining, desired.reason)
        prev = self._noted.get((name, "decision"))
        if self._note(name, "decision", decision) and (
            steps or desired.phase != "serving" or (prev is not None and prev[0] != "serving")
        ):  # a change worth explaining; not "full admission" for every target at start
            self.audit.record(
                "decided",
                target=name,
                before=_brief(observed),
                after={"cap": desired.cap, "draining": desired.draining, "phase": desired.phase},
                reason=desired.reason,
                fingerprints=fps,
            )
        last = state
        for kind, cap in steps:
            limit = self._limit(name, kind, fleet)
            if limit is not None:
                self._withheld(name, kind, limit, firing)
                break
            self._note(name, "withheld", None)
            result = self._act(name, kind, cap, observed, desired, fps)
            if result is None:
                break
            last = result
            if kind == "drain":
                fleet[name] = EngineView(fleet[name].model, draining=True, reachable=True)
            elif kind == "resume":
                fleet[name] = EngineView(fleet[name].model, draining=False, reachable=True)
        self._publish(name, last, desired, firing)

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

    def _maybe_restart(
        self, name: str, firing: Firing, observed: Observed, fleet: dict[str, EngineView]
    ) -> bool:
        """Start a restart when an alert asks for one (once per episode), or walk the flags back
        after a quiet period. True when a restart sequence was started."""
        limits = self.config.flags
        episode = firing.restart_episode
        if episode is not None and episode != self._restarted.get(name):
            view = self._flags(name)
            if view is None:
                return False
            flags, reason = view.current.lower(limits), "restart with lower memory flags"
        elif (
            not firing.actions
            and not observed.draining
            and observed.admission_cap >= observed.startup_max_num_seqs
        ):
            view = self._flags(name)
            if (
                view is None
                or view.current == view.original
                or time.time() - view.changed_at < limits.walk_back_after_seconds
            ):
                return False
            flags, reason = view.current.toward(view.original, limits), "walk flags back"
            episode = f"walk-back@{view.changed_at}"
        else:
            return False
        if flags == view.current and episode.startswith("walk-back"):
            return False
        limit = self._limit(name, "restart", fleet)
        if limit is not None:
            self._withheld(name, "restart", limit, firing)
            return False
        self._start_restart(name, flags, episode, reason, firing.fingerprints, view)
        fleet[name] = EngineView(fleet[name].model, draining=True, reachable=True)
        return True

    def _start_restart(
        self,
        name: str,
        flags: Flags,
        episode: str,
        reason: str,
        fps: list[str],
        view: FlagView,
    ) -> None:
        self._restarted[name] = episode
        self.safety.record(name, "restart")
        self.metrics.actions.labels(name, "restart", "started").inc()
        self.status[name].last_action = self.audit.record(
            "acted",
            target=name,
            action="restart",
            before={
                "gpu_memory_utilization": view.current.gpu_memory_utilization,
                "max_num_seqs": view.current.max_num_seqs,
            },
            after={
                "gpu_memory_utilization": flags.gpu_memory_utilization,
                "max_num_seqs": flags.max_num_seqs,
                "episode": episode,
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

        def run() -> None:
            try:
                result = sequence.run(self.target(name), flags, reason, fps)
            except Exception as exc:  # never let a sequence thread die silently
                log.exception("restart of %s failed", name)
                result = RestartResult(False, "internal", str(exc))
            self.metrics.actions.labels(name, "restart", "ok" if result.ok else "failed").inc()
            if not result.ok and result.step in ("drain", "wait_idle", "restart"):
                self._restarted.pop(name, None)  # not restarted: may be tried again, in limits
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

    def _limit(self, name: str, kind: str, fleet: Mapping[str, EngineView]) -> str | None:
        if kind in DISRUPTIVE:
            return self.safety.check(name, kind, fleet)
        return "pause" if self.paused else None  # restoring capacity is paced by the policy

    def _withheld(self, name: str, kind: str, limit: str, firing: Firing) -> None:
        if self._note(name, "withheld", (kind, limit)):
            self.metrics.safety_limited.labels(name, limit).inc()
            self.audit.record(
                "withheld",
                target=name,
                action=kind,
                result=limit,
                reason=f"{kind} withheld by the {limit} limit",
                fingerprints=firing.fingerprints,
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

    def _publish(self, name: str, state: dict[str, Any], desired: Desired, firing: Firing) -> None:
        st = self.status[name]
        # the mode the engine is in now (an action may have been withheld, failed or dry run)
        cap, startup = state.get("admission_cap"), state.get("startup_max_num_seqs")
        if state.get("mode") == "draining":
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
        st.alerts = firing.names
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
            if raw.get("status", {}).get("state") != "active":
                continue
            labels = labels_field(raw.get("labels"), f"{where}.labels")
            starts = time_field(raw.get("startsAt"), f"{where}.startsAt")
            if starts is None:
                raise PayloadError(f"{where}.startsAt is not set")
            out.append(Alert(str(raw["fingerprint"]), "firing", labels, starts, None))
        except (AttributeError, KeyError, PayloadError) as exc:
            log.warning("skipping an alert Alertmanager listed that cannot be read: %s", exc)
    return out
