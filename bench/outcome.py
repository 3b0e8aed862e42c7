"""Outcome benchmark: what a crash costs, and what oomguard saves, on the real vLLM scheduler.

For each trace (twin/oomguard/twin/traces/*.json) three configurations run one after the other on
the same two-engine twin fleet (oomguard.lab.runner): vLLM's flags with no oomguard (`default`), a
static conservative `max_num_seqs` 48 (`static`), and oomguard with its default policy
(`oomguard`: the exporter, the remediator in standalone mode with its shipped defaults, restart
backends on both engines, and the plugin's request guard enforcing: `--guard-mode`, recorded per
run). Every configuration is measured over the same **fixed horizon** that includes recovery: the
trace is extended (its steady traffic goes on) to the end of its GPU events plus the trace's model
reload time (`reload_s`, 12 minutes) plus two minutes, so a crash's reload is counted, not cut off
by the end of the trace.

Reported per trace and configuration: CUDA OOM crashes, requests lost (and why), goodput
(output tokens/s, over the horizon, of requests whose first token came within the trace's TTFT
objective), preemptions, p99 TTFT, the requests engine 0 held (running + queued) at the incident
(its first crash, or oomguard's first action on it) and at its peak, and the recovery: the time
from the end of the pressure to engine 0 back at full admission, with no re-trigger (a second
drain or lowering of engine 0 after the pressure ended counts as oscillation). Where the pressure
ends only with a restart (fragmentation-creep), it ends when engine 0's restarted process is up,
and the restart's chain is recorded with the reload apart (`restart_chain`).

`--inflight N` adds, from a minute before the trouble starts (the GPU trouble, or the phase of
requests that brings the pressure) until the pressure ends (to the horizon where only a restart
ends it), N closed-loop users per engine
(long outputs; each user sends its next request as soon as the last ends), so each engine holds
N requests at the incident whatever the machine's speed (the issue's >= 64), and checks that
every engine did. A user waits for its own engine while the load runs (503: after Retry-After;
refused: after 10 trace s) instead of failing over to the peer as the trace's requests do, so
the engine under test still holds its users' requests at its incident; once that engine answers
that it drains (the incident, with oomguard), its users' requests go to the peer as a gateway
re-sends them. An open-loop rate
sized by Little's law on the twin's roofline cannot promise
that here: on a 2-core machine vLLM's own CPU time per step with 64 sequences is longer than the
twin's compressed step at any compression that fits a 10-minute run, so the engines fall behind
their clock and their queues grow without bound (250 per engine at x4), or, on a busy machine,
the gateway falls behind and sends less. How far the engines fell behind is measured and
recorded (`inflight_decode_slowdown`: the in-flight requests' decode time against the twin's
roofline at that batch; 1.0 is keeping up). So is the CPU each part of the run used over the
replay (`cpu`, bench/census.py: percent of one core for the engine cores, the API servers, the
runner with its gateway and exporter, the supervisors, the remediator): with the engines
CPU-bound, a configuration's goodput moves with the CPU its engine cores got.

`--router vllm-router|nginx` puts a real router in front of the engines instead of the twin's
gateway (oomguard.lab.routers, configured as docs/vllm-plugin.md says; the remediator takes a
drained engine out of vllm-router's rotation through its admin API); the clients then retry what
OpenAI's clients retry, after Retry-After, and every non-200 answer they saw is counted
(`answers`). Results behind a router are recorded as "<trace>@<router>".

`--repeat` runs a trace's configurations again at the same code and records the run under
`repeats.<trace>` instead of replacing the trace's row (`--add-repeat FILE` records the runs of a
file a partial run wrote, `--config default --config oomguard --out FILE`): one run of a trace on
this noisy 2-core machine cannot tell a few percent of goodput (fragmentation-creep's ratio moved
by a quarter between runs of nearly the same code). Its summary, `oomguard_vs_default`, is
oomguard's goodput over vLLM alone's in the same run, over the trace's row and every repeat that
were made as it was (the same `measured_digest`, compression and load): n, min, median, max. A
run added twice is recorded once. `repeats` is history to bench.stale: the summary counts only
the runs of the row's own code, and the row's staleness says when that code changed.

Usage: python -m bench.outcome [--quick] [--trace NAME ...] [--inflight N] [--merge] [--router R]
[--repeat | --add-repeat FILE ...] (writes bench/results/outcome.json after every trace).
--quick: two traces at twice the time compression (the CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from bench import record
from bench.census import Census, engine_cores
from oomguard.handoff import AllocatorReport, InvalidReport
from oomguard.lab.matrix import STEP_TRACES  # (the same traces, simulated)
from oomguard.lab.routers import ROUTERS
from oomguard.lab.runner import (
    CONFIGS,
    NO_STEP_GUARD,
    ClosedLoop,
    EngineView,
    Fleet,
    Outcome,
    _Sent,
)
from oomguard.twin.physics import Physics, Step
from oomguard.twin.traces import Phase, Trace, names

ROOT = Path(__file__).resolve().parents[1]

QUICK = ("neighbour-growth", "do-no-harm")
# STEP_TRACES (oomguard.lab.matrix: memory taken within seconds under heavy prefill load, issue 27)
# run here at time compression 1 (each step takes its roofline time: the race is real) and in a
# fourth configuration, oomguard with the plugin's step guard off.
# The plugin's step guard in the `oomguard` configuration: enforcing, as an operator who deploys
# oomguard against CUDA OOMs runs it (the plugin ships it in `observe`).
STEP_GUARD_MODE = "enforce"
# The request guard in the `oomguard` configuration. The plugin ships it in `observe` (it refuses
# nothing); an operator who deploys oomguard to stop CUDA OOMs enforces it (the runbook's fix for
# requests whose own transient memory never fits: prompt-logprobs kills vLLM with observe).
GUARD_MODE = "enforce"
HORIZON_MARGIN_S = 120.0
INCIDENT_LEAD_S = 60.0  # the in-flight load starts this long before the GPU trouble


def incident_s(trace: Trace) -> float | None:
    """When the trace's GPU trouble starts: its first GPU event with anything on it."""
    for p in sorted(trace.gpu_events, key=lambda p: p.at_s):
        if p.neighbour_gib > 0 or p.fragmentation_gib > 0:
            return p.at_s
    return None


