"""Real processes for live tests: Prometheus, the exporter, and a vLLM /metrics stand-in whose
counters grow like a serving engine's. Every process binds 127.0.0.1 on a free port and is
stopped by the fixture that started it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import LocalServer, free_port

_COUNTER_LINE = re.compile(r"^(\S+?(?:_total|_sum|_count|_bucket)(?:\{.*\})?) (\S+)$")


def growing_metrics(fixture_text: str) -> LocalServer:
    """Serves the vLLM fixture with counters and histograms scaled up on every scrape."""
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
            out.append(f"{m.group(1)} {float(m.group(2)) * factor}" if m else line)
        return 200, ("\n".join(out) + "\n").encode(), "text/plain; version=0.0.4"

    return LocalServer(respond)


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"{proc.args[0]} exited: {proc.stdout.read() if proc.stdout else ''}"
            )
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready within {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Prometheus:
    """A real Prometheus with the shipped config, its targets pointed at this test's ports."""

    def __init__(
        self,
        repo_root: Path,
        workdir: Path,
        targets: dict[str, list[str]],
        alertmanager: str | None = None,
    ) -> None:
        config = yaml.safe_load((repo_root / "deploy/prometheus/prometheus.yml").read_text())
        config["rule_files"] = [str(repo_root / "alerts/generated/oomguard.rules.yaml")]
        config["global"]["scrape_interval"] = "1s"
        jobs = []
        for job in config["scrape_configs"]:
            if targets.get(job["job_name"]):
                job["static_configs"] = [{"targets": targets[job["job_name"]]}]
                jobs.append(job)
        config["scrape_configs"] = jobs
        if alertmanager:
            config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
        else:
            config.pop("alerting")
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                shutil.which("prometheus") or "prometheus",
                f"--config.file={path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_http(f"{self.url}/-/ready", 30, self.proc)

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def rules(self) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]

    def wait_for(self, expr: str, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.5)
        raise AssertionError(f"{expr} returned no data within {timeout}s")

    def close(self) -> None:
        stop(self.proc)


def start_exporter(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "oomguard", "exporter", "--listen", f"127.0.0.1:{port}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_http(f"http://127.0.0.1:{port}/healthz", 20, proc)
    return proc, f"127.0.0.1:{port}"
