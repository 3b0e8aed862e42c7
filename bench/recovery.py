"""Recovery benchmark: where the time goes from the end of the pressure to full admission.

For each trace whose pressure ends at a set time and that takes GPU memory away (the sudden
neighbours neighbour-2s-24gb, neighbour-8s-48gb and neighbour-30s-80gb, neighbour-growth,
fragmentation-spike, long-prompt-burst, long-context-burst; fragmentation-creep's ends only
with a restart, which bench/outcome.py measures), in simulated time (oomguard.lab.recovery: the
exporter's own level on the twin GPU, the action alerts' `for` and `keep_firing_for`,
Alertmanager's group_interval, the remediator's own decision and safety limits, an engine fed by
the trace's requests), the timeline link by link: the level falls below 2, the last action alert
resolves at its rule, the remediator hears it, the first re-admission stage, full admission.
Through both alerting paths (Prometheus + Alertmanager as generated, and standalone mode) and a
few variants that show what each setting costs: the shipped defaults, the settings of the
2026-11-29 outcome run (keep_firing_for 2 m and doubling re-admission: it measured 241-307 s on
the real twin), doubling alone, the settings before issue 30 item 4 (keep_firing_for 30 s,
re-admission stages that advance on admissions only) and each of them alone, the outcome
benchmark's heavy load (`--inflight 64`), that load kept on after the pressure ends (sustained),
engines four times slower (the real twin on this loaded machine ran about x4 behind its clock),
and an engine that reports no prefill counts (a plugin from before they were counted: the stage
then waits for whole requests).

Targets: recovery <= 45 s (issue 30; 60 s before) with no re-trigger on every trace, shipped
defaults, both paths.
The real check is bench/outcome.py on the real vLLM twin; this one runs in seconds.

Usage: python -m bench.recovery   (writes bench/results/recovery.json)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import record
from bench.outcome import with_horizon
from oomguard.lab.matrix import trace_levels
from oomguard.lab.recovery import (
    AlertPath,
    alertmanager_path,
    simulate_recovery,
    standalone_path,
)
from oomguard.remediator.policy import PolicyConfig
from oomguard.twin.traces import Trace, names

ROOT = Path(__file__).resolve().parents[1]


def traces() -> list[str]:
    """Every trace whose pressure ends at a set time and that takes engine 0's GPU memory;
    neighbour-growth first (the docs' chain, and the first row's pressure end, are its)."""
    every = [Trace.load(name) for name in names()]
    found = [t.name for t in every if t.pressure_ends_s is not None and t.gpu_events]
    return sorted(found, key=lambda n: n != "neighbour-growth")


SHIPPED = PolicyConfig()
DOUBLING = SHIPPED.model_copy(update={"readmit_stages": "doubling"})
ON_ADMISSIONS = SHIPPED.model_copy(update={"readmit_idle_seconds": 0.0})

TARGET_S = 45.0  # full admission this long after the pressure ends, at most (issue 30)


@dataclass(frozen=True)
class Variant:
    path: AlertPath
    policy: PolicyConfig = SHIPPED
    inflight: int = 0  # requests per engine in flight added around the incident
    sustained: bool = False  # ... and that load goes on after the pressure ends
    slowdown: float = 1.0  # engine steps this many times as long
    counts_prefills: bool = True


def variants(path: AlertPath) -> dict[str, Variant]:
    return {
        "shipped": Variant(path),
        "shipped, --inflight 64": Variant(path, inflight=64),
        "shipped, --inflight 64 sustained": Variant(path, inflight=64, sustained=True),
        "shipped, --inflight 64, engines x4 slower": Variant(path, inflight=64, slowdown=4.0),
        "shipped, --inflight 64 sustained, engines x4 slower": Variant(
            path, inflight=64, sustained=True, slowdown=4.0
        ),
        "--inflight 64 sustained, no prefill counts (old plugin)": Variant(
            path, inflight=64, sustained=True, counts_prefills=False
        ),
        "doubling re-admission": Variant(path, DOUBLING),
        "keep_firing_for 30s": Variant(replace(path, keep_firing_s=30.0)),
        "stages on admissions only (readmit_idle_seconds 0)": Variant(path, ON_ADMISSIONS),
        "before issue 30 item 4 (keep_firing_for 30s, stages on admissions only)": Variant(
            replace(path, keep_firing_s=30.0), ON_ADMISSIONS
        ),
        "2026-11-29 (keep_firing_for 2m, doubling)": Variant(
            replace(path, keep_firing_s=120.0), DOUBLING
        ),
    }


def loaded(base: Trace, v: Variant) -> Trace:
    """The trace over the outcome benchmark's horizon with the variant's extra load."""
    trace = with_horizon(base, v.inflight)
    if not (v.inflight and v.sustained):
        return trace
    heavy = trace.phases[-1]  # with_horizon appends the extra load last
    phases = [*trace.phases[:-1], heavy.model_copy(update={"end_s": trace.duration_s})]
    return trace.model_copy(update={"phases": phases})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "recovery.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    rows: list[dict[str, object]] = []
    met = True
    for name in traces():
        base = Trace.load(name)
        levels = trace_levels(with_horizon(base))  # the GPU events are the same with any load
        # ... and without the fragments its requests made, for an engine once it runs none
        # (a trace whose fragments its process holds has none to give back)
        released = (
            trace_levels(with_horizon(base), released=True)
            if base.fragments == "requests"
            else None
        )
        for path in (alertmanager_path(), standalone_path()):
            for variant, v in variants(path).items():
                r = simulate_recovery(
                    loaded(base, v),
                    levels,
                    path=v.path,
                    policy=v.policy,
                    slowdown=v.slowdown,
                    counts_prefills=v.counts_prefills,
                    released_levels=released,
                )
                row = {"trace": name, "variant": variant, **r.record()}
                rows.append(row)
                if variant.startswith("shipped"):
                    met &= (
                        r.recovery_s is not None and r.recovery_s <= TARGET_S and not r.retriggered
                    )
                x = row  # rounded (Recovery.record)
                print(
                    f"{name:19s} {path.name:24s} {variant:55s} level clear {x['level_clear_s']} "
                    f"resolved {x['resolved_s']} heard {x['delivered_s']} stage 1 "
                    f"{x['resumed_s']} full {x['full_s']}: recovery {x['recovery_s']} s "
                    f"({x['from_level_clear_s']} s after the level cleared)"
                    + (" RE-TRIGGERED" if r.retriggered else ""),
                    flush=True,
                )
    elapsed = time.perf_counter() - started
    print(
        f"shipped defaults: recovery <= {TARGET_S:.0f} s with no re-trigger on every trace: {met}"
    )
    record.write(
        args.out,
        "recovery",
        False,
        rows=rows,
        shipped_met=met,
        seconds=round(elapsed, 1),
    )
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
