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
over the interval instead of arriving together). The resync has a budget,
`resync_reads_per_second`: a fleet too large to be resynced within `quiet_resync_seconds` at that
rate is resynced more slowly (the interval grows with the fleet: 10,000 engines at 50 reads/s,
every 200 s on average), so the remediator's idle CPU stays bounded whatever the fleet's size.
Only quiet engines are paced: an engine under attention is read every pass. A quiet engine by
definition needs no step, so deciding with its last state changes nothing; the resync is what
notices a change made behind the remediator's back. Small fleets (fewer than `read_all_below`
engines) are read every pass.

A webhook that changes an engine's alerts wakes the loop at once. When many engines are under
attention (more than `focus_above`), that pass is focused: it reads and decides only the engines
the webhook changed, with every engine of their models that is not quiet (read too: its last
state may predate an action; not for an engine alerts ask only a lower cap of, which takes no
step the disruption budget limits) and one quiet peer per model, so a new alert is acted on without
waiting for a hundred other reads. The other engines under attention follow on the next tick.

The controller also runs such passes in a lane of their own (`focused`, Controller.focus_pass)
while a full pass is still reading: reads hold no lock, so two passes may have read one engine.
Every answer carries the epoch its pass began in, and an action's answer a newer one (`wrote`):
a pass decides on the newest state known (`read`), never acts again on what an older read showed.
"""

from __future__ import annotations

import heapq
import random
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from oomguard.actions import CAP_ONLY, OUT_OF_SERVICE
from oomguard.remediator.decision import Verdict
from oomguard.remediator.policy import PolicyConfig, actions_for
from oomguard.remediator.webhook import Alert


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
    focus_above: int = Field(
        32,
        ge=0,
        description="When more engines than this are under attention, the pass a webhook wakes "
        "reads and decides only the engines whose alerts it changed (their models' other "
        "engines on their last states); the rest follow on the next tick.",
    )
    resync_reads_per_second: float = Field(
        50.0,
        ge=0,
        description="Budget of the quiet resync: when reading every engine within "
        "quiet_resync_seconds would take more reads per second than this, the resync interval "
        "grows to engines / this rate (on average). Engines under attention are never paced. "
        "0: no budget.",
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
    """The read schedule of one controller: which engines are quiet and when each is next read.

    Every pass costs in proportion to the engines that need attention, not to the fleet: the
    engines read but not quiet are kept in a set, quiet ones in a heap by their next read, and
    the engines never read in track order, so a pass over 10,000 quiet engines touches only the
    few whose resync time has come."""

    def __init__(
        self,
        config: AttentionConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or AttentionConfig()
        self._rng = rng or random.Random()
        self._quiet_until: dict[str, float] = {}  # quiet engine -> (monotonic) its next read
        self._heap: list[tuple[float, str]] = []  # (next read, engine); stale entries skipped
        self._expired: set[str] = set()  # quiet engines whose resync time has come
        self._loud: set[str] = set()  # read, and not quiet: read every pass
        self._never: dict[str, None] = {}  # engines never read, in track order
        self._acted: dict[str, float] = {}  # engine -> wall time of its last action
        self._last: dict[str, Any] = {}  # engine -> the state (or error) it answered last
        self._models: dict[str, str] = {}
        self._members: dict[str, list[str]] = {}  # model -> its engines, in track order
        self._order: dict[str, int] = {}
        self._focus: set[str] = set()  # engines a webhook just changed: the next pass is theirs
        self._focus_lock = threading.Lock()  # webhooks add to it from their own threads
        self._epoch = 0  # counts passes begun and writes made (newest answer wins: `read`)
        self._at: dict[str, int] = {}  # engine -> the epoch of its last known state

    def track(self, models: Mapping[str, str]) -> None:
        """The targets, in decision order, with their models (at start and on discovery)."""
        self._models = dict(models)
        self._order = {name: i for i, name in enumerate(models)}
        self._members = {}
        for name, model in models.items():
            self._members.setdefault(model, []).append(name)
        self.forget(models)
        self._never = {name: None for name in models if name not in self._last}

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
        """The engines to read this pass, in track order. `names`: the tracked targets (all of
        them are read when fewer than `read_all_below`); `busy`: engines a restart owns;
        `acted_at`: wall time of each engine's last action, besides those noted through
        `acted` (compared with `wall`)."""
        focus = self._take_focus()
        if len(self._order) < self.config.read_all_below:
            return list(names)
        self._expire(now)
        asking, urgent, caps = self._asking(firing, policy)
        focus = self._relevant(focus, asking)
        if len(self._loud) <= self.config.focus_above:
            focus = set()  # a full pass is about as quick: no engine waits for a tick
        if focus:  # a pass for what a webhook changed: the rest waits for the next tick
            return self._with_peers(focus, urgent, caps)
        out = self._loud | self._expired | {n for n in busy if n in self._last}
        out |= asking
        recent = self.config.recent_action_seconds
        for table in (self._acted, acted_at or {}):
            out.update(n for n, t in table.items() if wall - t < recent and n in self._last)
        for model in urgent:
            out.update(n for n in self._members.get(model, ()) if n not in self._last)
        # an alert on an engine never read goes first: no batch of strangers in its pass
        if not any(n not in self._last for n in asking):
            batch = self.config.first_read_batch
            for name in self._never:
                if batch <= 0:
                    break
                if name not in out:
                    out.add(name)
                    batch -= 1
        return self.in_order(out)

    def focused(
        self, firing: Mapping[str, list[Alert]], policy: PolicyConfig, now: float
    ) -> list[str]:
        """The engines a webhook just changed, for a pass of their own beside a full pass in
        progress (the controller's focus lane): empty when none needs a read. Unlike `due`,
        whatever the number of engines under attention: the full pass goes on meanwhile."""
        focus = self._take_focus()
        if not focus:
            return []
        self._expire(now)
        asking, urgent, caps = self._asking(firing, policy)
        focus = self._relevant(focus, asking)
        return self._with_peers(focus, urgent, caps) if focus else []

    def _asking(
        self, firing: Mapping[str, list[Alert]], policy: PolicyConfig
    ) -> tuple[set[str], set[str], set[str]]:
        """(the tracked engines an alert asks an action of, the models where one of them may be
        taken out of service, the engines alerts ask nothing of but a lower cap)."""
        wants = {n: actions_for(alerts, policy) for n, alerts in firing.items() if alerts}
        asking = {n for n, actions in wants.items() if actions and n in self._order}
        # an engine that may be taken out of service is decided with every peer of its model
        # known (the disruption budget, the last-ready rule); a cap needs no peers
        urgent = {self._models[n] for n in asking if wants[n] & OUT_OF_SERVICE}
        caps = {n for n in asking if wants[n] <= CAP_ONLY}
        return asking, urgent, caps

    def _relevant(self, focus: set[str], asking: set[str]) -> set[str]:
        # an alert that asks for nothing on a quiet engine costs no read, focused or not
        known = self._order
        return {n for n in focus if n in asking or (n in known and n not in self._quiet_until)}

    def _with_peers(self, focus: set[str], urgent: set[str], caps: set[str]) -> list[str]:
        """The focused engines and every engine of their models that is not quiet: its last
        state may predate an action (a drain), and the disruption budget must see it as it
        is now (and every engine of a model where one may be taken out of service). An engine
        alerts ask only a lower cap of takes no step the budget limits: it needs no peers."""
        out = set(focus)
        for model in {self._models[n] for n in focus - caps}:
            for name in self._members.get(model, ()):
                if name in self._last:
                    if name in self._loud or name in self._expired:
                        out.add(name)
                elif model in urgent:
                    out.add(name)
        return self.in_order(out)

    def _expire(self, now: float) -> None:
        """Move quiet engines whose resync time has come to the expired set (read this pass and
        every pass until a verdict settles them again)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            until, name = heapq.heappop(heap)
            if self._quiet_until.get(name) == until:
                self._expired.add(name)

    def begin(self) -> int:
        """A pass is about to read: the epoch its answers carry (see `read`)."""
        self._epoch += 1
        return self._epoch

    def read(self, states: Mapping[str, Any], epoch: int | None = None) -> dict[str, Any]:
        """Remember what the engines read this pass answered; returns the states to decide on.

        Reads run outside the decision lock, so another pass (the focus lane) may have read or
        written an engine after this pass's read began: its answer (`wrote`) is newer than
        this one and wins, and the engine is never acted on twice for what one read showed."""
        epoch = self._epoch if epoch is None else epoch
        out = {}
        for name, state in states.items():
            if self._at.get(name, -1) > epoch:
                out[name] = self._last[name]  # known newer than this answer
            else:
                out[name] = self._last[name] = state
                self._at[name] = epoch
            self._never.pop(name, None)
            if name not in self._quiet_until:
                self._loud.add(name)
        return out

    def wrote(self, name: str, state: Any) -> None:
        """An action's answer: the engine's state after it, newer than any read begun before."""
        self._epoch += 1
        if name in self._order:
            self._last[name] = state
            self._at[name] = self._epoch

    def last(self, name: str) -> Any:
        return self._last.get(name)

    def acted(self, name: str, wall: float) -> None:
        """The remediator acted on this engine at `wall` (read every pass for a while)."""
        self._acted[name] = wall
        if len(self._acted) > 4 * len(self._order) + 64:  # bounded: drop the oldest half
            keep = sorted(self._acted.items(), key=lambda kv: kv[1])[len(self._acted) // 2 :]
            self._acted = dict(keep)

    def settle(self, verdict: Verdict, now: float) -> None:
        """After a verdict on an engine read this pass: quiet (read again on the resync) or not."""
        name = verdict.target
        self._expired.discard(name)
        if not is_quiet(verdict):
            self._quiet_until.pop(name, None)
            self._loud.add(name)
            return
        self._loud.discard(name)
        period = self.resync_period()
        if name in self._quiet_until:  # keeps its place in the spread, give or take the jitter
            until = now + period * (1 - self.config.jitter * self._rng.random())
        else:  # newly quiet: a random place in the interval, so a fleet's reads spread out
            until = now + period * self._rng.random()
        self._quiet_until[name] = until
        heapq.heappush(self._heap, (until, name))
        if len(self._heap) > 2 * len(self._quiet_until) + 64:  # drop stale entries
            self._heap = [(t, n) for t, n in self._heap if self._quiet_until.get(n) == t]
            heapq.heapify(self._heap)

    def resync_period(self) -> float:
        """The longest interval between two reads of a quiet engine: `quiet_resync_seconds`, or
        longer where the fleet would otherwise be resynced faster than `resync_reads_per_second`.
        The intervals are jittered into [period x (1 - jitter), period], so the budget is set by
        their mean. Sized by every tracked engine, not the quiet ones only: the rate stays under
        the budget from the first pass, while the fleet's first reads settle it."""
        c = self.config
        period = c.quiet_resync_seconds
        if c.resync_reads_per_second > 0:
            mean = len(self._order) / c.resync_reads_per_second
            period = max(period, mean / (1 - c.jitter / 2))
        return period

    def wake(self, name: str) -> None:
        """Read this engine on the next pass (its quiet state may be out of date)."""
        self._quiet_until.pop(name, None)
        self._expired.discard(name)
        if name in self._last:
            self._loud.add(name)

    def focus(self, names: Iterable[str]) -> None:
        """A webhook changed these engines' alerts: the next pass reads and decides only them
        (with their models' peers on their last states), so a new alert is acted on without
        waiting for the reads of every engine under attention; the tick after does the rest."""
        with self._focus_lock:
            self._focus.update(names)

    def _take_focus(self) -> set[str]:
        with self._focus_lock:
            focus, self._focus = self._focus, set()
        return focus

    def unfocus(self) -> None:
        """Forget pending focus (a replica that takes over starts with a full pass)."""
        self._take_focus()

    def peers(self, due: Iterable[str]) -> list[str]:
        """Quiet engines, not read this pass, that the decision must still see: one per model
        of a due engine. A quiet engine is ready and takes no step, so one such peer tells the
        disruption budget and the last-ready rule all that every quiet peer would (an engine
        that is not quiet is always read: its last state may predate an action)."""
        due_set = set(due)
        out = []
        for model in {self._models[n] for n in due_set if n in self._models}:
            for name in self._members.get(model, ()):
                if name in self._quiet_until and name not in due_set:
                    out.append(name)
                    break
        return out

    def forget(self, keep: Iterable[str]) -> None:
        """Drop engines no longer targeted (discovery removed them)."""
        keep = set(keep)
        for table in (self._quiet_until, self._last, self._acted, self._never, self._at):
            for name in [n for n in table if n not in keep]:
                del table[name]
        self._loud &= keep
        self._expired &= keep
        self._heap = [(t, n) for t, n in self._heap if self._quiet_until.get(n) == t]
        heapq.heapify(self._heap)

    def in_order(self, names: Iterable[str]) -> list[str]:
        return sorted(names, key=self._order.__getitem__)

    @property
    def quiet(self) -> int:
        return len(self._quiet_until)
