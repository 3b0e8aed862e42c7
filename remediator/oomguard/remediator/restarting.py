"""Restarts: which engines a restart sequence owns now, the flags their backends report, and the
alert episodes a restart already answered.

A restart runs in its own thread (restart.RestartSequence: drain, wait until nothing runs or
waits, restart with the new flags through the target's backend, wait until ready, staged
re-admission) so a model reload of minutes never stalls the reconcile loop; while it runs the
decision holds the engine (`restarting`). Each restart answers its alert episodes once: they are
remembered here (the restart's intent names them in the audit log before anything touches the
engine) and rebuilt from the audit log after a remediator restart, and given back when the
sequence fails before the engine was restarted (it may be tried again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from oomguard.remediator import crashpoints
from oomguard.remediator.actuator import Actuator, ActuatorError
from oomguard.remediator.audit import AuditLog, new_intent
from oomguard.remediator.config import RemediatorConfig
from oomguard.remediator.decision import Step
from oomguard.remediator.fleet import Fleet
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.restart import FlagView, RestartBackend, RestartResult, RestartSequence
from oomguard.remediator.safety import Safety

log = logging.getLogger("oomguard.remediator")

RESTARTED_LIMIT = 64  # restart episodes remembered per target
FLAGS_FRESH_SECONDS = 30.0  # a backend's flags are read at most this often per target


class Answered:
    """Per target, the alert episodes a restart already answered, oldest first, at most
    `limit` each. Insertion-ordered, so the oldest is forgotten first and never the episode
    just added (a set's pop() could drop that one: the same alert restarted an engine twice)."""

    def __init__(self, limit: int = RESTARTED_LIMIT) -> None:
        self.limit = limit
        self._by_target: dict[str, dict[str, None]] = {}

    def add(self, target: str, episodes: Iterable[str]) -> None:
        done = self._by_target.setdefault(target, {})
        for e in episodes:
            done.pop(e, None)  # seen again: now the newest
            done[e] = None
        while len(done) > self.limit:
            del done[next(iter(done))]

    def give_back(self, target: str, episodes: Iterable[str]) -> None:
        done = self._by_target.get(target, {})
        for e in episodes:
            done.pop(e, None)

    def of(self, target: str) -> frozenset[str]:
        return frozenset(self._by_target.get(target, ()))

    def as_dict(self) -> dict[str, set[str]]:
        return {t: set(eps) for t, eps in self._by_target.items()}


def _episodes(entry: Mapping[str, Any]) -> list[str]:
    after = entry.get("after")
    if not isinstance(after, dict):
        return []
    eps = after.get("episodes")
    if not isinstance(eps, list):
        eps = [after.get("episode")]
    return [e for e in eps if isinstance(e, str)]


def answered_from(entries: Iterable[Mapping[str, Any]]) -> Answered:
    """The alert episodes a restart already answered, per target, from the audit log: a
    restart's intent names them before anything touches the engine, so a remediator killed
    mid-restart never answers the same episode twice."""
    out = Answered()
    for entry in entries:
        try:
            if entry.get("event") in ("intent", "acted") and entry.get("action") == "restart":
                target = entry.get("target")
                if isinstance(target, str) and target:
                    out.add(target, _episodes(entry))
        except Exception:  # a shape nothing writes: skipped (the audit log is untrusted input)
            continue
    return out


def restarted_from(entries: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
    """Per target, the alert episodes a restart already answered (from the audit log)."""
    return answered_from(entries).as_dict()


class Restarts:
    """`on_done` asks for a reconcile pass when a sequence ends."""

    def __init__(
        self,
        config: RemediatorConfig,
        fleet: Fleet,
        actuator: Actuator,
        audit: AuditLog,
        metrics: RemediatorMetrics,
        backends: Mapping[str, RestartBackend] | None,
        on_done: Callable[[], None],
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.actuator = actuator
        self.audit = audit
        self.metrics = metrics
        self.backends: dict[str, RestartBackend] = dict(backends or {})
        self.on_done = on_done
        self.running: dict[str, threading.Thread] = {}  # target -> its restart sequence
        self._flag_views: dict[str, tuple[float, FlagView]] = {}
        self._answered = Answered()

    def restore(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """The episodes already answered, from the audit log (at start, on taking the lead)."""
        self._answered = answered_from(entries)

    def answered(self, name: str) -> frozenset[str]:
        return self._answered.of(name)

    def flags(self, name: str) -> FlagView | None:
        """The backend's flags for `name` (cached briefly), or None when they cannot be read."""
        cached = self._flag_views.get(name)
        if cached and time.monotonic() - cached[0] < FLAGS_FRESH_SECONDS:
            return cached[1]
        try:
            view = self.backends[name].flags()
        except (ActuatorError, KeyError, TypeError, ValueError) as exc:
            log.warning("cannot read the flags of %s: %s", name, exc)
            return None
        self._flag_views[name] = (time.monotonic(), view)
        return view

    def start(self, name: str, step: Step, fps: list[str], safety: Safety) -> dict[str, Any] | None:
        """Record the restart's intent (its episodes and flags), count it against the safety
        limits, start its sequence in a thread and commit; returns the committed entry, or
        None when the intent could not be recorded (nothing was started)."""
        assert step.flags is not None and step.episode is not None
        flags, reason = step.flags, step.reason
        view = self._flag_views.get(name)
        covers = set(step.covers or (step.episode,))
        before = (
            {
                "gpu_memory_utilization": view[1].current.gpu_memory_utilization,
                "max_num_seqs": view[1].current.max_num_seqs,
            }
            if view
            else None
        )
        after = {
            "gpu_memory_utilization": flags.gpu_memory_utilization,
            "max_num_seqs": flags.max_num_seqs,
            "episode": step.episode,
            "episodes": sorted(covers),
            "admission": "staged" if step.staged else "full",
        }
        key = new_intent()
        crashpoints.reach("before_intent")
        try:
            self.audit.record(
                "intent",
                target=name,
                action="restart",
                before=before,
                after=after,
                result="pending",
                reason=reason,
                fingerprints=fps,
                intent=key,
            )
        except OSError as exc:
            self.metrics.actions.labels(name, "restart", "unrecorded").inc()
            log.error("restart of %s not started: its intent cannot be recorded: %s", name, exc)
            return None
        crashpoints.reach("after_intent")
        self._answered.add(name, sorted(covers))
        safety.record(name, "restart", key=key)
        self.metrics.actions.labels(name, "restart", "started").inc()
        cfg = self.fleet.targets[name].restart
        assert cfg is not None
        sequence = RestartSequence(
            self.actuator,
            self.backends[name],
            self.audit,
            drain_timeout=cfg.drain_timeout_seconds,
            ready_timeout=cfg.ready_timeout_seconds,
            readmit_start=self.config.policy.readmit_start if step.staged else None,
        )
        target = self.fleet.target(name)

        def run() -> None:
            try:
                result = sequence.run(target, flags, reason, fps)
            except Exception as exc:  # never let a sequence thread die silently
                log.exception("restart of %s failed", name)
                result = RestartResult(False, "internal", str(exc))
            self.metrics.actions.labels(name, "restart", "ok" if result.ok else "failed").inc()
            if not result.ok and result.step in ("drain", "wait_idle", "restart"):
                self._answered.give_back(name, covers)  # may be tried again
            self._flag_views.pop(name, None)
            log.log(
                logging.INFO if result.ok else logging.ERROR,
                "restart of %s: %s (%s)",
                name,
                result.message,
                result.step,
            )
            self.running.pop(name, None)
            self.on_done()

        thread = threading.Thread(target=run, name=f"restart-{name}", daemon=True)
        self.running[name] = thread
        self.metrics.set_mode(name, "restarting")
        log.warning("restarting %s: %s", name, reason)
        thread.start()
        crashpoints.reach("after_engine")
        # the commit: the sequence runs (each of its steps is audited as it goes)
        entry = self.audit.try_record(
            "acted",
            target=name,
            action="restart",
            before=before,
            after=after,
            result="started",
            reason=reason,
            fingerprints=fps,
            intent=key,
        )
        crashpoints.reach("after_commit")
        if entry is None:  # not committed: the intent counts, and says what was started
            log.error("restart of %s started, but its commit cannot be recorded", name)
            entry = {"time": time.time(), "event": "acted", "action": "restart", "intent": key}
        return entry
