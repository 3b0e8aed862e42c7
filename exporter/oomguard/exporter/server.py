"""HTTP: /metrics serves the latest rendered snapshot's bytes; /healthz says if polling is alive.

A scrape never waits on hardware or on an engine: it reads one reference and writes bytes.

The port is reachable by anything on the node's network, so the server is bounded (issue 25,
defect 14: 400 half-open `GET /metrics` held 408 threads, none closed a minute later):
- at most `max_connections` connections are served at once (one thread each). At the cap a
  new connection takes the slot of one that is doing nothing (kept alive between requests,
  or still without a whole request head after EVICT_AFTER seconds: a scraper sends its head
  in one packet), the one waiting longest, which is closed; only when every connection is
  busy is the new one answered 503 and closed at once, without a thread, and logged. Before,
  64 clients that kept their connections open between scrapes (one request a minute each)
  shut a restarted Prometheus out for as long as they liked;
- a request's line and headers must arrive within `request_timeout` seconds of its first byte,
  however slowly they trickle (a per-request deadline, not a per-read timeout);
- a new connection must start its request within `request_timeout`; a keep-alive connection
  may wait `idle_timeout` for its next one (longer than common scrape intervals, so Prometheus
  keeps its connection);
- an answer must be taken within `write_timeout` (a client that never reads is dropped).
"""

from __future__ import annotations

import contextlib
import email.utils
import io
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from oomguard.exporter.render import OPENMETRICS_CONTENT_TYPE, TextRenderer

if TYPE_CHECKING:
    from oomguard.exporter.poller import Snapshot

log = logging.getLogger("oomguard.exporter.http")

_INDEX = b"""<html><head><title>oomguard exporter</title></head><body>
<h1>oomguard exporter</h1><p><a href="/metrics">/metrics</a> &middot;
<a href="/healthz">/healthz</a></p></body></html>
"""


MAX_CONNECTIONS = 64  # Prometheus (an HA pair), a few people with curl; far more is an attack
REQUEST_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0
WRITE_TIMEOUT = 10.0
EVICT_AFTER = 1.0  # a request head still incomplete this long is slow, not a scraper's
SLOT_WAIT = 2.0  # how long a new connection waits for the slot of a connection it closed

ONE_WRITE = 256 * 1024  # bodies up to this size go out with their head in one write

_date_cache: tuple[int, str] = (0, "")


def _http_date() -> str:
    """The Date header's value, formatted once a second."""
    global _date_cache
    now = int(time.time())
    cached = _date_cache
    if cached[0] != now:
        cached = _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return cached[1]


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 31\r\n"
    b"Connection: close\r\nRetry-After: 1\r\n\r\ntoo many connections, try again\n"
)


