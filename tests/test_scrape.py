from __future__ import annotations

import gzip
import re
import socket
import threading
from urllib.parse import parse_qs, urlencode, urlsplit
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.vllm import WANTED, VllmCollector, filtered_url
from oomguard.exporter.scrape import Scraper
from oomguard.exporter.textparse import parse
from tests.conftest import VLLM_FIXTURE


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


# -- name[] filtering (prometheus_client's exposition: vLLM's /metrics) -------------------------


def _restricted(page: str, names: set[str]) -> str:
    """What prometheus_client sends for name[] parameters: each family with only the samples
    of those names (the families' HELP and TYPE lines kept), a family without any left out."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if any(not ln.startswith("#") for ln in block):
            out.extend(block)

    for line in page.splitlines(keepends=True):
        if line.startswith("# HELP"):
            flush()
            block = [line]
        elif line.startswith("#") or re.split(r"[{ ]", line, maxsplit=1)[0] in names:
            block.append(line)
    flush()
    return "".join(out)


def _names_asked(path: str) -> set[str] | None:
    query = urlsplit(path).query
    return set(parse_qs(query).get("name[]", [])) if query else None


def test_asks_for_the_named_samples_only_and_reads_the_same_engines(local_server):
    """A server that honours name[] at /metrics/ (as vLLM 0.33 does) sends a fraction of its
    page; the collector reads the same engines, numbers and invalid counts from it."""
    full = VLLM_FIXTURE.read_text()
    asked: list[tuple[str, set[str] | None]] = []

    def respond(handler):
        names = _names_asked(handler.path)
        asked.append((urlsplit(handler.path).path, names))
        page = full if names is None else _restricted(full, names)
        return 200, page.encode(), "text/plain; version=0.0.4"

    server = local_server()
    server.responder = respond
    collector = VllmCollector("t", server.url)
    filtered = collector.collect()
    assert asked == [("/metrics/", set(WANTED))]
    assert len(_restricted(full, set(WANTED))) * 10 < len(full)  # histogram buckets left out
    assert filtered == VllmCollector.reading_from(parse(full, WANTED))


def test_a_filtered_answer_that_is_not_a_vllm_page_turns_the_filter_off(local_server):
    """A server whose /metrics/ is something else (a 200 with an index page, no vLLM series):
    the configured URL is asked at once, and from then on only it."""
    paths: list[str] = []

    def respond(handler):
        paths.append(handler.path)
        if urlsplit(handler.path).path == "/metrics/":
            return 200, b"<html>index</html>\n", "text/html"
        return 200, VLLM_FIXTURE.read_bytes(), "text/plain; version=0.0.4"

    server = local_server()
    server.responder = respond
    collector = VllmCollector("t", server.url)
    for _ in range(2):
        assert len(collector.collect().engines) == 2
    assert [urlsplit(p).path for p in paths] == ["/metrics/", "/metrics", "/metrics"]
    assert [_names_asked(p) for p in paths] == [set(WANTED), None, None]


def test_an_upstream_that_ignores_name_filters_sends_the_whole_page_and_still_works(local_server):
    server = local_server(VLLM_FIXTURE.read_text())  # answers every path with the whole page
    paths: list[str] = []
    page = VLLM_FIXTURE.read_bytes()

    def respond(handler):
        paths.append(handler.path)
        return 200, page, "text/plain; version=0.0.4"

    server.responder = respond
    collector = VllmCollector("t", server.url)
    for _ in range(2):
        assert collector.collect() == VllmCollector.reading_from(parse(page.decode(), WANTED))
    assert [_names_asked(p) for p in paths] == [set(WANTED)] * 2  # it keeps asking: harmless


def test_an_upstream_that_refuses_name_filters_is_asked_without_them_from_then_on(local_server):
    paths: list[str] = []

    def respond(handler):
        paths.append(handler.path)
        if "?" in handler.path:
            return 400, b"unknown parameter", "text/plain"
        return 200, b"a 1\n", "text/plain; version=0.0.4"

    server = local_server()
    server.responder = respond
    scraper = Scraper(server.url, timeout=2, names=["a", "b"])
    assert scraper.filtered
    assert scraper.get()[0] == "a 1\n"  # the same get: asked again without the filter
    assert scraper.get()[0] == "a 1\n"
    assert [_names_asked(p) for p in paths] == [{"a", "b"}, None, None]
    assert not scraper.filtered


def test_an_error_from_both_requests_is_the_plain_ones_and_the_filter_stays(local_server):
    """An upstream that fails the plain request too is down, not refusing the filter: the
    scrape's error is the plain request's, and the next scrape asks with the filter again."""
    for status in (503, 404):
        paths: list[str] = []

        def respond(handler, status=status, paths=paths):
            paths.append(handler.path)
            return status, b"no", "text/plain"

        server = local_server()
        server.responder = respond
        scraper = Scraper(server.url, timeout=2, names=["a"])
        for _ in range(2):
            with pytest.raises(CollectorError) as exc:
                scraper.get()
            assert exc.value.reason == "http_status" and f"HTTP {status}" in str(exc.value)
            assert scraper.filtered
        assert [_names_asked(p) for p in paths] == [{"a"}, None] * 2


@pytest.mark.slow  # imports vLLM (seconds)
def test_vllm_serves_name_filters_at_metrics_slash_only():
    """What filtered_url relies on, read from the installed vLLM's own routes: /metrics is
    prometheus-fastapi-instrumentator's handler (the whole registry, name[] ignored) and
    /metrics/ prometheus_client's ASGI app (name[] honoured). When a vLLM upgrade changes
    that, this fails (the exporter still works: whole pages, or the fallback)."""
    metrics = pytest.importorskip("vllm.entrypoints.serve.instrumentator.metrics")
    testclient = pytest.importorskip("fastapi.testclient")
    from fastapi import FastAPI

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "r", registry=registry).set(3)
    Gauge("vllm:other", "o", registry=registry).set(4)
    app = FastAPI()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics, "get_prometheus_registry", lambda: registry)
        metrics.attach_router(app)
    client = testclient.TestClient(app)
    query = "?" + urlencode({"name[]": "vllm:num_requests_running"})

    def served(path: str) -> set[str]:
        answer = client.get(path, follow_redirects=False)
        assert answer.status_code == 200
        return {ln.split(" ")[0] for ln in answer.text.splitlines() if ln.startswith("vllm:")}

    assert served("/metrics" + query) == {"vllm:num_requests_running", "vllm:other"}
    assert served(filtered_url("http://h:8000/metrics").removeprefix("http://h:8000") + query) == {
        "vllm:num_requests_running"
    }
    assert filtered_url("http://h:8000/custom") == "http://h:8000/custom"


def test_names_in_the_request_are_those_prometheus_client_filters_on():
    """The parameters as prometheus_client's own exposition reads them (make_wsgi_app, the
    same code as vLLM's make_asgi_app): the answer holds the named samples and nothing else."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "r", labels, registry=registry).labels("m", "0").set(3)
    Counter("vllm:num_preemptions", "p", labels, registry=registry).labels("m", "0").inc(2)
    for name in ("vllm:request_prompt_tokens", "vllm:e2e_request_latency_seconds"):
        Histogram(name, "h", labels, registry=registry).labels("m", "0").observe(5)

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = make_server("127.0.0.1", 0, make_wsgi_app(registry), handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/metrics"
        text, _ = Scraper(url, timeout=2, names=WANTED).get()
    finally:
        httpd.shutdown()
        httpd.server_close()
    samples = {ln.split("{")[0] for ln in text.splitlines() if not ln.startswith("#")}
    assert samples == {
        "vllm:num_requests_running",
        "vllm:num_preemptions_total",
        "vllm:request_prompt_tokens_sum",
        "vllm:request_prompt_tokens_count",
    }
