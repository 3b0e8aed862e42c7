"""Request guard benchmark: the cost of one decision in vLLM's API server (target < 50 us).

Times `Guard.check` as vLLM calls it (through the hook on `assign_request_id`): building the
request shape from an EngineCoreRequest's fields, the estimate, the decision against the cached
headroom of `engines` engines, and the Prometheus counter. Requests are a mix: plain chat-sized
prompts (the common case, no extra transient), prompt_logprobs prompts up to 16K tokens, and n/top
logprobs requests. Pure CPU in one process: what each request pays, whatever the GPU.

With `--trace NAME --config default|guard` it runs one twin trace instead (oomguard.lab.runner: two
real vLLM engines on twin GPUs serving the trace's model with its tokenizer) with vLLM's defaults
(`default`, the guard off) or with the guard enforcing and nothing else of oomguard (`guard`: no
exporter, no remediator), and merges the outcome into the same file under `traces`. Per trace,
once both have run: CUDA OOMs of each, the guard's never-fit answers (HTTP 400 naming the
parameter and the limit), the requests it lost otherwise, and its goodput against the defaults'
(do no harm: >= 99 %). One trace and configuration per call keeps each run under ten minutes.

Usage: python -m bench.guard [--quick]   (writes bench/results/guard.json)
       python -m bench.guard --trace prompt-logprobs --config default
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import record
from oomguard.vllm_plugin.admission import Guard

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results" / "guard.json"
TRACE_CONFIGS = ("default", "guard")
NEVER_FIT = "this engine has at most"  # in every 400 the guard answers (vllm_plugin/guard.py)


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
    interleaved rounds so that a busy moment of the shared machine hits all three alike; and of
    the mix while one engine is pressed (fragmentation has taken its profiled step's room: every
    request goes through the full decision, long prompts are deferred)."""
    guard = Guard("observe")
    guard.update([engine_report(e, (3 + e) * 2**30) for e in range(engines)])
    pressed = Guard("observe")
    pressed.update([engine_report(e, -(2**27) if e == 0 else 7 * 2**30) for e in range(engines)])
    sets = {
        "mix": (guard, reqs),
        "plain": (guard, [r for r in reqs if _is_plain(r)]),
        "logprobs": (guard, [r for r in reqs if not _is_plain(r)]),
        "pressed": (pressed, reqs),
    }
    samples: dict[str, list[float]] = {k: [] for k in sets}
    for _ in range(rounds):
        for kind, (deciding, batch) in sets.items():
            start = time.perf_counter_ns()
            for r in batch:
                deciding.check(r)
            samples[kind].append((time.perf_counter_ns() - start) / len(batch) / 1000)
    return {
        "engines": engines,
        "requests_per_round": len(reqs),
        "plain_share": round(len(sets["plain"][1]) / len(reqs), 3),
        "rounds": rounds,
        "us_per_decision_median": round(statistics.median(samples["mix"]), 2),
        "us_per_decision_max_round": round(max(samples["mix"]), 2),
        "us_plain_median": round(statistics.median(samples["plain"]), 2),
        "us_logprobs_median": round(statistics.median(samples["logprobs"]), 2),
        "us_pressed_mix_median": round(statistics.median(samples["pressed"]), 2),
    }


def machine_speed() -> float:
    """Nanoseconds for a fixed pure-Python loop: compares runs on busy and quiet machines."""
    start = time.perf_counter_ns()
    total = 0
    for i in range(1_000_000):
        total += i & 7
    return (time.perf_counter_ns() - start) / 1_000_000


def guard_decisions(url: str) -> dict[str, float]:
    """`oomguard_guard_decisions_total` on one engine's /metrics, as 'action/reason': count
    (the engine as it is at the end; a restarted engine counts from its restart)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "oomguard_guard_decisions":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = f"{sample.labels['action']}/{sample.labels['reason']}"
                out[key] = out.get(key, 0) + sample.value
    return out


def run_trace(name: str, config: str) -> dict[str, Any]:
    """One trace with one configuration on the twin fleet: the outcome, as recorded, and the
    guard's decisions on each engine (what it deferred and why)."""
    from oomguard.lab.runner import Fleet
    from oomguard.twin.traces import Trace

    trace = Trace.load(name)
    fleet = Fleet(trace, config, start_timeout=600)
    try:
        fleet.start()
        fleet.replay()
        outcome = asdict(fleet.outcome())
        outcome["guard_decisions"] = [guard_decisions(e.url) for e in fleet.engines]
    finally:
        fleet.stop()
    never_fit = [r for r in outcome["refusals"] if NEVER_FIT in r]
    return {
        **outcome,
        "never_fit_400": len(never_fit),
        "lost_otherwise": outcome["lost"] - len(never_fit),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": round(os.getloadavg()[0], 1),
    }


def summary(outcomes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Defaults against the guard on one trace: the issue's proof, as booleans with figures."""
    d, g = outcomes["default"], outcomes["guard"]
    ratio = (
        g["goodput_tokens_per_s"] / d["goodput_tokens_per_s"] if d["goodput_tokens_per_s"] else None
    )
    return {
        "default_crashes": d["crashes"],
        "guard_crashes": g["crashes"],
        "guard_never_fit_400": g["never_fit_400"],
        "guard_lost_otherwise": g["lost_otherwise"],
        "guard_goodput_vs_default": round(ratio, 4) if ratio is not None else None,
        "defaults_crash": d["crashes"] > 0,
        "guard_zero_crashes_zero_lost": g["crashes"] == 0 and g["lost_otherwise"] == 0,
        "do_no_harm_99": ratio is not None and ratio >= 0.99,
    }


def record_trace(name: str, config: str) -> dict[str, Any]:
    outcome = run_trace(name, config)  # minutes: read the file after it
    data: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    traces = data.setdefault("traces", {})
    entry = traces.setdefault(name, {"outcomes": {}})
    entry["outcomes"][config] = {**outcome, "provenance": record.provenance("guard")}
    if set(TRACE_CONFIGS) <= set(entry["outcomes"]):
        entry["summary"] = summary(entry["outcomes"])
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")
    print(f"recorded {RESULTS}")
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace", help="run this twin trace instead of the cost benchmark")
    parser.add_argument("--config", choices=TRACE_CONFIGS, default="guard")
    args = parser.parse_args()
    if args.trace:
        entry = record_trace(args.trace, args.config)
        print(json.dumps({k: v for k, v in entry["outcomes"][args.config].items()}, indent=1))
        if "summary" in entry:
            print(json.dumps(entry["summary"], indent=1))
        return
    reqs = requests(500 if args.quick else 5000)
    rounds = 5 if args.quick else 20
    speed = machine_speed()
    results = [measure(engines, reqs, rounds) for engines in (1, 2, 8)]
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    record.write(
        RESULTS,
        "guard",
        args.quick,
        target_us=50,
        ns_per_reference_loop_iteration=round(speed, 1),
        results=results,
        load_average=round(os.getloadavg()[0], 1),
        note="Guard.check per request in the API server (observe mode, with its counter); "
        "logging of non-admit decisions is off at the default WARNING level of this script. "
        "plain: no logprobs (the hook's shortcut); logprobs: requests with prompt_logprobs, "
        "logprobs or n (cached constants; defers go through the full decision); pressed: the mix "
        "while engine 0 cannot run its profiled step (now -128 MiB of 7 GiB idle), every "
        "request through the full decision, prefill steps that do not fit deferred.",
        **({"traces": previous["traces"]} if "traces" in previous else {}),
    )
    for r in results:
        print(r)


if __name__ == "__main__":
    main()
