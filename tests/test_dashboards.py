"""Dashboard lint: what Grafana needs to show every panel, checked on the generated JSON."""

from __future__ import annotations

import json

import pytest
from oomguard.alerts.rules import recording_rules
from oomguard.dashboards.definitions import DASHBOARDS
from oomguard.dashboards.generate import dashboard_path

from oomguard.catalog import exported_names
from tests.conftest import VLLM_FIXTURE
from tests.promql import metric_names, promtool_parses, substitute_grafana

ANGULAR = {"graph", "singlestat", "table-old", "text-old", "grafana-piechart-panel"}
VLLM_NAMES = {
    line.split("{")[0].split(" ")[0]
    for line in VLLM_FIXTURE.read_text().splitlines()
    if line and not line.startswith("#")
}


@pytest.fixture(params=sorted(DASHBOARDS))
def dashboard(request, repo_root):
    return json.loads((repo_root / dashboard_path(request.param)).read_text())


def panel_exprs(dashboard):
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            yield panel, t["expr"]


def test_schema_uid_and_variables(dashboard):
    assert 39 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"].startswith("oomguard-")
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "job", "node", "model", "engine"]


def test_unique_ids_and_no_overlapping_panels(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_every_panel_has_datasource_unit_description_and_modern_type(dashboard):
    for p in dashboard["panels"]:
        assert p["type"] not in ANGULAR, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert p["description"], p["title"]
        assert p["targets"], p["title"]
        if "legend" in p.get("options", {}):
            assert p["options"]["legend"]["showLegend"] is True


def test_rate_queries_use_rate_interval(dashboard):
    for panel, expr in panel_exprs(dashboard):
        for fn in ("rate(", "increase("):
            if fn in expr and "[1h]" not in expr:
                assert "[$__rate_interval]" in expr, (panel["title"], expr)


def test_every_expression_parses_as_promql(dashboard):
    exprs = [substitute_grafana(e) for _, e in panel_exprs(dashboard)]
    exprs += [substitute_grafana(a["expr"]) for a in dashboard["annotations"]["list"]]
    promtool_parses(exprs)


def test_every_metric_in_a_panel_is_exported_and_named_in_its_description(dashboard):
    known = exported_names() | {r.record for r in recording_rules()} | VLLM_NAMES | {"ALERTS"}
    for panel, expr in panel_exprs(dashboard):
        names = metric_names(substitute_grafana(expr))
        assert names, (panel["title"], expr)
        assert names <= known, (panel["title"], names - known)
        for name in names - {"ALERTS"}:
            stem = name.removesuffix("_bucket")
            assert stem in panel["description"] or name in panel["description"], (
                panel["title"],
                name,
            )


def test_level_panels_map_values_to_words(dashboard):
    for p in dashboard["panels"]:
        if p["type"] == "state-timeline":
            options = p["fieldConfig"]["defaults"]["mappings"][0]["options"]
            assert options["3"]["text"] == "critical"
