"""Safety limits between a decision and an action: pause, cooldown, rate limit, disruption budget.

`limit` is pure: it names the limit that withholds an action (counted in
oomguard_remediator_safety_limited_total{limit}) or returns None, from a `SafetyState` snapshot.
A cooldown holds an action only after one at least as severe (cap < drain < restart), so an
escalation is never held by the cooldown of a milder step; the budgets count every action.
Draining is held to a budget per model: never more than `max_draining_per_model` engines of one
model at once, and never the last one that is ready (draining every replica is an outage the
remediator would have caused) unless `allow_last_replica` says a single replica may go.

The state (pause, each target's recent actions) survives restarts and kill -9 at any point: it
is rebuilt from the audit log, where every action is recorded as an intent (fsynced) before the
engine is called, and every pause before it takes effect. A remediator that crash-loops
therefore cannot reset its own cooldowns and budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from oomguard.actions import DISRUPTIVE, OUT_OF_SERVICE, SEVERITY
from oomguard.remediator import clocks

COUNTED_RESULTS = frozenset({"ok", "started", "dry_run"})  # committed actions that used budget


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
    allow_last_replica: bool = Field(
        False,
        description="Let a drain or a restart take a model's last ready engine (a single "
        "replica). Off by default: it is an outage. On: 503 with Retry-After beats a CUDA OOM "
        "that loses every request in flight. Never for the flags' walk-back, which nothing "
        "needs: it waits for a ready peer.",
    )


@dataclass(frozen=True)
class EngineView:
    model: str
    draining: bool
    reachable: bool


@dataclass(frozen=True)
class SafetyState:
    """What the limits look at: the pause switch and each target's recent actions."""

    paused: bool = False
    history: Mapping[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)

    def with_action(self, target: str, at: float, action: str) -> SafetyState:
        history = dict(self.history)
        history[target] = (*history.get(target, ()), (at, action))
        return SafetyState(self.paused, history)


def limit(
    config: SafetyConfig,
    state: SafetyState,
    now: float,
    target: str,
    action: str,
    fleet: Mapping[str, EngineView],
) -> str | None:
    """The limit that withholds `action` on `target` at `now`, or None to go ahead."""
    if state.paused:
        return "pause"
    if action not in DISRUPTIVE:
        return None  # restoring capacity is paced by the policy, not by these limits
    c = config
    recent = [(t, k) for t, k in state.history.get(target, ()) if now - t <= c.window_seconds]
    severity = SEVERITY.get(action, 0)
    if any(
        now - t < c.cooldown_seconds and SEVERITY.get(k, 0) >= severity for t, k in recent
    ):  # escalation is exempt (ActionSpec.severity)
        return "cooldown"
    # Lowering steps never use up the budget of a drain or restart: a long incident that
    # stepped the cap down must still be able to take the engine out when it turns critical.
    counted = [k for _, k in recent if action not in OUT_OF_SERVICE or k in OUT_OF_SERVICE]
    if len(counted) >= c.max_actions:
        return "rate_limit"
    if action in OUT_OF_SERVICE:
        me = fleet[target]
        peers = {n: v for n, v in fleet.items() if v.model == me.model and n != target}
        if sum(v.draining for v in peers.values()) >= c.max_draining_per_model:
            return "disruption_budget"
        if not c.allow_last_replica and not any(
            v.reachable and not v.draining for v in peers.values()
        ):
            # no other engine serves the model at all (one engine: a single box): nothing but a
            # person relieves it, and the limit says so, apart from the last of several ready
            return "last_ready" if peers else "single_replica"
    return None


