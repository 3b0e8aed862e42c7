"""Step guard benchmark: what the guard costs each step, on the real vLLM server (target < 1 %).

Runs vLLM 0.33's own server (the twin's model-free executor on a twin H100, Llama-3-8B at
gpu_memory_utilization 0.9, time compression 1: each step takes its roofline time, 6-7 ms for a
decode step of a few sequences, 0.3 s for a full 8,192-token prefill chunk) under closed-loop
load: `--clients` users, most asking for short prompts and long outputs (decode steps), some for
long prompts (prefill chunks). The step guard times itself inside the engine (its memory reading
included: on the twin a re-read of the GPU state file at most every 20 ms, on a GPU one
`cudaMemGetInfo` and one read of the allocator's counters) and the steps it looks at (look to
look while the engine is busy); GET /oomguard/v1/step-guard reports both.

Phases, each `--seconds` long on a fresh engine:
- `observe`, healthy GPU: the common case, every full step fits (the guard reads, decides, and
  changes nothing);
- `enforce`, healthy GPU: the same with the guard enforcing (no shrink expected: do no harm);
- `enforce`, pressed: a neighbour holds 1 GiB more than a full step leaves free, so prefill
  steps shrink (the guard then also counts the step's demand).

Reported per phase: decisions, mean and worst cost per step (us), the mean step (ms), the cost's
share of a step, shrinks by kind, requests served and failed.

Usage: python -m bench.step_guard [--quick] [--seconds S] [--clients N]
       (writes bench/results/step_guard.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import record
from oomguard.lab.processes import MODELS, VllmProcess
from oomguard.twin.physics import Physics

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "step_guard.json"
MODEL = MODELS / "llama-3-8b"
GMU = 0.9
GIB = 2**30
PHASES = (("observe", "healthy"), ("enforce", "healthy"), ("enforce", "pressed"))


def slack_bytes() -> int:
    """What a full step leaves free on the twin H100 at GMU with nothing else on it."""
    p = Physics.for_model("llama-3-8b", gpu="H100", gpu_memory_utilization=GMU)
    return p.total - p.driver_reserved - p.resident - p.activation(p.max_num_batched_tokens)


async def load(url: str, clients: int, seconds: float) -> Counter[str]:
    """Closed-loop users: 1 in 5 sends a 6,000-token prompt, the rest 200 tokens, 64 out."""
    outcome: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def user(u: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                prompt = 6000 if (u + i) % 5 == 0 else 200
                body = {
                    "model": str(MODEL),
                    "prompt": [(u * 977 + i * 131 + k * 7) % 1000 + 3 for k in range(prompt)],
                    "max_tokens": 64,
                    "ignore_eos": True,
                }
                try:
                    r = await client.post("/v1/completions", json=body)
                    outcome[str(r.status_code)] += 1
                except httpx.HTTPError as exc:
                    outcome[type(exc).__name__] += 1
                i += 1

        await asyncio.gather(*(user(u) for u in range(clients)))
    return outcome


def phase(mode: str, gpu: str, seconds: float, clients: int, work: Path) -> dict[str, Any]:
    state = work / f"gpu-{mode}-{gpu}.json"
    neighbour = slack_bytes() + GIB if gpu == "pressed" else 0
    state.write_text(json.dumps({"neighbour_bytes": 0}))  # vLLM refuses to start beside it
    server = VllmProcess(
        "--no-skip-tokenizer-init",
        "--gpu-memory-utilization",
        str(GMU),
        "--max-model-len",
        "16384",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "64",
        log=work / f"vllm-{mode}-{gpu}.log",
        token="bench-step-guard",
        model=MODEL,
        timeout=600,
        env={
            "OOMGUARD_TWIN_GPU": "H100",
            "OOMGUARD_TWIN_MODEL": "llama-3-8b",
            "OOMGUARD_TWIN_TIME_COMPRESSION": "1",
            "OOMGUARD_TWIN_STATE_FILE": str(state),
            "OOMGUARD_GUARD_MODE": "off",
            "OOMGUARD_STEP_GUARD_MODE": mode,
            "HF_HUB_OFFLINE": "1",
        },
    )
    try:
        state.write_text(json.dumps({"neighbour_bytes": neighbour}))
        served = asyncio.run(load(server.url, clients, seconds))
        [engine] = httpx.get(f"{server.url}/oomguard/v1/step-guard", timeout=10).json()["engines"]
    finally:
        server.stop()
    decisions = max(1, engine["decisions"])
    cost_us = engine["cost_ns_total"] / decisions / 1000
    step_ms = 1000 * engine["step_seconds_total"] / max(1, engine["steps_timed"])
    return {
        "mode": mode,
        "gpu": gpu,
        "neighbour_gib": round(neighbour / GIB, 2),
        "decisions": engine["decisions"],
        "cost_us_mean": round(cost_us, 1),
        "cost_us_max": round(engine["cost_ns_max"] / 1000, 1),
        "step_ms_mean": round(step_ms, 2),
        "cost_share_of_step": round(cost_us / 1000 / step_ms, 5) if step_ms else None,
        "shrinks": engine["shrinks"],
        "requests": dict(served),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s phases, 8 clients")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    seconds, clients = (10.0, 8) if args.quick else (args.seconds, args.clients)
    rows = []
    with tempfile.TemporaryDirectory(prefix="oomguard-step-guard-") as tmp:
        for mode, gpu in PHASES:
            row = phase(mode, gpu, seconds, clients, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    healthy = [r for r in rows if r["gpu"] == "healthy"]
    targets = {
        "cost_below_1pct_of_a_step": all(
            r["cost_share_of_step"] is not None and r["cost_share_of_step"] < 0.01 for r in rows
        ),
        "no_shrink_on_a_healthy_gpu": all(not r["shrinks"] for r in healthy),
        "shrinks_when_pressed": all(r["shrinks"] for r in rows if r["gpu"] == "pressed"),
        "every_request_served": all(set(r["requests"]) == {"200"} for r in rows),
    }
    record.write(
        args.out,
        "step_guard",
        args.quick,
        seconds=seconds,
        clients=clients,
        phases=rows,
        targets=targets,
    )
    print(json.dumps(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
