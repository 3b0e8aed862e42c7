"""The real `vllm serve` (vLLM 0.33 on the CPU platform) with the model-free executor and the
oomguard plugin, for tests."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oomguard import vllm_seam
from oomguard.lab.processes import TINY_MODEL, VllmProcess

MODEL = TINY_MODEL
TOKEN = "test-token-0123456789"
NEWEST = vllm_seam.newest().VERSION
AUTH = {"Authorization": f"Bearer {TOKEN}"}


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
        pytest.fail(f"vLLM is not installed; `make test` installs vllm=={NEWEST}")
    pytest.skip(f"vLLM not installed (run `make test`, which installs vllm=={NEWEST})")


class VllmServer(VllmProcess):
    def __init__(
        self, *extra: str, env: dict[str, str] | None = None, log: Path, timeout: float = 180
    ) -> None:
        super().__init__(*extra, log=log, token=TOKEN, env=env, timeout=timeout)

    def alive(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/oomguard/v1/state", timeout=10).json()


# One plain engine (16 sequences, 2,048 tokens, the twin's defaults) for the test files that need
# nothing else of it: tests/test_remediator_actuator.py and tests/test_remediator_e2e.py asked for
# this same server each (a vLLM start is half a minute of CPU on a 2-core machine). They share an
# xdist group, so the session fixture starts once, on the worker that runs them both.
PLAIN_SEQS = 16
PLAIN_GROUP = "plain-vllm"


@pytest.fixture(scope="session")
def plain_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    require_vllm()
    server = VllmServer(
        "--max-num-seqs",
        str(PLAIN_SEQS),
        "--max-model-len",
        "2048",
        log=tmp_path_factory.mktemp("plain-vllm") / "vllm.log",
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def plain_vllm(plain_vllm_server: VllmServer) -> VllmServer:
    """The shared plain engine as a fresh one is: serving at its startup cap (what an earlier
    test changed is put back through the plugin's own API, and checked)."""
    url = plain_vllm_server.url
    assert plain_vllm_server.proc.poll() is None, plain_vllm_server.tail()
    httpx.post(f"{url}/oomguard/v1/resume", headers=AUTH, timeout=10).raise_for_status()
    r = httpx.put(
        f"{url}/oomguard/v1/admission", json={"cap": PLAIN_SEQS}, headers=AUTH, timeout=10
    )
    r.raise_for_status()
    state = plain_vllm_server.state()
    assert (state["mode"], state["admission_cap"], state["startup_max_num_seqs"]) == (
        "serving",
        PLAIN_SEQS,
        PLAIN_SEQS,
    ), state
    return plain_vllm_server


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


class SteadyLoad:
    """Short completions from `clients` concurrent clients until closed; every status is kept, so
    a test can check that none was lost."""

    def __init__(self, url: str, clients: int, max_tokens: int, timeout: float = 60) -> None:
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.timeout = timeout
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout) as client:

            async def worker(k: int) -> None:
                i = k
                while not self.stop.is_set():
                    r = await complete(client, self.url, i, 16, self.max_tokens)
                    self.statuses.append(r.status_code)
                    i += 100

            await asyncio.gather(*(worker(k) for k in range(self.clients)))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(self.timeout + 30)
