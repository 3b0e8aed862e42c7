"""Shared test helpers: fixture paths, free ports, tiny local HTTP servers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from oomguard.lab.processes import free_port  # noqa: F401  # tests import it from here

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

# vLLM inspects each model architecture it meets in a subprocess of its own (a vLLM import, about
# 10 s of CPU) and caches the answer under VLLM_CACHE_ROOT/modelinfos, keyed by a hash of the
# model's source file. On a machine whose cache is cold (a fresh CI box) that was 21 imports in
# tests/test_budget_vllm.py alone: 283 s there, 30 s with the cache warm. The suite brings its
# own copy of vLLM's answers for the architectures it uses (tests/fixtures/vllm-modelinfos/, for
# the vLLM in requirements/lock.txt; tests/test_budget_vllm.py fails when they go stale), in a
# cache root of its own, so every run is as warm as a developer's second one. A stale or missing
# entry is only slower: vLLM checks the hash and inspects afresh.
MODELINFOS = Path(__file__).parent / "fixtures" / "vllm-modelinfos"
if "VLLM_CACHE_ROOT" not in os.environ:
    _cache_root = Path(tempfile.mkdtemp(prefix="oomguard-tests-vllm-cache-"))
    shutil.copytree(MODELINFOS, _cache_root / "modelinfos")
    os.environ["VLLM_CACHE_ROOT"] = str(_cache_root)  # every vLLM the tests start inherits it
    atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)

# -- parallel runs (`make test`: pytest -n 2 --dist loadgroup --no-loadscope-reorder) -----------
# xdist's unit of work is a test file (module fixtures start a vLLM or a stack once), except that
# every test using the wheel or its venv is one unit (a worker builds them for itself) and files
# that share a session's server name their group (xdist_group). xdist hands out units in
# collection order, each to the first worker that runs low (2 tests or fewer left). So the units
# go longest first and the many short ones fill in at the end: the two workers then end within a
# short unit of each other. In the plain alphabetical order a vLLM file near the end of the
# alphabet (test_vllm_plugin_step_guard_server.py, a minute or more) could start as the other
# worker ran out of work, and the run waited for it alone.
#
# Seconds per unit: a single-file run under `nice -n 19` on the 2-core machine while benchmarks
# ran (load 3-6), rounded; the wheel's from a 2-worker CI run. Their order is what matters, not
# their values. A unit not listed counts as short (0); tests/test_schedule.py fails when a file
# that starts a vLLM server (or a fleet of them, or vLLM's sizing) is not listed.
UNIT_SECONDS = {
    "wheel": 480,  # the wheel, its venv, the full demo (five vLLMs), PyPI resolves (CI, earlier)
    "test_incidents_induced.py": 200,  # six supervised vLLM starts, one per incident type
    "test_restart.py": 190,  # one supervised vLLM, restarted four times, a failing start
    "test_bench_quick.py": 160,  # a vLLM, the step guard lane's, the detection lane's stack
    "test_routers.py": 140,  # two vLLMs behind vllm-router and nginx
    "test_rehearsal.py": 140,  # docs/single-box.md's rehearsal: vLLM, the stack, a neighbour
    "test_preflight.py": 125,  # two vLLMs, pushed until each finds its limit
    "restart-durable-vllm": 120,  # test_restart_durable.py: one supervised vLLM, two restarts
    "test_outcome_bench.py": 115,  # two vLLMs, Prometheus, Alertmanager, a trace
    "durable-vllm": 110,  # test_remediator_durable.py: one vLLM, remediators killed
    "test_vllm_plugin_guard_server.py": 85,  # two vLLMs
    "test_vllm_plugin_guard_trace.py": 70,  # a fleet of one vLLM, a trace
    "test_vllm_plugin_step_guard_server.py": 65,
    "plain-vllm": 65,  # test_remediator_e2e.py and test_remediator_actuator.py: one vLLM
    "test_vllm_plugin_dp.py": 60,  # one data-parallel vLLM (two engines)
    "test_budget_vllm.py": 60,  # one vLLM child builds the 41 corpus models (model info seeded)
    "test_vllm_plugin.py": 60,
    "twin-oom-child": 50,  # test_incidents.py and test_vllm_plugin_oom.py (tests/twin_oom.py)
    "test_fleet_routers.py": 50,  # two vLLMs behind vllm-router
    "test_cli_hostile.py": 50,  # hundreds of forked command lines
    "test_vllm_plugin_guard_concurrency.py": 50,
    "test_live_stack.py": 40,  # Prometheus, Alertmanager, exporter, remediator: waits for data
    # no vLLM, but tens of seconds each (promtool, replays, watches that time out); the hook
    # sorts by the seconds, not by this order
    "test_alert_rules.py": 70,
    "test_incident_pages.py": 45,
    "test_remediator_discovery.py": 40,
    "test_pressure.py": 40,
    "test_budget.py": 25,
    "test_exporter_http_bounds.py": 25,
    "test_status.py": 20,
    "test_outcome_load.py": 17,
    "test_children.py": 17,
    "test_wedged.py": 15,
    "test_operator_scrape.py": 15,
    "test_vllm032.py": 0,  # skips unless the vLLM 0.32 lane is set up (make test-vllm032)
}


def unit_seconds(name: str) -> int:
    return UNIT_SECONDS.get(name, 0)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process: the plain order
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            shared = {"wheel", "installed"} & set(getattr(item, "fixturenames", ()))
            item.add_marker(pytest.mark.xdist_group("wheel" if shared else item.path.name))

    def longest_first(item: pytest.Item) -> int:
        mark = item.get_closest_marker("xdist_group")
        return -unit_seconds(str(mark.args[0]) if mark and mark.args else "")

    items.sort(key=longest_first)  # stable: each file keeps its own order


FIXTURES = Path(__file__).parent / "fixtures"
VLLM_FIXTURE = FIXTURES / "vllm" / "vllm-dp2-multiproc.constructed.prom"
DCGM_K8S = FIXTURES / "dcgm" / "h100x2-k8s.prom"
DCGM_MIG = FIXTURES / "dcgm" / "h100-mig.prom"


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
