"""Acting on an engine through the oomguard plugin's HTTP API, and a dry-run stand-in.

Every write is absolute (set the cap to N, drain, resume), so retrying one is safe: timeouts,
connection errors and 5xx answers are retried with exponential backoff; 4xx answers are not
(a wrong token or a refused body will not get better by asking again).

A reconcile pass reads many engines at once (`states`): one asyncio loop on its own thread and
one aiohttp session with a bounded connection pool, at most `concurrency` reads in flight. aiohttp,
not httpx, because that is where the remediator's idle CPU went: against bench/fleet.py's stand-in
engines a state read cost about 0.3 ms of CPU with aiohttp, 1 ms with httpx's sync client and
2-3 ms with httpx.AsyncClient (encode/httpx#3215); a fleet's resync is mostly such reads. Writes
are rare and stay on httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from oomguard.actions import body_of, route
from oomguard.contract import API_PREFIX
from oomguard.engine_state import EngineState, StateError
from oomguard.engine_state import parse as parse_state
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
    # the plugin's state (EngineState; a stand-in may answer the document, readers parse both)
    def state(self, target: Target) -> EngineState | dict[str, Any]: ...

    def set_cap(self, target: Target, cap: int) -> dict[str, Any]: ...

    def drain(self, target: Target) -> dict[str, Any]: ...

    def resume(self, target: Target) -> dict[str, Any]: ...

    # an action with a route and no method of its own (oomguard.actions): its step's params
    # are the body its `body` model allows (none without one)
    def act(
        self, target: Target, action: str, params: dict[str, Any] | None = None
    ) -> dict[str, Any]: ...


RETRIED = frozenset({"timeout", "unreachable", "http_status"})  # may help to ask again


def answer(method: str, url: str, status: int, body: bytes) -> dict[str, Any]:
    """The plugin's JSON object from an HTTP answer, or an ActuatorError saying why not."""
    if status in (401, 403):
        text = body[:200].decode("utf-8", "replace")
        raise ActuatorError("auth", f"{method} {url}: HTTP {status} {text}")
    if 400 <= status < 500:
        text = body[:200].decode("utf-8", "replace")
        raise ActuatorError("rejected", f"{method} {url}: HTTP {status} {text}")
    if status >= 500:
        raise ActuatorError("http_status", f"{method} {url}: HTTP {status}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise ActuatorError("bad_response", f"{method} {url}: not JSON") from None
    if not isinstance(data, dict):
        raise ActuatorError("bad_response", f"{method} {url}: not a JSON object")
    return data


def engine_state(data: dict[str, Any], url: str) -> EngineState:
    """The plugin's state document, checked against oomguard.engine_state: a malformed one is
    an ActuatorError `bad_state` naming the field, like any other answer that cannot be used."""
    try:
        return parse_state(data)
    except StateError as exc:
        raise ActuatorError("bad_state", f"GET {url}: {exc}") from None


def state_url(target: Target) -> str:
    return f"{target.url.rstrip('/')}{API}/state"


def auth_headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.token}"} if target.token else {}


class StateReader:
    """Reads the state of many engines at once, in parallel, from any thread (`states` blocks
    until every read has answered, failed, or run out of attempts)."""

    def __init__(
        self, timeout: float, attempts: int, backoff: float, concurrency: int = 64
    ) -> None:
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff
        self.concurrency = concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="oomguard-reads", daemon=True
        )
        self._thread.start()
        self._session: Any = None  # aiohttp.ClientSession, made on the loop's thread

    def states(
        self, targets: Sequence[Target]
    ) -> list[EngineState | dict[str, Any] | ActuatorError]:
        if not targets:
            return []
        return asyncio.run_coroutine_threadsafe(self._all(targets), self._loop).result()

    async def _all(
        self, targets: Sequence[Target]
    ) -> list[EngineState | dict[str, Any] | ActuatorError]:
        import aiohttp  # the remediator extra; the plugin and exporter never need it

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency, limit_per_host=0),
                cookie_jar=aiohttp.DummyCookieJar(),  # no cookies from engines
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
        gate = asyncio.Semaphore(self.concurrency)
        return await asyncio.gather(*(self._one(gate, t) for t in targets))

    async def _one(
        self, gate: asyncio.Semaphore, target: Target
    ) -> EngineState | dict[str, Any] | ActuatorError:
        """One engine's state. Every attempt together gets one `timeout`, counted from when
        the read leaves the queue: a retry takes only the time left, and none is made once it
        is spent. A pass waits for its slowest read, so retrying a read that timed out would
        hold the whole pass for `attempts` timeouts (a 3 s engine made a 9.6 s pass); the next
        pass reads that engine again anyway. Fast failures (a refused connection, a 5xx) are
        still retried within the time left."""
        import aiohttp

        url = state_url(target)
        headers = auth_headers(target)
        loop = asyncio.get_running_loop()
        last: ActuatorError | None = None
        async with gate:
            deadline = loop.time() + self.timeout
            for attempt in range(self.attempts):
                extra: dict[str, Any] = {}  # the session's timeout: the whole budget, at first
                if attempt:
                    pause = self.backoff * 2 ** (attempt - 1)
                    left = deadline - loop.time() - pause
                    if left <= 0:
                        break
                    await asyncio.sleep(pause)
                    extra["timeout"] = aiohttp.ClientTimeout(total=left)
                try:
                    async with self._session.get(
                        url, headers=headers, allow_redirects=False, **extra
                    ) as r:
                        return engine_state(answer("GET", url, r.status, await r.read()), url)
                except TimeoutError:
                    return ActuatorError("timeout", f"GET {url}: no answer in {self.timeout}s")
                except (aiohttp.ClientError, OSError, ValueError) as exc:
                    last = ActuatorError("unreachable", f"GET {url}: {exc!r}")
                except ActuatorError as exc:
                    if exc.reason not in RETRIED:
                        return exc
                    last = exc
        return last or ActuatorError("unreachable", f"{url}: no attempt made")

    def close(self) -> None:
        async def shut() -> None:
            if self._session is not None:
                await self._session.close()

        if self._loop.is_running():
            with contextlib.suppress(Exception):  # best effort: the process is going away
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


