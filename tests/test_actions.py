"""The action registry (oomguard.actions) is the one table of action facts, and the action alerts
are defined once: the rules, the standalone watch, the recovery simulation and the docs' table
all come from the same definition."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
import yaml
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

import oomguard
import oomguard.actions
from oomguard import actions
from oomguard.actions import (
    ACTION_ALERTS,
    ACTIONS,
    ALERT_ACTIONS,
    BY_NAME,
    CAP_ONLY,
    DISRUPTIVE,
    OUT_OF_SERVICE,
    SEVERITY,
    STEPS,
    Action,
    StepKind,
)
from oomguard.alerts.generate import DOCS, DOCS_BEGIN, DOCS_END, RULES, alerts_table
from oomguard.alerts.rules import all_alerts
from oomguard.cli import main
from oomguard.contract import API_PREFIX, PLUGIN_TOKEN_ENV
from oomguard.lab.recovery import alertmanager_path, standalone_path
from oomguard.remediator.actuator import (
    Actuator,
    ActuatorError,
    DryRunActuator,
    PluginActuator,
    Target,
)
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import StandaloneConfig
from oomguard.remediator.controller import Controller
from oomguard.remediator.router import RoutedActuator
from oomguard.remediator.standalone import RULES as STANDALONE_RULES
from oomguard.remediator.standalone import durations
from oomguard.remediator.webhook import parse as parse_webhook
from oomguard.thresholds import AlertThresholds
from oomguard.units import parse_duration

ROOT = Path(__file__).resolve().parent.parent
# the package's folders in this checkout: one per import root (core/oomguard, exporter/...)
PACKAGE = sorted(
    p for p in (Path(d).resolve() for d in oomguard.__path__) if p.is_relative_to(ROOT)
)
REGISTRY = Path(oomguard.actions.__file__).resolve()


# -- one table of action facts ------------------------------------------------------------------
def test_the_types_name_exactly_the_registry_s_actions():
    assert get_args(Action) == ALERT_ACTIONS  # in precedence order
    assert set(get_args(StepKind)) == STEPS
    assert len(BY_NAME) == len(ACTIONS)  # no name twice


def test_views_are_derived_from_the_table():
    assert {a.name for a in ACTIONS if a.disruptive} == DISRUPTIVE
    assert {a.name: a.severity for a in ACTIONS if a.severity} == SEVERITY
    assert {a.name for a in ACTIONS if a.out_of_service} == OUT_OF_SERVICE
    assert {a.name for a in ACTIONS if a.alert and a.step and not a.out_of_service} == CAP_ONLY
    # the facts as the remediator has always had them
    assert ALERT_ACTIONS == ("hold", "drain", "lower_cap", "restart")
    assert {"drain", "lower_cap", "restart"} == DISRUPTIVE
    assert SEVERITY["lower_cap"] < SEVERITY["drain"] < SEVERITY["restart"]
    assert {"drain", "restart"} == OUT_OF_SERVICE and {"lower_cap"} == CAP_ONLY
    for a in ACTIONS:
        assert a.route is not None or a.call is None, a.name  # no route: not the actuator's


def _action_literals(tree: ast.AST, module_level: set[int]) -> list[tuple[int, list[str]]]:
    names, found = set(BY_NAME), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)} & names
            if len(keys) >= 2:
                found.append((node.lineno, sorted(keys)))
        elif isinstance(node, ast.Set | ast.Tuple | ast.List):
            elts = {e.value for e in node.elts if isinstance(e, ast.Constant)} & names
            if len(elts) >= 3 or (len(elts) >= 2 and id(node) in module_level):
                found.append((node.lineno, sorted(elts)))
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
            text = ast.unparse(node.slice)
            elts = {n for n in names if f"'{n}'" in text}
            if len(elts) >= 2:
                found.append((node.lineno, sorted(elts)))
    return found


def test_no_second_table_of_actions_in_the_code():
    """Outside oomguard/actions.py, no mapping keyed by action names, no collection naming three
    or more of them, no module-level constant or Literal naming two: such a table is a second
    copy of the registry's facts. A policy's own test of one or two actions is fine."""
    found = []
    for path in sorted(p for root in PACKAGE for p in root.rglob("*.py")):
        if path == REGISTRY:
            continue
        tree = ast.parse(path.read_text())
        module_level = set()
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
                module_level |= {id(n) for n in ast.walk(stmt.value)}
        found += [
            (str(path.relative_to(ROOT)), *hit) for hit in _action_literals(tree, module_level)
        ]
    assert found == [], f"a second table of action facts (use oomguard.actions): {found}"


def test_the_detector_sees_a_second_table():
    tree = ast.parse('OUT = frozenset({"drain", "restart"})\nX = {"drain": 1, "resume": 2}\n')
    module_level = {id(n) for stmt in tree.body for n in ast.walk(stmt)}
    assert len(_action_literals(tree, module_level)) == 2


# -- the actuator call and the plugin route of each step ----------------------------------------
def test_every_actuator_call_exists_on_every_actuator():
    calls = {a.call for a in ACTIONS if a.call}
    for cls in (Actuator, PluginActuator, DryRunActuator):
        assert all(callable(getattr(cls, c, None)) for c in calls), cls
    routed = RoutedActuator(PluginActuator(), {})  # what it has not, the plugin actuator does
    assert all(callable(getattr(routed, c, None)) for c in calls)


def test_the_actuator_sends_each_call_to_the_registry_s_route():
    sent: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path))
        return httpx.Response(200, json={})

    actuator = PluginActuator(httpx.Client(transport=httpx.MockTransport(handler)), attempts=1)
    target = Target("e", "http://engine")
    for a in ACTIONS:
        if a.call:
            sent.clear()
            method = getattr(actuator, a.call)
            method(target, 3) if a.call == "set_cap" else method(target)
            verb, path = str(a.route).split(" ", 1)
            assert sent == [(verb, API_PREFIX + path)], a.name


def test_the_plugin_serves_every_route_of_the_registry():
    from oomguard.vllm_plugin.api import CONTROL_PATHS, OomguardEndpointPlugin

    app = FastAPI()
    OomguardEndpointPlugin().attach_router(app)
    served = {
        (m, r.path)
        for r in app.routes
        for m in getattr(r, "methods", ()) or ()
        if r.path.startswith(API_PREFIX)
    }
    for method, path in actions.ROUTES:
        assert (method, API_PREFIX + path) in served
        if method == "POST":  # a control route: the drain gate lets it through
            assert API_PREFIX + path in CONTROL_PATHS


# -- the action alerts, defined once -------------------------------------------------------------
def _generated_action_rules(root: Path) -> dict[str, dict]:
    groups = yaml.safe_load((root / RULES).read_text())["groups"]
    (group,) = [g for g in groups if g["name"] == "oomguard-actions"]
    return {r["alert"]: r for r in group["rules"]}


def test_the_generated_rules_are_the_definition(repo_root):
    rules = _generated_action_rules(repo_root)
    assert list(rules) == [a.name for a in ACTION_ALERTS]
    for a in ACTION_ALERTS:
        rule = rules[a.name]
        assert rule["expr"] == a.expr
        assert rule["labels"] == {"severity": a.severity, "oomguard_action": a.action, **a.labels}


# the worst level over reasons and exporter pods (`>=`), or the lowest over reasons per pod
# and then the best-informed pod (`<`: blind)
_SERIES = r'(?P<{}metric>\w+)(?:\{{reason="(?P<{}reason>\w+)"\}})?'
RULE = re.compile(
    rf"(?:(?P<how>max) without \(reason, pod\) \({_SERIES.format('', '')}\)"
    rf"|max without \(pod\) \((?P<how_min>min) without \(reason\) "
    rf"\({_SERIES.format('m_', 'm_')}\)\))"
    r" (?P<op>>=|<) (?P<threshold>-?\d+)"
)


def _rule_level_holds(expr: str, level: float, reason: str | None) -> bool:
    """Whether the rule's condition holds for an engine at `level` (its series' worst, of the
    reason the rule looks at): the engine-wide aggregation and the reason are checked too."""
    m = RULE.fullmatch(expr)
    assert m is not None, expr
    how = m["how"] or m["how_min"]
    assert (m["metric"] or m["m_metric"]) == actions.LEVEL
    assert how == ("max" if m["op"] == ">=" else "min"), expr  # a blind series is blind
    assert (m["reason"] or m["m_reason"]) == reason, expr
    threshold = float(m["threshold"])
    return {">=": level >= threshold, "<": level < threshold}[m["op"]]


def test_standalone_and_recovery_watch_as_the_generated_rules_do(repo_root):
    """The standalone watch and the recovery simulation, at their defaults, use the committed
    rules' conditions, `for` and keep_firing_for: change one side only and this fails."""
    _watch_as_rules(repo_root, StandaloneConfig(exporters=["http://exporter/metrics"]))


