"""The reconcile loop: alerts firing now + each engine's observed state -> converge, safely.

Level-triggered, like a Kubernetes controller. Webhooks only update the set of firing alerts
and wake the loop; every pass then reads the engines that need attention, decides the fleet and
takes the steps between what is and what should be, each one through the safety limits and into
the audit log. Nothing depends on which webhook arrived when, so retries, duplicates, restarts
and a second replica all converge to the same place.

This module composes the parts, one job each:

- intake.py: payloads and Alertmanager's API -> the alert book, routed to allowlisted targets;
- convergence.py: one reconcile pass (read, decision.decide_fleet, act, publish);
- restarting.py: restart sequences in their threads, backends' flags, answered episodes;
- fleet.py: the allowlist and tokens they share; safety.py: the limits and their durable state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from typing import Any

from oomguard.remediator.actuator import Actuator, DryRunActuator, Target
from oomguard.remediator.alertbook import AlertBook
from oomguard.remediator.attention import Attention
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import RemediatorConfig
from oomguard.remediator.convergence import Convergence, TargetStatus, observe
from oomguard.remediator.decision import plan
from oomguard.remediator.fleet import Fleet, make_target
from oomguard.remediator.intake import Intake, Receipt, route, select
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.restart import RestartBackend
from oomguard.remediator.restarting import Restarts, restarted_from
from oomguard.remediator.safety import Safety
from oomguard.remediator.targets import TargetConfig
from oomguard.remediator.webhook import Alert, Webhook

log = logging.getLogger("oomguard.remediator")

INTENT_RETRY_SECONDS = 30.0  # uncommitted intents whose engine could not be read: next try
# what a restart needs from the audit log (the rest, mostly `received`, is not held in memory)
RESTORED_EVENTS = frozenset({"paused", "unpaused", "intent", "acted", "failed", "reconciled"})

__all__ = [
    "Controller",
    "Receipt",
    "TargetStatus",
    "make_target",
    "observe",
    "plan",
    "restarted_from",
    "route",
    "select",
]


class Controller:
    def __init__(
        self,
        config: RemediatorConfig,
        actuator: Actuator,
        audit: AuditLog,
        metrics: RemediatorMetrics | None = None,
        clock: Callable[[], float] | None = None,
        backends: Mapping[str, RestartBackend] | None = None,
    ) -> None:
        """`clock`: one clock for durations and wall time alike (tests); by default durations
        run on the monotonic clock and only audited stamps on wall time."""
        self.config = config
        self.dry_run = config.dry_run or isinstance(actuator, DryRunActuator)
        self.actuator = actuator
        self.audit = audit
        # a rotation carries the safety window's actions into the new file (auditrotate.py)
        audit.carry_seconds = max(audit.carry_seconds, config.safety.window_seconds)
        self.metrics = metrics or RemediatorMetrics()
        self.metrics.watch_audit(audit)
        self.safety = (
            Safety(config.safety) if clock is None else Safety(config.safety, clock, clock)
        )
        self.fleet = Fleet(config.targets)
        self.wake: Callable[[], None] = lambda: None  # the runner points this at its scheduler
        self.wake_focus: Callable[[], None] = lambda: None  # and this at its focus lane
        self.resync_soon: Callable[[], None] = lambda: None  # and this at the resync job
        self.intake = Intake(
            self.fleet,
            audit,
            config.alertmanager,
            on_change=self.request,
            on_truncated=lambda: self.resync_soon(),
        )
        self.restarts = Restarts(
            config, self.fleet, actuator, audit, self.metrics, backends, on_done=self.request
        )
        self.convergence = Convergence(
            config,
            self.fleet,
            actuator,
            audit,
            self.metrics,
            self.safety,
            self.intake,
            self.restarts,
            self.dry_run,
        )
        # Two lanes: full passes (reconcile, one at a time) and focused passes (focus_pass: what
        # a webhook just changed). Reads hold no lock; deciding and acting hold `_decide`, so a
        # focused pass never waits for a full pass's reads, only for its decisions.
        self._pass_lock = threading.Lock()
        self._focus_lock = threading.Lock()
        self._decide = threading.Lock()
        self._dirty = False
        self.failed_passes = 0  # consecutive passes that raised (/healthz degrades on these)
        self.restore_error: str | None = None  # the audit log could not be read (no action)
        self._pass_started: float | None = None  # (monotonic) of the pass in progress
        # a pass is stuck past this (None: the bound below, from the fleet's size)
        self.stuck_after: float | None = None
        self._uncommitted: list[dict[str, Any]] = []  # intents to reconcile with the engines
        self._intents_due = 0.0  # (monotonic) when to try the ones left again
        # what survives a remediator restart: the pause switch, each target's recent actions
        # (cooldowns, rate limits), the episodes already answered by a restart, and intents a
        # killed predecessor never committed
        self._restore()

    # -- the parts' state, as callers and tests read it ------------------------------------------
    @property
    def targets(self) -> dict[str, TargetConfig]:
        return self.fleet.targets

    @property
    def book(self) -> AlertBook:
        return self.intake.book

    @property
    def status(self) -> dict[str, TargetStatus]:
        return self.convergence.status

    @property
    def attention(self) -> Attention:
        return self.convergence.attention

    @property
    def backends(self) -> dict[str, RestartBackend]:
        return self.restarts.backends

    @property
    def _restarting(self) -> dict[str, threading.Thread]:
        return self.restarts.running

    @property
    def paused(self) -> bool:
        return self.safety.paused

    def target(self, name: str) -> Target:
        return self.fleet.target(name)

    # -- input -----------------------------------------------------------------------------------
    def receive(self, webhook: Webhook, source: str = "webhook") -> Receipt:
        receipt = self.intake.receive(webhook, source)
        if receipt.changed:  # the pass it wakes reads and decides these first (attention.py)
            self.attention.focus(receipt.targets)
            self.wake_focus()
        return receipt

    def resync(self) -> bool:
        return self.intake.resync()

    def firing_by_target(self) -> dict[str, list[Alert]]:
        return self.intake.firing_by_target()

    def set_paused(self, paused: bool, reason: str) -> None:
        # audited first: the audit log is where a restarted remediator finds the switch again
        self.audit.record("paused" if paused else "unpaused", reason=reason)
        self.safety.paused = paused
        self.metrics.paused.set(1 if paused else 0)
        log.warning("remediator %s: %s", "paused" if paused else "unpaused", reason)
        self.request()

    # -- the loop --------------------------------------------------------------------------------
    def request(self) -> None:
        """Ask for a pass as soon as possible (a pass in progress runs once more)."""
        self._dirty = True
        self.wake()

    def reconcile(self) -> None:
        if not self._pass_lock.acquire(blocking=False):
            self._dirty = True
            return
        self._pass_started = time.monotonic()
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
            self._pass_started = None
            self._pass_lock.release()

    def _pass(self) -> None:
        conv = self.convergence
        if self.restore_error is not None and not self.restore():
            raise RuntimeError(self.restore_error)  # a failed pass: counted, /healthz degrades
        if self._uncommitted and time.monotonic() >= self._intents_due:
            self._uncommitted = conv.reconcile_intents(self._uncommitted)
            # an engine that cannot be read now is asked again later, not every pass (each
            # read of an unreachable engine costs a timeout)
            self._intents_due = time.monotonic() + INTENT_RETRY_SECONDS
        with self._decide:
            plan = conv.begin()
        if plan is None:
            return
        read = conv.read(plan)  # no lock: a focused pass may decide and act meanwhile
        with self._decide:
            if conv.finish(plan, read):
                self._dirty = True

    def focus_pass(self) -> None:
        """Read, decide and act on the engines a webhook just changed (attention.focus), at
        once, beside a full pass in progress: a new alert is not kept waiting for a hundred
        other reads or a slow engine. The same decision and safety limits as a full pass; an
        engine another pass read meanwhile is decided on the newest state (attention.read)."""
        conv = self.convergence
        with self._focus_lock:
            try:
                with self._decide:
                    plan = conv.begin(focused=True)
                if plan is None:
                    return
                read = conv.read(plan)
                with self._decide:
                    again = conv.finish(plan, read)
            except Exception:  # counted and visible like a full pass's; the next one retries
                self.metrics.pass_failures.inc()
                log.exception("focused pass failed")
                return
        if again:
            self.request()

    def restore(self) -> bool:
        """Rebuild the safety state from the audit log (on taking over as the leader: the
        previous leader's cooldowns, budgets and answered restart episodes hold here too).
        False when the log cannot be read: then nothing is acted on until it can."""
        with self._decide:  # a pass from an earlier term may still be deciding
            ok = self._restore()
            self.attention.unfocus()  # a new leader's first pass looks at every engine due
        return ok

    def _restore(self) -> bool:
        try:
            entries = self.audit.entries(RESTORED_EVENTS)
        except OSError as exc:  # unreadable as a whole (permissions, I/O): content never raises
            self.restore_error = f"cannot read the audit log {self.audit.path}: {exc}"
            log.error("%s; acting on nothing until it can be read", self.restore_error)
            return False
        safety = Safety(self.config.safety, self.safety.clock, self.safety.wall)
        safety.restore(entries)
        self.safety = self.convergence.safety = safety
        self.restarts.restore(entries)
        self._uncommitted = safety.uncommitted
        self._intents_due = 0.0
        if safety.unreadable:
            self.audit.last_replay.skipped["bad_fields"] += safety.unreadable
        self.restore_error = None
        self.metrics.paused.set(1 if self.paused else 0)
        self.metrics.audit_replayed(self.audit.last_replay.skipped)
        if self._uncommitted:
            log.warning(
                "%d actions were recorded as intents but never committed (the remediator "
                "stopped in between): counted against the safety limits, reconciling with the "
                "engines",
                len(self._uncommitted),
            )
        return True

    def set_targets(self, targets: Iterable[TargetConfig]) -> None:
        """Replace the allowlist (discovered targets come and go): between passes, with the
        alert routes recomputed. An alert that came before its pod was discovered selected
        nothing then; the resync from Alertmanager finds it."""
        with self._decide, self.intake.lock:  # a pass reading now skips targets removed
            old = self.fleet.replace(targets)
            self.convergence.retarget(old)
            self.intake.reroute()
        if old.keys() != self.fleet.targets.keys():
            self.resync_soon()

    # -- views -----------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What makes this remediator degraded now (its /healthz says so), besides passes."""
        out = []
        if not self.audit.writable:
            out.append(f"audit log not writable ({self.audit.last_error}): no action is taken")
        if self.restore_error is not None:
            out.append(self.restore_error)
        started = self._pass_started
        if started is not None and time.monotonic() - started > self._stuck_after():
            # every call of a pass has a timeout: one this long is hung (a lock, a call
            # nobody bounded), and no engine is protected while it is
            out.append(f"a reconcile pass has run for {time.monotonic() - started:.0f} s (stuck)")
        return out

    def _stuck_after(self) -> float:
        """How long a pass may run: it reads every engine at once and takes a step or two per
        target, each call within the actuation timeout and attempts; far more is a hang."""
        if self.stuck_after is not None:
            return self.stuck_after
        c = self.config
        per_call = c.actuation_timeout_seconds * c.actuation_attempts
        return max(300.0, per_call * (2 * len(self.fleet.targets) + 10))

    def view(self) -> dict[str, Any]:
        replay = self.audit.last_replay
        return {
            "paused": self.paused,
            "dry_run": self.dry_run,
            "audit": {
                "writable": self.audit.writable,
                "error": self.audit.last_error,
                "skipped_lines": dict(replay.skipped),
                "uncommitted_intents": len(self._uncommitted),
            },
            "firing_alerts": self.intake.firing_count(),
            "targets": {name: asdict(st) for name, st in self.status.items()},
        }

    def close(self) -> None:
        self.convergence.close()
