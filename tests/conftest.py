"""Shared test helpers: fixture paths, free ports, tiny local HTTP servers."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# the wheel and its installed virtualenv, one each per session (test_packaging.py, test_demo.py)
from tests.wheel_env import installed, wheel  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures"
VLLM_FIXTURE = FIXTURES / "vllm" / "vllm-dp2-multiproc.constructed.prom"
DCGM_K8S = FIXTURES / "dcgm" / "h100x2-k8s.prom"
DCGM_MIG = FIXTURES / "dcgm" / "h100-mig.prom"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Responder = Callable[[BaseHTTPRequestHandler], tuple[int, bytes, str]]


class LocalServer:
    """An HTTP server on 127.0.0.1 whose answer the test can change at any time."""

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                status, body, ctype = outer.responder(self)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    def serve_text(self, text: str, ctype: str = "text/plain; version=0.0.4") -> None:
        self.responder = lambda _h: (200, text.encode(), ctype)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def local_server() -> Iterator[Callable[[str], LocalServer]]:
    servers: list[LocalServer] = []

    def make(text: str = "") -> LocalServer:
        server = LocalServer(lambda _h: (200, text.encode(), "text/plain; version=0.0.4"))
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
