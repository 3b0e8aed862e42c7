"""Running the remediator: the scheduler's jobs around the controller, and the HTTP API.

Jobs (apscheduler, one background thread pool):
- `reconcile` every `reconcile_seconds`, and at once when a webhook changes the firing set;
- `resync` from Alertmanager's API every `alertmanager.resync_seconds` (and at start).

Supervised threads (supervised.py: one that dies is restarted with backoff, counted in
oomguard_remediator_thread_restarts_total{thread} and reported by /healthz): leader election,
each namespace's pod discovery watch, and the watch of the exporters' pressure levels in
standalone mode.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

import httpx
from apscheduler.schedulers.background import BackgroundScheduler

from oomguard import supervised
from oomguard.errors import ConfigError
from oomguard.remediator import httpserve
from oomguard.remediator.actuator import Actuator, ActuatorError, DryRunActuator, PluginActuator
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import RemediatorConfig, SecretFile
from oomguard.remediator.controller import (
    Controller,
    make_target,
    observe,
    restarted_from,
    select,
)
from oomguard.remediator.decision import Context, EngineInput, decide_fleet, needs_flags
from oomguard.remediator.discovery import PodDiscovery
from oomguard.remediator.leader import LeaseElector
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.restart import FlagView, RestartBackend, SupervisorBackend
from oomguard.remediator.router import with_routers
from oomguard.remediator.safety import Safety
from oomguard.remediator.server import create_app
from oomguard.remediator.standalone import PressureWatcher
from oomguard.remediator.webhook import Webhook
from oomguard.supervised import Supervised

log = logging.getLogger("oomguard.remediator")
GC_THRESHOLD = 10_000  # allocations between young-generation collections (serve())


def build_controller(config: RemediatorConfig, actuator: Actuator | None = None) -> Controller:
    actuator = actuator or PluginActuator(
        timeout=config.actuation_timeout_seconds, attempts=config.actuation_attempts
    )
    # targets behind a router leave its rotation before a drain (opt-in: `router:` per target)
    actuator = with_routers(actuator, config.routers, config.targets)
    if config.dry_run and not isinstance(actuator, DryRunActuator):
        actuator = DryRunActuator(actuator)
    backends = {} if config.dry_run else restart_backends(config)
    return Controller(
        config,
        actuator,
        AuditLog(config.audit_log, config.audit_max_bytes, config.audit_backups),
        RemediatorMetrics(),
        backends=backends,
    )


def restart_backends(
    config: RemediatorConfig, client: httpx.Client | None = None
) -> dict[str, RestartBackend]:
    """The restart backend of every target that has one configured. The supervisor backends
    share one HTTP client (`client`, or one made here): building one costs ~20 ms of CPU (its
    SSL context), once per target at start and in `oomguard explain` otherwise."""
    out: dict[str, RestartBackend] = {}
    shared: httpx.Client | None = client
    for t in config.targets:
        if t.restart is None:
            continue
        if t.restart.supervisor is not None:
            ref = t.restart.supervisor
            secret = SecretFile(ref.token_file) if ref.token_file else None
            shared = shared or httpx.Client()
            out[t.name] = SupervisorBackend(
                ref.url, secret.get if secret else lambda: None, client=shared
            )
        elif t.restart.kubernetes is not None:
            from oomguard.remediator.kubernetes import KubernetesBackend

            out[t.name] = KubernetesBackend.from_environment(t.restart.kubernetes)
    return out


class Remediator:
    def __init__(self, config: RemediatorConfig, actuator: Actuator | None = None) -> None:
        self.config = config
        self.controller = build_controller(config, actuator)
        metrics = self.controller.metrics
        self._stopping = threading.Event()
        self.threads: list[Supervised] = []
        self.watcher = (
            PressureWatcher(config.standalone)
            if config.mode == "standalone" and config.standalone
            else None
        )
        if self.watcher is not None:
            every = config.standalone.interval_seconds if config.standalone else 1.0
            self.threads.append(
                Supervised(
                    "standalone-watch",
                    self._watch_loop,
                    self._stopping,
                    metrics.died,
                    stall_after=max(120.0, 10 * every),  # each look's reads have timeouts
                )
            )
        self.discovery = (
            PodDiscovery.from_environment(config.discovery, metrics.died)
            if config.discovery
            else None
        )
        if self.discovery is not None:
            self.threads += self.discovery.threads
        self._discovered = -1  # the discovery version the controller has
        self._leading = threading.Event()  # set while this replica leads (and has restored)
        self._lead_pending = False  # leads, but the audit log could not be read yet
        self.elector = None
        if config.leader_election is not None:
            le = config.leader_election
            identity = le.identity or os.environ.get("POD_NAME") or socket.gethostname()
            self.elector = LeaseElector.from_environment(
                le, identity, self._on_leading, metrics.died
            )
            self.threads.append(self.elector.thread)
            metrics.leader.set(0)
        else:
            self._leading.set()  # one replica, as on one box: it leads
        for t in self.threads:
            metrics.thread_restarts.labels(t.name)  # at 0 from the start: increase() works
        self.scheduler = BackgroundScheduler(timezone=UTC)
        self._wakes: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # job ids; None: stop
        self._waker_thread = threading.Thread(target=self._waker, name="waker", daemon=True)
        # the focus lane: a webhook's engines are read and decided at once, beside a full pass
        self._focus_wanted = threading.Event()
        self._focus_thread = threading.Thread(target=self._focuser, name="focus", daemon=True)
        # A wake-up while a pass runs is folded into that pass (Controller.reconcile); the
        # scheduler's "skipped: maximum number of running instances" notice is expected then.
        logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
        logging.getLogger("apscheduler.executors.default").setLevel(logging.ERROR)
        self.app = create_app(
            self.controller,
            config.auth,
            config.max_body_bytes,
            config.unhealthy_after_failed_passes,
            problems=self.problems,
        )

    def problems(self) -> list[str]:
        """What makes this remediator degraded now (/healthz): the audit log, its threads."""
        out = self.controller.problems() + supervised.problems(self.threads)
        if self._lead_pending:
            out.append("holds the Lease but cannot read the audit log: not acting")
        return out

    def _wake(self) -> None:
        self._wakes.put("reconcile")

    def _resync_soon(self) -> None:
        # a payload said alerts were left out of it: read Alertmanager now, not at the next tick
        self._wakes.put("resync")

    def _waker(self) -> None:
        """Runs jobs now, on request, from its own thread: a job that asks for another (a
        resync that changed the alerts wants a pass) must never call into the scheduler
        itself, since a shutdown holds the scheduler's lock while it waits for that job."""
        while (job := self._wakes.get()) is not None:
            # not started yet, or shutting down: the interval covers it
            with contextlib.suppress(Exception):
                self.scheduler.modify_job(job, next_run_time=datetime.now(UTC))

    def _wake_focus(self) -> None:
        self._focus_wanted.set()

    def _focuser(self) -> None:
        """Runs the controller's focused passes (Controller.focus_pass), on the leader only."""
        while not self._stopping.is_set():
            self._focus_wanted.wait()
            self._focus_wanted.clear()
            if self._stopping.is_set():
                return
            if self._leading.is_set() and (self.elector is None or self.elector.leading):
                self.controller.focus_pass()

    def _on_leading(self, leading: bool) -> None:
        c = self.controller
        if not leading:
            self._leading.clear()
            self._lead_pending = False
            c.metrics.leader.set(0)
            return
        # the previous leader's actions are in the shared audit log: its cooldowns, budgets
        # and answered restart episodes hold for this replica too. Until it has been read,
        # this replica does not act (each pass tries again: _reconcile)
        self._lead_pending = True
        self._take_lead()

    def _take_lead(self) -> None:
        c = self.controller
        if not c.restore():
            return
        self._lead_pending = False
        self._leading.set()
        c.metrics.leader.set(1)
        c.request()

    def _sync_targets(self) -> None:
        d = self.discovery
        if d is None or d.version == self._discovered:
            return
        self._discovered = d.version
        static = {t.name for t in self.config.targets}
        found = [t for t in d.targets() if t.name not in static]
        self.controller.set_targets([*self.config.targets, *found])
        self.controller.metrics.discovered.set(len(found))
        self.controller.metrics.forget(self.controller.targets)  # pods gone: their series too

    def _reconcile(self) -> None:
        """A pass, on the leader only: a standby keeps its alert book warm (webhooks, resync)
        and acts on nothing until it holds the Lease."""
        self._sync_targets()
        if self._lead_pending and self.elector is not None and self.elector.leading:
            self._take_lead()
        if not self._leading.is_set() or (self.elector is not None and not self.elector.leading):
            return
        self.controller.reconcile()

    def _resync(self) -> None:
        try:
            self.controller.resync()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("cannot read alerts from Alertmanager (keeping what is known): %s", exc)

    def _watch(self) -> None:
        """One look at the exporters; their alerts go through the book like a webhook's."""
        assert self.watcher is not None
        webhook = self.watcher.poll()
        if webhook.alerts:
            try:
                self.controller.receive(webhook, source="standalone")
            except OSError as exc:  # not recorded, so not applied: the next look tries again
                log.error("standalone: cannot record the alerts in the audit log: %s", exc)

    def _watch_loop(self) -> None:
        assert self.config.standalone is not None
        interval = self.config.standalone.interval_seconds
        me = next(t for t in self.threads if t.name == "standalone-watch")
        while not self._stopping.is_set():
            started = time.monotonic()
            self._watch()
            me.beat()
            self._stopping.wait(max(0.0, interval - (time.monotonic() - started)))

    def start(self) -> None:
        """Rebuild from Alertmanager and the engines, then start the jobs (not the API)."""
        c = self.controller
        if self.discovery is not None:
            self.discovery.start()
            if not self.discovery.wait_synced(30):
                log.warning("pod discovery not synced after 30 s: starting with what is known")
            self._sync_targets()
        if self.config.mode == "alertmanager" and self.config.alertmanager:
            self._resync()
        if self.elector is not None:
            self.elector.try_once()  # lead at once when nobody else does
            self.elector.start()
        self._reconcile()  # the engines' own state: a re-admission in progress carries on
        self._waker_thread.start()
        self._focus_thread.start()
        c.wake = self._wake
        c.wake_focus = self._wake_focus
        c.resync_soon = self._resync_soon
        s = self.scheduler
        s.add_job(
            self._reconcile,
            "interval",
            id="reconcile",
            seconds=self.config.reconcile_seconds,
            max_instances=1,
            coalesce=True,
        )
        am = self.config.alertmanager
        if self.config.mode == "alertmanager" and am and am.resync_seconds > 0:
            s.add_job(
                self._resync,
                "interval",
                id="resync",
                seconds=am.resync_seconds,
                coalesce=True,
                max_instances=1,
            )
        s.start()
        if self.watcher is not None:
            self.threads[0].start()  # the standalone watch
        log.info(
            "remediator started: %d targets, mode %s%s",
            len(c.targets),
            self.config.mode,
            ", DRY RUN" if c.dry_run else "",
        )

    def stop(self) -> None:
        self._stopping.set()
        if self.elector is not None:
            self.elector.stop()  # gives the Lease up: a standby takes over at once
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        if self._waker_thread.is_alive():
            self._wakes.put(None)
            self._waker_thread.join(10)
        self._focus_wanted.set()
        if self._focus_thread.is_alive():
            self._focus_thread.join(10)
        if self.watcher is not None:
            self.threads[0].join(10)
        if self.discovery is not None:
            self.discovery.stop()
        self.controller.close()
        close = getattr(self.controller.actuator, "close", None)
        if close is not None:
            close()  # the read loop's thread and connections

    def serve(self) -> int:
        host, port = self.config.host_port
        # A read allocates a few hundred short-lived objects, nearly all freed by reference
        # counting; at the default threshold (700) the collector still ran every few reads,
        # about 2 % of a core at 170 reads/s (10,000 engines, 60 s resync). Process-wide, so
        # here in the remediator's own process, not where the controller is a library.
        gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        self.start()
        try:
            httpserve.run(
                self.app,
                host,
                port,
                max_connections=self.config.max_connections,
                request_timeout=self.config.request_timeout_seconds,
            )
        finally:
            self.stop()
        return 0


