"""The restart actuator: drain, let in-flight and queued requests finish, restart with adjusted
flags, wait for ready, hand over to staged re-admission. Every step is audited; a step that fails
stops the sequence, leaves the engine serving if it still can, and reports.

Backends restart the engine with new flags and report the flags in force:
- `SupervisorBackend`: `oomguard serve` on the engine's host (remediator/supervisor.py);
- `KubernetesBackend`: patches the Deployment or StatefulSet (remediator/kubernetes.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from oomguard.engine_state import parse as parse_state
from oomguard.remediator.actuator import Actuator, ActuatorError, Target
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.flags import Flags


class RestartError(ActuatorError):
    pass


@dataclass(frozen=True)
class FlagView:
    """The flags a backend reports: as first started, now in force, and since when."""

    original: Flags
    current: Flags
    changed_at: float


class RestartBackend(Protocol):
    def flags(self) -> FlagView: ...

    def restart(self, flags: Flags, initial_cap: int | None, reason: str) -> None: ...


class SupervisorBackend:
    def __init__(
        self,
        url: str,
        token: Callable[[], str | None],
        timeout: float = 10.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        # one client for every call (kept-alive connection; building one costs ~20 ms of CPU)
        self.client = client or httpx.Client()

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        token = self.token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            r = self.client.request(
                method, f"{self.url}{path}", json=body, headers=headers, timeout=self.timeout
            )
        except httpx.HTTPError as exc:
            raise RestartError("unreachable", f"supervisor {self.url}: {exc}") from exc
        if r.status_code >= 300:
            raise RestartError(
                "auth" if r.status_code in (401, 403) else "rejected",
                f"supervisor {method} {path}: HTTP {r.status_code} {r.text[:200]}",
            )
        data = r.json()
        if not isinstance(data, dict):
            raise RestartError("bad_response", f"supervisor {path}: not a JSON object")
        return data

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/v1/status")

    def flags(self) -> FlagView:
        f = self.status()["flags"]
        return FlagView(Flags(**f["original"]), Flags(**f["current"]), float(f["changed_at"]))

    def restart(self, flags: Flags, initial_cap: int | None, reason: str) -> None:
        self._call(
            "POST",
            "/v1/restart",
            {
                "flags": {
                    "gpu_memory_utilization": flags.gpu_memory_utilization,
                    "max_num_seqs": flags.max_num_seqs,
                },
                "initial_cap": initial_cap,
                "reason": reason,
            },
        )


@dataclass(frozen=True)
class RestartResult:
    ok: bool
    step: str  # the last step reached: drain, wait_idle, restart, wait_ready, done
    message: str


@dataclass
class RestartSequence:
    plugin: Actuator
    backend: RestartBackend
    audit: AuditLog
    drain_timeout: float = 120.0
    ready_timeout: float = 900.0
    readmit_start: int | None = 1  # the restarted engine's admission cap; None: full admission
    poll: float = 0.5
    clock: Callable[[], float] = time.monotonic

    def run(
        self, target: Target, flags: Flags, reason: str, fingerprints: list[str]
    ) -> RestartResult:
        def note(step: str, result: str, message: str, after: Any = None) -> None:
            # the restart's intent is durable already: a step that cannot be noted (disk full)
            # does not stop the sequence half-way, with the engine drained
            self.audit.try_record(
                "restart",
                target=target.name,
                action=step,
                after=after,
                result=result,
                reason=f"{reason}: {message}",
                fingerprints=fingerprints,
            )

        try:
            self.plugin.drain(target)
        except ActuatorError as exc:
            note("drain", "failed", str(exc))
            return RestartResult(False, "drain", f"cannot drain: {exc}")
        note("drain", "ok", "admissions stopped; waiting for in-flight requests")

        deadline = self.clock() + self.drain_timeout
        while not self._idle(target):
            if self.clock() > deadline:
                message = (
                    f"requests in flight or queued did not finish in {self.drain_timeout:.0f} s"
                )
                self._resume(target)
                note("wait_idle", "failed", message + "; resumed, not restarted")
                return RestartResult(False, "wait_idle", message)
            time.sleep(self.poll)
        note("wait_idle", "ok", "no request in flight or queued")

        try:
            self.backend.restart(flags, self.readmit_start, reason)
        except ActuatorError as exc:
            self._resume(target)
            note("restart", "failed", f"{exc}; resumed with the old flags")
            return RestartResult(False, "restart", str(exc))
        note(
            "restart",
            "ok",
            f"restarting with gpu_memory_utilization {flags.gpu_memory_utilization}, "
            f"max_num_seqs {flags.max_num_seqs}, "
            + (
                f"admission cap {self.readmit_start}"
                if self.readmit_start is not None
                else "full admission"
            ),
            after={
                "gpu_memory_utilization": flags.gpu_memory_utilization,
                "max_num_seqs": flags.max_num_seqs,
            },
        )

        deadline = self.clock() + self.ready_timeout
        while self.clock() <= deadline:
            try:
                state = parse_state(self.plugin.state(target))
                gmu = state.gpu_memory_utilization
                if state.startup_max_num_seqs == flags.max_num_seqs and (
                    gmu is None or abs(gmu - flags.gpu_memory_utilization) < 1e-6
                ):
                    note(
                        "wait_ready",
                        "ok",
                        "serving again; staged re-admission follows"
                        if self.readmit_start is not None
                        else "serving again at full admission",
                        after={"cap": state.admission_cap, "mode": state.mode},
                    )
                    return RestartResult(True, "done", "restarted")
            except (ActuatorError, KeyError, TypeError, ValueError):
                pass
            time.sleep(self.poll)
        message = f"not ready {self.ready_timeout:.0f} s after the restart"
        note("wait_ready", "failed", message)
        return RestartResult(False, "wait_ready", message)

    def _idle(self, target: Target) -> bool:
        """Nothing queued, and nothing running (or the plugin says it is drained): a restart now
        drops no request. The plugin's `drained` counts running requests only, so a queued
        request is checked for here either way: it would be lost with the process."""
        try:
            return parse_state(self.plugin.state(target)).idle
        except (ActuatorError, ValueError):  # unreadable (StateError is a ValueError): not idle
            return False

    def _resume(self, target: Target) -> None:
        # a failure here is reported by the step that failed; the reconcile loop sees the state
        with contextlib.suppress(ActuatorError):
            self.plugin.resume(target)
