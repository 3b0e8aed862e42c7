"""The step guard (issue 27, item 1): its plan (pure), its hook on vLLM's scheduler, what it
publishes in the hand-off, and what the exporter makes of it (a metric and the pressure level).

The real-server proof (a neighbour taking the GPU within seconds under heavy prefill load, no
CUDA OOM, every request served) is tests/test_vllm_plugin_step_guard_server.py."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomguard.handoff import AllocatorReport, InvalidReport
from oomguard.twin.physics import Physics, Step
from oomguard.vllm_plugin import step_guard
from oomguard.vllm_plugin.step_guard import Room, StepCosts, StepGuard, margin_for, plan

GIB = 2**30
VOCAB, HIDDEN = 128_256, 4096
H100 = Physics.for_model("llama-3-8b", gpu="H100", gpu_memory_utilization=0.9)
FULL = 8192


@pytest.fixture(autouse=True)
def clean_registry():
    step_guard._reset_for_tests()
    yield
    step_guard._reset_for_tests()


def twin_room(p: Physics, neighbour: float = 0, fragmentation: float = 0) -> Room:
    idle = p.total - p.driver_reserved - p.resident
    return Room(
        int(idle - neighbour * GIB - fragmentation * GIB),
        idle,
        p.activation(p.max_num_batched_tokens),
    )


def costs_for(p: Physics) -> StepCosts:
    return StepCosts.calibrated(
        p.activation(p.max_num_batched_tokens), p.max_num_batched_tokens, HIDDEN, VOCAB
    )


def test_calibrated_to_the_profile_the_costs_are_the_twin_s_physics():
    costs = costs_for(H100)
    for tokens in (1, 100, 2048, 8192):
        assert costs.need(tokens) == pytest.approx(H100.activation(tokens), rel=1e-9)
        assert costs.need(tokens, plp_tokens=tokens) == pytest.approx(
            H100.activation(tokens) + H100.logits(tokens), rel=1e-9
        )
    # a GPU whose profile measured twice the calibration: every part scales with it
    double = StepCosts.calibrated(2 * H100.activation(FULL), FULL, HIDDEN, VOCAB)
    assert double.need(FULL) == pytest.approx(2 * H100.activation(FULL))
    assert double.need(0) == 0


@given(
    neighbour=st.floats(0, 14),
    fragmentation=st.floats(0, 6),
    plp=st.integers(0, 20_000),
    rows=st.integers(0, 64),
    gmu=st.sampled_from([0.85, 0.9, 0.92, 0.95]),
)
def test_what_the_plan_allows_fits_the_twin(neighbour, fragmentation, plp, rows, gmu):
    """Whatever the neighbour and fragmentation, the budget the plan gives never makes a step
    that the twin's physics would kill (the prompt-logprobs tokens counted first)."""
    p = Physics.for_model("llama-3-8b", gpu="H100", gpu_memory_utilization=gmu)
    room = twin_room(p, neighbour, fragmentation)
    costs = costs_for(p)
    step = plan(costs, room, margin_for(room, costs, 0.15), plp, rows)
    assert 0 <= step.budget <= FULL
    if step.budget:
        worst = Step(tokens=step.budget, logits=min(step.budget, plp))
        assert p.fits(worst, int(fragmentation * GIB), int(neighbour * GIB))
    if step.action is None:
        assert step.budget == FULL


@pytest.mark.parametrize("gpu", ["RTX4090", "L40S", "A100-40GB", "A100-80GB", "H100", "H200"])
@pytest.mark.parametrize("gmu", [0.85, 0.9, 0.92, 0.95, 0.98])
def test_do_no_harm_a_full_step_on_a_healthy_engine_is_never_shrunk(gpu, gmu):
    """Nothing else on the GPU: the full profiled step always fits, at any sane gmu, any GPU
    (the margin is a share of what a full step leaves free)."""
    for model in ("llama-3-8b", "llama-3.2-3b", "llama-3.2-1b"):
        try:
            p = Physics.for_model(model, gpu=gpu, gpu_memory_utilization=gmu)
            _ = p.kv_pool
        except Exception:
            continue
        room = twin_room(p)
        costs = StepCosts.calibrated(
            p.activation(FULL), FULL, p.shape.hidden_size, p.shape.vocab_size
        )
        assert plan(costs, room, margin_for(room, costs, 0.15)).action is None, (gpu, gmu, model)
        return
    pytest.skip(f"no twin model starts on {gpu} at {gmu}")


