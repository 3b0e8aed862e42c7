"""The remediation actions and the alerts that ask for them: one table each, read by every part.

`ACTIONS` is the one place the facts about an action are written down: whether an alert may ask
for it, whether the remediator takes it as a step on an engine, how far it takes an engine out
of service (the safety limits), the actuator call that takes it and the plugin route that call
uses. Every other view (the safety limits' disruptive set and severities, the attention's
out-of-service and cap-only sets, the alert actions' precedence, the convergence's dispatch to
the actuator, the routes the plugin's drain gate lets through) is derived here from it.

`ACTION_ALERTS` is the one definition of the alerts that ask for an action on the exporter's
level series (OomguardMemoryPressure, OomguardFragmentationPressure, OomguardMemoryCritical,
OomguardPressureBlind): their condition, `for`, `keep_firing_for`, severity and action. The
Prometheus rules (oomguard.alerts.rules), the standalone watch (remediator/standalone.py), the
recovery simulation (lab/recovery.py) and the docs' alerts table are generated from it.

Adding an action: an entry in `ACTIONS` (and its name in `Action`/`StepKind`), the plugin's
EngineCore utility (vllm_plugin/engine.py), and the policy that asks for it (remediator/policy.py
and its plan in decision.py). With a route and an `engine_call`, the actuator's generic `act` and
the plugin's generic handler take it, with a request body when the entry names its `body` model
(the step's `params`, checked by the model on both sides of the wire). Only an action that needs
more than one engine call, or work around it (drain: the router, shedding the queue), has its own
actuator method (remediator/actuator.py) and plugin handler (vllm_plugin/api.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel

from oomguard.contract import FRAGMENTATION_REASON
from oomguard.thresholds import AlertThresholds
from oomguard.units import parse_duration

# What an alert may ask the remediator to do (its `oomguard_action` label), and the steps the
# remediator takes on an engine. tests/test_actions.py ties both to `ACTIONS`.
Action = Literal["hold", "drain", "lower_cap", "restart"]
StepKind = Literal["drain", "lower_cap", "restart", "resume", "raise_cap", "readmit"]


@dataclass(frozen=True)
class ActionSpec:
    """One remediation action: what it does and which part takes it."""

    name: str
    doc: str
    alert: bool = False  # an alert may ask for it (`oomguard_action`): an alert action
    step: bool = False  # the remediator takes it as a step on an engine
    # How far it takes an engine out of service; 0: not limited by the safety limits (restoring
    # capacity is paced by the policy). A cooldown holds an action only after one at least as
    # severe: memory that turns critical right after a cap step is drained now, not a cooldown
    # later (the OOM would come first); the budgets still count every limited action.
    severity: int = 0
    out_of_service: bool = False  # decided with every peer of its model (disruption budget)
    draining: bool | None = None  # the drain state a step leaves the engine in (None: unchanged)
    # The actuator's method that takes the step. None with a route: the actuator's generic
    # `act`, which sends the route no body; None without one: not the actuator's (hold, restart).
    call: str | None = None
    route: str | None = None  # "METHOD /path" under contract.API_PREFIX that the call uses
    # The EngineCore utility (vllm_plugin/engine.py UTILITIES) the plugin's generic handler of
    # `route` calls on every engine. None: the plugin has a handler of its own (api.py).
    engine_call: str | None = None
    # The request body of a generic route (None: no body). The remediator's step carries its
    # fields (decision.Step.params); the actuator validates them with it before sending, the
    # plugin again on arrival (a 400 naming the field), and hands them to `engine_call` in the
    # model's field order. tests/test_actions.py holds each to extra="forbid".
    body: type[BaseModel] | None = None
    told: str = ""  # a step taken, as a sentence: "{target}", "{cap}" (the demo's timeline)

    @property
    def disruptive(self) -> bool:
        """Counted by the cooldown, the rate limit and the disruption budget."""
        return self.severity > 0

    @property
    def cap_only(self) -> bool:
        """An alert action decided without a model's peers: a cap needs none."""
        return self.alert and self.step and not self.out_of_service


# In the alert actions' order of precedence: hold (the exporter is blind to the engine: change
# nothing), drain, lower the cap, restart; then the steps that give capacity back.
ACTIONS: tuple[ActionSpec, ...] = (
    ActionSpec("hold", "change nothing, in either direction: the exporter is blind", alert=True),
    ActionSpec(
        "drain",
        "stop admitting; running requests finish",
        alert=True,
        step=True,
        severity=2,
        out_of_service=True,
        draining=True,
        call="drain",
        route="POST /drain",
        told="drained {target}",
    ),
    ActionSpec(
        "lower_cap",
        "lower the admission cap",
        alert=True,
        step=True,
        severity=1,
        call="set_cap",
        route="PUT /admission",
        told="lowered {target}'s cap to {cap}",
    ),
    ActionSpec(
        "restart",
        "restart the engine with lower memory flags (the restart backend)",
        alert=True,
        step=True,
        severity=3,
        out_of_service=True,
        told="restarted {target}",
    ),
    ActionSpec(
        "resume",
        "admit again after a drain",
        step=True,
        draining=False,
        call="resume",
        route="POST /resume",
        told="resumed {target}",
    ),
    ActionSpec(
        "raise_cap",
        "raise the admission cap",
        step=True,
        call="set_cap",
        route="PUT /admission",
        told="raised {target}'s cap to {cap}",
    ),
    ActionSpec(
        "readmit",
        "the first re-admission stage's cap, set while still drained",
        step=True,
        call="set_cap",
        route="PUT /admission",
        told="set {target}'s cap to {cap} to re-admit",
    ),
)

