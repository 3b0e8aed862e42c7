"""GET one /metrics page over a kept-alive connection, bounded in time and size.

A lean HTTP/1.1 client for the one exchange a collector makes, poll after poll: a request it
writes once (its bytes are made at construction) and a response read straight off the socket.
http.client spent about 0.35 ms of CPU a page on its email-parser headers and buffered readers,
a bare socket about 0.05 ms; at node scale (16 engines a second) that was most of a poll.

The upstream is untrusted: what it sends is held to the protocol and to bounds, and whatever it
does ends in a CollectorError with a reason (never another exception, never a hang):
- time: the timeout bounds the whole exchange (connect, head, body), however slowly the bytes
  trickle: each read waits only until the exchange's deadline (`timeout`);
- size: a head over MAX_HEAD bytes is refused (`parse_error`), a body over `max_bytes` (its
  Content-Length, the chunks read so far, or the bytes before the close) is refused before it is
  read (`too_large`), as is a gzip body that inflates past it;
- framing: Content-Length must be digits (repeats must agree), Transfer-Encoding only
  `chunked` and never with a Content-Length, chunk sizes hex within bounds, each chunk followed
  by CRLF; anything else is `parse_error`, a connection closed mid-answer `unreachable`;
- status: an answer other than 200 is `http_status` (its body is not read: the connection closes).
A connection is kept only after a whole, well-framed answer with nothing after it; a kept one
the server has closed meanwhile is reconnected once.

`names`: the sample names the caller reads, asked for as `name[]` query parameters, which
prometheus_client's exposition app (make_asgi_app, make_wsgi_app) honours by leaving every other
sample out, at `filtered_url` (by default the URL itself). vLLM's page is about 750 lines an
engine, 30 of them read: the filtered page is a twentieth of the bytes to send, receive and
scan. The caller still filters what it parses: an upstream that ignores the parameters sends the
whole page and works as before. One that answers the filtered request other than 200 is asked
at once at the URL without them, and when that answers, never with them again (`unfilter`);
when both fail, the plain request's error is the scrape's and the filter is kept (the upstream
is down, not refusing the filter).
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
import time
import zlib
from collections.abc import Iterable
from urllib.parse import quote, urlencode, urlsplit

from oomguard.errors import CollectorError

log = logging.getLogger("oomguard.exporter.scrape")

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
MAX_HEAD = 64 * 1024  # a status line and headers; a /metrics answer's are a few hundred bytes
MAX_INTERIM = 8  # 1xx answers skipped before the real one
RECV = 256 * 1024
# identity: on loopback, compression only costs CPU at both ends
HEADERS = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1", "Accept-Encoding": "identity"}

_PATH_SAFE = "!#$%&'()*+,/:;=?@[]~"  # what a request target may hold as it is
_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?")
_HEADER = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*(.*?)[ \t]*")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")


class _Closed(Exception):
    """The server closed the connection (or reset it) before a byte of the answer."""


class _Bad(Exception):
    """The answer breaks HTTP/1.1's framing: its text says how."""


class _Refused(Exception):
    """An answer other than 200 to a request with name[] parameters: ask without them."""


class _TooLarge(Exception):
    pass


