"""Outcome benchmark: the same traces, same seeds, side by side, on the real vLLM scheduler.

For each trace (twin/traces/*.json) three configurations run one after the other on the same
two-engine twin fleet (twin/runner.py): vLLM's flags with no oomguard (`default`), a static
conservative `max_num_seqs` 48 (`static`), and oomguard with its default policy (`oomguard`).
Reported per trace: CUDA OOM crashes, requests lost, goodput (output tokens/s of requests whose
first token came within the trace's TTFT objective), preemptions, p99 TTFT, and the time from the
end of the pressure to engine 0 back at full admission; then the targets, met or not, and why.

Usage: python bench/outcome.py [--quick] [--trace NAME ...]   (writes bench/results/outcome.json)
--quick runs two traces at twice the time compression (the CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oomguard.twin.runner import CONFIGS, Outcome, run  # noqa: E402
from oomguard.twin.traces import Trace, names  # noqa: E402

from bench import record  # noqa: E402

QUICK = ("neighbour-growth", "do-no-harm")


def judge(trace: Trace, outcomes: dict[str, Outcome]) -> dict[str, object]:
    d, s, o = outcomes["default"], outcomes["static"], outcomes["oomguard"]
    best_static = max(d.goodput_tokens_per_s, s.goodput_tokens_per_s)
    checks: dict[str, object] = {
        "oomguard_zero_crashes": o.crashes == 0,
        "oomguard_zero_lost": o.lost == 0,
        "goodput_vs_best_static": round(o.goodput_tokens_per_s / best_static, 3)
        if best_static
        else None,
    }
    checks["goodput_at_least_95pct_of_best_static"] = (
        checks["goodput_vs_best_static"] is not None and checks["goodput_vs_best_static"] >= 0.95
    )
    if d.crashes:
        checks["above_defaults_where_defaults_crash"] = (
            o.goodput_tokens_per_s > d.goodput_tokens_per_s
        )
    if trace.name == "do-no-harm":
        ratio = o.goodput_tokens_per_s / d.goodput_tokens_per_s if d.goodput_tokens_per_s else None
        checks["do_no_harm_ratio"] = round(ratio, 3) if ratio is not None else None
        checks["do_no_harm_at_least_99pct"] = ratio is not None and ratio >= 0.99
    if trace.pressure_ends_s is not None:
        checks["recovery_within_60s"] = o.recovery_s is not None and o.recovery_s <= 60
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace", action="append", help="run only these traces")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "outcome.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other traces already recorded in --out (re-run some traces only)",
    )
    args = parser.parse_args()
    chosen = args.trace or (list(QUICK) if args.quick else names())
    traces: dict[str, object] = {}
    if args.merge and Path(args.out).exists():
        traces = json.loads(Path(args.out).read_text()).get("traces", {})
    for name in chosen:
        trace = Trace.load(name)
        if args.quick:
            trace = trace.model_copy(update={"time_compression": trace.time_compression * 2})
        print(f"{name}: {trace.description}", flush=True)
        outcomes = {config: run(trace, config) for config in CONFIGS}
        checks = judge(trace, outcomes)
        for config, o in outcomes.items():
            print(
                f"  {config:9s} crashes {o.crashes}  lost {o.lost}/{o.requests}  goodput "
                f"{o.goodput_tokens_per_s:8.1f} tok/s  p99 TTFT {o.ttft_p99_s}  preemptions "
                f"{o.preemptions}  recovery {o.recovery_s}  actions {len(o.actions)}",
                flush=True,
            )
        print(f"  targets: {json.dumps(checks)}", flush=True)
        traces[name] = {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "trace": trace.model_dump(),
            "outcomes": {c: o.__dict__ for c, o in outcomes.items()},
            "targets": checks,
        }
        record.write(args.out, "outcome", args.quick, traces=traces)  # after every trace
    return 0


if __name__ == "__main__":
    sys.exit(main())
