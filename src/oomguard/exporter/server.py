"""HTTP: /metrics serves the latest rendered snapshot's bytes; /healthz says if polling is alive.

A scrape never waits on hardware or on an engine: it reads one reference and writes bytes.
"""

from __future__ import annotations

import logging
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection
    server: MetricsServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without TCP_NODELAY a keep-alive client
        # waits out the peer's delayed ACK (40 ms) on every scrape.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            snapshot = self.server.snapshot()
            accept = self.headers.get("Accept", "")
            if "application/openmetrics-text" in accept:
                self._send(200, snapshot.openmetrics, OPENMETRICS_CONTENT_TYPE, {})
            elif "gzip" in self.headers.get("Accept-Encoding", ""):
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

    def __init__(
        self,
        address: tuple[str, int],
        snapshot: Callable[[], Snapshot],
        max_snapshot_age: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(address, _Handler)
        self._snapshot = snapshot
        self.max_snapshot_age = max_snapshot_age
        self.clock = clock
        self._thread: threading.Thread | None = None

    def snapshot(self) -> Snapshot:
        return self._snapshot()

    def health(self) -> tuple[bool, str]:
        age = self.clock() - self.snapshot().timestamp
        if age > self.max_snapshot_age:
            return False, f"stale: last snapshot {age:.1f}s old"
        return True, "ok"

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
