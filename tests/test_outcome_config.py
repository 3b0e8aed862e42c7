"""The outcome benchmark's fleet runs the remediator an operator gets, and its load is sized."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.outcome import (
    INFLIGHT_OUTPUT,
    INFLIGHT_PROMPT,
    inflight_rate,
    trouble_starts_s,
    with_horizon,
)
from oomguard.lab.runner import LAB_IDLE_TO_LEVEL_S, Fleet, remediator_config
from oomguard.remediator.config import RemediatorConfig, StandaloneConfig
from oomguard.remediator.policy import PolicyConfig
from oomguard.remediator.safety import SafetyConfig
from oomguard.twin.physics import Physics, Step
from oomguard.twin.traces import Trace


def fleet_config(tmp_path: Path, c: float) -> RemediatorConfig:
    fleet = Fleet(Trace.load("neighbour-growth"), "oomguard", tmp_path)
    fleet.engines = [  # what remediator_targets reads of a started engine
        SimpleNamespace(url=f"http://127.0.0.1:800{i}", api=f"http://127.0.0.1:900{i}")
        for i in range(fleet.n)
    ]
    raw = remediator_config(
        fleet.remediator_targets(restart=True),
        c,
        audit=tmp_path / "audit.jsonl",
        token_file=tmp_path / "rtoken",
        exporters=["http://127.0.0.1:9848/metrics"],
    )
    return RemediatorConfig.model_validate(raw)


@pytest.mark.parametrize("c", [1.0, 5.0, 20.0])
def test_the_twins_remediator_is_the_shipped_one_at_the_traces_clock(tmp_path, c):
    cfg = fleet_config(tmp_path, c)
    shipped = StandaloneConfig(exporters=["http://127.0.0.1:9848/metrics"])
    assert cfg.mode == "standalone" and cfg.standalone is not None
    # the fleet's own remediator had keep_firing 120 s of trace time, four times the shipped
    # hysteresis on action alerts: its recovery was not the product's
    assert cfg.standalone.keep_firing_seconds == pytest.approx(shipped.keep_firing_seconds / c)
    assert cfg.standalone.pressure_for_seconds == pytest.approx(shipped.pressure_for_seconds / c)
    assert cfg.standalone.critical_for_seconds == pytest.approx(shipped.critical_for_seconds / c)
    policy, safety = PolicyConfig(), SafetyConfig()
    assert cfg.policy.step_seconds == pytest.approx(policy.step_seconds / c)
    assert cfg.policy.restart_after_drain_seconds == pytest.approx(
        policy.restart_after_drain_seconds / c
    )
    # the settle: the shipped one where the lab's wall-time chain from an idle engine to its
    # level fits in its margin over keep_firing_for, else that margin in wall seconds
    settle = cfg.policy.fragmentation_settle_seconds
    margin = settle - cfg.standalone.keep_firing_seconds
    assert settle >= policy.fragmentation_settle_seconds / c
    assert margin >= LAB_IDLE_TO_LEVEL_S
    if (
        policy.fragmentation_settle_seconds - shipped.keep_firing_seconds
    ) / c >= LAB_IDLE_TO_LEVEL_S:
        assert settle == pytest.approx(policy.fragmentation_settle_seconds / c)  # x1, x5
    else:  # x20: the shipped margin (30 s) is 1.5 wall s, under the lab's chain
        assert margin == pytest.approx(LAB_IDLE_TO_LEVEL_S)
    assert cfg.policy.readmit_stages == policy.readmit_stages
    assert cfg.policy.readmit_successes == policy.readmit_successes
    assert cfg.safety.cooldown_seconds == pytest.approx(safety.cooldown_seconds / c)
    assert cfg.safety.max_actions == safety.max_actions
    # and it can restart either engine through its supervisor, as a node running
    # `oomguard serve` allows
    assert all(t.restart is not None and t.restart.supervisor is not None for t in cfg.targets)


def test_the_in_flight_load_holds_about_n_requests_per_engine():
    trace = Trace.load("neighbour-growth")
    rate = inflight_rate(trace, 64)
    p = Physics.for_model(trace.model, gpu=trace.gpu, gpu_memory_utilization=0.9)
    output = sum(INFLIGHT_OUTPUT) / 2
    ctx = int(64 * (sum(INFLIGHT_PROMPT) / 2 + output / 2))
    decode_s = output * p.step_seconds(Step(tokens=64, attention=ctx, context=ctx))
    assert rate / 2 * decode_s == pytest.approx(64)  # Little's law, per engine
    loaded = with_horizon(trace, 64)
    extra = loaded.phases[-1]
    # from a minute before the neighbour starts to grow until the pressure ends
    assert trouble_starts_s(trace) == 150
    assert (extra.start_s, extra.end_s) == (90, trace.pressure_ends_s)
    # the fixed horizon holds a crash's model reload after the trouble
    assert loaded.duration_s >= (trace.pressure_ends_s or 0) + trace.reload_s


def test_no_in_flight_load_without_gpu_trouble():
    trace = Trace.load("do-no-harm")
    assert trouble_starts_s(trace) is None
    assert len(with_horizon(trace, 64).phases) == len(trace.phases)


@pytest.mark.parametrize("c", [1.0, 15.0])
def test_the_lab_exporters_event_holds_run_on_the_traces_clock(c):
    """Issue 30: a step-guard shrink held level 2 for 15 wall s (225 trace s at x15) and an
    allocator retry for 120 wall s; in the lab both last their shipped time of trace time."""
    from dataclasses import replace

    from oomguard.exporter import pressure
    from oomguard.exporter.pressure import EngineSource, PressureEvaluator
    from oomguard.lab.processes import step_guard_hold_on_trace_clock
    from oomguard.lab.runner import exporter_thresholds
    from oomguard.thresholds import PressureThresholds
    from tests.test_pressure import GB, alloc, engine, gpu, levels

    shipped = PressureThresholds()
    thresholds = exporter_thresholds(c)
    assert thresholds.event_hold_seconds == pytest.approx(shipped.event_hold_seconds / c)
    assert thresholds.model_dump(exclude={"event_hold_seconds"}) == shipped.model_dump(
        exclude={"event_hold_seconds"}
    )
    src, healthy = [EngineSource("t", engine(0.9))], gpu(8 * GB)
    shrink = replace(alloc(), step_shrinks={"fewer_prefill_tokens/activations": 1})
    shipped_hold = pressure.STEP_GUARD_HOLD_S
    with step_guard_hold_on_trace_clock(c) as hold:
        assert hold == pytest.approx(shipped_hold / c)
        for report, lasts, reason in (
            (shrink, hold, "step_guard_shrink"),
            (alloc(retries=1), thresholds.event_hold_seconds, "allocator_retries"),
        ):
            ev = PressureEvaluator(thresholds)
            ev.observe_allocator([alloc()], now=0)
            ev.observe_allocator([report], now=1)
            _, held = levels(ev, [healthy], src, [report], now=1 + lasts * 0.9)
            assert set(held.values()) == {(2, reason)}
            _, after = levels(ev, [healthy], src, [report], now=1 + lasts * 1.1)
            assert set(after.values()) == {(0, "ok")}
    assert shipped_hold == pressure.STEP_GUARD_HOLD_S  # only while the lab's fleet runs
