"""The decision: from the alerts firing for an engine and the engine's own state, its desired state.

A pure function, so the same inputs always give the same answer: retried webhooks, a restarted
remediator and two replicas side by side all decide alike. It keeps no memory of its own; what
pacing needs comes from the engine's state (the plugin reports how long ago the cap changed and
what was admitted, finished and preempted since), so a restart in the middle of a staged
re-admission simply carries on.

Defaults from the field:
- `lower_cap` (sustained preemptions, memory pressure): lower the cap by 20 % per step, at once
  from full admission, then one step per `step_seconds`, never below `floor`;
- `drain` (critical memory): stop admitting; running requests finish;
- `hold` (the exporter is blind to the engine: no data, stale data): change nothing, in either
  direction, until it can see again;
- when nothing asks for action: resume if draining, then staged re-admission, by the field rule
  of a long-context serving team (docs/remediator.md): admit one request at a time, and go back
  to full admission after `readmit_successes` clean admissions (`readmit_stages: field`); or,
  with `readmit_stages: doubling`, multiply the cap by `readmit_growth` per clean stage.
  An admission is clean once its prefill has run (its prompt's KV blocks are allocated and its
  activations' peak is past) with no preemption since the last cap change and no action alert:
  waiting for it to finish would make the stage last five whole requests (minutes with long
  outputs). One at a time: from `readmit_start`, the cap rises by one per clean admission, so
  the next request is let in only once the last one's prefill ran; the cap itself carries the
  count (a restarted remediator carries on), and a preemption holds the stage, for at most
  `readmit_stall_seconds` (preemption is vLLM's answer to a full KV cache, not memory danger).
  Under light traffic a stage that held nobody back for `readmit_idle_seconds` (nothing
  waiting, nothing in prefill) counts as one clean admission: the stages advance with time,
  not only with requests that may come seconds apart.
KV-cache usage alone never leads to an action.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from oomguard.actions import ALERT_ACTIONS, Action
from oomguard.contract import ACTION_LABEL
from oomguard.engine_state import EngineState
from oomguard.engine_state import parse as parse_state
from oomguard.remediator.webhook import Alert

# Alerts that never act, whatever a label or the policy says: KV near 100 % is normal for vLLM.
NEVER_ACT = frozenset({"OomguardKVCacheUsageHigh", "OomguardMemoryCaution", "Watchdog"})
# Alerts that always hold their engine, whatever their labels say: the exporter cannot judge it.
ALWAYS_HOLD = frozenset({"OomguardPressureBlind"})


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step_factor: float = Field(0.8, gt=0, lt=1, description="Cap multiplier per lowering step.")
    step_seconds: float = Field(30.0, ge=0, description="Least time between two lowering steps.")
    floor: int = Field(1, ge=1, description="Never lower the cap below this.")
    readmit_start: int = Field(1, ge=1, description="First cap of a staged re-admission.")
    readmit_successes: int = Field(
        5, ge=1, description="Clean admissions needed before the next re-admission stage."
    )
    restart_after_drain_seconds: float = Field(
        600.0,
        ge=0,
        description="A drained, idle engine whose drain alert still fires this long after the "
        "drain is restarted with lower memory flags (targets with a restart backend). About a "
        "model reload: memory critical that long is no longer cheaper to wait out.",
    )
    restart_on_fragmentation: bool = Field(
        True,
        description="Answer pressure whose reason is the engine's own allocator fragmentation "
        "with a drain and, once idle, a restart with the same flags (targets with a restart "
        "backend). false: capped or drained like any other pressure (for engines whose reload "
        "costs more than running capped until the fragments coalesce).",
    )
    fragmentation_settle_seconds: float = Field(
        45.0,
        ge=0,
        description="A drained engine idle this long whose fragmentation alert still fires is "
        "restarted. The fragments its finished requests made coalesce within seconds once it "
        "is idle, and the alert resolves after its keep_firing_for (15 s): then it resumes "
        "without a reload. What is still there after this only a new process gives back.",
    )
    readmit_idle_seconds: float = Field(
        3.0,
        ge=0,
        description="A re-admission stage held this long with nothing waiting, nothing in "
        "prefill, no preemption and no alert counts as one clean admission: under light "
        "traffic (one request every few seconds) the cap holds nobody back, and waiting for "
        "readmit_successes new requests would keep a healthy engine capped for a minute. "
        "0: stages advance on admissions only.",
    )
    readmit_stall_seconds: float = Field(
        300.0,
        gt=0,
        description="A re-admission stage that preemptions alone have held this long, with no "
        "alert asking for action, goes to full admission: preemption is vLLM's own answer to a "
        "full KV cache, not memory danger, and a healthy engine must not stay capped.",
    )
    readmit_stages: Literal["field", "doubling"] = Field(
        "field",
        description="field: after the first clean stage, full admission; doubling: multiply "
        "the cap by readmit_growth per clean stage.",
    )
    readmit_growth: float = Field(
        2.0, gt=1, description="Cap multiplier per stage (readmit_stages: doubling)."
    )
    actions: dict[str, Action] = Field(
        default_factory=dict,
        description="Alert name -> action; overrides the alert's oomguard_action label.",
    )


@dataclass(frozen=True)
class Observed:
    """An engine's state as the plugin reports it (GET /oomguard/v1/state)."""

    startup_max_num_seqs: int
    admission_cap: int
    draining: bool
    seconds_since_cap_change: float
    admitted_since_cap_change: int
    finished_since_cap_change: int
    preemptions_since_cap_change: int
    running: int = 0
    waiting: int = 0
    prefilled_since_cap_change: int = 0  # 0 from a plugin that does not count prefills

    @property
    def clean_admissions(self) -> int:
        """Admissions since the last cap change whose prefill has run (or, from an older plugin
        that does not count prefills, that finished): 0 after any preemption."""
        if self.preemptions_since_cap_change:
            return 0
        done = max(self.prefilled_since_cap_change, self.finished_since_cap_change)
        return min(self.admitted_since_cap_change, done)

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing queued: a restart now loses no request."""
        return self.running == 0 and self.waiting == 0

    @classmethod
    def from_state(cls, state: EngineState | dict[str, Any]) -> Observed:
        """From the plugin's state (oomguard.engine_state: parsed strictly; a malformed document
        raises StateError naming the field, and observe() reports it)."""
        s = parse_state(state)
        since = s.since_cap_change
        return cls(
            startup_max_num_seqs=s.startup_max_num_seqs,
            admission_cap=s.admission_cap,
            draining=s.draining,
            seconds_since_cap_change=since.seconds,
            admitted_since_cap_change=since.admitted,
            finished_since_cap_change=since.finished,
            preemptions_since_cap_change=since.preemptions,
            running=s.running or 0,  # unknown counts as nothing, as before (restarts check)
            waiting=s.waiting or 0,
            prefilled_since_cap_change=since.prefilled,
        )


Phase = Literal["serving", "capped", "draining", "readmitting", "held"]


@dataclass(frozen=True)
class Desired:
    draining: bool
    cap: int
    phase: Phase
    reason: str


def actions_for(alerts: Iterable[Alert], policy: PolicyConfig) -> set[Action]:
    """The action classes that the firing alerts of one engine ask for."""
    wanted: set[Action] = set()
    for alert in alerts:
        if alert.status != "firing" or alert.name in NEVER_ACT:
            continue
        if alert.name in ALWAYS_HOLD:
            wanted.add("hold")
            continue
        action = policy.actions.get(alert.name) or alert.labels.get(ACTION_LABEL)
        if action in ALERT_ACTIONS:
            wanted.add(cast(Action, action))  # a label's string, checked against the registry
    return wanted


def decide(actions: set[Action], observed: Observed, policy: PolicyConfig) -> Desired:
    startup = max(1, observed.startup_max_num_seqs)
    current = observed.admission_cap

    def clamp(cap: float) -> int:
        return max(1, min(startup, int(cap)))

    if "hold" in actions:
        return Desired(
            observed.draining, clamp(current), "held", "the exporter is blind to this engine: hold"
        )
    if "drain" in actions:
        return Desired(True, clamp(current), "draining", "critical memory: drain")
    if "lower_cap" in actions or "restart" in actions:
        # (restart is the restart actuator's; until it exists, treat it as pressure)
        if observed.draining:
            # leaving a drain under pressure: resume at the re-admission start, not at full cap
            return Desired(
                False,
                clamp(min(current, policy.readmit_start)),
                "capped",
                "pressure after a drain: resume capped",
            )
        # Pace consecutive steps; the first step from full admission goes at once (the last
        # change may have been the re-admission that just reached the startup cap).
        if current < startup and observed.seconds_since_cap_change < policy.step_seconds:
            return Desired(False, clamp(current), "capped", "pressure: waiting for the next step")
        lowered = max(policy.floor, math.floor(current * policy.step_factor))
        return Desired(False, clamp(min(lowered, current)), "capped", "pressure: lower the cap")
    if observed.draining:
        return Desired(
            False,
            clamp(policy.readmit_start),
            "readmitting",
            "alerts resolved: resume at the first re-admission stage",
        )
    if current >= startup:
        return Desired(False, startup, "serving", "no alerts: full admission")
    # A preemption makes no admission since the last cap change clean, and only a cap change
    # resets that count: without this, a stage that saw one would hold its cap for good.
    if (
        observed.preemptions_since_cap_change
        and observed.seconds_since_cap_change >= policy.readmit_stall_seconds
    ):
        return Desired(
            False,
            startup,
            "readmitting",
            f"preemptions alone held re-admission {observed.seconds_since_cap_change:.0f} s with "
            "no alert: full admission",
        )
    clean = observed.clean_admissions
    # Light traffic: a stage that held nobody back for readmit_idle_seconds (nothing waiting,
    # nothing in prefill, no preemption, no alert) is as clean as one admission.
    idle_stage = (
        policy.readmit_idle_seconds > 0
        and observed.waiting == 0
        and observed.preemptions_since_cap_change == 0
        and observed.admitted_since_cap_change <= clean
        and observed.seconds_since_cap_change >= policy.readmit_idle_seconds
    )
    # ... but only as one: requests still running from before the drain add nothing to it
    # (they do to a new clean admission), so an idle stage raises the cap by one at a time
    idle_only = idle_stage and clean == 0
    if idle_stage:
        clean = max(clean, 1)
    if policy.readmit_stages == "doubling":
        if clean >= policy.readmit_successes:
            grown = max(current + 1, math.ceil(current * policy.readmit_growth))
            return Desired(False, clamp(grown), "readmitting", "clean stage: raise the cap")
        return Desired(
            False, clamp(current), "readmitting", "re-admitting: waiting for clean admissions"
        )
    # The field rule, one at a time: let one more in once the last one's prefill ran cleanly.
    # The cap carries the count so far: each clean admission raised it by one from
    # readmit_start. Requests running when nothing is being prefilled count too (the ones a
    # drain let finish hold their KV and ran through the end of the pressure), but never
    # instead of one new clean admission.
    # A cap at or above readmit_start + readmit_successes (an engine capped, never drained)
    # carries no count: it needs its clean admissions at that cap, as many at once as it allows.
    n = policy.readmit_successes
    single = current < policy.readmit_start + n
    in_prefill = observed.admitted_since_cap_change > clean
    base = current if in_prefill or not single or idle_only else max(current, observed.running)
    done = clean + (min(n - 1, max(0, base - policy.readmit_start)) if single else 0)
    if clean >= 1 and done >= n:
        return Desired(False, startup, "readmitting", "clean admissions: full admission")
    over_cap = observed.preemptions_since_cap_change == 0 and observed.waiting > 0
    if single and not in_prefill and (clean >= 1 or (over_cap and observed.running >= current)):
        return Desired(
            False,
            clamp(base + 1),
            "readmitting",
            f"clean admissions {done} of {n}: let one more in",
        )
    return Desired(
        False, clamp(current), "readmitting", "re-admitting: waiting for clean admissions"
    )