def explain(
    config: RemediatorConfig,
    webhook: Webhook,
    states: dict[str, dict[str, Any]] | None = None,
    actuator: Actuator | None = None,
    backends: dict[str, RestartBackend] | None = None,
    now: float | None = None,
) -> list[dict[str, Any]]:
    """What the remediator would do for this payload alone, target by target; changes nothing.

    The same decision as the reconcile loop (decision.decide_fleet), with the same safety state:
    the pause switch, cooldowns, budgets and answered restart episodes are rebuilt from the
    audit log when it can be read. Engine states come from `states` (offline) or are read live
    through the actuator; restart backends' flags are read live where a restart may be wanted.
    """
    reader = actuator or PluginActuator(timeout=config.actuation_timeout_seconds, attempts=1)
    if backends is None:
        try:
            backends = {} if config.dry_run else restart_backends(config)
        except Exception as exc:  # e.g. no Kubernetes credentials where explain runs
            log.warning("explain: restart backends unavailable (%s): restarts not shown", exc)
            backends = {}
    out: list[dict[str, Any]] = []
    selected = [(alert, select(alert, config.targets)) for alert in webhook.alerts]
    for alert, names in selected:
        if len(names) != 1:
            out.append(
                {
                    "alert": alert.name,
                    "fingerprint": alert.fingerprint,
                    "ignored": "not on the allowlist" if not names else f"ambiguous: {names}",
                }
            )
    try:
        entries = AuditLog(config.audit_log).entries()
    except (OSError, ConfigError):
        entries = []
    safety = Safety(config.safety)
    safety.restore(entries)
    restarted = restarted_from(entries)
    inputs = []
    for target in config.targets:
        mine = [a for a, names in selected if a.status == "firing" and names == [target.name]]
        if states is not None and target.name in states:
            state: Any = states[target.name]
        else:
            secret = SecretFile(target.token_file) if target.token_file else None
            try:
                state = reader.state(make_target(target, secret))
            except ActuatorError as exc:
                state = exc
        engine = EngineInput(
            target.name,
            target.model,
            tuple(mine),
            observe(state),
            restartable=target.name in backends and not config.dry_run,
            restarted=frozenset(restarted.get(target.name, ())),
        )
        if needs_flags(engine, config.policy):
            view: FlagView | None
            try:
                view = backends[target.name].flags()
            except (ActuatorError, KeyError, TypeError, ValueError):
                view = None
            engine = EngineInput(**{**engine.__dict__, "flags": view})
        inputs.append(engine)
    ctx = Context(
        config.policy,
        config.safety,
        config.flags,
        safety.state(),
        safety.clock() if now is None else now,
        safety.wall() if now is None else now,
    )
    for v in decide_fleet(inputs, ctx):
        entry: dict[str, Any] = {
            "target": v.target,
            "alerts": sorted(a.name for a in next(e for e in inputs if e.name == v.target).alerts),
        }
        if v.observed is None or v.desired is None:
            entry["held"] = f"cannot read the engine's state: {v.message}"
            out.append(entry)
            continue
        entry.update(
            observed={"cap": v.observed.admission_cap, "draining": v.observed.draining},
            desired={
                "cap": v.desired.cap,
                "draining": v.desired.draining,
                "phase": v.desired.phase,
            },
            reason=v.desired.reason,
            steps=[s.describe() for s in v.taken],
            withheld=[s.describe() for s in v.steps if s.withheld],
        )
        if v.held:
            entry["held"] = v.message
        if v.waiting:
            entry["waiting"] = v.waiting
        if safety.paused or config.dry_run:
            entry["note"] = "paused or dry run: nothing would be changed"
        out.append(entry)
    return out
