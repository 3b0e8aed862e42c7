"""Acting on an engine through the oomguard plugin's HTTP API, and a dry-run stand-in.

Every write is absolute (set the cap to N, drain, resume), so retrying one is safe: timeouts,
connection errors and 5xx answers are retried with exponential backoff; 4xx answers are not
(a wrong token or a refused body will not get better by asking again).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from oomguard.contract import API_PREFIX
from oomguard.errors import OomguardError

API = API_PREFIX


class ActuatorError(OomguardError):
    """An engine could not be read or changed; `reason` is a short label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Target:
    """An engine on the allowlist: its name, the vLLM server's base URL, its plugin token."""

    name: str
    url: str
    token: str | None = None
    model: str = ""


class Actuator(Protocol):
    def state(self, target: Target) -> dict[str, Any]: ...

    def set_cap(self, target: Target, cap: int) -> dict[str, Any]: ...

    def drain(self, target: Target) -> dict[str, Any]: ...

    def resume(self, target: Target) -> dict[str, Any]: ...


class PluginActuator:
    def __init__(
        self,
        client: httpx.Client | None = None,
        timeout: float = 5.0,
        attempts: int = 3,
        backoff: float = 0.2,
    ) -> None:
        self.client = client or httpx.Client()
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff

    def _call(self, target: Target, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        url = f"{target.url.rstrip('/')}{API}{path}"
        last = ActuatorError("unreachable", f"{url}: no attempt made")
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = self.client.request(
                    method, url, json=body, headers=headers, timeout=self.timeout
                )
            except httpx.TimeoutException:
                last = ActuatorError("timeout", f"{method} {url}: no answer in {self.timeout}s")
                continue
            except httpx.HTTPError as exc:
                last = ActuatorError("unreachable", f"{method} {url}: {exc}")
                continue
            if r.status_code in (401, 403):
                raise ActuatorError("auth", f"{method} {url}: HTTP {r.status_code} {r.text[:200]}")
            if 400 <= r.status_code < 500:
                raise ActuatorError(
                    "rejected", f"{method} {url}: HTTP {r.status_code} {r.text[:200]}"
                )
            if r.status_code >= 500:
                last = ActuatorError("http_status", f"{method} {url}: HTTP {r.status_code}")
                continue
            try:
                data = r.json()
            except ValueError:
                raise ActuatorError("bad_response", f"{method} {url}: not JSON") from None
            if not isinstance(data, dict):
                raise ActuatorError("bad_response", f"{method} {url}: not a JSON object")
            return data
        raise last

    def state(self, target: Target) -> dict[str, Any]:
        return self._call(target, "GET", "/state")

    def set_cap(self, target: Target, cap: int) -> dict[str, Any]:
        return self._call(target, "PUT", "/admission", {"cap": int(cap)})

    def drain(self, target: Target) -> dict[str, Any]:
        return self._call(target, "POST", "/drain")

    def resume(self, target: Target) -> dict[str, Any]:
        return self._call(target, "POST", "/resume")


@dataclass
class DryRunActuator:
    """Reads through the real actuator; records writes instead of sending them."""

    reader: Actuator
    intended: list[tuple[str, str, Any]] = field(default_factory=list)

    def state(self, target: Target) -> dict[str, Any]:
        return self.reader.state(target)

    def _intend(self, target: Target, action: str, value: Any = None) -> dict[str, Any]:
        self.intended.append((target.name, action, value))
        return self.reader.state(target)

    def set_cap(self, target: Target, cap: int) -> dict[str, Any]:
        return self._intend(target, "set_cap", cap)

    def drain(self, target: Target) -> dict[str, Any]:
        return self._intend(target, "drain")

    def resume(self, target: Target) -> dict[str, Any]:
        return self._intend(target, "resume")
