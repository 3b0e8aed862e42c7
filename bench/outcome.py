"""Outcome benchmark: what a crash costs, and what oomguard saves, on the real vLLM scheduler.

For each trace (twin/traces/*.json) three configurations run one after the other on the same
two-engine twin fleet (twin/runner.py): vLLM's flags with no oomguard (`default`), a static
conservative `max_num_seqs` 48 (`static`), and oomguard with its default policy (`oomguard`:
the exporter, and the remediator in standalone mode with its shipped defaults, restart backends
on both engines). Every configuration is measured over the same **fixed horizon** that includes
recovery: the trace is extended (its steady traffic goes on) to the end of its GPU events plus
the trace's model reload time (`reload_s`, 12 minutes) plus two minutes, so a crash's reload is
counted, not cut off by the end of the trace.

Reported per trace and configuration: CUDA OOM crashes, requests lost (and why), goodput
(output tokens/s, over the horizon, of requests whose first token came within the trace's TTFT
objective), preemptions, p99 TTFT, the requests engine 0 held (running + queued) at the incident
(its first crash, or oomguard's first action on it) and at its peak, and the recovery: the time
from the end of the pressure to engine 0 back at full admission, with no re-trigger (a second
drain or lowering of engine 0 after the pressure ended counts as oscillation).

`--inflight N` adds, from a minute before the GPU trouble starts until the pressure ends,
enough long-output traffic (Little's law on the twin's roofline decode) for each engine to hold
about N requests at once (the issue's >= 64), and checks that every engine did at the incident.
Streams carry one chunk per 1/32 of the output (the first token at once), but the engines' step
clock is compressed: on a small machine run it at `--compression 4`, where the engines already
fall behind their clock (they then hold more than N).

Usage: python bench/outcome.py [--quick] [--trace NAME ...] [--inflight N] [--merge]
(writes bench/results/outcome.json after every trace). --quick: two traces at twice the time
compression (the CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from oomguard.twin.physics import Physics, Step  # noqa: E402
from oomguard.twin.runner import CONFIGS, Fleet, Outcome  # noqa: E402
from oomguard.twin.traces import Phase, Trace, names  # noqa: E402

QUICK = ("neighbour-growth", "do-no-harm")
HORIZON_MARGIN_S = 120.0
INCIDENT_LEAD_S = 60.0  # the in-flight load starts this long before the GPU trouble


def incident_s(trace: Trace) -> float | None:
    """When the trace's GPU trouble starts: its first GPU event with anything on it."""
    for p in sorted(trace.gpu_events, key=lambda p: p.at_s):
        if p.neighbour_gib > 0 or p.fragmentation_gib > 0:
            return p.at_s
    return None


def trouble_starts_s(trace: Trace) -> float | None:
    """When the GPU memory starts to go: the last empty GPU event before the first one with
    anything on it (the events are interpolated, so the ramp starts there)."""
    first = incident_s(trace)
    if first is None:
        return None
    before = [p.at_s for p in trace.gpu_events if p.at_s < first]
    return max(before, default=first)


# the in-flight load: short prompts, long outputs (decode dominates, so requests stay in flight)
INFLIGHT_PROMPT = (256, 512)
INFLIGHT_OUTPUT = (1536, 2048)


def inflight_rate(trace: Trace, inflight: int, engines: int = 2) -> float:
    """Arrivals per second that keep `inflight` requests in each engine (Little's law: rate x
    time in system), the time in system being the twin's roofline decode at that batch."""
    physics = Physics.for_model(
        trace.model,
        gpu=trace.gpu,
        gpu_memory_utilization=trace.engine.gpu_memory_utilization,
        max_num_batched_tokens=trace.engine.max_num_batched_tokens,
    )
    output = sum(INFLIGHT_OUTPUT) / 2
    context = inflight * (sum(INFLIGHT_PROMPT) / 2 + output / 2)  # mean context mid-decode
    step = physics.step_seconds(Step(tokens=inflight, attention=int(context), context=int(context)))
    return engines * inflight / (output * step)


def with_horizon(trace: Trace, inflight: int = 0) -> Trace:
    """The trace over a fixed horizon that includes a crash's reload; with `inflight`, extra
    long-output traffic from before the GPU trouble starts until the pressure ends, so each
    engine holds about that many requests at the incident."""
    end_events = max((p.at_s for p in trace.gpu_events), default=0.0)
    trouble_end = max(end_events, trace.pressure_ends_s or 0.0)
    horizon = max(trace.duration_s, trouble_end + trace.reload_s + HORIZON_MARGIN_S)
    phases = [
        p.model_copy(update={"end_s": horizon}) if p.end_s >= trace.duration_s else p
        for p in trace.phases
    ]
    start = trouble_starts_s(trace)
    if inflight and start is not None:
        begin = max(0.0, start - INCIDENT_LEAD_S)
        phases.append(
            Phase(
                start_s=begin,
                end_s=max(begin + 1, trouble_end),
                rate_per_s=round(inflight_rate(trace, inflight), 3),
                prompt_tokens=INFLIGHT_PROMPT,
                output_tokens=INFLIGHT_OUTPUT,
            )
        )
    return trace.model_copy(update={"duration_s": horizon, "phases": phases})