def _watch_as_rules(root: Path, d: StandaloneConfig) -> None:
    rules = _generated_action_rules(root)
    shipped, local = alertmanager_path(), standalone_path()
    assert set(STANDALONE_RULES) == set(rules)
    for name, rule in rules.items():
        for_s = parse_duration(rule.get("for", "0s"))
        keep_s = parse_duration(rule.get("keep_firing_for", "0s"))
        alert = STANDALONE_RULES[name]
        for level in (-1, 0, 1, 2, 3):
            assert alert.condition(level) == _rule_level_holds(rule["expr"], level, alert.reason), (
                name,
                level,
            )
        assert (alert.severity, alert.action, alert.reason) == (
            rule["labels"]["severity"],
            rule["labels"]["oomguard_action"],
            rule["labels"].get("reason"),
        )
        assert durations(d, alert) == (for_s, keep_s), name
        assert shipped.for_s[name] == local.for_s[name] == for_s, name
        if keep_s:
            assert shipped.keep_firing_s == local.keep_firing_s == keep_s, name


@pytest.mark.parametrize(
    "drift", [{"pressure_for_seconds": 20}, {"critical_for_seconds": 5}, {"keep_firing_seconds": 1}]
)
def test_a_standalone_duration_that_drifts_from_the_rules_is_caught(repo_root, drift):
    d = StandaloneConfig(exporters=["http://exporter/metrics"], **drift)
    with pytest.raises(AssertionError):
        _watch_as_rules(repo_root, d)


