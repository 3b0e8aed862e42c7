"""The step guard on the real vLLM server (issue 27, item 1).

Twin H100 at gpu_memory_utilization 0.9, time compression 1 (steps take their roofline time:
0.3 s for a full 8,192-token prefill chunk), prompts of 7,000 tokens arriving every 0.2 s (heavy
prefill load: every step a full chunk). A neighbour takes 9 GiB within 2 s: more than the 7.9
GiB a full step leaves free, so the next full chunk would raise a CUDA OOM (vLLM alone dies
here; tests/test_vllm_plugin_step_guard.py shows the physics), long before any alert could
drain the engine. With the step guard enforcing, steps shrink to what fits instead: no OOM,
every request served, the shrinks counted in the hand-off the exporter reads."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest

from oomguard.handoff import AllocatorReport
from oomguard.lab.processes import MODELS, VllmProcess
from oomguard.twin.physics import Physics, Step
from tests.vllm_server import TOKEN, require_vllm

pytestmark = pytest.mark.slow

MODEL = MODELS / "llama-3-8b"
GIB = 2**30
PHYSICS = Physics.for_model("llama-3-8b", gpu="H100", gpu_memory_utilization=0.9)
NEIGHBOUR = 9 * GIB


def test_a_neighbour_taking_the_gpu_in_two_seconds_under_heavy_prefill_kills_nothing(tmp_path):
    require_vllm()
    assert not PHYSICS.fits(Step(tokens=8192), neighbour=NEIGHBOUR)  # vLLM alone would die
    assert PHYSICS.fits(Step(tokens=64), neighbour=NEIGHBOUR)  # smaller steps still fit
    state = tmp_path / "gpu.json"
    state.write_text("{}")
    server = VllmProcess(
        "--no-skip-tokenizer-init",
        "--gpu-memory-utilization",
        "0.9",
        "--max-model-len",
        "16384",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "16",
        log=tmp_path / "vllm.log",
        token=TOKEN,
        model=MODEL,
        timeout=600,
        env={
            "OOMGUARD_TWIN_GPU": "H100",
            "OOMGUARD_TWIN_MODEL": "llama-3-8b",
            "OOMGUARD_TWIN_TIME_COMPRESSION": "1",
            "OOMGUARD_TWIN_STATE_FILE": str(state),
            "OOMGUARD_ALLOCATOR_DIR": str(tmp_path / "allocator"),
            "OOMGUARD_TARGET": "engine-0",
            "OOMGUARD_GUARD_MODE": "off",  # the step guard alone
            "OOMGUARD_STEP_GUARD_MODE": "enforce",
            "HF_HUB_OFFLINE": "1",
        },
    )

    async def load() -> list[int | str]:
        # generous: the backlog of prefills runs in smaller steps once the neighbour is there,
        # and a loaded 2-core machine slows the engine further
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:

            async def one(i: int) -> int | str:
                try:
                    r = await client.post(
                        "/v1/completions",
                        json={
                            "model": str(MODEL),
                            "prompt": [(i * 131 + k * 7) % 1000 + 3 for k in range(7000)],
                            "max_tokens": 8,
                        },
                    )
                    return r.status_code
                except httpx.HTTPError as exc:
                    return type(exc).__name__

            t0 = time.monotonic()
            tasks = []
            i = 0
            while (t := time.monotonic() - t0) < 8:
                share = min(1.0, max(0.0, (t - 3) / 2))  # from 3 s: 0 -> 9 GiB in 2 s
                state.write_text(json.dumps({"neighbour_bytes": int(share * NEIGHBOUR)}))
                tasks.append(asyncio.create_task(one(i)))
                i += 1
                await asyncio.sleep(0.2)
            while time.monotonic() - t0 < 9:  # the neighbour stays
                state.write_text(json.dumps({"neighbour_bytes": NEIGHBOUR}))
                await asyncio.sleep(0.2)
            return await asyncio.gather(*tasks)

    try:
        statuses = asyncio.run(load())
        assert Counter(statuses) == {200: len(statuses)}, (Counter(statuses), server.tail(40))
        [path] = (tmp_path / "allocator").glob("pid-*.json")
        report = AllocatorReport.from_json(path.read_text())
        assert report.ooms == 0
        shrinks = report.step_shrinks or {}
        assert shrinks.get("fewer_prefill_tokens/activations", 0) > 0, shrinks
        assert set(shrinks) <= {
            "fewer_prefill_tokens/activations",
            "decode_only/activations",
            "wait/activations",
        }
        assert "oomguard step guard (enforce): fewer_prefill_tokens" in server.tail(2000)
    finally:
        server.stop()