def engine0(fleet: Fleet, trace: Trace, o: Outcome) -> dict[str, Any]:
    """Engine 0 at the incident, at its peak, and during the recovery (with its remediator steps
    in trace time: the recovery's timeline), and what every engine held at the incident."""
    history = [views[0] for views in list(fleet.history)]
    wall0 = time.time() - (time.monotonic() - fleet.t0)  # the audit log's clock at trace 0
    steps: list[str] = []
    first_action = None
    if fleet.audit.exists():
        for line in fleet.audit.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "acted" and e["target"] == fleet.names[0]:
                at_s = (e["time"] - wall0) * fleet.c
                first_action = at_s if first_action is None else first_action
                cap = (e.get("after") or {}).get("cap")
                steps.append(f"{at_s:.1f} {e['action']}" + (f" {cap}" if cap is not None else ""))
    at = fleet.crash_times[0] if fleet.crash_times else first_action or incident_s(trace)
    held = [v.running + v.waiting for v in history if at is not None and v.t <= at and v.up]
    before = [views for views in list(fleet.history) if at is not None and views[0].t <= at]
    out: dict[str, Any] = {
        "incident_s": round(at, 1) if at is not None else None,
        "inflight_at_incident": held[-1] if held else None,
        "inflight_at_incident_per_engine": [v.running + v.waiting for v in before[-1]]
        if before
        else None,
        "inflight_peak": max((v.running + v.waiting for v in history), default=0),
        "engine0_steps": steps,
    }
    end = trace.pressure_ends_s
    if end is not None:
        # a re-trigger: engine 0 leaves full admission again after it first got back to it
        back = fleet.recovered_at()
        after = [v for v in history if back is not None and v.t > back]
        out["retriggered"] = any(v.up and v.mode in ("capped", "draining") for v in after)
        out["recovery_s"] = o.recovery_s
    return out


def run(trace: Trace, config: str) -> tuple[Outcome, dict[str, Any]]:
    fleet = Fleet(trace, config)  # oomguard: the fleet's remediator, shipped defaults + restarts
    try:
        fleet.start()
        fleet.replay()
        o = fleet.outcome()
        return o, engine0(fleet, trace, o)
    finally:
        fleet.stop()


def judge(
    trace: Trace, outcomes: dict[str, Outcome], extra: dict[str, dict[str, Any]]
) -> dict[str, object]:
    o = outcomes.get("oomguard")
    if o is None:
        return {}
    checks: dict[str, object] = {
        "oomguard_zero_crashes": o.crashes == 0,
        "oomguard_zero_lost": o.lost == 0,
    }
    if trace.pressure_ends_s is not None:
        checks["recovery_within_60s"] = o.recovery_s is not None and o.recovery_s <= 60
        checks["no_retrigger_during_recovery"] = not extra["oomguard"].get("retriggered", False)
    if "default" not in outcomes or "static" not in outcomes:
        return checks  # a partial run (--config): the comparisons need all three
    d, s = outcomes["default"], outcomes["static"]
    best_static = max(d.goodput_tokens_per_s, s.goodput_tokens_per_s)
    checks["goodput_vs_best_static"] = (
        round(o.goodput_tokens_per_s / best_static, 3) if best_static else None
    )
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
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace", action="append", help="run only these traces")
    parser.add_argument("--inflight", type=int, default=0, help="requests per engine at incident")
    parser.add_argument(
        "--compression",
        type=float,
        help="override the traces' time compression (lower: slower, truer on a loaded machine)",
    )
    parser.add_argument(
        "--config", action="append", choices=CONFIGS, help="run only these configurations"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "outcome.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other traces already recorded in --out (re-run some traces only)",
    )
    args = parser.parse_args()
    chosen = args.trace or (list(QUICK) if args.quick else names())
    traces: dict[str, object] = {}
    failed: dict[str, str] = {}
    if args.merge and Path(args.out).exists():
        traces = json.loads(Path(args.out).read_text()).get("traces", {})
    for name in chosen:
        trace = Trace.load(name)
        if args.quick:
            trace = trace.model_copy(update={"time_compression": trace.time_compression * 2})
        if args.compression:
            trace = trace.model_copy(update={"time_compression": args.compression})
        trace = with_horizon(trace, args.inflight)
        print(f"{name}: {trace.description} (horizon {trace.duration_s:.0f} s)", flush=True)
        outcomes: dict[str, Outcome] = {}
        extra: dict[str, dict[str, Any]] = {}
        for config in args.config or CONFIGS:
            try:
                outcomes[config], extra[config] = run(trace, config)
            except RuntimeError as exc:  # an engine that did not start on a loaded machine
                print(f"  {config}: not run: {exc}".splitlines()[0], flush=True)
                failed[f"{name}/{config}"] = str(exc).splitlines()[0]
        checks = judge(trace, outcomes, extra)
        if args.inflight and incident_s(trace) is not None:
            for config in outcomes:  # every engine held the load asked for at the incident
                held = extra[config]["inflight_at_incident_per_engine"] or [0]
                checks[f"{config}_inflight_at_incident_ge_{args.inflight}"] = (
                    min(held) >= args.inflight
                )
        for config, o in outcomes.items():
            x = extra[config]
            print(
                f"  {config:9s} crashes {o.crashes}  lost {o.lost}/{o.requests}  goodput "
                f"{o.goodput_tokens_per_s:8.1f} tok/s  p99 TTFT {o.ttft_p99_s}  preemptions "
                f"{o.preemptions}  in flight at incident {x['inflight_at_incident']} (peak "
                f"{x['inflight_peak']})  recovery {o.recovery_s}  actions {len(o.actions)}",
                flush=True,
            )
        print(f"  targets: {json.dumps(checks)}", flush=True)
        traces[name] = {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "trace": trace.model_dump(),
            "outcomes": {c: {**o.__dict__, **extra[c]} for c, o in outcomes.items()},
            "targets": checks,
        }
        record.write(args.out, "outcome", args.quick, traces=traces, not_run=failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
