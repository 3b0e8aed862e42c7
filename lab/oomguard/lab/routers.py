"""Real routers in front of twin engines: vllm-router (PyPI, a Rust binary) and nginx (Debian),
configured as docs/vllm-plugin.md ("Behind a router") tells operators to.

Both bind 127.0.0.1 on free ports, log into their work folder and stop with their process group
(processes.Process). The settings come from `VllmRouterSettings` / `NginxSettings`, so the tests,
the fleet runner, the demo and bench/routers.py run exactly what the docs recommend, and a
measurement can change one setting (a 503 deferral, nginx told to retry 429) to show why.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from oomguard.contract import API_PREFIX
from oomguard.lab.processes import Process, free_port

ROUTERS = ("gateway", "vllm-router", "nginx")  # "gateway": the twin's own (runner.Gateway)
VLLM_ROUTER_VERSION = "0.1.17"  # pinned in requirements/lock.txt (dev extra)


class RouterMissing(RuntimeError):
    """The router's program is not installed; the message says how to install it."""


def vllm_router_binary() -> str:
    """The `vllm-router` console script of this environment (or on PATH)."""
    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
        "vllm-router"
    )
    if found is None:
        raise RouterMissing(
            f"vllm-router is not installed: pip install vllm-router=={VLLM_ROUTER_VERSION} "
            "(the dev extra pins it; `make setup` installs it)"
        )
    return found


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/bin/nginx") if Path(p).exists()), None
    )
    if found is None:
        raise RouterMissing(
            "nginx is not installed: apt-get install nginx (scripts/install-system-deps.sh, "
            "run by `make test`, installs it)"
        )
    return found


@dataclass(frozen=True)
class VllmRouterSettings:
    """vllm-router's flags that matter to a drain and a deferral (docs/vllm-plugin.md).

    `readiness`: health-check the plugin's /oomguard/v1/ready instead of /health, every
    `interval_s`, out after `failures` failed checks and back after `successes`; the drain's
    grace must cover interval x failures + the check's timeout."""

    policy: str = "cache_aware"  # vllm-router's default
    readiness: bool = True
    interval_s: int = 5
    failures: int = 2
    successes: int = 1
    timeout_s: int = 2


class VllmRouter(Process):
    """`vllm-router` in front of `workers` (base URLs)."""

    def __init__(
        self,
        workdir: Path,
        workers: list[str],
        settings: VllmRouterSettings = VllmRouterSettings(),
        timeout: float = 60.0,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port, metrics = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = settings
        health = (
            [
                "--health-check-endpoint",
                f"{API_PREFIX}/ready",
                "--health-check-interval-secs",
                str(settings.interval_s),
                "--health-failure-threshold",
                str(settings.failures),
                "--health-success-threshold",
                str(settings.successes),
                "--health-check-timeout-secs",
                str(settings.timeout_s),
            ]
            if settings.readiness
            else []
        )
        super().__init__(
            [
                vllm_router_binary(),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                # its Prometheus exporter binds 0.0.0.0:29000 unless told otherwise: two routers
                # (or two test workers) would collide
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(metrics),
                "--policy",
                settings.policy,
                "--worker-startup-check-interval",
                "1",
                *health,
                "--worker-urls",
                *workers,
            ],
            workdir / "vllm-router.log",
        )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        # /health answers before the workers are registered; /list_workers once they are
        self.wait_http(f"{self.url}/list_workers", timeout)

    def workers(self) -> list[str]:
        return list(httpx.get(f"{self.url}/list_workers", timeout=5).json().get("urls", []))


@dataclass(frozen=True)
class NginxSettings:
    """nginx's upstream and retry settings (docs/vllm-plugin.md). `retry_503`: a drain's 503
    goes to the next upstream, POST included (`http_503 non_idempotent`); `retry_429`: so does
    a deferral's 429 (not recommended: nginx then counts it as a failure and ejects the
    upstream, both of them under a burst); `max_fails`/`fail_timeout`: nginx's defaults."""

    retry_503: bool = True
    retry_429: bool = False
    max_fails: int = 1
    fail_timeout_s: int = 10
    tries: int = 3
    read_timeout_s: int = 600


def nginx_config(
    workdir: Path, port: int, workers: list[str], settings: NginxSettings = NginxSettings()
) -> str:
    """A complete nginx.conf: one upstream of `workers` (http://host:port), one server."""
    servers = "\n".join(
        f"    server {w.removeprefix('http://').rstrip('/')} "
        f"max_fails={settings.max_fails} fail_timeout={settings.fail_timeout_s}s;"
        for w in workers
    )
    retry = ["error", "timeout"]
    if settings.retry_503:
        retry.append("http_503")
    if settings.retry_429:
        retry.append("http_429")
    if settings.retry_503 or settings.retry_429:
        retry.append("non_idempotent")  # inference is a POST: never retried without it
    w = workdir
    return f"""worker_processes 1;
pid {w}/nginx.pid;
error_log {w}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log {w}/access.log;
  client_body_temp_path {w}/tmp-body;
  proxy_temp_path {w}/tmp-proxy;
  fastcgi_temp_path {w}/tmp-fastcgi;
  uwsgi_temp_path {w}/tmp-uwsgi;
  scgi_temp_path {w}/tmp-scgi;
  upstream vllm {{
{servers}
    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{port};
    # long prompts: nginx's 1 MB default refuses a 100K-token prompt (413); kept in memory, so
    # the workers (not root) need no writable temp folder
    client_max_body_size 64m;
    client_body_buffer_size 64m;
    location / {{
      proxy_pass http://vllm;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout {settings.read_timeout_s}s;
      proxy_next_upstream {" ".join(retry)};
      proxy_next_upstream_tries {settings.tries};
    }}
  }}
}}
"""


class Nginx(Process):
    """nginx (foreground, its own prefix and logs) in front of `workers`."""

    def __init__(
        self,
        workdir: Path,
        workers: list[str],
        settings: NginxSettings = NginxSettings(),
        timeout: float = 30.0,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.settings = settings
        conf = workdir / "nginx.conf"
        conf.write_text(nginx_config(workdir, self.port, workers, settings))
        binary = nginx_binary()
        super().__init__(
            [binary, "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"],
            workdir / "nginx.out",
        )
        self.wait_listening(timeout)

    def wait_listening(self, timeout: float) -> None:
        import socket
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited:\n{self.tail()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"nginx did not listen on {self.port} within {timeout}s")
