"""Serving an ASGI app with uvicorn: bounded against slow and many clients, and so that the
caller's cleanup runs on SIGTERM.

Bounds (the remediator's API and `oomguard serve`'s):
- at most `max_connections` connections at once. At the cap a new connection takes the place
  of one that does nothing (kept alive between requests, or without its whole request head
  after EVICT_AFTER seconds), the one waiting longest, which is closed; when every connection
  is busy or new, the new one is answered 503 (Retry-After) and closed at once, before
  anything is read. Clients that only hold connections open cannot keep Alertmanager out;
- a request must arrive whole (head and body) within `request_timeout` seconds of the
  connection, or of the previous response on a kept-alive connection: a client that sends a
  byte a minute (slowloris) or opens a connection and says nothing is closed, and its slot is
  free again. Handling the request is not limited (an fsync on a busy disk may take a while);
- an idle kept-alive connection is closed after `idle_timeout` seconds (uvicorn's keep-alive);
- a request head larger than h11's 16 KiB limit is refused by h11 (400).
Connections are coroutines on one event loop, not threads: 400 idle clients cost no thread.

uvicorn restores the previous signal handlers after a graceful shutdown and re-raises the signal
it caught. With Python's default handler that kills the process before a `finally:` can stop
what it started (the supervisor's vLLM child, the remediator's scheduler). A handler that only
notes the signal is installed first, so the re-raised signal is harmless and `run` returns.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("oomguard.http")

MAX_CONNECTIONS = 256
REQUEST_TIMEOUT = 10.0
IDLE_TIMEOUT = 5.0
EVICT_AFTER = 1.0  # a request head still incomplete this long is slow, not Alertmanager's
_BUSY = b"too many connections\n"
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY)
)


def bounded_protocol(max_connections: int, request_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a connection cap and a deadline for each whole request."""

    class Bounded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_since = 0.0  # (monotonic) since the connection or its last answer
        _answered = 0  # requests answered on this connection
        refused_at = -1e9
        evicted = 0  # connections closed to make room, since start (all protocols)

        def _idle_for(self, now: float) -> float | None:
            """How long this connection has done nothing worth its slot, or None: waiting
            for its next request (kept alive), or for its first request head to complete
            for over EVICT_AFTER."""
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return None
            if self.cycle is not None and not self.cycle.response_complete:
                return None
            waited = now - self._waiting_since
            return waited if self._answered or waited >= EVICT_AFTER else None

        def _make_room(self) -> bool:
            now = time.monotonic()
            idle = [
                (waited, c)
                for c in self.connections
                if c is not self
                and isinstance(c, Bounded)
                and (waited := c._idle_for(now)) is not None
            ]
            if not idle:
                return False
            _, victim = max(idle, key=lambda pair: pair[0])
            victim.transport.close()
            Bounded.evicted += 1
            return True

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            live = sum(not c.transport.is_closing() for c in self.connections)
            if live > max_connections and not self._make_room():
                now = time.monotonic()
                if now - Bounded.refused_at > 10:  # a line per burst, not per connection
                    log.warning("%d connections: refusing more", len(self.connections) - 1)
                Bounded.refused_at = now
                transport.write(REFUSAL)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_since = time.monotonic()
            self._deadline = self.loop.call_later(request_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is h11.DONE:
                return
            # slow or silent: its slot is worth more to the next client
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()  # received whole (or over): handling it is not limited

        def on_response_complete(self) -> None:
            self._answered += 1
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Bounded


def run(
    app: Any,
    host: str,
    port: int,
    max_connections: int = MAX_CONNECTIONS,
    request_timeout: float = REQUEST_TIMEOUT,
    idle_timeout: float = IDLE_TIMEOUT,
) -> None:
    def note(signum: int, frame: FrameType | None) -> None:
        pass  # uvicorn's own handler did the work; this one only keeps the process alive

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            http=bounded_protocol(max_connections, request_timeout),
            timeout_keep_alive=max(1, round(idle_timeout)),
        )
        uvicorn.Server(config).run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
