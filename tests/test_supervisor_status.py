"""`oomguard serve`'s /v1/status is cheap to read and never holds up its other routes.

The status is read often: the remediator's flag reads, `oomguard status`, a dashboard, the lab's
watcher (ten times a second per engine). Each read asks vLLM's /health. Building an HTTP client
for that costs ~20 ms of CPU (its SSL context): the lab's creep runs showed `oomguard serve` at
~10 % of a core per engine, nearly all of it there, on a machine whose cores vLLM needs. And a
health check waiting on a busy vLLM inside the event loop held up /healthz and a restart.

The supervisor and its API are the real ones; the child is a stand-in HTTP server that answers
/health like vLLM does, counts the connections it accepts and can be made slow.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from oomguard.remediator.config import AuthConfig, RemediatorConfig
from oomguard.remediator.main import restart_backends
from oomguard.remediator.restart import SupervisorBackend
from oomguard.remediator.supervisor import Supervisor, create_app
from tests.conftest import free_port

TOKEN = "supervisor-status-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# vLLM's /health, keep-alive like uvicorn's: one line per accepted connection in argv[1], and
# each answer delayed by the seconds in argv[1] + ".delay" when that file exists
CHILD = r"""
import http.server, pathlib, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
conns = pathlib.Path(sys.argv[1])
delay = pathlib.Path(sys.argv[1] + ".delay")
class Health(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):
        super().setup()
        with conns.open("a") as f:
            f.write("accepted\n")
    def do_GET(self):
        if delay.exists():
            time.sleep(float(delay.read_text()))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class Served:
    def __init__(self, sup: Supervisor, url: str, conns: Path) -> None:
        self.sup, self.url, self.conns = sup, url, conns

    def accepted(self) -> int:
        return len(self.conns.read_text().splitlines()) if self.conns.exists() else 0

    def slow(self, seconds: float) -> None:
        Path(f"{self.conns}.delay").write_text(str(seconds))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    conns = tmp_path / "connections"
    argv = [sys.executable, "-c", CHILD, str(conns), "--port", str(free_port())]
    sup = Supervisor(
        [*argv, "--max-num-seqs", "16", "--gpu-memory-utilization", "0.9"],
        tmp_path / "state",
        stop_timeout=5,
        cgroup_dir="",
    )
    sup.start()
    port = free_port()
    app = create_app(sup, AuthConfig(bearer_token_file=str(token)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not (server.started and sup.ready()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started and sup.ready(), "the stand-in vLLM never answered /health"
        yield Served(sup, f"http://127.0.0.1:{port}", conns)
    finally:
        server.should_exit = True
        thread.join(10)
        sup.stop()


def test_status_reads_share_one_kept_alive_connection_to_vllm(served: Served) -> None:
    before = served.accepted()
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=10) as client:
        for _ in range(10):
            status = client.get("/v1/status")
            assert status.status_code == 200 and status.json()["ready"] is True
    # a client (and its SSL context) per read would open a connection per read: 10
    assert served.accepted() - before <= 1


def test_a_slow_health_check_does_not_hold_up_healthz(served: Served) -> None:
    served.slow(3.0)  # past the health check's 2 s: not ready, said after 2 s
    finished: dict[str, float] = {}
    ready: list[bool] = []

    def read_status() -> None:
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=10) as client:
            ready.append(client.get("/v1/status").json()["ready"])
            finished["status"] = time.monotonic()

    reader = threading.Thread(target=read_status)
    reader.start()
    time.sleep(0.5)  # the status read is waiting on vLLM's /health now
    asked = time.monotonic()
    healthz = httpx.get(f"{served.url}/healthz", timeout=10)
    finished["healthz"] = time.monotonic()
    reader.join(10)
    assert healthz.status_code == 200 and ready == [False]
    # answered while the status read still waited (held up, it would come ~2.5 s later)
    assert finished["healthz"] < finished["status"]
    assert finished["healthz"] - asked < 1.5


def test_the_remediators_reads_of_a_supervisor_share_one_client(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = SupervisorBackend(served.url, lambda: TOKEN)
    built: list[object] = []
    init = httpx.Client.__init__

    def counted(self: httpx.Client, *args: object, **kwargs: object) -> None:
        built.append(self)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx.Client, "__init__", counted)
    for _ in range(5):
        view = backend.flags()
        assert view.current.max_num_seqs == 16
    assert built == []  # the backend's own client, built before; none per read


def test_every_supervisor_backend_of_a_remediator_shares_one_client(tmp_path: Path) -> None:
    """Each supervisor target gets its backend; they share one HTTP client (building one costs
    ~20 ms of CPU, at start and in `oomguard explain`), the one given or one made for them."""
    token = tmp_path / "stoken"
    token.write_text(TOKEN)
    config = RemediatorConfig.model_validate(
        {
            "targets": [
                {
                    "name": f"engine-{i}",
                    "url": f"http://127.0.0.1:{9000 + i}",
                    "restart": {
                        "supervisor": {
                            "url": f"http://127.0.0.1:{9100 + i}",
                            "token_file": str(token),
                        }
                    },
                }
                for i in range(4)
            ]
            + [{"name": "no-restart", "url": "http://127.0.0.1:9200"}],
            "auth": {"bearer_token_file": str(token)},
            "audit_log": str(tmp_path / "audit.jsonl"),
        }
    )
    backends = restart_backends(config)
    assert sorted(backends) == [f"engine-{i}" for i in range(4)]
    clients = {id(b.client) for b in backends.values() if isinstance(b, SupervisorBackend)}
    assert len(clients) == 1
    given = httpx.Client()
    try:
        backends = restart_backends(config, client=given)
        assert all(
            isinstance(b, SupervisorBackend) and b.client is given for b in backends.values()
        )
    finally:
        given.close()
