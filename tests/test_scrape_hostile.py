"""The scraper against broken and hostile upstreams: each case ends in a CollectorError with
its reason, within the timeout, and the scraper keeps working against a good answer after.

A raw socket server plays a script per connection: the bytes it sends, then what it does
(close, reset, hang, trickle). Each test would fail against a client that trusted the framing
(read past a Content-Length, took a truncated chunked body, waited on a slow-loris server)."""

from __future__ import annotations

import gzip
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest

from oomguard.errors import CollectorError
from oomguard.exporter.scrape import MAX_HEAD, Scraper
from tests.raw_server import RawServer

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
GOOD = OK_HEAD + b"Content-Length: 4\r\n\r\na 1\n"

Script = Callable[[socket.socket, int], None]  # (connection, request number on it)


class ScriptedServer(RawServer):
    """Reads each request head on a connection and plays `script` for it."""

    def __init__(self, script: Script) -> None:
        self.script = script
        super().__init__(self._requests)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def _requests(self, conn: socket.socket) -> None:
        buf, n = b"", 0
        while not self.stop.is_set():
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            buf = buf.split(b"\r\n\r\n", 1)[1]
            n += 1
            self.script(conn, n)


@pytest.fixture
def raw() -> Iterator[Callable[[Script], ScriptedServer]]:
    made: list[ScriptedServer] = []

    def make(script: Script) -> ScriptedServer:
        made.append(ScriptedServer(script))
        return made[-1]

    yield make
    for s in made:
        s.close()


def send(data: bytes, then: str = "keep") -> Script:
    def script(conn: socket.socket, _n: int) -> None:
        conn.sendall(data)
        if then == "close":
            conn.shutdown(socket.SHUT_WR)
            raise OSError("closed")
        if then == "reset":  # RST, not FIN: SO_LINGER 0
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raise OSError("reset")
        if then == "hang":
            time.sleep(30)

    return script


def fails(
    server: ScriptedServer, reason: str, timeout: float = 1.0, framed: bool = False, **kw: int
) -> str:
    """`framed`: a well-framed answer whose body is bad: its connection may be kept."""
    scraper = Scraper(server.url, timeout=timeout, **kw)
    started = time.monotonic()
    with pytest.raises(CollectorError) as exc:
        scraper.get()
    assert exc.value.reason == reason, str(exc.value)
    assert time.monotonic() - started < timeout + 1.0
    assert framed or scraper._conn is None  # nothing kept from a broken exchange
    return str(exc.value)


def test_a_good_answer_keeps_the_connection_for_the_next(raw):
    server = raw(send(GOOD))
    scraper = Scraper(server.url, timeout=1)
    assert scraper.get() == ("a 1\n", "text/plain; version=0.0.4")
    assert scraper.get()[0] == "a 1\n" and server.connections == 1


def test_a_chunked_answer_with_extensions_and_trailers(raw):
    body = b"4;ext=1\r\na 1\n\r\n4\r\nb 2\n\r\n0\r\nX-Trailer: y\r\n\r\n"
    server = raw(send(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body))
    scraper = Scraper(server.url, timeout=1)
    assert scraper.get()[0] == "a 1\nb 2\n"
    assert scraper.get()[0] == "a 1\nb 2\n" and server.connections == 1


def test_interim_100_continue_is_skipped(raw):
    server = raw(send(b"HTTP/1.1 100 Continue\r\n\r\n" + GOOD))
    assert Scraper(server.url, timeout=1).get()[0] == "a 1\n"


def test_a_body_over_the_limit_by_its_content_length_is_not_read(raw):
    server = raw(send(OK_HEAD + b"Content-Length: 5000000\r\n\r\n", then="hang"))
    fails(server, "too_large", max_bytes=1000)  # at once: not after waiting for 5 MB


def test_a_chunked_body_over_the_limit(raw):
    chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
    server = raw(send(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 3, "hang"))
    fails(server, "too_large", max_bytes=2000)


def test_a_body_to_the_close_over_the_limit(raw):
    server = raw(send(OK_HEAD + b"\r\n" + b"y" * 5000, then="close"))
    fails(server, "too_large", max_bytes=1000)


def test_a_body_to_the_close_is_read_and_the_connection_dropped(raw):
    server = raw(send(OK_HEAD + b"\r\nc 3\n", then="close"))
    scraper = Scraper(server.url, timeout=1)
    assert scraper.get()[0] == "c 3\n" and scraper._conn is None


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: -1\r\n",
        b"Content-Length: 4x\r\n",
        b"Content-Length: 4\r\nContent-Length: 5\r\n",
        b"Content-Length: 99999999999999999999999\r\n",
        b"Transfer-Encoding: gzip, chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
        b"Content-Length : 4\r\n",  # a space before the colon (request smuggling's favourite)
        b"X-Folded: a\r\n continued\r\n",  # obs-fold
        b"no colon here\r\n",
    ],
)
def test_bad_framing_headers_are_parse_errors(raw, head):
    server = raw(send(OK_HEAD + head + b"\r\na 1\n", then="hang"))
    fails(server, "parse_error")


@pytest.mark.parametrize(
    "answer",
    [
        b"\x00\xff garbage \x13\x37\r\n\r\n",
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    ],
)
def test_garbage_instead_of_a_status_line(raw, answer):
    server = raw(send(answer, then="hang"))
    assert "status line" in fails(server, "parse_error")