def test_actions_and_reasons():
    costs = costs_for(H100)
    idle = twin_room(H100)
    margin = margin_for(idle, costs, 0.15)
    slack = (idle.idle - H100.activation(FULL)) / GIB  # 7.9 GiB on an H100 at 0.9
    # a neighbour takes more than the slack: prefill chunks shrink
    some = plan(costs, twin_room(H100, slack + 1), margin, decode_tokens=10)
    assert (some.action, some.reason) == ("fewer_prefill_tokens", "activations")
    assert 10 < some.budget < FULL
    # the same room with more decoding requests than tokens that fit: decodes only
    few = plan(costs, twin_room(H100, slack + 1), margin, decode_tokens=1000)
    assert few.action == "decode_only" and 0 < few.budget <= 1000
    # not even a one-token step: wait
    none = plan(costs, twin_room(H100, slack + 4), margin)
    assert (none.action, none.budget) == ("wait", 0)
    # a full step fits beside a 5 GiB neighbour, a full chunk of prompt logprobs does not
    logits = plan(costs, twin_room(H100, 5), margin, plp_tokens=FULL)
    assert logits.reason == "prompt_logprobs_logits" and 0 < logits.budget < FULL
    # a full step fits, not with the top-logprobs rows of 256 sequences besides
    between = idle.available - margin - costs.need(FULL) - 128 * costs.sample_row
    rows = plan(costs, twin_room(H100, between / GIB), margin, sample_rows=256)
    assert rows.reason == "sampling_logits" and 0 < rows.budget < FULL


class FakeScheduler:
    """What the hook reads of vLLM's Scheduler; `schedule` records the budget it was given."""

    def __init__(self, running=(), waiting=()):
        self.max_num_scheduled_tokens = FULL
        self.max_num_running_reqs = 256
        self.running = list(running)
        self.waiting = list(waiting)
        self.seen: list[int] = []

    def get_request_counts(self):
        return len(self.running), len(self.waiting)

    def schedule(self, *args):
        self.seen.append(self.max_num_scheduled_tokens)
        return SimpleNamespace(total_num_scheduled_tokens=self.max_num_scheduled_tokens)


def req(prompt: int, computed: int = 0, plp: bool = False, rid: str = "r"):
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=prompt,
        num_tokens=prompt,
        num_tokens_with_spec=prompt,
        num_computed_tokens=computed,
        sampling_params=SimpleNamespace(prompt_logprobs=1 if plp else None, logprobs=None),
        is_finished=lambda: False,
    )


def guard(mode: str, neighbour: list[float], clock=None) -> StepGuard:
    def probe():
        r = twin_room(H100, neighbour[0])
        return {"available": r.available, "idle": r.idle, "profiled": r.profiled}

    return StepGuard(
        mode,
        probe,
        lambda profiled: StepCosts.calibrated(profiled, FULL, HIDDEN, VOCAB),
        wait_seconds=0.001,
        **({"clock": clock} if clock else {}),
    )


def run_step(g: StepGuard, scheduler: FakeScheduler) -> None:
    from oomguard.vllm_plugin.engine import _guarded_schedule

    scheduler._oomguard_step_guard = g
    _guarded_schedule(type(scheduler).schedule, scheduler, (), {})


