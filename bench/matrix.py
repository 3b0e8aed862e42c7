"""GPU matrix benchmark: is oomguard right on every common GPU at every sane setting?

Every twin GPU (24 GB to 192 GB, MIG slices) x gpu_memory_utilization {0.85, 0.90, 0.92, 0.95}
x {steady heavy load, each memory incident trace scaled to the GPU}, in simulated time
(twin/matrix.py: the twin's memory physics, the exporter's own NVML collector and pressure
evaluator, the remediation the alerts carry). Reported per cell: the highest level and why,
remediator actions, when vLLM alone would hit a CUDA OOM, whether it does with oomguard, and the
lead time (OOM minus the first level 2). Targets: steady cells at level 0 with zero actions;
incident cells at level >= 2 before the OOM and no OOM with oomguard.

Usage: python bench/matrix.py [--quick] [--real]   (writes bench/results/matrix.json)
--quick runs three GPUs (24 GB, 48 GB, 80 GB) at the default gmu 0.92.
--real also runs those three GPUs at 0.92 on the real vLLM twin (twin/runner.py: vLLM 0.33's
server and scheduler, the exporter, the standalone remediator), each incident trace with vLLM
alone and with oomguard and the do-no-harm trace with oomguard, and checks that the simulation
agrees: vLLM alone crashes where the simulation says it would, oomguard prevents the crash where
the simulation says it does, and steady load gets no action.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from oomguard.twin.gpu import GPU_MODELS  # noqa: E402
from oomguard.twin.matrix import (  # noqa: E402
    GMUS,
    INCIDENT_TRACES,
    Cell,
    run,
    scaled_trace,
    simulate,
)
from oomguard.twin.traces import Trace  # noqa: E402


def judge(cell: Cell) -> bool:
    if cell.scenario == "steady":
        return cell.max_level == 0 and cell.actions == 0 and cell.oom_without_s is None
    return (
        cell.oom_without_s is not None
        and cell.first_pressure_s is not None
        and cell.first_pressure_s < cell.oom_without_s
        and cell.oom_with_s is None
    )


def table(cells: list[Cell]) -> str:
    rows = [
        "| GPU | gmu | model | scenario | max level (reason) | actions | OOM alone (s) "
        "| OOM with oomguard | lead (s) | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        oom_with = "none" if c.oom_with_s is None else f"at {c.oom_with_s:.0f} s"
        rows.append(
            f"| {c.gpu} | {c.gmu:.2f} | {c.model} | {c.scenario} | {c.max_level} ({c.max_reason}) "
            f"| {c.actions} | {'-' if c.oom_without_s is None else f'{c.oom_without_s:.0f}'} "
            f"| {oom_with} | {'-' if c.lead_s is None else f'{c.lead_s:.0f}'} "
            f"| {'yes' if judge(c) else 'NO'} |"
        )
    return "\n".join(rows)


REAL_GPUS = ("L4", "L40S", "H100")


def real_subset(log: object = print) -> list[dict[str, object]]:
    """The representative subset on the real vLLM twin, beside the simulation of each cell."""
    from oomguard.twin.runner import run as run_fleet

    rows: list[dict[str, object]] = []
    for gpu in REAL_GPUS:
        for name in (*INCIDENT_TRACES, "do-no-harm"):
            base = Trace.load(name)
            trace = scaled_trace(base, gpu, 0.92)
            sim = simulate(gpu, 0.92, trace if base.gpu_events else None, duration_s=60)
            row: dict[str, object] = {"gpu": gpu, "trace": name, "model": trace.model}
            configs = ("oomguard",) if not base.gpu_events else ("default", "oomguard")
            for config in configs:
                out = run_fleet(trace, config, log=lambda _m: None)
                row[config] = {"crashes": out.crashes, "lost": out.lost, "actions": out.actions}
            if base.gpu_events:
                agree = (row["default"]["crashes"] > 0) == (sim.oom_without_s is not None) and (  # type: ignore[index]
                    row["oomguard"]["crashes"] == 0  # type: ignore[index]
                ) == (sim.oom_with_s is None)
            else:
                agree = row["oomguard"]["crashes"] == 0 and not row["oomguard"]["actions"]  # type: ignore[index]
            row["simulated"] = sim.record()
            row["agrees"] = agree
            print(f"real {gpu} {name}: {row}", flush=True)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--real", action="store_true", help="also run the real vLLM subset")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "matrix.json"))
    args = parser.parse_args()
    gpus = ("L4", "L40S", "H100") if args.quick else tuple(GPU_MODELS)
    gmus = (0.92,) if args.quick else GMUS
    started = time.perf_counter()
    cells = run(gpus, gmus, INCIDENT_TRACES)
    elapsed = time.perf_counter() - started
    print(table(cells))
    met = sum(judge(c) for c in cells)
    print(f"\n{met}/{len(cells)} cells met their target ({elapsed:.0f} s)")
    real = real_subset() if args.real else []
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
        real_subset=real,
        real_agreed=agreed,
        seconds=round(elapsed, 1),
    )
    return 0 if met == len(cells) and agreed == len(real) else 1


if __name__ == "__main__":
    raise SystemExit(main())