class _DeadlineSocketIO(socket.SocketIO):
    """The request reader: every read waits only until the handler's current deadline, so a
    client trickling one byte at a time cannot hold the thread past it."""

    def __init__(self, sock: socket.socket, handler: _Handler) -> None:
        super().__init__(sock, "rb")
        self._handler = handler

    def readinto(self, b: memoryview | bytearray) -> int | None:  # type: ignore[override]
        remaining = self._handler.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request deadline passed")
        self._handler.connection.settimeout(remaining)
        return super().readinto(b)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection
    server: MetricsServer
    deadline = 0.0
    # what the connection does now, for the choice of one to close at the cap: "waiting"
    # (for a request, or the rest of its head) since `since`, or "busy" answering one
    phase = "waiting"
    since = 0.0
    kept_alive = False  # waiting for a second or later request (not a new connection)

    def setup(self) -> None:
        self.since = time.monotonic()
        self.server.opened(self)
        super().setup()
        # Headers and body go out in separate writes; without TCP_NODELAY a keep-alive client
        # waits out the peer's delayed ACK (40 ms) on every scrape.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = io.BufferedReader(_DeadlineSocketIO(self.connection, self))
        self.rfile = self._reader
        self._requests = 0

    def handle_one_request(self) -> None:
        # Wait for the request's first byte (a new connection: request_timeout; a kept-alive
        # one: idle_timeout), then give the whole request line and headers request_timeout.
        wait = self.server.idle_timeout if self._requests else self.server.request_timeout
        self.phase, self.since, self.kept_alive = "waiting", time.monotonic(), self._requests > 0
        self.deadline = self.since + wait
        try:
            if not self._reader.peek(1):
                self.close_connection = True  # the client closed it
                return
        except OSError:  # TimeoutError included: nothing came
            self.close_connection = True
            return
        self._requests += 1
        self.kept_alive = False  # a request has begun: no longer idle (its head may be slow)
        self.deadline = time.monotonic() + self.server.request_timeout
        super().handle_one_request()  # a TimeoutError in there closes the connection

    def finish(self) -> None:
        self.server.closed(self)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str]) -> None:
        # sendall's timeout bounds the whole answer: a client that never reads is dropped
        self.connection.settimeout(self.server.write_timeout)
        if self.request_version == "HTTP/0.9":  # no status line, no headers: the base class's
            self.send_response(status)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        # The head made in one piece (the base class encodes and buffers it header by header,
        # and formats the date on every answer), and sent with the body in one write when the
        # body is small (the gzipped forms a scraper asks for): one system call, one segment.
        self.log_request(status)
        head = [
            f"{self.protocol_version} {status} {self.responses[status][0]}\r\n"
            f"Server: {self.version_string()}\r\nDate: {_http_date()}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        ]
        head += [f"{k}: {v}\r\n" for k, v in extra.items()]
        head.append("\r\n")
        head_bytes = "".join(head).encode("latin-1")
        if self.command == "HEAD":
            self.wfile.write(head_bytes)
        elif len(body) <= ONE_WRITE:
            self.wfile.write(head_bytes + body)
        else:  # a large body (plain text at node scale, 2 MB) is not copied to join it
            self.wfile.write(head_bytes)
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self.phase = "busy"  # its head arrived whole: answering it is never interrupted
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            snapshot = self.server.snapshot()
            accept = self.headers.get("Accept", "")
            gzipped = "gzip" in self.headers.get("Accept-Encoding", "")
            if "application/openmetrics-text" in accept:  # what Prometheus 2.x asks for first
                if gzipped:
                    self._send(
                        200,
                        snapshot.openmetrics_gzip,
                        OPENMETRICS_CONTENT_TYPE,
                        {"Content-Encoding": "gzip"},
                    )
                else:
                    self._send(200, snapshot.openmetrics, OPENMETRICS_CONTENT_TYPE, {})
            elif gzipped:
                self._send(
                    200, snapshot.text_gzip, TextRenderer.CONTENT_TYPE, {"Content-Encoding": "gzip"}
                )
            else:
                self._send(200, snapshot.text, TextRenderer.CONTENT_TYPE, {})
        elif path == "/healthz":
            ok, message = self.server.health()
            self._send(200 if ok else 503, message.encode() + b"\n", "text/plain", {})
        elif path == "/":
            self._send(200, _INDEX, "text/html", {})
        else:
            self._send(404, b"not found\n", "text/plain", {})


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog: connections beyond the cap are refused fast

    def __init__(
        self,
        address: tuple[str, int],
        snapshot: Callable[[], Snapshot],
        max_snapshot_age: float,
        clock: Callable[[], float] = time.time,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        write_timeout: float = WRITE_TIMEOUT,
        problems: Callable[[], list[str]] = lambda: [],
    ) -> None:
        super().__init__(address, _Handler)
        self._snapshot = snapshot
        self._problems = problems  # e.g. a poller thread that died (poller.problems)
        self.max_snapshot_age = max_snapshot_age
        self.clock = clock
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[_Handler] = set()
        self._open_lock = threading.Lock()
        self._stopped = False  # set by stop(): a connection that opens after it is shut
        self.refused = 0  # connections answered 503 at the cap, since start
        self.evicted = 0  # idle or slow connections closed for a new one at the cap
        self._last_warning = -math.inf
        self._thread: threading.Thread | None = None

    def opened(self, handler: _Handler) -> None:
        with self._open_lock:
            if not self._stopped:
                self._open.add(handler)
                return
        # accepted just before stop(), its thread started after stop() closed the others
        with contextlib.suppress(OSError):
            handler.request.shutdown(socket.SHUT_RDWR)

    def closed(self, handler: _Handler) -> None:
        with self._open_lock:
            self._open.discard(handler)

    def _evict(self) -> bool:
        """At the cap: close the connection that has waited longest while doing nothing (kept
        alive between requests, or with a request head incomplete after EVICT_AFTER); False
        when every connection is busy or new."""
        now = time.monotonic()
        with self._open_lock:
            idle = [
                h
                for h in self._open
                if h.phase == "waiting" and (h.kept_alive or now - h.since >= EVICT_AFTER)
            ]
            victim = min(idle, key=lambda h: h.since, default=None)
            if victim is None:
                return False
            self._open.discard(victim)  # never chosen twice
        with contextlib.suppress(OSError):  # its thread's read ends; its slot comes back
            victim.request.shutdown(socket.SHUT_RDWR)
        self.evicted += 1
        return True

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self._slots.acquire(blocking=False) and not (
            self._evict() and self._slots.acquire(timeout=SLOT_WAIT)
        ):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()  # no thread (out of threads): the slot stays free
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        # a client that hung up mid-answer, a reset: its business, not a traceback on stderr
        log.debug("connection from %s ended with an error", client_address, exc_info=True)

    def _refuse(self, request: socket.socket) -> None:
        """503 and close, from the accepting thread: never blocks (the answer fits an empty
        send buffer; a failed send is ignored)."""
        self.refused += 1
        try:
            request.setblocking(False)
            request.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)
        now = time.monotonic()
        if now - self._last_warning > 60:
            self._last_warning = now
            log.warning(
                "refusing connections: %d open, the limit (%d refused since start)",
                self.max_connections,
                self.refused,
            )

    def snapshot(self) -> Snapshot:
        return self._snapshot()

    def health(self) -> tuple[bool, str]:
        age = self.clock() - self.snapshot().timestamp
        if age > self.max_snapshot_age:
            return False, f"stale: last snapshot {age:.1f}s old"
        problems = self._problems()
        if problems:
            return False, "degraded: " + "; ".join(problems)
        return True, "ok"

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, and close every connection still open: a scraper's kept-alive
        connection would otherwise go on being answered, by its own thread, from a stopped
        poller's last snapshot (a stopped exporter that still looks up)."""
        self.shutdown()
        self.server_close()
        with self._open_lock:
            self._stopped = True
            still, self._open = list(self._open), set()
        for handler in still:
            with contextlib.suppress(OSError):  # its thread's read or write ends
                handler.request.shutdown(socket.SHUT_RDWR)
