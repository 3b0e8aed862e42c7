"""Request guard benchmark: the cost of one decision in vLLM's API server (target < 50 us).

Times `Guard.check` as vLLM calls it (through the hook on `assign_request_id`): building the
request shape from an EngineCoreRequest's fields, the estimate, the decision against the cached
headroom of `engines` engines, and the Prometheus counter. Requests are a mix: plain chat-sized
prompts (the common case, no extra transient), prompt_logprobs prompts up to 16K tokens, and n/top
logprobs requests. Pure CPU in one process: what each request pays, whatever the GPU.

Usage: python bench/guard.py [--quick]   (writes bench/results/guard.json)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from oomguard.vllm_plugin.admission import Guard  # noqa: E402


def requests(count: int, seed: int = 7) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = rng.random()
        prompt = rng.randint(16, 2048) if kind < 0.8 else rng.randint(1024, 16_384)
        out.append(
            SimpleNamespace(
                request_id=f"cmpl-{i}",
                prompt_token_ids=list(range(prompt)),
                sampling_params=SimpleNamespace(
                    n=rng.choice((1, 1, 1, 4)),
                    best_of=None,
                    logprobs=rng.choice((None, None, 5)),
                    prompt_logprobs=1 if 0.8 <= kind < 0.95 else None,
                    max_tokens=rng.randint(16, 1024),
                ),
            )
        )
    return out


def engine_report(engine: int, now: int) -> dict:
    return {
        "engine": engine,
        "vocab_size": 128_256,
        "hidden_size": 4096,
        "max_num_batched_tokens": 8192,
        "chunked_prefill": True,
        "block_size": 16,
        "total_kv_blocks": 26_000,
        "free_kv_blocks": 12_000,
        "memory": {"now": now, "idle": 7 * 2**30},
    }


def _is_plain(r: SimpleNamespace) -> bool:
    p = r.sampling_params
    return p.prompt_logprobs is None and not p.logprobs


def measure(engines: int, reqs: list[SimpleNamespace], rounds: int) -> dict[str, float]:
    """Per-decision cost of the mix, and of its plain and its logprobs requests alone, timed in
    interleaved rounds so that a busy moment of the shared machine hits all three alike."""
    guard = Guard("observe")
    guard.update([engine_report(e, (3 + e) * 2**30) for e in range(engines)])
    sets = {
        "mix": reqs,
        "plain": [r for r in reqs if _is_plain(r)],
        "logprobs": [r for r in reqs if not _is_plain(r)],
    }
    samples: dict[str, list[float]] = {k: [] for k in sets}
    for _ in range(rounds):
        for kind, batch in sets.items():
            start = time.perf_counter_ns()
            for r in batch:
                guard.check(r)
            samples[kind].append((time.perf_counter_ns() - start) / len(batch) / 1000)
    return {
        "engines": engines,
        "requests_per_round": len(reqs),
        "plain_share": round(len(sets["plain"]) / len(reqs), 3),
        "rounds": rounds,
        "us_per_decision_median": round(statistics.median(samples["mix"]), 2),
        "us_per_decision_max_round": round(max(samples["mix"]), 2),
        "us_plain_median": round(statistics.median(samples["plain"]), 2),
        "us_logprobs_median": round(statistics.median(samples["logprobs"]), 2),
    }


def machine_speed() -> float:
    """Nanoseconds for a fixed pure-Python loop: compares runs on busy and quiet machines."""
    start = time.perf_counter_ns()
    total = 0
    for i in range(1_000_000):
        total += i & 7
    return (time.perf_counter_ns() - start) / 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reqs = requests(500 if args.quick else 5000)
    rounds = 5 if args.quick else 20
    speed = machine_speed()
    results = [measure(engines, reqs, rounds) for engines in (1, 2, 8)]
    record.write(
        ROOT / "bench" / "results" / "guard.json",
        "guard",
        args.quick,
        target_us=50,
        ns_per_reference_loop_iteration=round(speed, 1),
        results=results,
        load_average=round(os.getloadavg()[0], 1),
        note="Guard.check per request in the API server (observe mode, with its counter); "
        "logging of non-admit decisions is off at the default WARNING level of this script. "
        "plain: no logprobs (the hook's shortcut); logprobs: the full estimate and decision.",
    )
    for r in results:
        print(r)


if __name__ == "__main__":
    main()
