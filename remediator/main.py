"""Running the remediator: the scheduler's jobs around the controller, and the HTTP API.

Jobs (apscheduler, one background thread pool):
- `reconcile` every `reconcile_seconds`, and at once when a webhook changes the firing set;
- `resync` from Alertmanager's API every `alertmanager.resync_seconds` (and at start);
- `watch` of the exporters' pressure levels in standalone mode.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

import httpx
from apscheduler.schedulers.background import BackgroundScheduler
from oomguard.remediator import httpserve
from oomguard.remediator.actuator import Actuator, DryRunActuator, PluginActuator
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import RemediatorConfig, SecretFile
from oomguard.remediator.controller import Controller, decide_for, make_target, plan, select
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.policy import Observed
from oomguard.remediator.restart import RestartBackend, SupervisorBackend
from oomguard.remediator.server import create_app
from oomguard.remediator.standalone import PressureWatcher
from oomguard.remediator.webhook import Webhook

log = logging.getLogger("oomguard.remediator")


def build_controller(config: RemediatorConfig, actuator: Actuator | None = None) -> Controller:
    actuator = actuator or PluginActuator(
        timeout=config.actuation_timeout_seconds, attempts=config.actuation_attempts
    )
    if config.dry_run and not isinstance(actuator, DryRunActuator):
        actuator = DryRunActuator(actuator)
    backends = {} if config.dry_run else restart_backends(config)
    return Controller(
        config, actuator, AuditLog(config.audit_log), RemediatorMetrics(), backends=backends
    )


def restart_backends(config: RemediatorConfig) -> dict[str, RestartBackend]:
    """The restart backend of every target that has one configured."""
    out: dict[str, RestartBackend] = {}
    for t in config.targets:
        if t.restart is None:
            continue
        if t.restart.supervisor is not None:
            ref = t.restart.supervisor
            secret = SecretFile(ref.token_file) if ref.token_file else None
            out[t.name] = SupervisorBackend(ref.url, secret.get if secret else lambda: None)
        elif t.restart.kubernetes is not None:
            from oomguard.remediator.kubernetes import KubernetesBackend

            out[t.name] = KubernetesBackend.from_environment(t.restart.kubernetes)
    return out


class Remediator:
    def __init__(self, config: RemediatorConfig, actuator: Actuator | None = None) -> None:
        self.config = config
        self.controller = build_controller(config, actuator)
        self.watcher = (
            PressureWatcher(config.standalone)
            if config.mode == "standalone" and config.standalone
            else None
        )
        self.scheduler = BackgroundScheduler(timezone=UTC)
        # A wake-up while a pass runs is folded into that pass (Controller.reconcile); the
        # scheduler's "skipped: maximum number of running instances" notice is expected then.
        logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
        logging.getLogger("apscheduler.executors.default").setLevel(logging.ERROR)
        self.app = create_app(self.controller, config.auth, config.max_body_bytes)

    def _wake(self) -> None:
        # not started yet, or shutting down: the interval covers it
        with contextlib.suppress(Exception):
            self.scheduler.modify_job("reconcile", next_run_time=datetime.now(UTC))

    def _resync(self) -> None:
        try:
            self.controller.resync()
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("cannot read alerts from Alertmanager (keeping what is known): %s", exc)

    def _watch(self) -> None:
        assert self.watcher is not None
        webhook = self.watcher.poll()
        if webhook.alerts:
            self.controller.receive(webhook, source="standalone")

    def start(self) -> None:
        """Rebuild from Alertmanager and the engines, then start the jobs (not the API)."""
        c = self.controller
        if self.config.mode == "alertmanager" and self.config.alertmanager:
            self._resync()
        c.reconcile()  # the engines' own state: a re-admission in progress carries on
        c.wake = self._wake
        s = self.scheduler
        s.add_job(
            c.reconcile,
            "interval",
            id="reconcile",
            seconds=self.config.reconcile_seconds,
            max_instances=1,
            coalesce=True,
        )
        am = self.config.alertmanager
        if self.config.mode == "alertmanager" and am and am.resync_seconds > 0:
            s.add_job(
                self._resync, "interval", id="resync", seconds=am.resync_seconds, coalesce=True
            )
        if self.watcher is not None and self.config.standalone:
            s.add_job(
                self._watch,
                "interval",
                id="watch",
                seconds=self.config.standalone.interval_seconds,
                max_instances=1,
                coalesce=True,
                next_run_time=datetime.now(UTC),
            )
        s.start()
        log.info(
            "remediator started: %d targets, mode %s%s",
            len(c.targets),
            self.config.mode,
            ", DRY RUN" if c.dry_run else "",
        )

    def stop(self) -> None:
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        self.controller.close()

    def serve(self) -> int:
        host, port = self.config.host_port
        self.start()
        try:
            httpserve.run(self.app, host, port)
        finally:
            self.stop()
        return 0


def explain(
    config: RemediatorConfig,
    webhook: Webhook,
    states: dict[str, dict[str, Any]] | None = None,
    actuator: Actuator | None = None,
) -> list[dict[str, Any]]:
    """What the remediator would do for this payload alone, target by target; changes nothing.

    Engine states come from `states` (offline) or are read live through the actuator.
    """
    reader = actuator or PluginActuator(timeout=config.actuation_timeout_seconds, attempts=1)
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
    for target in config.targets:
        mine = [a for a, names in selected if a.status == "firing" and names == [target.name]]
        entry: dict[str, Any] = {"target": target.name, "alerts": [a.name for a in mine]}
        try:
            if states is not None and target.name in states:
                state = states[target.name]
            else:
                secret = SecretFile(target.token_file) if target.token_file else None
                state = reader.state(make_target(target, secret))
            observed = Observed.from_state(state)
        except Exception as exc:
            entry["held"] = f"cannot read the engine's state: {exc}"
            out.append(entry)
            continue
        desired = decide_for(mine, observed, config.policy)
        entry.update(
            observed={"cap": observed.admission_cap, "draining": observed.draining},
            desired={"cap": desired.cap, "draining": desired.draining, "phase": desired.phase},
            reason=desired.reason,
            steps=[f"{k} {cap}" if cap is not None else k for k, cap in plan(observed, desired)],
        )
        if config.safety.paused or config.dry_run:
            entry["note"] = "paused or dry run: nothing would be changed"
        out.append(entry)
    return out
