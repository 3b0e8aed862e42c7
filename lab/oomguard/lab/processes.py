"""Launching the real parts on one machine: vLLM (model-free), Prometheus, Alertmanager.

Used by `oomguard demo` and by the tests. Every process binds 127.0.0.1 on a port it is given,
runs in its own process group, and is stopped whole (vLLM forks its EngineCore). Each gets
SIGTERM when the process that started it dies, however it dies (oomguard.children): a demo or a
test killed with SIGKILL leaves nothing running.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from oomguard import children
from oomguard.contract import PLUGIN_TOKEN_ENV
from oomguard.paths import deploy_dir


def package_dir(package: str) -> Path:
    """A component's folder, found by import (its data sits inside it), never beside this file:
    the lab, the twin and the alerts are different import roots in a checkout."""
    return Path(str(resources.files(package)))


MODELS = package_dir("oomguard.twin") / "models"  # twin model folders: config, tokenizer
TINY_MODEL = MODELS / "tiny-llama"
EXECUTOR = "oomguard.twin.executor.ModelFreeExecutor"
RULES = package_dir("oomguard.alerts") / "generated" / "oomguard.rules.yaml"
PROMETHEUS_CONFIG = deploy_dir() / "prometheus" / "prometheus.yml"
ALERTMANAGER_CONFIG = deploy_dir() / "alertmanager" / "alertmanager.yml"


P = TypeVar("P", bound="Process")


# Ports this process has handed out. A supervised engine keeps its port across restarts, and
# while it is down the kernel may offer that same port again: the demo once gave a restarting
# engine's port to the next engine it started, and both then answered as one.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port(attempts: int = 100) -> int:
    """A port on 127.0.0.1 that is free now and that this process has not handed out before."""
    with _HANDED_OUT_LOCK:
        for _ in range(attempts):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError(f"no free port in {attempts} tries that was not handed out already")


class Process:
    """A child process with a log file, started in its own session, stopped with its group;
    it dies with this process (children.popen)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log.open("w")
        self.proc = children.popen(
            argv,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tail(self, n: int = 40) -> str:
        if not self.log.closed:
            self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"{self.argv[0]} exited:\n{tail}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tail = self.tail()
        self.stop()
        raise RuntimeError(f"{url} not ready within {timeout}s:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            children.signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                children.signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()


def vllm_command(
    port: int, model: Path, args: tuple[str, ...], tokenizer: bool = False
) -> list[str]:
    """`vllm serve` on 127.0.0.1:port with the model-free executor; `tokenizer`: load the model
    folder's offline tokenizer (text prompts, chat, prompt_logprobs) instead of skipping it."""
    vllm = shutil.which("vllm", path=str(Path(sys.executable).parent)) or "vllm"
    return [
        vllm,
        "serve",
        str(model),
        *([] if tokenizer else ["--skip-tokenizer-init"]),
        "--distributed-executor-backend",
        EXECUTOR,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


def vllm_env(token: str, env: dict[str, str] | None) -> dict[str, str]:
    """vLLM on the CPU platform with the oomguard plugin and its token."""
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_PLUGINS": "oomguard",
        PLUGIN_TOKEN_ENV: token,
        **(env or {}),
    }


def start_all(factories: list[Callable[[], P]]) -> list[P]:
    """Start processes in parallel (each vLLM takes seconds); all or none."""
    results: list[P | BaseException | None] = [None] * len(factories)

    def start(i: int) -> None:
        try:
            results[i] = factories[i]()
        except BaseException as exc:  # reported below, in the caller's thread
            results[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(factories))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = [r for r in results if isinstance(r, Process)]
    failed = [r for r in results if not isinstance(r, Process)]
    if failed:
        for proc in started:
            proc.stop()
        raise RuntimeError(f"a process did not start: {failed[0]}")
    return started


class VllmProcess(Process):
    """`vllm serve` on the CPU with the model-free executor and the oomguard plugin."""

    def __init__(
        self,
        *args: str,
        log: Path,
        token: str,
        env: dict[str, str] | None = None,
        model: Path = TINY_MODEL,
        timeout: float = 180,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        super().__init__(vllm_command(self.port, model, args), log, vllm_env(token, env))
        self.wait_http(f"{self.url}/health", timeout)


class Prometheus(Process):
    """Prometheus with the shipped config and rules; scrape targets set per job."""

    def __init__(
        self,
        workdir: Path,
        targets: dict[str, list[str]],
        alertmanager: str | None = None,
        scrape_interval: str = "1s",
        rules: Path = RULES,
        labels: dict[str, dict[str, str]] | None = None,
        every_job_at: str | None = None,
    ) -> None:
        """`labels`: extra target labels by address (an `instance` label names the node);
        `every_job_at`: one scrape interval for every job (the demo's pictures need 1 s data)."""
        config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
        config["rule_files"] = [str(rules)]
        config["global"]["scrape_interval"] = scrape_interval
        config["scrape_configs"] = [
            {
                **job,
                **({"scrape_interval": every_job_at} if every_job_at else {}),
                "static_configs": [
                    {"targets": [address], "labels": (labels or {}).get(address, {})}
                    for address in targets[job["job_name"]]
                ],
            }
            for job in config["scrape_configs"]
            if targets.get(job["job_name"])
        ]
        if alertmanager:
            config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
        else:
            config.pop("alerting")
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            [
                shutil.which("prometheus") or "prometheus",
                f"--config.file={path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            workdir / "prometheus.log",
        )
        self.wait_http(f"{self.url}/-/ready", 30)

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        if body["status"] != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        body = httpx.get(
            f"{self.url}/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": step},
            timeout=30,
        ).json()
        if body["status"] != "success":
            raise RuntimeError(f"query {expr!r} failed: {body.get('error', body)}")
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
        raise RuntimeError(f"{expr} returned no data within {timeout}s")


class Alertmanager(Process):
    """Alertmanager with the shipped routes, every webhook pointed at `webhook_base`."""

    def __init__(
        self, workdir: Path, webhook_base: str, token_file: Path, remediator: str | None = None
    ) -> None:
        config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
        for receiver in config["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = f"{webhook_base}/{receiver['name']}"
                if remediator and receiver["name"] == "remediator":
                    hook["url"] = f"{remediator}/v1/alertmanager"
                auth = hook.get("http_config", {}).get("authorization")
                if auth:
                    auth["credentials_file"] = str(token_file)
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        super().__init__(
            [
                binary or "alertmanager",
                f"--config.file={path}",
                f"--storage.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            workdir / "alertmanager.log",
        )
        self.wait_http(f"{self.url}/-/ready", 30)


class RemediatorProcess(Process):
    """`oomguard remediator` with a config written from `config` (listen filled in)."""

    def __init__(
        self,
        workdir: Path,
        config: dict[str, Any],
        *extra: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        if "listen" not in config:
            config = {**config, "listen": f"127.0.0.1:{free_port()}"}
        self.config = config
        self.url = f"http://{config['listen']}"
        self.path = workdir / "remediator.yaml"
        self.path.write_text(yaml.safe_dump(config))
        super().__init__(
            [
                sys.executable,
                "-m",
                "oomguard.cli",
                "remediator",
                "--config",
                str(self.path),
                *extra,
            ],
            workdir / "remediator.log",
            env=env,
        )
        if wait:
            self.wait_http(f"{self.url}/healthz", 30)

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would end it (no clean shutdown)."""
        if self.proc.poll() is None:
            children.signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if not self.log.closed:
            self.log.close()


class SupervisedVllm(Process):
    """`oomguard serve -- vllm serve ...` (model-free executor, plugin): the local backend.
    `model`: the folder served (its config.json; with `tokenizer`, its tokenizer too)."""

    def __init__(
        self,
        workdir: Path,
        *args: str,
        plugin_token: str,
        supervisor_token_file: Path,
        env: dict[str, str] | None = None,
        restart_delay: float = 1.0,
        max_crashes: int = 5,
        timeout: float = 180,
        keep_flags_on_crash: bool = False,
        model: Path = TINY_MODEL,
        tokenizer: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = f"http://127.0.0.1:{free_port()}"
        self.token = supervisor_token_file.read_text().strip()
        argv = [
            sys.executable,
            "-m",
            "oomguard.cli",
            "serve",
            "--listen",
            self.api.removeprefix("http://"),
            "--token-file",
            str(supervisor_token_file),
            "--state-dir",
            str(workdir / "state"),
            "--restart-delay",
            str(restart_delay),
            "--max-crashes",
            str(max_crashes),
            "--stop-timeout",
            "30",
            *(["--keep-flags-on-crash"] if keep_flags_on_crash else []),
            "--",
            *vllm_command(self.port, model, args, tokenizer),
        ]
        super().__init__(argv, workdir / "supervisor.log", vllm_env(plugin_token, env))
        self.wait_http(f"{self.url}/health", timeout)

    def status(self) -> dict[str, Any]:
        return httpx.get(
            f"{self.api}/v1/status", headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        ).json()

    def stop(self) -> None:
        """Stop the supervisor (it stops vLLM); make sure vLLM's own session is gone too."""
        try:
            pid = self.status().get("pid")
        except (httpx.HTTPError, ValueError):
            pid = None
        super().stop()
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # only if it outlived the supervisor


def twin_exporter(
    targets: dict[str, str],
    nvml: Any,
    allocator_dir: Path,
    interval: float = 0.5,
    hostname: str = "twin-node",
    pressure: Any = None,
) -> tuple[Any, int]:
    """The real exporter, in this process, reading twin GPUs through its NVML code path.

    `targets`: vLLM target name -> base URL; target i sits on GPU i; `pressure`: its
    PressureThresholds (None: the shipped ones). Returns (exporter, port)."""
    from oomguard.exporter.config import ExporterConfig, VllmTarget
    from oomguard.exporter.main import Exporter
    from oomguard.thresholds import PressureThresholds

    port = free_port()
    exporter = Exporter(
        ExporterConfig(
            listen=f"127.0.0.1:{port}",
            interval_seconds=interval,
            hostname=hostname,
            pressure=pressure or PressureThresholds(),
            vllm=[
                VllmTarget(name=name, url=f"{url}/metrics", gpus=[str(i)])
                for i, (name, url) in enumerate(targets.items())
            ],
            cgroups=[],
            allocator={"directory": str(allocator_dir)},
        ),
        nvml_backend=nvml,
    )
    exporter.start()
    return exporter, port


@contextlib.contextmanager
def step_guard_hold_on_trace_clock(compression: float) -> Iterator[float]:
    """While it lasts, a step-guard shrink holds the level of the exporter running in this
    process for the shipped hold (pressure.STEP_GUARD_HOLD_S, 15 s) of *trace* time, i.e. divided
    by `compression` in wall time; yields that wall hold. Unscaled, one shrink held level 2 for
    225 trace seconds at x15, long after the memory it warned of came back (issue 30).

    A lab-side override of a module constant, not a threshold, on purpose: gpu-check.json
    measures exporter/pressure.py and only a session with a GPU can re-record it; the threshold
    (PressureThresholds, like event_hold_seconds) belongs to that session. Not for two fleets at
    different compressions in one process at once (the benchmarks run them one after another)."""
    from oomguard.exporter import pressure

    shipped = pressure.STEP_GUARD_HOLD_S
    pressure.STEP_GUARD_HOLD_S = shipped / compression
    try:
        yield pressure.STEP_GUARD_HOLD_S
    finally:
        pressure.STEP_GUARD_HOLD_S = shipped


def have_prometheus_stack() -> bool:
    return bool(
        shutil.which("prometheus")
        and (shutil.which("prometheus-alertmanager") or shutil.which("alertmanager"))
    )


class Inbox:
    """Receives the on-call receivers' webhooks (what the pager and the ticket queue would get)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        inbox = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = min(int(self.headers.get("Content-Length", 0) or 0), 1 << 20)
                body = self.rfile.read(length)
                try:
                    payload = json.loads(body)
                except json.JSONDecodeError:
                    payload = {}
                inbox.received.append(
                    {"at": time.time(), "receiver": self.path.strip("/"), "payload": payload}
                )
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