def pressure_phase_s(trace: Trace) -> float | None:
    """Request-driven trouble (prompt_logprobs, huge prefills): when the phase of requests that
    ends with the pressure starts."""
    end = trace.pressure_ends_s
    if end is None:
        return None
    return min((p.start_s for p in trace.phases if 0 < p.start_s < end >= p.end_s), default=None)


def trouble_starts_s(trace: Trace) -> float | None:
    """When the trouble starts: the last empty GPU event before the first one with anything on
    it (the events are interpolated, so the ramp starts there), or, without GPU trouble, the
    start of the phase of requests that brings the pressure."""
    first = incident_s(trace)
    if first is None:
        return pressure_phase_s(trace)
    before = [p.at_s for p in trace.gpu_events if p.at_s < first]
    return max(before, default=first)


# the in-flight load: short prompts, long outputs (decode dominates, so requests stay in flight)
INFLIGHT_PROMPT = (256, 512)
INFLIGHT_OUTPUT = (1536, 2048)


def inflight_rate(trace: Trace, inflight: int, engines: int = 2) -> float:
    """Arrivals per second that keep `inflight` requests in each engine (Little's law: rate x
    time in system), the time in system being the twin's roofline decode at that batch. Holds
    only where the engines keep their clock (the simulation in bench/recovery.py); the real twin
    gets closed-loop users (`inflight_load`)."""
    return engines * inflight / decode_seconds(trace, inflight)


def decode_seconds(trace: Trace, inflight: int) -> float:
    """The twin's roofline time (trace seconds) to decode one in-flight request's output with
    `inflight` such requests in the engine, mid-decode (what the engine takes if it keeps up)."""
    physics = Physics.for_model(
        trace.model,
        gpu=trace.gpu,
        gpu_memory_utilization=trace.engine.gpu_memory_utilization,
        max_num_batched_tokens=trace.engine.max_num_batched_tokens,
    )
    output = sum(INFLIGHT_OUTPUT) / 2
    context = int(inflight * (sum(INFLIGHT_PROMPT) / 2 + output / 2))
    return output * physics.step_seconds(Step(tokens=inflight, attention=context, context=context))


def trouble_end_s(trace: Trace) -> float:
    end_events = max((p.at_s for p in trace.gpu_events), default=0.0)
    return max(end_events, trace.pressure_ends_s or 0.0)


def inflight_load(trace: Trace, inflight: int, engines: int = 2) -> ClosedLoop | None:
    """`inflight` closed-loop users per engine, from INCIDENT_LEAD_S before the trouble starts
    until it ends (None for a trace without trouble: do-no-harm). A trace whose pressure ends
    only with a restart (fragmentation-creep: its trouble is hours of steady traffic) keeps
    them to the horizon: the pressure ends when the restarted engine is up, so the load still
    runs through the restart and the re-admission, as production traffic would."""
    start = trouble_starts_s(trace)
    if not inflight or start is None:
        return None
    begin = max(0.0, start - INCIDENT_LEAD_S)
    end = horizon_s(trace) if trace.pressure_ends_with_restart else trouble_end_s(trace)
    return ClosedLoop(
        users=inflight * engines,
        start_s=begin,
        end_s=max(begin + 1, end),
        prompt_tokens=INFLIGHT_PROMPT,
        output_tokens=INFLIGHT_OUTPUT,
        ramp_s=min(10.0, INCIDENT_LEAD_S / 2),
        seed=trace.seed,
    )