class PluginActuator:
    def __init__(
        self,
        client: httpx.Client | None = None,
        timeout: float = 5.0,
        attempts: int = 3,
        backoff: float = 0.2,
        concurrency: int = 64,
    ) -> None:
        self.client = client or httpx.Client()
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff
        self.concurrency = concurrency
        self._reader: StateReader | None = None
        self._reader_lock = threading.Lock()

    def _call(self, target: Target, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = auth_headers(target)
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
            try:
                return answer(method, url, r.status_code, r.content)
            except ActuatorError as exc:
                if exc.reason not in RETRIED:
                    raise
                last = exc
        raise last

    def state(self, target: Target) -> EngineState:
        return engine_state(self._call(target, "GET", "/state"), state_url(target))

    def states(
        self, targets: Sequence[Target]
    ) -> list[EngineState | dict[str, Any] | ActuatorError]:
        """Many engines' states at once (a reconcile pass): each a state or why it failed."""
        with self._reader_lock:
            if self._reader is None:
                self._reader = StateReader(
                    self.timeout, self.attempts, self.backoff, self.concurrency
                )
        return self._reader.states(targets)

    def close(self) -> None:
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        self.client.close()

    def set_cap(self, target: Target, cap: int) -> dict[str, Any]:
        return self._call(target, *route("set_cap"), {"cap": int(cap)})

    def drain(self, target: Target, grace_seconds: float | None = None) -> dict[str, Any]:
        """`grace_seconds`: override the plugin's drain grace (0 once a router was told)."""
        body = None if grace_seconds is None else {"grace_seconds": grace_seconds}
        return self._call(target, *route("drain"), body)

    def resume(self, target: Target) -> dict[str, Any]:
        return self._call(target, *route("resume"))

    def act(
        self, target: Target, action: str, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """An action the registry routes with no method of its own here (oomguard.actions),
        with the body its `body` model makes of `params`: params that do not fit it are refused
        here, before the engine is called."""
        try:
            body = body_of(action, params)
        except ValueError as exc:
            raise ActuatorError("rejected", f"{action}: bad parameters: {exc}") from None
        return self._call(target, *route(action), body)


@dataclass
class DryRunActuator:
    """Reads through the real actuator; records writes instead of sending them."""

    reader: Actuator
    intended: list[tuple[str, str, Any]] = field(default_factory=list)

    def state(self, target: Target) -> EngineState | dict[str, Any]:
        return self.reader.state(target)

    def states(
        self, targets: Sequence[Target]
    ) -> list[EngineState | dict[str, Any] | ActuatorError]:
        return read_states(self.reader, targets)

    def close(self) -> None:
        close = getattr(self.reader, "close", None)
        if close is not None:
            close()

    def _intend(self, target: Target, action: str, value: Any = None) -> dict[str, Any]:
        self.intended.append((target.name, action, value))
        return {"state": self.reader.state(target)}  # unchanged: the engine was not written

    def set_cap(self, target: Target, cap: int) -> dict[str, Any]:
        return self._intend(target, "set_cap", cap)

    def drain(self, target: Target) -> dict[str, Any]:
        return self._intend(target, "drain")

    def resume(self, target: Target) -> dict[str, Any]:
        return self._intend(target, "resume")

    def act(
        self, target: Target, action: str, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return self._intend(target, action, params)


def read_states(
    actuator: Actuator, targets: Sequence[Target], pool: Any = None
) -> list[EngineState | dict[str, Any] | ActuatorError]:
    """Each target's state or why it could not be read: all at once where the actuator reads
    many in parallel (PluginActuator.states), else one by one (on `pool`, a thread pool, when
    given)."""
    many = getattr(actuator, "states", None)
    if many is not None:
        return list(many(targets))

    def one(target: Target) -> EngineState | dict[str, Any] | ActuatorError:
        try:
            return actuator.state(target)
        except ActuatorError as exc:
            return exc

    return list(pool.map(one, targets) if pool is not None else map(one, targets))
