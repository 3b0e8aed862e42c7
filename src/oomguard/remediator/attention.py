"""Which engines a reconcile pass reads: the ones that need attention, and the rest slowly.

Reading every engine every second costs one HTTP request per engine per second: fine for a box,
not for a fleet of thousands. An engine needs attention, and is read every pass, when

- an action-carrying alert fires for it (a new one is read on the pass the webhook wakes),
- its last state was anything but serving at full admission with nothing to do (a cap, a drain,
  a staged re-admission, a hold, an unreadable state), or it has never been read,
- a restart sequence owns it, or the remediator acted on it within `recent_action_seconds`.

Engines never read (at start, and on a standby that takes over) are read `first_read_batch` per
pass, except that every engine of a model with an alert asking for a drain or a restart is read
at once: the disruption budget and the last-ready rule see the whole model before anything is
taken out of service. An alert on an engine never read goes first (no batch in its pass).

Every other engine is quiet: its last state is still what the decision sees, and it is read again
on a slow resync (`quiet_resync_seconds`, each engine at its own jittered time, so reads spread
over the interval instead of arriving together). A quiet engine by definition needs no step, so
deciding with its last state changes nothing; the resync is what notices a change made behind the
remediator's back. Small fleets (fewer than `read_all_below` engines) are read every pass.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from oomguard.remediator.decision import Verdict
from oomguard.remediator.policy import PolicyConfig, actions_for
from oomguard.remediator.webhook import Alert

OUT_OF_SERVICE = frozenset({"drain", "restart"})  # alert actions that look at a model's peers


class AttentionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    read_all_below: int = Field(
        64, ge=0, description="Fleets with fewer engines are read every pass (0: never)."
    )
    quiet_resync_seconds: float = Field(
        60.0, gt=0, description="A quiet engine is read at least this often (jittered)."
    )
    recent_action_seconds: float = Field(
        300.0, ge=0, description="An engine acted on this recently is read every pass."
    )
    jitter: float = Field(
        0.2, ge=0, le=1, description="Share of the resync interval each read is spread over."
    )
    first_read_batch: int = Field(
        1000,
        ge=1,
        description="Engines never read yet (at start, on a takeover) are read this many per "
        "pass; all of a model at once when one of its engines has an alert asking for action.",
    )


def is_quiet(verdict: Verdict) -> bool:
    """Serving at full admission, readable, no alert asking, nothing to do: safe to read slowly."""
    o, d = verdict.observed, verdict.desired
    return (
        verdict.held is None
        and o is not None
        and d is not None
        and not verdict.steps
        and not o.draining
        and o.admission_cap >= o.startup_max_num_seqs
        and d.phase == "serving"
    )


class Attention:
    """The read schedule of one controller: which engines are quiet and when each is next read."""

    def __init__(
        self,
        config: AttentionConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or AttentionConfig()
        self._rng = rng or random.Random()
        self._quiet_until: dict[str, float] = {}  # quiet engine -> (monotonic) its next read
        self._last: dict[str, Any] = {}  # engine -> the state (or error) it answered last
        self._models: dict[str, str] = {}
        self._order: dict[str, int] = {}

    def track(self, models: Mapping[str, str]) -> None:
        """The targets, in decision order, with their models (at start and on discovery)."""
        self._models = dict(models)
        self._order = {name: i for i, name in enumerate(models)}
        self.forget(models)

    def due(
        self,
        names: Iterable[str],
        firing: Mapping[str, list[Alert]],
        policy: PolicyConfig,
        now: float,
        busy: Iterable[str] = (),
        acted_at: Mapping[str, float] | None = None,
        wall: float = 0.0,
    ) -> list[str]:
        """The engines to read this pass, in the order given. `busy`: engines a restart owns;
        `acted_at`: wall time of each engine's last action (compared with `wall`)."""
        ordered = list(names)
        if len(ordered) < self.config.read_all_below:
            return ordered
        busy, acted_at = set(busy), acted_at or {}
        recent = self.config.recent_action_seconds
        wants = {n: actions_for(alerts, policy) for n, alerts in firing.items() if alerts}
        asking = {n for n, actions in wants.items() if actions}
        # an engine that may be taken out of service is decided with every peer of its model
        # known (the disruption budget, the last-ready rule); a cap needs no peers
        urgent = {self._models.get(n) for n in asking if wants[n] & OUT_OF_SERVICE}
        # an alert on an engine never read goes first: no batch of strangers in its pass
        batch = 0 if any(n not in self._last for n in asking) else self.config.first_read_batch
        out = []
        for name in ordered:
            until = self._quiet_until.get(name)
            if name not in self._last:  # never read
                if name in asking or self._models.get(name) in urgent or batch > 0:
                    out.append(name)
                    batch -= name not in asking and self._models.get(name) not in urgent
                continue
            if (
                until is None
                or now >= until
                or name in busy
                or name in asking
                or wall - acted_at.get(name, float("-inf")) < recent
            ):
                out.append(name)
        return out

    def read(self, states: Mapping[str, Any]) -> None:
        """Remember what the engines read this pass answered."""
        self._last.update(states)

    def last(self, name: str) -> Any:
        return self._last.get(name)

    def settle(self, verdict: Verdict, now: float) -> None:
        """After a verdict on an engine read this pass: quiet (read again on the resync) or not."""
        name = verdict.target
        if not is_quiet(verdict):
            self._quiet_until.pop(name, None)
            return
        period = self.config.quiet_resync_seconds
        if name in self._quiet_until:  # keeps its place in the spread, give or take the jitter
            self._quiet_until[name] = now + period * (1 - self.config.jitter * self._rng.random())
        else:  # newly quiet: a random place in the interval, so a fleet's reads spread out
            self._quiet_until[name] = now + period * self._rng.random()

    def wake(self, name: str) -> None:
        """Read this engine on the next pass (its quiet state may be out of date)."""
        self._quiet_until.pop(name, None)

    def peers(self, due: Iterable[str]) -> list[str]:
        """Quiet engines, not read this pass, that the decision must still see: one per model
        of a due engine. A quiet engine is ready and takes no step, so one such peer tells the
        disruption budget and the last-ready rule all that every quiet peer would."""
        due = list(due)
        models = self._models
        wanted = {models[n] for n in due}
        due_set = set(due)
        out: dict[str, str] = {}
        for name in self._quiet_until:
            model = models.get(name)
            if model in wanted and model not in out and name not in due_set:
                out[model] = name
        return list(out.values())

    def forget(self, keep: Iterable[str]) -> None:
        """Drop engines no longer targeted (discovery removed them)."""
        keep = set(keep)
        for table in (self._quiet_until, self._last):
            for name in [n for n in table if n not in keep]:
                del table[name]

    def in_order(self, names: Iterable[str]) -> list[str]:
        return sorted(names, key=self._order.__getitem__)

    @property
    def quiet(self) -> int:
        return len(self._quiet_until)