def horizon_s(trace: Trace) -> float:
    """The fixed horizon: the end of the trouble plus a crash's reload plus HORIZON_MARGIN_S."""
    return max(trace.duration_s, trouble_end_s(trace) + trace.reload_s + HORIZON_MARGIN_S)


def with_horizon(trace: Trace, inflight: int = 0) -> Trace:
    """The trace over a fixed horizon that includes a crash's reload; with `inflight` (the
    simulation's open-loop form of `inflight_load`), extra long-output traffic from before the
    trouble starts until it ends, so each engine holds about that many requests at the
    incident if it keeps its clock."""
    trouble_end = trouble_end_s(trace)
    horizon = horizon_s(trace)
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


def engine0(fleet: Fleet, trace: Trace, o: Outcome, crash_s: float | None = None) -> dict[str, Any]:
    """Engine 0 at the incident (`crash_s`: its first CUDA OOM, else the fleet's first crash,
    else oomguard's first action on it), at its peak, and during the recovery (with its
    remediator steps in trace time: the recovery's timeline), and what every engine held at the
    incident."""
    history = [views[0] for views in list(fleet.history)]
    wall0 = time.time() - (time.monotonic() - fleet.t0)  # the audit log's clock at trace 0
    steps: list[str] = []
    first_action = None
    # engine 0's audit entries, each with its trace time (the remediator's own clock)
    lines = fleet.audit.read_text().splitlines() if fleet.audit.exists() else []
    audited = [
        ((e["time"] - wall0) * fleet.c, e)
        for e in map(json.loads, lines)
        if e.get("target") == fleet.names[0]
    ]
    for at_s, e in audited:
        if e["event"] == "acted":
            first_action = at_s if first_action is None else first_action
            cap = (e.get("after") or {}).get("cap")
            steps.append(f"{at_s:.1f} {e['action']}" + (f" {cap}" if cap is not None else ""))
    at = (
        crash_s
        if crash_s is not None
        else (fleet.crash_times[0] if fleet.crash_times else first_action)
    )
    if at is None:  # neither a crash nor an action: the trouble itself
        at = incident_s(trace) if incident_s(trace) is not None else pressure_phase_s(trace)
    views = list(fleet.history)
    out: dict[str, Any] = {
        "incident_s": round(at, 1) if at is not None else None,
        # what the clients had in each engine just before (a crash loses those), and what
        # each engine last reported holding (its state read may lag on a loaded machine)
        "inflight_at_incident_per_engine": gateway_held(fleet.sent, at - BEFORE_S, fleet.n)
        if at is not None
        else None,
        "inflight_at_incident_reported": [reported_held(views, at, i) for i in range(fleet.n)]
        if at is not None
        else None,
        "inflight_peak": max((v.running + v.waiting for v in history), default=0),
        "engine0_steps": steps,
        "inflight_decode_slowdown": slowdown(fleet, trace),
        "timeline": timeline(fleet),
    }
    if trace.pressure_ends:
        # a re-trigger: engine 0 leaves full admission again after it first got back to it
        back = fleet.recovered_at()
        after = [v for v in history if back is not None and v.t > back]
        out["retriggered"] = any(v.up and v.mode in ("capped", "draining") for v in after)
        out["recovery_s"] = o.recovery_s
    if trace.pressure_ends_with_restart:
        out["restart_chain"] = restart_chain(fleet, audited, first_action, crash_s)
    return out


