"""GET one /metrics page over a kept-alive connection, bounded in time and size.

The stdlib's http.client on a persistent connection: at a 100 ms poll interval over loopback its
per-request work is less than half of a general-purpose client's, and each collector thread owns
its own connection, so nothing is shared. The timeout bounds the whole exchange, head and body,
however slowly they trickle: each read waits only until the exchange's deadline. A timeout per
socket operation let a server that sent a byte a second hold a collector (or the remediator's
standalone watch, which reads every exporter in turn) for as long as it liked.
"""

from __future__ import annotations

import http.client
import io
import math
import socket
import time
import zlib
from typing import Any
from urllib.parse import urlsplit

from oomguard.errors import CollectorError


class _DeadlineIO(io.RawIOBase):
    """A response's reader: every read waits only until the exchange's deadline.

    It wraps the socket reader makefile() gave, which holds a reference on the socket: when a
    server closes after its answer (HTTP/1.0, `Connection: close`) http.client closes the
    connection before the body is read, and only that reference keeps the socket open."""

    def __init__(self, raw: Any, sock: socket.socket, scraper: Scraper) -> None:
        super().__init__()
        self._raw = raw
        self._sock = sock
        self._scraper = scraper

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        left = self._scraper.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer took longer than the timeout")
        self._sock.settimeout(left)
        return self._raw.readinto(b)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()  # its reference on the socket: the last one closes it
        super().close()


def _response_class(scraper: Scraper) -> type[http.client.HTTPResponse]:
    class Response(http.client.HTTPResponse):
        def __init__(self, sock: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(sock, *args, **kwargs)
            # nothing is buffered yet (begin() reads later): detach() hands over the raw reader
            self.fp = io.BufferedReader(_DeadlineIO(self.fp.detach(), sock, scraper))

    return Response


DEFAULT_MAX_BYTES = 16 * 1024 * 1024
# identity: on loopback, compression only costs CPU at both ends
HEADERS = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1", "Accept-Encoding": "identity"}


class Scraper:
    def __init__(self, url: str, timeout: float, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._conn: http.client.HTTPConnection | None = None
        self.deadline = math.inf  # (monotonic) of the exchange in progress

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout)
            self._conn.response_class = _response_class(self)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _exchange(self) -> tuple[int, str, str, bytes, bool]:
        conn = self._connection()
        conn.request("GET", self._path, headers=HEADERS)
        resp = conn.getresponse()
        body = resp.read(self.max_bytes + 1)
        if len(body) <= self.max_bytes and not resp.isclosed():
            # a body that ends where the server closes (no Content-Length): http.client marks it
            # read only once a read comes back empty, which this one does at the end
            body += resp.read(1)
        complete = resp.isclosed()  # False when more body is left unread: a dirty connection
        if resp.will_close or not complete:
            self.close()
        return (
            resp.status,
            resp.getheader("Content-Type", ""),
            resp.getheader("Content-Encoding", ""),
            body,
            complete,
        )

    def get(self) -> tuple[str, str]:
        """Returns (text, content type). Raises CollectorError with a reason."""
        self.deadline = time.monotonic() + self.timeout
        for attempt in (1, 2):
            try:
                status, content_type, encoding, body, complete = self._exchange()
                break
            except TimeoutError as exc:
                self.close()
                raise CollectorError(
                    "timeout", f"{self.url} did not answer within {self.timeout}s"
                ) from exc
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self.close()  # a kept-alive connection the server closed: reconnect once
                if attempt == 2:
                    raise CollectorError("unreachable", f"{self.url}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                raise CollectorError(
                    "unreachable", f"{self.url}: {type(exc).__name__}: {exc}"
                ) from exc
        if status != 200:
            raise CollectorError("http_status", f"{self.url} answered HTTP {status}")
        if len(body) > self.max_bytes or not complete:
            raise CollectorError("too_large", f"{self.url} sent more than {self.max_bytes} bytes")
        if encoding.lower() in ("gzip", "deflate"):
            inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)
            try:
                body = inflate.decompress(body, self.max_bytes + 1)
            except zlib.error as exc:
                raise CollectorError("parse_error", f"{self.url}: bad {encoding} body") from exc
            if len(body) > self.max_bytes or inflate.unconsumed_tail:
                raise CollectorError("too_large", f"{self.url} inflates past {self.max_bytes}")
        try:
            return body.decode("utf-8"), content_type
        except UnicodeDecodeError as exc:
            raise CollectorError("parse_error", f"{self.url} sent text that is not UTF-8") from exc
