"""The real `vllm serve` (vLLM 0.33 on the CPU platform) with the model-free executor and the
oomguard plugin, for tests. Started in its own process group and always stopped whole."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "twin" / "models" / "tiny-llama"
TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXECUTOR = "oomguard.twin.executor.ModelFreeExecutor"


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def require_vllm() -> None:
    """Skip on a developer machine without vLLM; in CI (`make test` installs it) fail instead."""
    if vllm_available():
        return
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed; `make test` installs vllm==0.33.0")
    pytest.skip("vLLM not installed (run `make test`, which installs vllm==0.33.0)")


class VllmServer:
    def __init__(self, *extra: str, env: dict[str, str] | None = None, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        vllm = shutil.which("vllm", path=str(Path(sys.executable).parent)) or "vllm"
        self.log_path = log
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [
                vllm,
                "serve",
                str(MODEL),
                "--skip-tokenizer-init",
                "--distributed-executor-backend",
                EXECUTOR,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *extra,
            ],
            env={
                **os.environ,
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_PLUGINS": "oomguard",
                "OOMGUARD_PLUGIN_TOKEN": TOKEN,
                **(env or {}),
            },
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready(180)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.tail()
                self.stop()
                raise AssertionError(f"vllm serve exited: {tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = self.tail()
        self.stop()
        raise AssertionError(f"vllm serve not ready in {timeout}s: {tail}")

    def tail(self, n: int = 40) -> str:
        if not self.log.closed:
            self.log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-n:])

    def alive(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/oomguard/v1/state", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with_group = os.getpgid(self.proc.pid)
            os.killpg(with_group, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(with_group, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def prompt(i: int, length: int) -> list[int]:
    """Distinct token ids per request, so prefix caching does not share their blocks."""
    return [(i * 7919 + k * 31) % 30000 + 10 for k in range(length)]


async def complete(
    client: httpx.AsyncClient, url: str, i: int, prompt_len: int, max_tokens: int
) -> httpx.Response:
    return await client.post(
        f"{url}/v1/completions",
        json={
            "model": str(MODEL),
            "prompt": prompt(i, prompt_len),
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)