# -- views -------------------------------------------------------------------------------------
BY_NAME: dict[str, ActionSpec] = {a.name: a for a in ACTIONS}
ALERT_ACTIONS = cast(tuple[Action, ...], tuple(a.name for a in ACTIONS if a.alert))
STEPS: frozenset[str] = frozenset(a.name for a in ACTIONS if a.step)
DISRUPTIVE: frozenset[str] = frozenset(a.name for a in ACTIONS if a.disruptive)
SEVERITY: dict[str, int] = {a.name: a.severity for a in ACTIONS if a.disruptive}
OUT_OF_SERVICE: frozenset[str] = frozenset(a.name for a in ACTIONS if a.out_of_service)
CAP_ONLY: frozenset[str] = frozenset(a.name for a in ACTIONS if a.cap_only)
ROUTES: frozenset[tuple[str, str]] = frozenset(
    (m, p) for a in ACTIONS if a.route for m, p in [a.route.split(" ", 1)]
)


def body_of(action: str, params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON body of a generic action's route from its step's `params`, checked by the
    action's `body` model: ValueError (pydantic's ValidationError) naming the field when they do
    not fit it, or when an action without a body model is given any."""
    model = next(a.body for a in ACTIONS if a.name == action)  # ACTIONS, as route() reads it
    if model is None:
        if params:
            raise ValueError(f"{action} takes no parameters, got {sorted(params)}")
        return None
    return model.model_validate(params or {}).model_dump(mode="json")


def route(call: str) -> tuple[str, str]:
    """The plugin route (method, path under API_PREFIX) of an actuator call, or of an action
    taken by the actuator's generic `act`."""
    for a in ACTIONS:
        if (a.call or a.name) == call and a.route:
            method, path = a.route.split(" ", 1)
            return method, path
    raise KeyError(call)


# -- the alerts that ask for an action on the exporter's level series ---------------------------
LEVEL = "oomguard_engine_pressure_level"
# The label prometheus-operator gives every series with the name of the pod it scraped. The
# exporter's DaemonSet rolls with a surge (the new pod serves before the old one stops), so for a
# while two pods serve one engine's level, and after it another pod does: an alert that kept this
# label would be a new alert (its `for` started again, a new episode for the remediator) at every
# rollout. The rules take the level across the pods that serve it.
POD_LABEL = "pod"


def across_pods(expr: str) -> str:
    """`expr` as one series per engine (GPU, rank) whichever exporter pod serves it: the highest
    any pod sees. For gauges, and for counters the rules judge by `increase()` or `resets()`
    within a window (one pod's series rises or resets, the other's does not: either counts).
    Counters the exporter reads from files that outlive it are compared across pods by identity
    first (alerts.rules.rose_since)."""
    return f"max without ({POD_LABEL}) ({expr})"


