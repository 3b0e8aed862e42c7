"""The plugin's background work ends with the API server. Found in CI: an engine died of a CUDA
OOM, the API server shut down, and its process never exited — asyncio's shutdown cancels every
task once and waits for them, and the request guard's headroom refresh kept looping because
`asyncio.wait_for` (Python 3.11) swallows a cancel that arrives as the awaited call finishes,
which a dead engine's calls do at once. `oomguard serve` waits for the exit to restart vLLM."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard.vllm_plugin.admission import Guard
from oomguard.vllm_plugin.api import OomguardEndpointPlugin


def run_bounded(coro: Any) -> None:
    """asyncio.run without its final cancel-and-wait, which would hang on the very defect
    under test instead of failing."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()


def dead_engine(gate: asyncio.Future[None]) -> SimpleNamespace:
    async def call_utility_all_async(method: str, *args: Any) -> list[Any]:
        await gate
        raise RuntimeError("EngineCore encountered an issue")  # vLLM's EngineDeadError

    return SimpleNamespace(
        engine_core=SimpleNamespace(call_utility_all_async=call_utility_all_async)
    )


async def _cancel_as_the_call_fails() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    plugin = OomguardEndpointPlugin()
    plugin.engine_client = dead_engine(gate)
    guard = Guard(mode="enforce", refresh=0.01)
    task = loop.create_task(guard.run(lambda: plugin.call_engines("oomguard_headroom")))
    for _ in range(5):
        await asyncio.sleep(0)  # the refresh is waiting on the engine
    gate.set_result(None)
    await asyncio.sleep(0)  # the engine call fails; the refresh has not resumed yet
    task.cancel()  # the server shuts down in that moment
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done, "the guard's refresh outlived the cancel: vLLM would never exit"
    assert task.cancelled()


def test_the_guard_refresh_ends_when_cancelled_as_an_engine_call_fails():
    run_bounded(_cancel_as_the_call_fails())


@pytest.mark.parametrize("delay", [0.0, 0.005])
def test_the_guard_refresh_ends_when_cancelled_at_any_moment(delay):
    async def run() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        gate.set_result(None)  # every call fails at once, as on a dead engine
        plugin = OomguardEndpointPlugin()
        plugin.engine_client = dead_engine(gate)
        task = loop.create_task(
            Guard(mode="observe", refresh=0.001).run(
                lambda: plugin.call_engines("oomguard_headroom")
            )
        )
        await asyncio.sleep(delay)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        assert task in done and task.cancelled()

    for _ in range(50):
        run_bounded(run())
