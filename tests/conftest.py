"""Shared test helpers: fixture paths, free ports, tiny local HTTP servers."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# the twin's OOM in a child process, run once (test_vllm_plugin_oom.py, test_incidents.py)
from tests.twin_oom import twin_oom_dir  # noqa: F401

# one plain vLLM engine per session (test_remediator_actuator.py, test_remediator_e2e.py)
from tests.vllm_server import plain_vllm, plain_vllm_server  # noqa: F401

# the wheel and its installed virtualenv, one each per session (test_packaging.py, test_demo.py)
from tests.wheel_env import installed, wheel  # noqa: F401

# vLLM picks its platform once per process, at the first import that asks; with no GPU only this
# variable makes it the CPU. Set before any test imports vLLM here, in whatever order they run (a
# test that imports the twin's executor first would otherwise leave vLLM without a device type).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# `oomguard budget` sizes with vLLM's own code where vLLM is importable (tens of seconds a call
# here); its CLI tests use the pure path, and tests/test_budget_vllm.py asks for vLLM's by flag.
os.environ.setdefault("OOMGUARD_SIZING", "python")

# -- parallel runs (`make test`: pytest -n 2 --dist loadgroup --no-loadscope-reorder) -----------
# xdist's unit of work is a test file (module fixtures start a vLLM or a stack once), except that
# every test using the wheel or its venv is one unit: a worker builds them for itself. The longest
# units (minutes each, several vLLMs) go first so that the two workers end together; xdist hands
# out units in collection order, each to the first worker that runs low.
LONG_FIRST = (  # by their time in a 2-worker run (22:03 UTC), longest first
    "wheel",  # the wheel, its venv, the full demo, a PyPI resolve: 7 min
    "test_incidents_induced.py",
    "test_restart.py",
    "test_vllm_plugin_dp.py",
    "test_outcome_bench.py",
    "test_bench_quick.py",  # one vLLM, and the detection lane's two with Prometheus
    "test_preflight.py",
    "test_live_stack.py",
    "test_vllm_plugin.py",
    "test_vllm032.py",  # the plugin smoke test on vLLM 0.32 (its own lane): 2.5 min
    "test_vllm_plugin_guard_server.py",
    "test_vllm_plugin_guard_trace.py",
    "twin-oom-child",  # test_incidents.py and test_vllm_plugin_oom.py (tests/twin_oom.py)
    "plain-vllm",  # test_remediator_e2e.py and test_remediator_actuator.py: one engine
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process: the plain order
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            shared = {"wheel", "installed"} & set(getattr(item, "fixturenames", ()))
            item.add_marker(pytest.mark.xdist_group("wheel" if shared else item.path.name))

    def rank(item: pytest.Item) -> int:
        mark = item.get_closest_marker("xdist_group")
        name = str(mark.args[0]) if mark and mark.args else ""
        return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order


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