def restart_chain(
    fleet: Fleet,
    audited: list[tuple[float, dict[str, Any]]],
    first_action: float | None,
    crash_s: float | None,
) -> dict[str, float | None]:
    """Engine 0's way out of a pressure that only a restart ends (trace seconds): oomguard's
    first action, its drain, the restart decided (the sequence then waits until nothing runs or
    waits), the restart begun (the old process stopped, the new one started; after a crash: the
    crash), the restarted engine ready (the pressure's end), and full admission. The reload
    (begun -> ready: a model reload, minutes in production) is the restart's cost, kept apart
    from the re-admission (ready -> full admission: the recovery). `audited`: engine 0's audit
    entries with their trace times."""
    acted: dict[str, float] = {}
    for at_s, e in audited:
        if e.get("result") in ("ok", "started"):
            acted.setdefault(f"{e['event']}:{e.get('action')}", at_s)
    begun = acted.get("restart:restart", crash_s)
    ready, full = fleet.pressure_ended_at(), fleet.recovered_at()

    def r(x: float | None) -> float | None:
        return round(x, 1) if x is not None else None

    return {
        "first_action_s": r(first_action),
        "drain_s": r(acted.get("acted:drain")),
        "restart_decided_s": r(acted.get("acted:restart")),
        "restart_begun_s": r(begun),
        "engine_ready_s": r(ready),
        "full_admission_s": r(full),
        "reload_s": r(ready - begun) if ready is not None and begun is not None else None,
        "readmission_s": r(full - ready) if full is not None and ready is not None else None,
    }


BEFORE_S = 5.0  # trace seconds before the incident at which the clients' requests are counted


def gateway_held(sent: list[_Sent], at: float, engines: int) -> list[int]:
    """Requests the clients had in each engine at `at` (trace seconds): arrived by then, not
    ended by then, counted at the engine they had been sent to by then (a request a drain sent
    on to the peer later was in its first engine until then)."""
    held = [0] * engines
    for s in sent:
        if s.request.at_s <= at and (s.done_s is None or s.done_s > at):
            engine = s.engine_at(at)
            if engine >= 0:
                held[engine % engines] += 1
    return held


def reported_held(history: list[list[EngineView]], at: float, i: int) -> int | None:
    """What engine `i` last reported holding (running + waiting) at or before `at`, while up."""
    seen = [views[i] for views in history if views[i].t <= at and views[i].up]
    return seen[-1].running + seen[-1].waiting if seen else None


def timeline(fleet: Fleet, points: int = 120) -> list[list[Any]]:
    """What each engine held and its mode, about every horizon/`points` trace seconds:
    [t, [running + waiting per engine, as it reported], [the clients' requests in each
    engine], [mode per engine]] (the story of one run)."""
    history = list(fleet.history)
    if not history:
        return []
    every = max(1.0, max(v[0].t for v in history) / points)
    out: list[list[Any]] = []
    for views in history:
        if not out or views[0].t >= out[-1][0] + every:
            held = [v.running + v.waiting if v.up else None for v in views]
            clients = gateway_held(fleet.sent, views[0].t, len(views))
            out.append([round(views[0].t, 1), held, clients, [v.mode for v in views]])
    return out


