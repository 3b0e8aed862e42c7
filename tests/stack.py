"""Live-test helpers: the exporter as a process, and a vLLM /metrics stand-in whose counters grow
like a serving engine's. Prometheus and Alertmanager come from oomguard.lab.processes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from oomguard import children
from oomguard.lab.processes import Prometheus
from tests.conftest import LocalServer, free_port

__all__ = ["Prometheus", "growing_metrics", "start_exporter", "stop"]

_COUNTER_LINE = re.compile(r"^(\S+?(?:_total|_sum|_count|_bucket)(?:\{.*\})?) (\S+)$")


def growing_metrics(fixture_text: str, frozen: tuple[str, ...] = ()) -> LocalServer:
    """Serves the vLLM fixture with counters and histograms scaled up on every scrape (but the
    series named in `frozen`, which keep the fixture's value)."""
    lines = fixture_text.splitlines()
    state = {"n": 0}
    lock = threading.Lock()

    def respond(_handler: Any) -> tuple[int, bytes, str]:
        with lock:
            state["n"] += 1
            factor = 1 + 0.01 * state["n"]
        out = []
        for line in lines:
            m = _COUNTER_LINE.match(line)
            grows = m is not None and not m.group(1).startswith(frozen)
            out.append(f"{m.group(1)} {float(m.group(2)) * factor}" if grows and m else line)
        return 200, ("\n".join(out) + "\n").encode(), "text/plain; version=0.0.4"

    return LocalServer(respond)


def start_exporter(*args: str) -> tuple[subprocess.Popen, str]:
    """`oomguard exporter` as a process on a free port; returns it once /healthz answers."""
    port = free_port()
    proc = children.popen(  # never outlives the test process
        [sys.executable, "-m", "oomguard", "exporter", "--listen", f"127.0.0.1:{port}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exporter exited early: {proc.stdout.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, f"127.0.0.1:{port}"
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("exporter did not become healthy in 20 s")


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM, as a service manager would; the exporter must exit 0. Returns its output."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError("exporter ignored SIGTERM") from None
    assert proc.returncode == 0, out
    return out
