"""GPU matrix benchmark: is oomguard right on every common GPU at every sane setting?

Every twin GPU (24 GB to 192 GB, MIG slices) x gpu_memory_utilization {0.85, 0.90, 0.92, 0.95}
x {steady heavy load, each memory incident trace scaled to the GPU, each trace of memory taken
within seconds (STEP_TRACES, 0.1 s ticks)}, in simulated time
(oomguard.lab.matrix: the twin's memory physics, the exporter's own NVML collector and pressure
evaluator, the remediation the alerts carry). Reported per cell: the highest level and why,
remediator actions, when vLLM alone would hit a CUDA OOM, whether it does with oomguard, and the
lead time (OOM minus the first level 2), and where the trace's pressure ends, the recovery: the
end of the pressure to full admission through the shipped alert hysteresis and the remediator's
own decision (oomguard.lab.recovery), and the plugin's step guard on top (the same plan before each
step: the ticks it shrank, and any OOM despite it, at a step's start or end). Targets: steady
cells at level 0 with zero actions and no shrink; incident cells at level >= 2 before the OOM,
no OOM with oomguard (with and without the step guard), recovery <= 60 s with no re-trigger;
cells of memory taken within seconds: vLLM alone dies, none with the step guard (the alerts'
drain cannot outrun the next chunk there, and is not required to).

Usage: python -m bench.matrix [--quick] [--real | --real-only] [--gpus ...] [--traces ...]
(writes bench/results/matrix.json; the real subset is merged into bench/results/matrix-real.json)
--quick runs three GPUs (24 GB, 48 GB, 80 GB) at the default gmu 0.92.
--real also runs those three GPUs at 0.92 on the real vLLM twin (oomguard.lab.runner: vLLM 0.33's
server and scheduler, the exporter, the standalone remediator), each incident trace with vLLM
alone and with oomguard and the do-no-harm trace with oomguard, and checks that the simulation
agrees: vLLM alone crashes where the simulation says it would, oomguard prevents the crash where
the simulation says it does, and steady load gets no action.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench import record
from oomguard.lab.matrix import (
    GMUS,
    INCIDENT_TRACES,
    STEP_TRACES,
    Cell,
    real_trace,
    run,
    scaled_trace,
    simulate,
)
from oomguard.twin.gpu import GPU_MODELS
from oomguard.twin.traces import Trace

ROOT = Path(__file__).resolve().parents[1]


def judge(cell: Cell) -> bool:
    if cell.scenario == "steady":
        # do no harm: no level, no action, and the step guard never shrinks a step
        return (
            cell.max_level == 0
            and cell.actions == 0
            and cell.oom_without_s is None
            and cell.step_guard_shrinks == 0
        )
    if cell.scenario in STEP_TRACES:
        # memory taken within seconds: vLLM alone dies, the step guard keeps it alive (the
        # alerts' drain is recorded, not required: it cannot outrun the next chunk)
        return cell.oom_without_s is not None and cell.oom_with_step_guard_s is None
    return (
        cell.oom_without_s is not None
        and cell.first_pressure_s is not None
        and cell.first_pressure_s < cell.oom_without_s
        and cell.oom_with_s is None
        and cell.oom_with_step_guard_s is None
        # where the pressure ends: full admission within 60 s, and no re-trigger
        and (cell.recovery_s is None or cell.recovery_s <= 60)
        and not cell.retriggered
    )


def table(cells: list[Cell]) -> str:
    rows = [
        "| GPU | gmu | model | scenario | max level (reason) | actions | OOM alone (s) "
        "| OOM with oomguard | with the step guard (shrunk ticks) | lead (s) | recovery (s) "
        "| met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        oom_with = "none" if c.oom_with_s is None else f"at {c.oom_with_s:.0f} s"
        step = "none" if c.oom_with_step_guard_s is None else f"at {c.oom_with_step_guard_s:.0f} s"
        rows.append(
            f"| {c.gpu} | {c.gmu:.2f} | {c.model} | {c.scenario} | {c.max_level} ({c.max_reason}) "
            f"| {c.actions} | {'-' if c.oom_without_s is None else f'{c.oom_without_s:.0f}'} "
            f"| {oom_with} | {step} ({c.step_guard_shrinks}) "
            f"| {'-' if c.lead_s is None else f'{c.lead_s:.0f}'} "
            f"| {_recovery(c)} | {'yes' if judge(c) else 'NO'} |"
        )
    return "\n".join(rows)


def _recovery(c: Cell) -> str:
    if c.recovery_s is None:
        return "-"
    return f"{c.recovery_s:.0f}" + (" re-triggered" if c.retriggered else "")


REAL_GPUS = ("L4", "L40S", "H100")
REAL_TRACES = (*INCIDENT_TRACES, "do-no-harm")
REAL_OUT = ROOT / "bench" / "results" / "matrix-real.json"


def real_cell(gpu: str, name: str) -> dict[str, object]:
    """One cell on the real vLLM twin, beside its simulation: do the two agree?"""
    from oomguard.lab.runner import run as run_fleet

    base = Trace.load(name)
    scaled = scaled_trace(base, gpu, 0.92)
    sim = simulate(gpu, 0.92, scaled if base.gpu_events else None, duration_s=60)
    trace, start = real_trace(scaled, sim)
    row: dict[str, object] = {
        "gpu": gpu,
        "trace": name,
        "model": trace.model,
        "replayed": {
            "from_s": round(start, 1),
            "duration_s": round(trace.duration_s, 1),
            "time_compression": round(trace.time_compression, 2),
        },
    }
    configs = ("oomguard",) if not base.gpu_events else ("default", "oomguard")
    runs: dict[str, dict[str, object]] = {}
    for config in configs:
        started = time.perf_counter()
        out = run_fleet(trace, config, log=lambda _m: None)
        runs[config] = {
            "crashes": out.crashes,
            "lost": out.lost,
            "actions": out.actions,
            "seconds": round(time.perf_counter() - started),
        }
    if base.gpu_events:
        # vLLM alone crashes where the simulation says it would; oomguard prevents the crash
        # where the simulation says it does.
        agree = (int(runs["default"]["crashes"]) > 0) == (sim.oom_without_s is not None) and (  # type: ignore[call-overload]
            runs["oomguard"]["crashes"] == 0
        ) == (sim.oom_with_s is None)
    else:  # steady heavy load: no crash and no action
        agree = runs["oomguard"]["crashes"] == 0 and not runs["oomguard"]["actions"]
    row.update(runs)
    row["simulated"] = sim.record()
    row["agrees"] = agree
    row["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    row["load_average"] = round(os.getloadavg()[0], 1)
    row["provenance"] = record.provenance("matrix-real")  # cells run at different commits
    return row


def real_subset(
    gpus: tuple[str, ...], traces: tuple[str, ...], out: Path
) -> list[dict[str, object]]:
    """Run the chosen cells and merge them into `out` (a cell run again replaces its old row), so
    the subset can be run a few cells at a time on a shared machine; each row keeps its date."""
    previous = json.loads(out.read_text()).get("cells", []) if out.exists() else []
    rows = {(str(r["gpu"]), str(r["trace"])): r for r in previous}
    for gpu in gpus:
        for name in traces:
            row = real_cell(gpu, name)
            print(f"real {gpu} {name}: {row}", flush=True)
            rows[(gpu, name)] = row
            cells = [rows[k] for k in sorted(rows)]
            record.write(
                out,
                "matrix-real",
                False,
                note="each cell is one run of vLLM alone and one with oomguard; cells carry "
                "their own date and load average",
                cells=cells,
                agreed=sum(bool(r["agrees"]) for r in cells),
                total=len(cells),
                expected=len(REAL_GPUS) * len(REAL_TRACES),
            )
    return [rows[k] for k in sorted(rows)]


def main() -> int:
    # A stopped benchmark stops what it started: SystemExit unwinds through the runner's finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--real", action="store_true", help="also run the real vLLM subset")
    parser.add_argument(
        "--real-only", action="store_true", help="only the real vLLM subset (no simulation)"
    )
    parser.add_argument("--gpus", nargs="+", choices=REAL_GPUS, default=REAL_GPUS)
    parser.add_argument("--traces", nargs="+", choices=REAL_TRACES, default=REAL_TRACES)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "matrix.json"))
    args = parser.parse_args()
    if args.real_only:
        real = real_subset(tuple(args.gpus), tuple(args.traces), REAL_OUT)
        agreed = sum(bool(r["agrees"]) for r in real)
        print(f"real vLLM subset: {agreed}/{len(real)} cells agree with the simulation")
        return 0 if agreed == len(real) else 1
    gpus = ("L4", "L40S", "H100") if args.quick else tuple(GPU_MODELS)
    gmus = (0.92,) if args.quick else GMUS
    started = time.perf_counter()
    cells = run(gpus, gmus, INCIDENT_TRACES + STEP_TRACES)
    elapsed = time.perf_counter() - started
    print(table(cells))
    met = sum(judge(c) for c in cells)
    print(f"\n{met}/{len(cells)} cells met their target ({elapsed:.0f} s)")
    real = real_subset(tuple(args.gpus), tuple(args.traces), REAL_OUT) if args.real else []
    agreed = sum(bool(r["agrees"]) for r in real)
    if real:
        print(f"real vLLM subset: {agreed}/{len(real)} cells agree with the simulation")
    record.write(
        args.out,
        "matrix",
        args.quick,
        cells=[{**c.record(), "met": judge(c)} for c in cells],
        cells_met=met,
        cells_total=len(cells),
        seconds=round(elapsed, 1),
    )
    return 0 if met == len(cells) and agreed == len(real) else 1


if __name__ == "__main__":
    raise SystemExit(main())