def slowdown(fleet: Fleet, trace: Trace) -> float | None:
    """How far the engines fell behind their clock under the in-flight load: the closed-loop
    users' served requests' decode time (first to last token, trace seconds) against the
    twin's roofline at that batch (median; 1.0: the engines kept up, 5.0: five times slower)."""
    load = fleet.load
    if load is None:
        return None
    per_engine = load.users // fleet.n
    ideal = decode_seconds(trace, per_engine) / (sum(INFLIGHT_OUTPUT) / 2)  # per token
    ratios = sorted(
        (s.done_s - s.first_token_s) / (ideal * max(1, s.tokens - 1))
        for s in fleet.sent
        if s.user is not None
        and s.status == "ok"
        and s.first_token_s is not None
        and s.done_s is not None
        and s.tokens > 1
    )
    return round(ratios[len(ratios) // 2], 2) if ratios else None


def oom_records(fleet: Fleet) -> list[tuple[float, str]]:
    """(trace seconds, engine) of every CUDA OOM in the fleet, in time order, from the records
    the plugin's OOM observer writes as the step fails. The supervisor's exit time is late: it
    sees the exit when vLLM's API server has ended its streams and shut down (80 trace s after
    the OOM at x15 with 64 streams)."""
    found = []
    for path in (fleet.work / "allocator" / "incidents").glob("oom-*.json"):
        try:
            record = json.loads(path.read_text())
            if record.get("target") in fleet.names:
                found.append((fleet.trace_time(float(record["timestamp"])), record["target"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found)


def oom_times(fleet: Fleet, target: str | None = None) -> list[float]:
    """Trace seconds of every CUDA OOM in the fleet (`target`: one engine's only)."""
    return [t for t, engine in oom_records(fleet) if target in (None, engine)]


def configs_for(trace: str) -> tuple[str, ...]:
    """The configurations a trace runs in: the three, and without the step guard where memory
    is taken within seconds."""
    return (*CONFIGS, NO_STEP_GUARD) if trace in STEP_TRACES else CONFIGS


def step_shrinks(fleet: Fleet) -> dict[str, int]:
    """The step guard's shrinks in the fleet, by "action/reason", from every engine process's
    last hand-off report (a restarted engine's files stay beside the new one's)."""
    total: dict[str, int] = {}
    for path in (fleet.work / "allocator").glob("pid-*.json"):
        try:
            report = AllocatorReport.from_json(path.read_text())
        except (OSError, ValueError, InvalidReport):
            continue
        if report.target in fleet.names:
            for kind, count in (report.step_shrinks or {}).items():
                total[kind] = total.get(kind, 0) + count
    return total


def run(
    trace: Trace,
    config: str,
    load: ClosedLoop | None,
    guard_mode: str = GUARD_MODE,
    step_guard_mode: str = STEP_GUARD_MODE,
    router: str = "gateway",
) -> tuple[Outcome, dict[str, Any]]:
    # oomguard: the fleet's remediator, shipped defaults + restarts, the request guard in
    # `guard_mode` and the step guard in `step_guard_mode` (off without the step guard);
    # default and static: vLLM alone (guards off). `router`: what is in front of the engines
    # (the twin's gateway, vllm-router or nginx: oomguard.lab.routers)
    mode = guard_mode if config in ("oomguard", NO_STEP_GUARD) else None
    step_mode = step_guard_mode if config == "oomguard" else None
    fleet = Fleet(
        trace, config, load=load, guard_mode=mode, step_guard_mode=step_mode, router=router
    )
    try:
        fleet.start()
        with Census() as census:  # the replay's CPU by role (bench/census.py)
            fleet.replay()
        ooms = oom_records(fleet)
        if ooms and len(ooms) >= len(fleet.crash_times):
            # the OOMs as they happened (the supervisor's exit times come late)
            fleet.crash_times = [t for t, _ in ooms]
        o = fleet.outcome()
        first = next((t for t, engine in ooms if engine == fleet.names[0]), None)
        return o, {
            "guard_mode": mode or "off",
            "step_guard_mode": step_mode or "off",
            "step_guard_shrinks": step_shrinks(fleet),
            **engine0(fleet, trace, o, first),
            "cpu": census.result(),
        }
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
        # the request guard answers a request that can never fit 400 naming its parameter: a
        # refusal with its reason, not a request lost to a crash or a drain
        "oomguard_zero_lost_besides_refusals": o.lost - o.lost_why.get("HTTP 400", 0) == 0,
    }
    if trace.pressure_ends:
        checks["recovery_within_60s"] = o.recovery_s is not None and o.recovery_s <= 60
        # issue 30: full admission within 45 s of the pressure's end on every trace
        checks["recovery_within_45s"] = o.recovery_s is not None and o.recovery_s <= 45
        checks["no_retrigger_during_recovery"] = not extra["oomguard"].get("retriggered", False)
    if "default" not in outcomes or "static" not in outcomes:
        return checks  # a partial run (--config): the comparisons need all three
    d, s = outcomes["default"], outcomes["static"]
    best_static = max(d.goodput_tokens_per_s, s.goodput_tokens_per_s)
    ratio = round(o.goodput_tokens_per_s / best_static, 3) if best_static else None
    checks["goodput_vs_best_static"] = ratio
    checks["goodput_at_least_95pct_of_best_static"] = ratio is not None and ratio >= 0.95
    if d.crashes:
        checks["above_defaults_where_defaults_crash"] = (
            o.goodput_tokens_per_s > d.goodput_tokens_per_s
        )
    if trace.name == "do-no-harm":
        ratio = o.goodput_tokens_per_s / d.goodput_tokens_per_s if d.goodput_tokens_per_s else None
        checks["do_no_harm_ratio"] = round(ratio, 3) if ratio is not None else None
        checks["do_no_harm_at_least_99pct"] = ratio is not None and ratio >= 0.99
    if trace.name in STEP_TRACES:
        checks["vllm_alone_crashes"] = d.crashes > 0
        n = outcomes.get(NO_STEP_GUARD)
        if n is not None:
            checks["without_step_guard_crashes"] = n.crashes
    return checks


def step_checks(trace: Trace, extra: dict[str, dict[str, Any]]) -> dict[str, object]:
    """The step guard's part of the targets: it acted where memory was taken within seconds,
    and never on the steady (do-no-harm) trace."""
    shrinks = extra.get("oomguard", {}).get("step_guard_shrinks")
    if shrinks is None:
        return {}
    if trace.name in STEP_TRACES:
        return {"step_guard_shrank": sum(shrinks.values()) > 0}
    if not trace.gpu_events and trace.pressure_ends_s is None:  # steady: do no harm
        return {"no_step_guard_shrink": not shrinks}
    return {}


def step_summary(traces: dict[str, Any]) -> dict[str, object]:
    """Across the step traces recorded: oomguard without the step guard lost the race on at
    least one (a CUDA OOM), and with it every one had no OOM and lost nothing."""
    rows = {n: traces[n]["outcomes"] for n in STEP_TRACES if n in traces}
    lost_race = [n for n, o in rows.items() if o.get(NO_STEP_GUARD, {}).get("crashes", 0) > 0]
    return {
        "traces": sorted(rows),
        "without_step_guard_lost_the_race_on": lost_race,
        "without_step_guard_lost_at_least_one": bool(lost_race),
        "with_step_guard_no_oom_nothing_lost": bool(rows)
        and all(
            o.get("oomguard", {}).get("crashes", 1) == 0
            and o.get("oomguard", {}).get("lost", 1) == 0
            for o in rows.values()
        ),
    }


# what a repeat keeps of each configuration's outcome (the row itself keeps everything)
REPEAT_FIELDS = (
    "requests",
    "completed",
    "lost",
    "crashes",
    "good_tokens",
    "goodput_tokens_per_s",
    "inflight_decode_slowdown",
    "cpu",
    "actions",
    "retriggered",
)


def versus_default(outcomes: dict[str, Any]) -> float | None:
    """oomguard's goodput over vLLM alone's (`default`) in one run; None without both."""
    d, g = outcomes.get("default"), outcomes.get("oomguard")
    if not d or not g or not d.get("goodput_tokens_per_s"):
        return None
    return round(g["goodput_tokens_per_s"] / d["goodput_tokens_per_s"], 3)


def repeat_entry(row: dict[str, Any]) -> dict[str, Any]:
    """One more run of a trace, from the row a run recorded: each configuration's counts and
    goodput, and oomguard's goodput over vLLM alone's in that run."""
    outcomes = row["outcomes"]
    return {
        "when": row["when"],
        "load_average_before": row.get("load_average_before"),
        "load_average_after": row.get("load_average_after"),
        "time_compression": row.get("time_compression"),
        "inflight": row.get("inflight"),
        "outcomes": {c: {k: o.get(k) for k in REPEAT_FIELDS} for c, o in outcomes.items()},
        "oomguard_vs_default": versus_default(outcomes),
        "provenance": row["provenance"],
    }


def _how(run: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two runs of a trace comparable: the code measured and the run's settings."""
    return (
        run.get("provenance", {}).get("measured_digest"),
        run.get("time_compression"),
        run.get("inflight"),
    )


def repeats_summary(row: dict[str, Any] | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """oomguard over default across the trace's row and the repeats made as it was (the same
    code, compression and load; the others are kept, and left out of the figures). A run
    without both configurations (one failed) has no ratio and is counted apart."""
    same = [r for r in runs if row is not None and _how(r) == _how(row)]
    ratios = ([versus_default(row["outcomes"])] if row else []) + [
        r["oomguard_vs_default"] for r in same
    ]
    known = [r for r in ratios if r is not None]
    return {
        "n": len(known),
        "ratios": known,
        "min": min(known, default=None),
        "median": statistics.median(known) if known else None,
        "max": max(known, default=None),
        "without_ratio": len(ratios) - len(known),
        "left_out": len(runs) - len(same),
    }


def resummarise(kept_keys: dict[str, Any], key: str, row: dict[str, Any]) -> None:
    """A new row for a trace with repeats: their summary counts the new row, not the old one."""
    mine = kept_keys.get("repeats", {}).get(key)
    if mine is not None:
        mine["oomguard_vs_default"] = repeats_summary(row, mine.get("runs", []))


def add_repeats(recorded: dict[str, Any], key: str, entries: list[dict[str, Any]]) -> int:
    """Append `entries` (those not recorded yet) to `recorded`'s repeats of `key`, recompute
    their summary, and say how many were new."""
    repeats = recorded.setdefault("repeats", {})
    mine = repeats.setdefault(key, {"runs": []})
    runs = list(mine.get("runs", []))
    seen = {(r["when"], r["provenance"].get("started")) for r in runs}
    row = recorded.get("traces", {}).get(key)
    if row is not None:  # the row itself, given as a repeat by mistake
        seen.add((row.get("when"), row.get("provenance", {}).get("started")))
    new = [e for e in entries if (e["when"], e["provenance"].get("started")) not in seen]
    mine["runs"] = runs + new
    mine["oomguard_vs_default"] = repeats_summary(row, mine["runs"])
    return len(new)


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
        "--config",
        action="append",
        choices=(*CONFIGS, NO_STEP_GUARD),
        help="run only these configurations",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "outcome.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other traces (and, with --config, the other configurations of this "
        "trace) already recorded in --out",
    )
    parser.add_argument(
        "--guard-mode",
        choices=("off", "observe", "enforce"),
        default=GUARD_MODE,
        help="the request guard's mode in the oomguard configuration",
    )
    parser.add_argument(
        "--router",
        choices=ROUTERS,
        default="gateway",
        help="what is in front of the engines: the twin's gateway (re-sends 503s to a peer), or "
        "vllm-router or nginx configured as docs/vllm-plugin.md says (the clients retry what "
        "OpenAI's clients retry, after Retry-After); a trace's results are kept per router",
    )
    parser.add_argument(
        "--step-guard-mode",
        choices=("off", "observe", "enforce"),
        default=STEP_GUARD_MODE,
        help="the step guard's mode in the oomguard configuration",
    )
    parser.add_argument("--conditions", help="how the run went (recorded as is)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument(
        "--repeat",
        action="store_true",
        help="record the run under repeats.<trace> (with --merge), not as the trace's row",
    )
    again.add_argument(
        "--add-repeat",
        action="append",
        metavar="FILE",
        help="record the traces a partial run wrote to FILE as repeats in --out, and run nothing",
    )
    args = parser.parse_args()
    if args.add_repeat:
        return add_repeat_files(Path(args.out), [Path(f) for f in args.add_repeat])
    if args.repeat and not (args.merge and Path(args.out).exists()):
        parser.error("--repeat adds to a recorded file: give --merge and an existing --out")
    chosen = args.trace or (list(QUICK) if args.quick else names())
    recorded: dict[str, Any] = {}
    if args.merge and Path(args.out).exists():
        recorded = json.loads(Path(args.out).read_text())
    traces: dict[str, Any] = recorded.get("traces", {})
    failed: dict[str, str] = recorded.get("not_run", {})
    conditions = args.conditions or recorded.get("conditions")
    # what else the file holds (earlier runs, notes) stays as it was
    kept_keys = {k: v for k, v in recorded.items() if k not in OWN_KEYS}
    for name in chosen:
        trace = Trace.load(name)
        if args.quick:
            trace = trace.model_copy(update={"time_compression": trace.time_compression * 2})
        if args.compression:
            trace = trace.model_copy(update={"time_compression": args.compression})
        load = inflight_load(trace, args.inflight)
        trace = with_horizon(trace)
        print(f"{name}: {trace.description} (horizon {trace.duration_s:.0f} s)", flush=True)
        if load is not None:
            print(f"  in-flight load: {load}", flush=True)
        # behind a real router a trace's results are kept apart: "<trace>@<router>"
        key = name if args.router == "gateway" else f"{name}@{args.router}"
        # a repeat runs every configuration it names afresh; a row keeps the others it has
        outcomes, extra = kept(
            None if args.repeat else traces.get(key), trace, args.config, args.inflight
        )
        load_before = [round(x, 2) for x in os.getloadavg()]
        if args.repeat:
            failed = {}  # this run's own: the file's not_run describes its rows
        for config in args.config or configs_for(name):
            failed.pop(f"{key}/{config}", None)
            try:
                outcomes[config], extra[config] = run(
                    trace, config, load, args.guard_mode, args.step_guard_mode, args.router
                )
                print("  " + summary(outcomes[config], extra[config]), flush=True)
            except RuntimeError as exc:  # an engine that did not start on a loaded machine
                print(f"  {config}: not run: {exc}".splitlines()[0], flush=True)
                failed[f"{key}/{config}"] = str(exc).splitlines()[0]
                outcomes.pop(config, None)
                extra.pop(config, None)
            # recorded after each configuration: a run stopped at its time limit keeps the rest
            checks = {**judge(trace, outcomes, extra), **step_checks(trace, extra)}
            if load is not None:
                for c in outcomes:  # every engine held the load asked for at the incident
                    held = extra[c]["inflight_at_incident_per_engine"] or [0]
                    checks[f"{c}_inflight_at_incident_ge_{args.inflight}"] = (
                        min(held) >= args.inflight
                    )
            row = {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "router": args.router,
                "inflight": args.inflight,
                "time_compression": trace.time_compression,
                "load_average_before": load_before,
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
                "trace": json.loads(json.dumps(trace.model_dump())),
                "closed_loop": asdict(load) if load is not None else None,
                "outcomes": {c: {**o.__dict__, **extra[c]} for c, o in outcomes.items()},
                "targets": checks,
                "provenance": record.provenance("outcome"),  # traces run at different commits
            }
            if args.repeat:
                continue  # recorded once all its configurations ran (below)
            traces[key] = row
            resummarise(kept_keys, key, row)
            record.write(
                args.out,
                "outcome",
                args.quick,
                conditions=conditions,
                horizon=HORIZON,
                traces=traces,
                not_run=failed,
                step_guard=step_summary(traces),
                **kept_keys,
            )
        if args.repeat:
            view = {**kept_keys, "traces": traces}
            entry = repeat_entry(row) | {"not_run": failed, "conditions": args.conditions}
            add_repeats(view, key, [entry])
            kept_keys["repeats"] = view["repeats"]
            write_kept(args.out, recorded, kept_keys)
            print(f"  repeats: {json.dumps(kept_keys['repeats'][key]['oomguard_vs_default'])}")
            continue
        print(f"  targets: {json.dumps(traces[key]['targets'])}", flush=True)
    return 0


def write_kept(out: str | Path, recorded: dict[str, Any], kept_keys: dict[str, Any]) -> None:
    """Write `recorded` back with `kept_keys` (its rows and their provenance as they were)."""
    record.write(
        out,
        "outcome",
        bool(recorded.get("quick")),
        conditions=recorded.get("conditions"),
        horizon=HORIZON,
        traces=recorded.get("traces", {}),
        not_run=recorded.get("not_run", {}),
        step_guard=step_summary(recorded.get("traces", {})),
        **kept_keys,
    )


def add_repeat_files(out: Path, files: list[Path]) -> int:
    """`--add-repeat`: each trace row in `files` becomes a repeat of that trace in `out`."""
    recorded = json.loads(out.read_text())
    for f in files:
        run = json.loads(f.read_text())
        for key, row in run.get("traces", {}).items():
            entry = repeat_entry(row) | {
                "not_run": {k: v for k, v in run.get("not_run", {}).items() if k.startswith(key)},
                "conditions": run.get("conditions"),
            }
            added = add_repeats(recorded, key, [entry])
            summary = json.dumps(recorded["repeats"][key]["oomguard_vs_default"])
            print(f"{f}: {key}: {'added' if added else 'already recorded'}; {summary}")
    write_kept(out, recorded, {k: v for k, v in recorded.items() if k not in OWN_KEYS})
    return 0


OWN_KEYS = (
    "benchmark",
    "quick",
    "when",
    "machine",
    "conditions",
    "horizon",
    "traces",
    "not_run",
    "step_guard",
)
HORIZON = (
    "each trace extended to the end of its trouble + reload_s (720 s) + 120 s, the same for all "
    "configurations; goodput = good output tokens / horizon"
)


def summary(o: Outcome, x: dict[str, Any]) -> str:
    """One line per configuration: what the crash cost and how long recovery took."""
    cores = engine_cores(x.get("cpu"))
    return (
        f"{o.config:9s} crashes {o.crashes}  lost {o.lost}/{o.requests}  goodput "
        f"{o.goodput_tokens_per_s:8.1f} tok/s  p99 TTFT {o.ttft_p99_s}  preemptions "
        f"{o.preemptions}  in flight at incident {x.get('inflight_at_incident_per_engine')} "
        f"(engine 0 peak {x.get('inflight_peak')})  slowdown {x.get('inflight_decode_slowdown')}"
        f"  recovery {o.recovery_s}  actions {len(o.actions)}"
        f"  step guard {x.get('step_guard_shrinks') or '-'}"
        f"  engine cores' CPU {cores} %"
        + (f"  restart chain {x['restart_chain']}" if x.get("restart_chain") else "")
    )


def kept(
    recorded: dict[str, Any] | None, trace: Trace, configs: list[str] | None, inflight: int
) -> tuple[dict[str, Outcome], dict[str, dict[str, Any]]]:
    """With --config, the other configurations already recorded for this trace, when they ran
    the same trace (horizon, clock) and load: a trace's three runs may be split across runs."""
    outcomes: dict[str, Outcome] = {}
    extra: dict[str, dict[str, Any]] = {}
    if not configs or not recorded or recorded.get("inflight", 0) != inflight:
        return outcomes, extra
    if recorded.get("trace") != json.loads(json.dumps(trace.model_dump())):
        return outcomes, extra
    names_ = {f.name for f in fields(Outcome)}
    for config, row in recorded.get("outcomes", {}).items():
        if config not in configs:
            outcomes[config] = Outcome(**{k: v for k, v in row.items() if k in names_})
            extra[config] = {k: v for k, v in row.items() if k not in names_}
    return outcomes, extra


if __name__ == "__main__":
    sys.exit(main())