@dataclass(frozen=True)
class ActionAlert:
    """An alert on the engine's pressure level that asks the remediator for `action`.

    It judges the *engine*, not one level series: `reason` is a label of the series, so an
    alert on the raw series would start its `for` again at every change of reason (a step-guard
    shrink's hold, then headroom_low again) and never fire while the level stays up. The
    expression aggregates the reason away (the worst level for `>=`, the lowest for `<`, so
    that one blind series is blind); `reason` set: only that reason's series count, and the
    alert carries it as a label (the one reason the remediator answers differently). The
    exporter pod that serves the series is aggregated away too (POD_LABEL): each pod's view of
    the engine, then the best-informed one (a new pod that cannot see the engine yet does not
    make it blind while the old one still can)."""

    name: str
    op: Literal[">=", "<"]
    level: int
    action: Action
    severity: str
    summary: str
    description: str
    for_: str | None = None  # the AlertThresholds field that holds its `for` (None: at once)
    keep: bool = False  # keeps firing for AlertThresholds.action_keep_firing_for (else clears)
    doc: str = ""  # the docs table's condition, after the generated part
    reason: str | None = None  # only the series with this reason (and a label saying so)

    def condition(self, level: float) -> bool:
        return level >= self.level if self.op == ">=" else level < self.level

    def counts(self, reason: str) -> bool:
        """Whether a level series with this `reason` label is one this alert judges."""
        return self.reason is None or reason == self.reason

    def worst(self, levels: Iterable[float]) -> float:
        """The engine's level as the expression sees it, from its series' levels."""
        return max(levels) if self.op == ">=" else min(levels)

    @property
    def expr(self) -> str:
        series = LEVEL if self.reason is None else f'{LEVEL}{{reason="{self.reason}"}}'
        if self.op == ">=":  # the worst level of any reason, as any pod sees it
            return f"max without (reason, {POD_LABEL}) ({series}) {self.op} {self.level}"
        # the lowest level of any reason (blind if one is), as the pod that sees best sees it
        return f"{across_pods(f'min without (reason) ({series})')} {self.op} {self.level}"

    @property
    def labels(self) -> dict[str, str]:
        """Labels the rule adds besides severity and oomguard_action."""
        return {} if self.reason is None else {"reason": self.reason}

    def for_duration(self, t: AlertThresholds) -> str:
        return "0s" if self.for_ is None else str(getattr(t, self.for_))

    def keep_duration(self, t: AlertThresholds) -> str | None:
        return t.action_keep_firing_for if self.keep else None

    def describe(self, t: AlertThresholds) -> str:
        """When it fires, for the docs' alerts table."""
        words = {">=": "≥", "<": "<"}
        out = f"engine pressure level {words[self.op]} {self.level}"
        if self.reason is not None:
            out += f" with reason `{self.reason}`"
        if self.for_seconds(t):
            out += f" for {self.for_duration(t)}"
        if self.doc:
            out += f"; {self.doc}"
        keep = self.keep_duration(t)
        return out + (f"; keeps firing {keep}" if keep else "; fires and clears at once")

    def for_seconds(self, t: AlertThresholds) -> float:
        return parse_duration(self.for_duration(t))

    def keep_seconds(self, t: AlertThresholds) -> float:
        keep = self.keep_duration(t)
        return 0.0 if keep is None else parse_duration(keep)


_ENGINE = "engine {{ $labels.engine }} of {{ $labels.target }} on {{ $labels.instance }}"
# The alert judges the engine whatever its reason: the reasons are on its level series (a query
# template that read them back would run at every 250 ms evaluation of every firing alert)
_REASONS = "(the `reason` of its oomguard_engine_pressure_level series says why)"

ACTION_ALERTS: tuple[ActionAlert, ...] = (
    ActionAlert(
        "OomguardMemoryPressure",
        ">=",
        2,
        "lower_cap",
        "warning",
        "A vLLM engine is under GPU memory pressure.",
        f"The pressure level of {_ENGINE} is {{{{ $value }}}} {_REASONS}: the memory left on "
        "its GPU once every engine reaches its planned peak is low, or the allocator had to "
        "retry. oomguard lowers its admission cap.",
        for_="pressure_for",
        keep=True,
        doc="whatever its reason, which may change while it fires",
    ),
    # the one reason the remediator answers differently (decision.py): fragments in the
    # engine's own allocator, which capping does not give back and a new process does
    ActionAlert(
        "OomguardFragmentationPressure",
        ">=",
        2,
        "lower_cap",
        "warning",
        "A vLLM engine's own allocator fragmentation takes its GPU memory headroom.",
        f"The pressure level of {_ENGINE} is {{{{ $value }}}} because of free blocks stranded "
        "in its own PyTorch allocator (reason allocator_fragmentation), which only a new "
        "process gives back. With a restart backend oomguard drains it and restarts it at "
        "the first quiet moment; without one it lowers its admission cap.",
        for_="pressure_for",
        keep=True,
        doc="carries `reason`",
        reason=FRAGMENTATION_REASON,
    ),
    # blind is not healthy: the remediator changes nothing on the engine while it fires (at
    # once, and clears at once); a hold that lasts is OomguardRemediationHeld's ticket
    ActionAlert(
        "OomguardPressureBlind",
        "<",
        0,
        "hold",
        "warning",
        "oomguard cannot judge the memory pressure of a vLLM engine.",
        f"The exporter on {{{{ $labels.instance }}}} lacks the data to judge {_ENGINE} "
        f"{_REASONS}; the remediator holds it (blind is not healthy).",
        doc="-1 is blind: the remediator changes nothing",
    ),
    ActionAlert(
        "OomguardMemoryCritical",
        ">=",
        3,
        "drain",
        "warning",
        "A vLLM engine is about to run out of GPU memory; oomguard drains it.",
        f"The pressure level of {_ENGINE} is {{{{ $value }}}} {_REASONS}: the memory left on "
        "its GPU at the engines' planned peak is nearly gone, or the allocator reported an "
        "out-of-memory error. oomguard drains the engine.",
        for_="critical_for",
        keep=True,
        doc="whatever its reason",
    ),
)
