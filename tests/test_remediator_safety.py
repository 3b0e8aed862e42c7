from __future__ import annotations

from oomguard.remediator.safety import EngineView, Safety, SafetyConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


FLEET = {
    "a": EngineView("llama", draining=False, reachable=True),
    "b": EngineView("llama", draining=False, reachable=True),
    "c": EngineView("qwen", draining=False, reachable=True),
}


def test_pause_withholds_everything():
    assert Safety(SafetyConfig(paused=True)).check("a", "set_cap", FLEET) == "pause"


def test_cooldown_then_rate_limit_per_target():
    clock = Clock()
    s = Safety(SafetyConfig(cooldown_seconds=10, max_actions=3, window_seconds=100), clock)
    for _ in range(3):
        assert s.check("a", "lower_cap", FLEET) is None
        s.record("a")
        assert s.check("a", "lower_cap", FLEET) == "cooldown"
        assert s.check("b", "lower_cap", FLEET) is None  # other targets are not held
        assert s.check("a", "raise_cap", FLEET) is None  # restoring capacity is never held
        clock.now += 11
    assert s.check("a", "lower_cap", FLEET) == "rate_limit"
    clock.now += 100  # the window slides
    assert s.check("a", "lower_cap", FLEET) is None


def test_never_drain_the_last_ready_replica_or_past_the_budget():
    s = Safety(SafetyConfig(cooldown_seconds=0))
    assert s.check("a", "drain", FLEET) is None
    b_draining = {**FLEET, "b": EngineView("llama", draining=True, reachable=True)}
    assert s.check("a", "drain", b_draining) == "disruption_budget"
    assert s.check("c", "drain", FLEET) == "single_replica"  # the only qwen engine
    b_down = {**FLEET, "b": EngineView("llama", draining=False, reachable=False)}
    assert s.check("a", "drain", b_down) == "last_ready"  # an unreachable peer is not ready
    three = {**FLEET, "d": EngineView("llama", draining=False, reachable=True)}
    two_allowed = Safety(SafetyConfig(max_draining_per_model=2))
    assert two_allowed.check("a", "drain", {**three, "b": b_draining["b"]}) is None


def test_lowering_steps_never_use_up_the_budget_of_a_drain():
    clock = Clock()
    s = Safety(SafetyConfig(cooldown_seconds=1, max_actions=3, window_seconds=1000), clock)
    for _ in range(3):  # a long incident steps the cap down to the limit
        clock.now += 30
        assert s.check("a", "lower_cap", FLEET) is None
        s.record("a", "lower_cap")
    clock.now += 30
    assert s.check("a", "lower_cap", FLEET) == "rate_limit"
    assert s.check("a", "drain", FLEET) is None  # it turned critical: the drain may still go
    for _ in range(3):
        s.record("a", "drain")
        clock.now += 30
    assert s.check("a", "drain", FLEET) == "rate_limit"  # drains have their own limit
