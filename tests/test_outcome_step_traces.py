"""The outcome benchmark's part for issue 27: the traces of memory taken within seconds run a
fourth configuration (oomguard without the step guard), record the step guard's shrinks from the
hand-off, and are judged across traces. The runs themselves are real-time replays (minutes each,
recorded by the lead: docs/benchmarks.md); these tests check the bookkeeping on recorded shapes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from bench.outcome import (
    STEP_TRACES,
    configs_for,
    judge,
    step_checks,
    step_shrinks,
    step_summary,
)
from oomguard.handoff import AllocatorReport, write_report
from oomguard.lab.runner import CONFIGS, NO_STEP_GUARD, Fleet, Outcome
from oomguard.twin.traces import Trace, names


def test_the_step_traces_exist_and_run_a_fourth_configuration():
    assert set(STEP_TRACES) <= set(names())
    for name in STEP_TRACES:
        assert configs_for(name) == (*CONFIGS, NO_STEP_GUARD)
    assert configs_for("neighbour-growth") == CONFIGS


def test_the_fleet_runs_the_step_guard_per_configuration(tmp_path: Path):
    """`oomguard` runs oomguard's loop and the step guard (enforcing when the bench asks);
    `oomguard-no-step-guard` the same loop with the step guard off."""
    trace = Trace.load("neighbour-2s-24gb")
    with_guard = Fleet(trace, "oomguard", tmp_path / "a", step_guard_mode="enforce")
    without = Fleet(trace, NO_STEP_GUARD, tmp_path / "b", step_guard_mode="enforce")
    assert (with_guard.step_guard_mode, without.config) == ("enforce", NO_STEP_GUARD)


def test_shrinks_are_read_from_every_engine_process_s_hand_off(tmp_path: Path):
    fleet = SimpleNamespace(work=tmp_path, names=["engine-0", "engine-1"])

    def report(pid: int, target: str, shrinks: dict[str, int] | None) -> None:
        write_report(
            tmp_path / "allocator",
            AllocatorReport.from_memory_stats(
                {},
                timestamp=1.0,
                pid=pid,
                rank=0,
                target=target,
                engine="0",
                device_index=0,
                device_uuid="",
                step_shrinks=shrinks,
            ),
        )

    report(10, "engine-0", {"fewer_prefill_tokens/activations": 3})
    report(11, "engine-0", {"fewer_prefill_tokens/activations": 2, "wait/activations": 1})
    report(12, "engine-1", None)
    report(13, "someone-else", {"wait/activations": 9})  # not this fleet's
    (tmp_path / "allocator" / "pid-14.json").write_text("not json")
    assert step_shrinks(fleet) == {  # type: ignore[arg-type]
        "fewer_prefill_tokens/activations": 5,
        "wait/activations": 1,
    }


def outcome(config: str, crashes: int = 0, lost: int = 0, goodput: float = 100.0) -> Outcome:
    return Outcome("t", config, 100, 100 - lost, lost, crashes, goodput)


def test_the_targets_of_a_step_trace_and_of_do_no_harm():
    trace = Trace.load("neighbour-8s-48gb")
    outcomes = {
        "default": outcome("default", crashes=1, lost=9, goodput=80),
        "static": outcome("static", crashes=1, lost=7, goodput=85),
        NO_STEP_GUARD: outcome(NO_STEP_GUARD, crashes=1, lost=1, goodput=90),
        "oomguard": outcome("oomguard", goodput=80),
    }
    extra = {c: {"step_guard_shrinks": {}} for c in outcomes}
    extra["oomguard"]["step_guard_shrinks"] = {"fewer_prefill_tokens/activations": 40}
    checks = {**judge(trace, outcomes, extra), **step_checks(trace, extra)}
    assert checks["vllm_alone_crashes"] is True
    assert checks["without_step_guard_crashes"] == 1
    assert checks["oomguard_zero_crashes"] and checks["oomguard_zero_lost"]
    assert checks["goodput_at_least_95pct_of_best_static"] is False  # 80 < 0.95 x 85
    assert checks["step_guard_shrank"] is True
    steady = step_checks(Trace.load("do-no-harm"), extra)
    assert steady == {"no_step_guard_shrink": False}  # a shrink on a healthy GPU is harm
    extra["oomguard"]["step_guard_shrinks"] = {}
    assert step_checks(Trace.load("do-no-harm"), extra) == {"no_step_guard_shrink": True}


def test_across_the_step_traces_the_race_is_lost_without_the_guard_and_held_with_it():
    def recorded(without_crashes: int, with_crashes: int = 0, with_lost: int = 0) -> dict:
        return {
            "outcomes": {
                NO_STEP_GUARD: {"crashes": without_crashes},
                "oomguard": {"crashes": with_crashes, "lost": with_lost},
            }
        }

    traces = {
        "neighbour-2s-24gb": recorded(1),
        "neighbour-30s-80gb": recorded(0),
        "do-no-harm": {"outcomes": {}},
    }
    summary = step_summary(traces)
    assert summary["without_step_guard_lost_the_race_on"] == ["neighbour-2s-24gb"]
    assert summary["without_step_guard_lost_at_least_one"] is True
    assert summary["with_step_guard_no_oom_nothing_lost"] is True
    traces["fragmentation-spike"] = recorded(1, with_lost=2)
    assert step_summary(traces)["with_step_guard_no_oom_nothing_lost"] is False
    assert step_summary({})["with_step_guard_no_oom_nothing_lost"] is False