class Safety:
    """The live safety state of one remediator (the controller's), around the pure `limit`.

    Durations run on `clock` (monotonic): a wall clock stepped back or forward never stretches
    or cuts a cooldown. Actions read back from the audit log are placed on that clock by their
    age (clocks.age: exact on the same boot, from wall time otherwise)."""

    def __init__(
        self,
        config: SafetyConfig,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall = wall
        self.paused = config.paused
        self._history: dict[str, list[tuple[float, str, str | None]]] = {}
        self.uncommitted: list[dict[str, Any]] = []  # intents neither committed nor failed
        self.unreadable = 0  # audit entries whose fields could not be used (restore)

    def state(self) -> SafetyState:
        now = self.clock()
        window = self.config.window_seconds
        history = {
            t: tuple((at, kind) for at, kind, _ in entries if now - at <= window)
            for t, entries in self._history.items()
        }
        return SafetyState(self.paused, history)

    def check(self, target: str, action: str, fleet: Mapping[str, EngineView]) -> str | None:
        return limit(self.config, self.state(), self.clock(), target, action, fleet)

    def record(
        self,
        target: str,
        action: str = "lower_cap",
        at: float | None = None,
        key: str | None = None,
    ) -> None:
        """Count an action (at `at` on `clock`, default now); `key` (its intent) lets
        `forget` take it back when the engine refused it."""
        entries = self._history.setdefault(target, [])
        entries.append((self.clock() if at is None else at, action, key))
        del entries[: max(0, len(entries) - 10 * self.config.max_actions)]  # bounded

    def forget(self, target: str, key: str) -> None:
        """Take back the action recorded under `key` (the engine call failed: nothing done)."""
        entries = self._history.get(target)
        if entries:
            entries[:] = [e for e in entries if e[2] != key]

    def restore(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """Rebuild the pause switch and the recent actions from the audit log (oldest first).

        An action counts from its intent on: an intent that was never committed (the process
        died between recording it and hearing the engine's answer) counts as taken, and is
        listed in `uncommitted` to be reconciled with the engine; one whose engine call failed
        does not count. An action whose age cannot be told (dated in the future: the clock
        stepped back since) counts against the budget but holds no cooldown: no timestamp read
        from a file can keep a target waiting. The configuration's `paused: true` wins over an
        audited unpause. Entries with unusable fields are counted in `unreadable`, never raised.
        """
        counted: dict[str, tuple[str, str, float | None]] = {}  # key -> target, action, age
        pending: dict[str, dict[str, Any]] = {}
        intents: set[str] = set()  # ids seen on an intent: a second one is another action
        wall_now, uptime_now = self.wall(), clocks.boottime()
        for n, e in enumerate(entries):
            try:
                event = e.get("event")
                if event in ("paused", "unpaused"):
                    self.paused = self.config.paused or event == "paused"
                    continue
                target, action, intent = e.get("target"), e.get("action"), e.get("intent")
                key = intent if isinstance(intent, str) and intent else f"#{n}"
                if event == "intent":
                    if key in intents:  # a duplicate id (nothing we write): count both
                        key = f"{key}#{n}"
                    intents.add(key)
                    if isinstance(target, str) and target and action in DISRUPTIVE:
                        counted[key] = (target, str(action), clocks.age(e, wall_now, uptime_now))
                    if isinstance(target, str) and target:
                        pending[key] = dict(e)
                elif event == "acted":
                    if key in pending:  # committed: counted from its intent already
                        pending.pop(key)
                        if e.get("result") not in COUNTED_RESULTS:
                            counted.pop(key, None)
                    elif (
                        isinstance(target, str)
                        and target
                        and action in DISRUPTIVE
                        and e.get("result") in COUNTED_RESULTS
                    ):
                        counted[key] = (target, str(action), clocks.age(e, wall_now, uptime_now))
                elif event == "failed" and key in pending:
                    pending.pop(key)
                    counted.pop(key, None)  # refused: nothing was done
                elif event == "reconciled" and key in pending:
                    pending.pop(key)  # still counted: it may have been done
            except Exception:  # a field of a shape nothing writes: count it, keep going
                self.unreadable += 1
        now = self.clock()
        window, cooldown = self.config.window_seconds, self.config.cooldown_seconds
        for key, (target, action, age) in counted.items():
            if age is None:
                age = min(cooldown, window)  # unknown: in the budget, out of the cooldown
            if age <= window:
                self.record(target, action, now - age, None if key.startswith("#") else key)
        self.uncommitted = list(pending.values())