def test_a_rule_that_drifts_from_standalone_is_caught(repo_root, tmp_path):
    (tmp_path / RULES).parent.mkdir(parents=True)
    text = (repo_root / RULES).read_text()
    assert "oomguard_engine_pressure_level) >= 3" in text
    (tmp_path / RULES).write_text(text.replace("pressure_level) >= 3", "pressure_level) >= 4"))
    with pytest.raises(AssertionError):
        _watch_as_rules(tmp_path, StandaloneConfig(exporters=["http://exporter/metrics"]))


# -- the docs' alerts table ------------------------------------------------------------------------
def test_every_alert_says_when_it_fires():
    assert [a.name for a in all_alerts() if not a.doc] == []


def test_the_docs_table_is_the_rules(repo_root):
    page = (repo_root / DOCS).read_text()
    section = page[page.index(DOCS_BEGIN) + len(DOCS_BEGIN) : page.index(DOCS_END)]
    assert section.strip() == alerts_table(AlertThresholds()).strip()
    assert len({a.name for a in all_alerts()}) == section.count("\n| Oomguard") + 1  # + Watchdog


def test_a_hand_edit_of_the_docs_table_is_drift(repo_root, tmp_path, capsys):
    (tmp_path / DOCS).parent.mkdir(parents=True)
    shutil.copy(repo_root / DOCS, tmp_path / DOCS)
    page = (tmp_path / DOCS).read_text()
    (tmp_path / DOCS).write_text(page.replace("| OomguardMemoryCritical | warning | drain |", "|"))
    assert main(["generate", "--root", str(tmp_path), "--check"]) == 1
    assert f"differs: {DOCS}" in capsys.readouterr().out
    assert main(["generate", "--root", str(tmp_path)]) == 0
    assert (tmp_path / DOCS).read_text() == page


def test_an_action_with_only_a_route_and_an_engine_call_needs_no_code_of_its_own(monkeypatch):
    """A new action whose plugin side is one EngineCore utility: the registry's entry gives it
    the actuator's generic `act`, the plugin's generic route and the drain gate's pass."""
    from oomguard.vllm_plugin import api

    spec = actions.ActionSpec("shed", "scratch", step=True, route="POST /shed", engine_call="x")
    monkeypatch.setattr(actions, "ACTIONS", (*ACTIONS, spec))
    monkeypatch.setattr(api, "ACTIONS", (*ACTIONS, spec))
    app = FastAPI()
    api.OomguardEndpointPlugin().attach_router(app)
    assert any(getattr(r, "path", "") == f"{API_PREFIX}/shed" for r in app.routes)

    sent: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path))
        return httpx.Response(200, json={})

    actuator = PluginActuator(httpx.Client(transport=httpx.MockTransport(handler)), attempts=1)
    actuator.act(Target("e", "http://engine"), "shed")
    assert sent == [("POST", f"{API_PREFIX}/shed")]
    dry = DryRunActuator(actuator)
    monkeypatch.setattr(actuator, "state", lambda target: {})
    dry.act(Target("e", "http://engine"), "shed")
    assert dry.intended == [("e", "shed", None)]


class ShedBody(BaseModel):
    """A scratch action's body: what share of the queue to shed."""

    model_config = ConfigDict(extra="forbid", strict=True)
    fraction: float = Field(ge=0, le=1)
    why: str = "pressure"