def test_the_hook_shrinks_vllm_s_budget_for_one_call_and_restores_it():
    neighbour = [0.0]
    s = FakeScheduler(running=[req(100, 100)], waiting=[req(30_000, rid="long")])
    g = guard("enforce", neighbour)
    run_step(g, s)
    assert s.seen == [FULL] and s.max_num_scheduled_tokens == FULL  # healthy: untouched
    neighbour[0] = 9.0  # a neighbour took more than the slack
    run_step(g, s)
    assert 0 < s.seen[-1] < FULL and s.max_num_scheduled_tokens == FULL
    assert g.shrunk == 1 and step_guard.shrinks() == {"fewer_prefill_tokens/activations": 1}
    # observe: decides and counts, never changes vLLM's budget
    o = guard("observe", neighbour)
    run_step(o, s)
    assert s.seen[-1] == FULL and o.shrunk == 1
    # nothing held back (only decodes to run): no shrink counted
    calm = FakeScheduler(running=[req(100, 100)])
    run_step(g, calm)
    assert g.shrunk == 1
    # off: no reading at all
    off = guard("off", neighbour)
    off.probe = lambda: pytest.fail("off must not read memory")  # type: ignore[assignment]
    run_step(off, s)
    assert s.seen[-1] == FULL


def test_a_step_that_cannot_fit_at_all_waits_and_counts_it():
    neighbour = [12.0]
    s = FakeScheduler(waiting=[req(30_000)])
    g = guard("enforce", neighbour)
    started = time.monotonic()
    run_step(g, s)
    assert s.seen[-1] == 0 and time.monotonic() - started >= 0.001
    assert step_guard.shrinks() == {"wait/activations": 1}


def test_prompt_logprobs_requests_are_tracked_until_they_finish():
    neighbour = [5.0]  # a full step fits beside it, a full chunk's logits too do not
    g = guard("enforce", neighbour)
    r = req(8000, plp=True, rid="plp")
    done = [False]
    r.is_finished = lambda: done[0]
    g.track(r)
    s = FakeScheduler(waiting=[r])
    room = twin_room(H100, neighbour[0])
    costs = g._make_costs(room.profiled)
    assert costs.need(FULL) < room.available < costs.need(FULL, FULL)
    run_step(g, s)
    assert 0 < s.seen[-1] < FULL
    assert step_guard.shrinks() == {"fewer_prefill_tokens/prompt_logprobs_logits": 1}
    done[0] = True
    run_step(g, s)
    assert s.seen[-1] == FULL and not g.tracked


def ramp(trend_safety: float, monkeypatch) -> list[tuple[float, int, bool]]:
    """Full 0.3 s steps, then a neighbour growing 5 GiB/s to 1.15 x the slack: each step's
    (neighbour at its end, budget, whether the twin's physics holds it at its end)."""
    monkeypatch.setattr(step_guard, "TREND_SAFETY", trend_safety)
    now = [0.0]
    neighbour = [0.0]
    g = guard("enforce", neighbour, clock=lambda: now[0])
    s = FakeScheduler(waiting=[req(10_000_000)])
    slack = (twin_room(H100).idle - H100.activation(FULL)) / GIB
    out = []
    for k in range(40):
        run_step(g, s)
        now[0] += 0.3
        if k >= 5:  # the neighbour grows while the step runs
            neighbour[0] = min(1.15 * slack, neighbour[0] + 5 * 0.3)
        budget = s.seen[-1]
        fits = not budget or H100.fits(Step(tokens=budget), neighbour=int(neighbour[0] * GIB))
        out.append((neighbour[0], budget, fits))
    return out


def test_a_neighbour_growing_fast_is_met_with_the_trend_margin(monkeypatch):
    """A neighbour growing 5 GiB/s meets a step's activations at the step's end: the guard keeps
    free what the room lost per step recently, so every step still fits when it ends; with the
    static margin alone one does not."""
    steps = ramp(step_guard.TREND_SAFETY, monkeypatch)
    assert all(fits for _, _, fits in steps), steps
    assert steps[0][1] == FULL and 0 < steps[-1][1] < FULL  # full, then shrunk, never stopped
    static = ramp(0.0, monkeypatch)
    assert not all(fits for _, _, fits in static)


def test_the_hand_off_carries_the_shrinks_strictly():
    report = AllocatorReport.from_memory_stats(
        {},
        timestamp=1.0,
        pid=7,
        rank=0,
        target="e",
        engine="0",
        device_index=0,
        device_uuid="GPU-1",
        step_shrinks={"fewer_prefill_tokens/activations": 3, "wait/activations": 1},
    )
    back = AllocatorReport.from_json(report.to_json())
    assert back.step_shrinks == {"fewer_prefill_tokens/activations": 3, "wait/activations": 1}
    plain = json.loads(report.to_json())
    for bad in ({"invented/label": 1}, {"wait/activations": -1}, {"wait/activations": "1"}, [1]):
        with pytest.raises(InvalidReport):
            AllocatorReport.from_json(json.dumps({**plain, "step_shrinks": bad}))
    del plain["step_shrinks"]  # an older plugin: no field at all
    assert AllocatorReport.from_json(json.dumps(plain)).step_shrinks is None