class _Connection:
    """A socket and the bytes read from it that no answer has used yet."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.answers = 0  # answers read on it: a kept one that fails is tried again once

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Scraper:
    def __init__(
        self,
        url: str,
        timeout: float,
        max_bytes: int = DEFAULT_MAX_BYTES,
        names: Iterable[str] = (),
        filtered_url: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        path = quote(path, safe=_PATH_SAFE)  # spaces, controls, non-ASCII: percent-encoded
        host = parts.netloc.rpartition("@")[2]  # as given, with its port; never credentials
        if not host.isascii():
            host = host.encode("idna").decode("ascii")  # a UnicodeError is a ValueError
        head = [f"Host: {host}", "User-Agent: oomguard"]
        head += [f"{k}: {v}" for k, v in HEADERS.items()]
        tail = "\r\n" + "\r\n".join(head) + "\r\n\r\n"
        self._plain_request = f"GET {path} HTTP/1.1{tail}".encode("ascii")
        self._request = self._plain_request
        self.filtered = False  # whether requests ask for `names` only (name[] parameters)
        query = urlencode([("name[]", n) for n in sorted(set(names))])
        if query:
            fparts = urlsplit(filtered_url or url)
            if (fparts.scheme, fparts.netloc) != (parts.scheme, parts.netloc):
                raise ValueError(f"not the same server as {url!r}: {filtered_url!r}")
            fpath = quote(fparts.path or "/", safe=_PATH_SAFE)
            fpath += f"?{quote(fparts.query, safe=_PATH_SAFE)}&" if fparts.query else "?"
            self._request = f"GET {fpath}{query} HTTP/1.1{tail}".encode("ascii")
            self.filtered = True
        self._filtered_request = self._request
        self._conn: _Connection | None = None
        self.deadline = 0.0  # (monotonic) of the exchange in progress

    def unfilter(self, why: str) -> None:
        """Ask for the whole page from now on (the upstream does not serve the filtered one)."""
        if self.filtered:
            log.warning("%s: %s; asking for the whole page from now on", self.url, why)
        self._request = self._filtered_request = self._plain_request
        self.filtered = False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- the socket, within the deadline ---------------------------------------------------------
    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer took longer than the timeout")
        return left

    def _connect(self) -> _Connection:
        sock = socket.create_connection((self._host, self._port), timeout=self._left())
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._https:
                sock.settimeout(self._left())
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock)

    def _recv(self, conn: _Connection) -> bool:
        """More bytes into conn.buf; False when the server closed the connection."""
        conn.sock.settimeout(self._left())
        data = conn.sock.recv(RECV)
        conn.buf += data
        return bool(data)

    def _until(self, conn: _Connection, delim: bytes, limit: int, too_long: str, part: str) -> int:
        """Where the next `delim` is in conn.buf, reading until it comes; what precedes it may
        be at most `limit` bytes (else _Bad(too_long)). A close before it is a reset mid-`part`,
        or _Closed when it comes before a byte of a head (a kept connection the server dropped)."""
        start = 0
        while (end := conn.buf.find(delim, start)) < 0:
            if len(conn.buf) > limit:
                raise _Bad(too_long)
            start = max(0, len(conn.buf) - len(delim) + 1)  # a delimiter split across reads
            if not self._recv(conn):
                if part == "head" and not conn.buf:
                    raise _Closed("the server closed the connection")
                raise ConnectionResetError(f"the server closed the connection mid-{part}")
        if end > limit:
            raise _Bad(too_long)
        return end

    # -- one answer ------------------------------------------------------------------------------
    def _head(self, conn: _Connection) -> tuple[int, bool, dict[bytes, bytes]]:
        """(status, HTTP/1.0, headers by lower-case name) of the next answer, its head consumed."""
        for _ in range(MAX_INTERIM + 1):
            end = self._until(
                conn, b"\r\n\r\n", MAX_HEAD, f"a response head over {MAX_HEAD} bytes", "head"
            )
            lines = bytes(conn.buf[:end]).split(b"\r\n")
            del conn.buf[: end + 4]
            m = _STATUS.fullmatch(lines[0])
            if m is None:
                raise _Bad(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
            status = int(m.group(2))
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                h = _HEADER.fullmatch(line)
                if h is None:  # obs-fold, a space before the colon, a bare name: all refused
                    raise _Bad(f"a malformed header line: {line[:80]!r}")
                name = h.group(1).lower()
                if name in headers and name != b"content-length":
                    headers[name] += b", " + h.group(2)
                elif name in headers and headers[name] != h.group(2):
                    raise _Bad("Content-Length headers that disagree")
                else:
                    headers[name] = h.group(2)
            if 100 <= status < 200 and status != 101:
                continue  # 100 Continue, 103 Early Hints: the answer follows
            return status, m.group(1) == b"0", headers
        raise _Bad(f"more than {MAX_INTERIM} interim (1xx) answers")

    def _exactly(self, conn: _Connection, n: int) -> bytes:
        """The next n bytes (n within max_bytes + a chunk's CRLF)."""
        if len(conn.buf) >= n:
            out = bytes(conn.buf[:n])
            del conn.buf[:n]
            return out
        body = bytearray(n)
        view = memoryview(body)
        got = len(conn.buf)
        view[:got] = conn.buf
        conn.buf.clear()
        while got < n:
            conn.sock.settimeout(self._left())
            k = conn.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("the server closed the connection mid-body")
            got += k
        view.release()
        return bytes(body)

    def _line(self, conn: _Connection, limit: int = 4096) -> bytes:
        """The next CRLF-ended line (chunked framing), without its CRLF."""
        end = self._until(conn, b"\r\n", limit, "a chunk-size or trailer line too long", "body")
        line = bytes(conn.buf[:end])
        del conn.buf[: end + 2]
        return line

    def _chunked(self, conn: _Connection) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size_text = self._line(conn).split(b";", 1)[0].strip(b" \t")
            if _HEX.fullmatch(size_text) is None:
                raise _Bad(f"a bad chunk size: {size_text[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                break
            total += size
            if total > self.max_bytes:
                raise _TooLarge
            chunk = self._exactly(conn, size + 2)
            if chunk[-2:] != b"\r\n":
                raise _Bad("a chunk not followed by CRLF")
            parts.append(chunk[:-2])
        trailer = 0
        while line := self._line(conn):  # trailer fields, up to the empty line
            trailer += len(line)
            if trailer > MAX_HEAD:
                raise _Bad(f"trailers over {MAX_HEAD} bytes")
        return b"".join(parts)

    def _to_close(self, conn: _Connection) -> bytes:
        """A body that ends where the server closes the connection."""
        while len(conn.buf) <= self.max_bytes:
            if not self._recv(conn):
                break
        if len(conn.buf) > self.max_bytes:
            raise _TooLarge
        body = bytes(conn.buf)
        conn.buf.clear()
        return body

    def _exchange(self, conn: _Connection) -> tuple[str, str, bytes, bool]:
        """(content type, content encoding, body, keep the connection) of a 200 answer."""
        conn.sock.settimeout(self._left())
        conn.sock.sendall(self._request)
        status, http10, headers = self._head(conn)
        conn.answers += 1
        if status != 200:
            if self._request is not self._plain_request:
                raise _Refused(status)
            raise CollectorError("http_status", f"{self.url} answered HTTP {status}")
        connection = headers.get(b"connection", b"").lower()
        keep = not http10 and b"close" not in connection
        te = headers.get(b"transfer-encoding")
        length = headers.get(b"content-length")
        if te is not None:
            if te.strip().lower() != b"chunked":
                raise _Bad(f"unsupported Transfer-Encoding {te[:40]!r}")
            if length is not None:
                raise _Bad("both Transfer-Encoding and Content-Length")
            body = self._chunked(conn)
        elif length is not None:
            if not length.isdigit() or len(length) > 18:
                raise _Bad(f"a bad Content-Length {length[:40]!r}")
            n = int(length)
            if n > self.max_bytes:
                raise _TooLarge
            body = self._exactly(conn, n)
        else:
            body, keep = self._to_close(conn), False
        if conn.buf:  # bytes after the answer, unasked for: the connection is not trusted
            keep = False
        return (
            headers.get(b"content-type", b"").decode("latin-1"),
            headers.get(b"content-encoding", b"").decode("latin-1"),
            body,
            keep,
        )

    def get(self) -> tuple[str, str]:
        """Returns (text, content type). Raises CollectorError with a reason."""
        self.deadline = time.monotonic() + self.timeout
        content_type = encoding = ""
        body = b""
        reconnected = False
        while True:
            conn = self._conn
            try:
                if conn is None:
                    conn = self._conn = self._connect()
                content_type, encoding, body, keep = self._exchange(conn)
                if not keep:
                    self.close()
                break
            except CollectorError:
                self.close()
                raise
            except _Refused as exc:
                self.close()  # its body was not read
                self._request = self._plain_request
                try:
                    text = self.get()  # a deadline of its own: once, never again if it answers
                finally:
                    self._request = self._filtered_request
                self.unfilter(f"HTTP {exc.args[0]} to the filtered request")
                return text
            except TimeoutError as exc:
                self.close()
                raise CollectorError(
                    "timeout", f"{self.url} did not answer within {self.timeout}s"
                ) from exc
            except _TooLarge:
                self.close()
                raise CollectorError(
                    "too_large", f"{self.url} sent more than {self.max_bytes} bytes"
                ) from None
            except _Bad as exc:
                self.close()
                raise CollectorError("parse_error", f"{self.url}: bad HTTP answer: {exc}") from exc
            except (_Closed, ConnectionResetError, BrokenPipeError) as exc:
                self.close()  # a kept-alive connection the server closed: reconnect once
                kept = conn is not None and conn.answers > 0
                if reconnected or not (kept or isinstance(exc, _Closed)):
                    raise CollectorError("unreachable", f"{self.url}: {exc}") from exc
                reconnected = True
            except (OSError, ValueError, UnicodeError) as exc:  # ssl.SSLError is an OSError
                self.close()
                raise CollectorError(
                    "unreachable", f"{self.url}: {type(exc).__name__}: {exc}"
                ) from exc
        if encoding.lower() in ("gzip", "deflate", "x-gzip"):
            inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)
            try:
                body = inflate.decompress(body, self.max_bytes + 1)
            except zlib.error as exc:
                raise CollectorError("parse_error", f"{self.url}: bad {encoding} body") from exc
            if len(body) > self.max_bytes or inflate.unconsumed_tail:
                raise CollectorError("too_large", f"{self.url} inflates past {self.max_bytes}")
            if not inflate.eof:
                raise CollectorError("parse_error", f"{self.url}: a truncated {encoding} body")
        elif encoding and encoding.lower() != "identity":
            raise CollectorError("parse_error", f"{self.url}: unsupported encoding {encoding!r}")
        try:
            return body.decode("utf-8"), content_type
        except UnicodeDecodeError as exc:
            raise CollectorError("parse_error", f"{self.url} sent text that is not UTF-8") from exc