def test_a_head_that_never_ends_is_refused_at_its_limit(raw):
    server = raw(send(OK_HEAD + b"X-Pad: " + b"p" * (MAX_HEAD + 10), then="hang"))
    fails(server, "parse_error")


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\na 1\n\r\n0\r\n\r\n",  # not hex
        b"4\r\na 1\nXX0\r\n\r\n",  # no CRLF after the chunk
        b"-4\r\na 1\n\r\n0\r\n\r\n",
        b"fffffffffffffffff\r\n",  # 17 hex digits
    ],
)
def test_bad_chunks_are_parse_errors(raw, body):
    server = raw(send(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body, then="hang"))
    fails(server, "parse_error")


@pytest.mark.parametrize(
    "answer",
    [
        OK_HEAD + b"Content-Length: 100\r\n\r\na 1\n",  # 4 of 100 bytes
        OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n4\r\na 1\n\r\n",  # no last chunk
        OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n40\r\na 1\n",  # a chunk cut short
        OK_HEAD + b"Content-Le",  # a head cut short
    ],
)
@pytest.mark.parametrize("then", ["close", "reset"])
def test_a_truncated_answer_is_unreachable_not_a_short_page(raw, answer, then):
    server = raw(send(answer, then=then))
    fails(server, "unreachable")


@pytest.mark.parametrize(
    "answer",
    [
        OK_HEAD + b"Content-Length: 100\r\n\r\na 1\n",  # waits for bytes that never come
        OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n4\r\na 1\n\r\n",
        b"",  # accepts, reads the request, never answers
    ],
)
def test_a_server_that_stops_sending_is_cut_at_the_timeout(raw, answer):
    server = raw(send(answer, then="hang"))
    fails(server, "timeout", timeout=0.5)


def test_a_slow_loris_answer_is_cut_at_the_timeout_of_the_whole_exchange(raw):
    def trickle(conn: socket.socket, _n: int) -> None:  # a byte every 50 ms: each read succeeds
        for byte in GOOD[:-1]:
            time.sleep(0.05)
            conn.sendall(bytes([byte]))

    fails(raw(trickle), "timeout", timeout=0.5)


@pytest.mark.parametrize("status", [b"404 Not Found", b"500 Internal Server Error", b"204 No"])
def test_a_status_other_than_200(raw, status):
    server = raw(send(b"HTTP/1.1 " + status + b"\r\nContent-Length: 999999\r\n\r\n", "hang"))
    assert status[:3].decode() in fails(server, "http_status")


def test_a_reset_before_any_answer_is_unreachable(raw):
    server = raw(send(b"", then="reset"))
    fails(server, "unreachable")


def test_a_kept_connection_closed_by_the_server_is_tried_again_once(raw):
    def once_then_close(conn: socket.socket, n: int) -> None:
        conn.sendall(GOOD)
        if n == 1:
            time.sleep(0.05)
            conn.shutdown(socket.SHUT_RDWR)  # as a server dropping an idle keep-alive
            raise OSError("closed")

    server = raw(once_then_close)
    scraper = Scraper(server.url, timeout=1)
    assert scraper.get()[0] == "a 1\n"
    time.sleep(0.2)
    assert scraper.get()[0] == "a 1\n" and server.connections == 2


def test_extra_bytes_after_the_answer_drop_the_connection(raw):
    server = raw(send(GOOD + b"HTTP/1.1 200 OK\r\n"))  # unasked-for bytes after the body
    scraper = Scraper(server.url, timeout=1)
    assert scraper.get()[0] == "a 1\n" and scraper._conn is None


def test_a_body_that_is_not_utf8_and_an_unknown_encoding(raw):
    server = raw(send(OK_HEAD + b"Content-Length: 2\r\n\r\n\xff\xfe"))
    assert "UTF-8" in fails(server, "parse_error", framed=True)
    server = raw(send(OK_HEAD + b"Content-Encoding: br\r\nContent-Length: 4\r\n\r\na 1\n"))
    assert "encoding" in fails(server, "parse_error", framed=True)


@pytest.mark.parametrize(
    "body", [b"\x1f\x8b\x00\x00", gzip.compress(b"a 1\n" * 100)[:-20]], ids=["bad", "truncated"]
)
def test_a_bad_gzip_body(raw, body):
    head = OK_HEAD + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body)
    server = raw(send(head + body))
    fails(server, "parse_error", framed=True)


def test_nothing_listening_is_unreachable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(CollectorError) as exc:
        Scraper(f"http://127.0.0.1:{port}/metrics", timeout=1).get()
    assert exc.value.reason == "unreachable"


def test_the_request_names_the_host_and_path(raw):
    seen: list[bytes] = []

    def capture(conn: socket.socket) -> None:
        seen.append(conn.recv(65536))
        conn.sendall(GOOD)

    server = RawServer(capture)
    try:
        url = f"http://127.0.0.1:{server.port}/m?x=1"
        assert Scraper(url, timeout=1).get()[0] == "a 1\n"
    finally:
        server.close()
    line, *headers = seen[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert line == b"GET /m?x=1 HTTP/1.1"
    host = f"127.0.0.1:{server.port}".encode()
    assert b"Host: " + host in headers and b"Accept-Encoding: identity" in headers


def test_a_url_with_spaces_controls_or_non_ascii_is_sent_percent_encoded(raw):
    seen: list[bytes] = []

    def capture(conn: socket.socket, _n: int) -> None:
        conn.sendall(GOOD)

    server = raw(capture)
    original = server.handle

    def serve(conn: socket.socket) -> None:
        seen.append(conn.recv(65536, socket.MSG_PEEK))
        original(conn)

    server.handle = serve
    url = server.url.replace("/metrics", "/m étrics?a=b c&x=\x01")
    assert Scraper(url, timeout=1).get()[0] == "a 1\n"
    assert seen[0].startswith(b"GET /m%20%C3%A9trics?a=b%20c&x=%01 HTTP/1.1\r\n")