def test_the_exporter_counts_shrinks_and_raises_the_engine_s_level_at_once(tmp_path):
    from oomguard.exporter.collectors.allocator import AllocatorCollector
    from oomguard.exporter.pressure import CRITICAL, PRESSURE, PressureEvaluator
    from oomguard.exporter.render import FamilyBuilder
    from oomguard.handoff import write_report

    def report(shrinks: dict[str, int] | None) -> AllocatorReport:
        return AllocatorReport.from_memory_stats(
            {},
            timestamp=time.time(),
            pid=4242,
            rank=0,
            target="engine-0",
            engine="0",
            device_index=0,
            device_uuid="GPU-1",
            step_shrinks=shrinks,
        )

    evaluator = PressureEvaluator()
    evaluator.observe_allocator([report(None)], 0.0)
    evaluator.observe_allocator([report({"fewer_prefill_tokens/activations": 2})], 1.0)
    assert evaluator._held(evaluator._held_engine, ("engine-0", "0")).level == PRESSURE
    assert evaluator._held(evaluator._held_engine, ("engine-0", "0")).reason == (
        "step_guard_shrink"
    )
    evaluator.observe_allocator(
        [report({"fewer_prefill_tokens/activations": 2, "decode_only/activations": 1})], 2.0
    )
    held = evaluator._held(evaluator._held_engine, ("engine-0", "0"))
    assert (held.level, held.reason) == (CRITICAL, "step_guard_stall")
    # the level falls soon after the shrinks stop (they are counted while memory is short)
    evaluator._expire(2.0 + 14.0)
    assert evaluator._held(evaluator._held_engine, ("engine-0", "0")).level == CRITICAL
    evaluator._expire(2.0 + 16.0)
    assert evaluator._held(evaluator._held_engine, ("engine-0", "0")).level == 0

    write_report(tmp_path, report({"wait/prompt_logprobs_logits": 5}))
    collector = AllocatorCollector(str(tmp_path), "node-1")
    out = FamilyBuilder()
    collector.families(collector.collect(), out)
    [family] = [f for f in out.families() if f.spec.name == "oomguard_step_guard_shrinks_total"]
    [(labels, value)] = family.samples
    named = dict(zip(family.spec.labels, labels, strict=True))
    assert (named["target"], named["action"], named["reason"], value) == (
        "engine-0",
        "wait",
        "prompt_logprobs_logits",
        5.0,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OOMGUARD_STEP_GUARD_MODE", "panic"),
        ("OOMGUARD_STEP_GUARD_MARGIN", "1.5"),
        ("OOMGUARD_STEP_GUARD_MARGIN", "nan"),
        ("OOMGUARD_STEP_GUARD_WAIT_SECONDS", "soon"),
    ],
)
def test_a_bad_step_guard_setting_names_the_variable_and_leaves_vllm_alone(
    monkeypatch, name, value
):
    from oomguard.vllm_plugin.engine import _make_step_guard

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        StepGuard.from_env(lambda: None, lambda profiled: costs_for(H100))
    step_guard.register_probe(lambda: None)
    scheduler = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(
                get_hidden_size=lambda: HIDDEN, get_vocab_size=lambda: VOCAB, dtype=None
            )
        ),
        max_num_scheduled_tokens=FULL,
    )
    assert _make_step_guard(scheduler) is None  # an error logged, vLLM's own steps


def test_without_an_in_process_worker_the_guard_is_inactive(monkeypatch):
    from oomguard.vllm_plugin.engine import _make_step_guard

    monkeypatch.setenv("OOMGUARD_STEP_GUARD_MODE", "enforce")
    assert step_guard.registered_probe() is None  # workers in other processes register there
    assert _make_step_guard(SimpleNamespace()) is None
