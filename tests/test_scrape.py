from __future__ import annotations

import gzip
import socket

import pytest

from oomguard.errors import CollectorError
from oomguard.exporter.scrape import Scraper


def test_keeps_the_connection_alive_and_reconnects_when_the_server_drops_it(local_server):
    server = local_server("a 1\n")
    scraper = Scraper(server.url, timeout=2)
    assert scraper.get() == ("a 1\n", "text/plain; version=0.0.4")
    conn = scraper._conn
    assert scraper.get()[0] == "a 1\n" and scraper._conn is conn  # reused
    conn.sock.shutdown(socket.SHUT_RDWR)  # as when the server drops an idle keep-alive
    assert scraper.get()[0] == "a 1\n"


@pytest.mark.parametrize("protocol", ["HTTP/1.0", "HTTP/1.0 no length", "HTTP/1.1 close"])
def test_reads_a_server_that_closes_after_each_answer(local_server, protocol):
    """An HTTP/1.0 server (Python's http.server, a WSGI reference server) or one that says
    `Connection: close` hands the socket to the response: the body must still be read (to the
    close, when no Content-Length says where it ends), and the next scrape reconnects."""
    server = local_server("c 3\n")
    handler = server.httpd.RequestHandlerClass
    if protocol.startswith("HTTP/1.0"):
        handler.protocol_version = "HTTP/1.0"
        if protocol.endswith("no length"):
            send_header = handler.send_header

            def without_length(self, keyword, value):
                if keyword != "Content-Length":
                    send_header(self, keyword, value)

            handler.send_header = without_length
    else:
        original = handler.end_headers

        def end_headers(self):
            self.send_header("Connection", "close")
            original(self)

        handler.end_headers = end_headers
    scraper = Scraper(server.url, timeout=2)
    for _ in range(2):
        assert scraper.get()[0] == "c 3\n"
        assert scraper._conn is None  # nothing kept: the server closed it


def test_gzip_body_is_inflated_within_the_limit(local_server):
    server = local_server()
    payload = gzip.compress(b"b 2\n")

    def respond(handler):
        return 200, payload, "text/plain"

    server.responder = respond
    # the test server cannot set Content-Encoding through its helper: send it by hand
    original = server.httpd.RequestHandlerClass.end_headers

    def end_headers(self):
        self.send_header("Content-Encoding", "gzip")
        original(self)

    server.httpd.RequestHandlerClass.end_headers = end_headers
    assert Scraper(server.url, timeout=2).get()[0] == "b 2\n"
    with pytest.raises(CollectorError) as exc:
        server.responder = lambda _h: (200, gzip.compress(b"x" * 5000), "text/plain")
        Scraper(server.url, timeout=2, max_bytes=1000).get()
    assert exc.value.reason == "too_large"


def test_oversized_body_closes_the_dirty_connection(local_server):
    server = local_server("y" * 5000)
    scraper = Scraper(server.url, timeout=2, max_bytes=1000)
    with pytest.raises(CollectorError) as exc:
        scraper.get()
    assert exc.value.reason == "too_large" and scraper._conn is None


def test_only_http_urls():
    with pytest.raises(ValueError, match="http"):
        Scraper("file:///etc/passwd", timeout=1)
