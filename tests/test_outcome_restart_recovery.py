"""Recovery on a trace whose pressure ends only with a restart (fragmentation-creep: the
fragmentation lives in the engine process): the pressure ends when the restarted engine 0 is up,
recovery runs from there to full admission, and the restart's own chain is reported with the
reload apart from the re-admission."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.outcome import engine0, horizon_s, inflight_load, judge, with_horizon
from oomguard.lab.runner import EngineView, Fleet, Outcome
from oomguard.twin.traces import GpuPoint, Trace, names

CREEP = "fragmentation-creep"


def test_only_fragmentation_that_stays_ends_with_a_restart():
    assert [n for n in names() if Trace.load(n).pressure_ends_with_restart] == [CREEP]
    creep = Trace.load(CREEP)
    # fragmentation that clears on its own, or a trace that says when its pressure ends: no
    cleared = [*creep.gpu_events, GpuPoint(at_s=7300, fragmentation_gib=0)]
    assert not creep.model_copy(update={"gpu_events": cleared}).pressure_ends_with_restart
    assert not creep.model_copy(update={"pressure_ends_s": 7200.0}).pressure_ends_with_restart


def test_the_load_runs_through_the_restart_to_the_horizon():
    creep = Trace.load(CREEP)
    load = inflight_load(creep, 64)
    assert load is not None and load.users == 128
    assert load.end_s == horizon_s(creep) == with_horizon(creep).duration_s == 8040
    # a trace with a pressure end keeps its window
    ng = Trace.load("neighbour-growth")
    assert inflight_load(ng, 64).end_s == ng.pressure_ends_s  # type: ignore[union-attr]


def view(t: float, mode: str, generation: int, up: bool = True) -> list[EngineView]:
    return [
        EngineView(t=t, up=up, mode=mode if up else "down", generation=generation),
        EngineView(t=t, up=True, mode="serving", generation=1),
    ]


def creep_fleet(tmp_path: Path) -> Fleet:
    fleet = Fleet(with_horizon(Trace.load(CREEP)), "oomguard", tmp_path, log=lambda _: None)
    fleet.history = [
        view(5000, "serving", 1),
        view(5200, "capped", 1),
        view(5850, "draining", 1),
        view(6500, "down", 2, up=False),  # restarted: the new process is loading
        view(7200, "capped", 2),  # up at the first re-admission stage: the pressure's end
        view(7230, "capped", 2),
        view(7241, "serving", 2),  # full admission
        view(7600, "serving", 2),
    ]
    return fleet


def test_recovery_runs_from_the_restarted_engine_up_to_full_admission(tmp_path):
    fleet = creep_fleet(tmp_path)
    assert fleet.pressure_ended_at() == 7200
    assert fleet.recovered_at() == 7241
    assert fleet.outcome().recovery_s == 41.0
    # never restarted: the pressure never ended, nothing recovered
    fleet.history = fleet.history[:3]
    assert fleet.pressure_ended_at() is None and fleet.recovered_at() is None
    assert fleet.outcome().recovery_s is None


def test_the_restart_chain_keeps_the_reload_apart_from_the_readmission(tmp_path):
    fleet = creep_fleet(tmp_path)
    fleet.t0 = time.monotonic()
    wall0 = time.time() - (time.monotonic() - fleet.t0)
    c = fleet.c

    def entry(t: float, event: str, action: str, result: str, target: str = "engine-0") -> str:
        return json.dumps(
            {
                "time": wall0 + t / c,
                "event": event,
                "target": target,
                "action": action,
                "result": result,
            }
        )

    fleet.audit.write_text(
        "\n".join(
            [
                entry(5200, "acted", "lower_cap", "ok"),
                entry(5100, "acted", "drain", "ok", target="engine-1"),  # not engine 0's
                entry(5850, "acted", "drain", "ok"),
                entry(6450, "acted", "restart", "started"),
                entry(6450, "restart", "drain", "ok"),
                entry(6460, "restart", "wait_idle", "ok"),
                entry(6470, "restart", "restart", "ok"),
                entry(7210, "restart", "wait_ready", "ok"),
            ]
        )
        + "\n"
    )
    o = fleet.outcome()
    out = engine0(fleet, fleet.trace, o)
    chain = out["restart_chain"]
    assert chain["first_action_s"] is not None
    assert abs(chain["first_action_s"] - 5200) < 1  # the audit's wall clock in trace time
    assert abs(chain["drain_s"] - 5850) < 1
    assert abs(chain["restart_decided_s"] - 6450) < 1
    assert abs(chain["restart_begun_s"] - 6470) < 1
    assert (chain["engine_ready_s"], chain["full_admission_s"]) == (7200, 7241)
    assert abs(chain["reload_s"] - 730) < 1 and chain["readmission_s"] == 41.0
    assert out["recovery_s"] == 41.0 and out["retriggered"] is False

    # the judge holds it to the 60 s target, and a second lowering after full admission fails
    trace = fleet.trace
    checks = judge(trace, {"oomguard": o}, {"oomguard": out})
    assert checks["recovery_within_60s"] is True
    assert checks["no_retrigger_during_recovery"] is True
    fleet.history.append(view(7700, "capped", 2))
    out = engine0(fleet, trace, o)
    assert out["retriggered"] is True
    slow = Outcome(CREEP, "oomguard", recovery_s=75.0)
    assert judge(trace, {"oomguard": slow}, {"oomguard": out})["recovery_within_60s"] is False


def test_after_a_crash_the_restart_begins_with_the_crash(tmp_path):
    # default and static: no remediator; the supervisor reloads for reload_s after the OOM
    fleet = creep_fleet(tmp_path)
    fleet.config = "default"
    chain = engine0(fleet, fleet.trace, fleet.outcome(), crash_s=6400.0)["restart_chain"]
    assert chain["first_action_s"] is None and chain["drain_s"] is None
    assert chain["restart_begun_s"] == 6400.0 and chain["reload_s"] == 800.0