def test_an_action_with_a_body_needs_only_its_model_in_the_registry(monkeypatch, tmp_path):
    """A new action with parameters: its `body` model in the registry gives it the step's
    params through the convergence, the actuator's generic `act` (checked before sending) and
    the plugin's generic route (checked again, handed to the engine utility in field order)."""
    from fastapi.testclient import TestClient

    from oomguard.remediator import convergence
    from oomguard.remediator.decision import Step, Verdict
    from oomguard.vllm_plugin import api
    from tests.remediator_helpers import Engines, alert, config, payload

    spec = actions.ActionSpec(
        "shed", "scratch", step=True, route="POST /shed", engine_call="x", body=ShedBody
    )
    monkeypatch.setattr(actions, "ACTIONS", (*ACTIONS, spec))
    monkeypatch.setattr(api, "ACTIONS", (*ACTIONS, spec))
    monkeypatch.setitem(actions.BY_NAME, "shed", spec)

    # the plugin: the route exists, checks the body, and hands its fields to the engines
    monkeypatch.setenv(PLUGIN_TOKEN_ENV, "scratch-token")
    plugin = api.OomguardEndpointPlugin()
    called: list[tuple[str, tuple[Any, ...]]] = []

    async def call_engines(method: str, *args: Any) -> list[Any]:
        called.append((method, args))
        raise HTTPException(599, "stop here: the call is what is checked")

    monkeypatch.setattr(plugin, "call_engines", call_engines)
    app = FastAPI()
    plugin.attach_router(app)
    url = f"{API_PREFIX}/shed"
    assert TestClient(app).post(url, json={"fraction": 0.25}).status_code == 401
    client = TestClient(app, headers={"Authorization": "Bearer scratch-token"})
    assert client.post(url, json={"fraction": 0.25}).status_code == 599
    assert called == [("x", (0.25, "pressure"))]
    bad = client.post(url, json={"fraction": 2})
    assert bad.status_code == 400 and "fraction" in bad.text
    assert client.post(url, json={"fraction": 0.5, "extra": 1}).status_code == 400
    assert client.post(url, content=b"{not json").status_code == 400
    assert len(called) == 1  # nothing refused reached an engine

    # the actuator: params checked before anything is sent, then sent as the body
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={})

    actuator = PluginActuator(httpx.Client(transport=httpx.MockTransport(handler)), attempts=1)
    actuator.act(Target("e", "http://engine"), "shed", {"fraction": 0.5})
    assert sent == [{"fraction": 0.5, "why": "pressure"}]
    with pytest.raises(ActuatorError) as refused:
        actuator.act(Target("e", "http://engine"), "shed", {"fraction": "half"})
    assert refused.value.reason == "rejected" and len(sent) == 1
    with pytest.raises(ActuatorError):  # a body-less action takes no params
        actuator.act(Target("e", "http://engine"), "resume", {"fraction": 0.5})

    # the convergence: a decision's step carries its params to the actuator and the audit
    class Acting(Engines):
        def act(self, target: Target, action: str, params: Any = None) -> dict[str, Any]:
            self.calls.append((target.name, action, params))
            return self.state(target)

    real = convergence.decide_fleet

    def with_shed(*args: Any, **kwargs: Any) -> list[Verdict]:
        out = real(*args, **kwargs)
        return [
            dataclasses.replace(
                v, steps=(Step("shed", params={"fraction": 0.5}, reason="scratch"),)
            )
            if v.target == "a" and v.desired is not None
            else v
            for v in out
        ]

    monkeypatch.setattr(convergence, "decide_fleet", with_shed)
    engines = Acting(Engines.of("a").engines)
    c = Controller(config(tmp_path, "a"), engines, AuditLog(tmp_path / "audit.jsonl"))
    try:
        c.receive(parse_webhook(payload(alert("OomguardMemoryPressure", "a"))))
        c.reconcile()
        assert ("a", "shed", {"fraction": 0.5}) in engines.calls
        intent = [e for e in c.audit.entries() if e["event"] == "intent"]
        assert intent[-1]["action"] == "shed"
        assert intent[-1]["after"] == {"params": {"fraction": 0.5}}
    finally:
        c.close()


def test_every_body_model_refuses_what_it_does_not_name():
    for spec in ACTIONS:
        if spec.body is not None:
            assert spec.body.model_config.get("extra") == "forbid", spec.name
    with pytest.raises(ValueError):
        actions.body_of("resume", {"anything": 1})
    assert actions.body_of("resume", None) is None
