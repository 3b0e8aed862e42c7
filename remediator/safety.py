"""Safety limits between a decision and an action: pause, cooldown, rate limit, disruption budget.

`check` names the limit that withholds an action (counted in
oomguard_remediator_safety_limited_total{limit}) or returns None. Draining is held to a budget per
model: never more than `max_draining_per_model` engines of one model at once, and never the last
one that is ready (draining every replica is an outage the remediator would have caused).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

OUT_OF_SERVICE = frozenset({"drain", "restart"})


class SafetyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paused: bool = Field(False, description="Global pause: decide and report, change nothing.")
    cooldown_seconds: float = Field(
        10.0, ge=0, description="Least time between two actions on one target."
    )
    max_actions: int = Field(20, ge=1, description="Actions per target per window, then stop.")
    window_seconds: float = Field(3600.0, gt=0)
    max_draining_per_model: int = Field(
        1, ge=1, description="Engines of one model draining at once."
    )


@dataclass(frozen=True)
class EngineView:
    model: str
    draining: bool
    reachable: bool


class Safety:
    def __init__(self, config: SafetyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._history: dict[str, deque[tuple[float, str]]] = {}

    def check(self, target: str, action: str, fleet: Mapping[str, EngineView]) -> str | None:
        """The limit that withholds `action` on `target` now, or None to go ahead."""
        c = self.config
        if c.paused:
            return "pause"
        now = self.clock()
        history = self._history.get(target, deque())
        while history and now - history[0][0] > c.window_seconds:
            history.popleft()
        if history and now - history[-1][0] < c.cooldown_seconds:
            return "cooldown"
        # Lowering steps never use up the budget of a drain or restart: a long incident that
        # stepped the cap down must still be able to take the engine out when it turns critical.
        counted = [k for _, k in history if action not in OUT_OF_SERVICE or k in OUT_OF_SERVICE]
        if len(counted) >= c.max_actions:
            return "rate_limit"
        if action in OUT_OF_SERVICE:
            me = fleet[target]
            peers = {n: v for n, v in fleet.items() if v.model == me.model and n != target}
            if sum(v.draining for v in peers.values()) >= c.max_draining_per_model:
                return "disruption_budget"
            if not any(v.reachable and not v.draining for v in peers.values()):
                return "last_ready"
        return None

    def record(self, target: str, action: str = "lower_cap") -> None:
        self._history.setdefault(target, deque()).append((self.clock(), action))
