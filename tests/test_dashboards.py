"""Dashboard lint: what Grafana needs to show every panel, checked on the generated JSON, and
Grafana's own published JSON schema (tests/fixtures/grafana/SOURCE.md) with zero findings."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from typing import Any

import jsonschema
import pytest

from oomguard.alerts.rules import all_recording_rules
from oomguard.catalog import exported_names
from oomguard.dashboards.definitions import DASHBOARDS, NODE_UID
from oomguard.dashboards.generate import dashboard_path
from tests.conftest import FIXTURES, VLLM_FIXTURE
from tests.promql import metric_names, promtool_parses, substitute_grafana

ANGULAR = {"graph", "singlestat", "table-old", "text-old", "grafana-piechart-panel"}
VLLM_NAMES = {
    line.split("{")[0].split(" ")[0]
    for line in VLLM_FIXTURE.read_text().splitlines()
    if line and not line.startswith("#")
}
SCHEMAS = FIXTURES / "grafana"
# panel type -> the schema file of its options and fieldConfig.defaults.custom
PANEL_SCHEMAS = {
    "timeseries": "timeseries",
    "stat": "stat",
    "state-timeline": "statetimeline",
    "table": "table",
}


@cache
def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{name}.jsonschema.json").read_text())


def _validator(name: str, definition: str | None = None) -> jsonschema.Draft7Validator:
    schema = _schema(name)
    if definition:
        schema = {**schema, "$ref": f"#/definitions/{definition}"}
    return jsonschema.Draft7Validator(schema)


def schema_findings(dashboard: dict[str, Any]) -> list[str]:
    """Every place where the dashboard differs from Grafana's published schemas: the dashboard
    model, each Prometheus query, and each panel type's options and custom field config."""
    found = [
        f"{list(e.absolute_path)}: {e.message}"
        for e in _validator("dashboard").iter_errors(dashboard)
    ]
    query = _validator("prometheus", "Dataquery")
    for panel in dashboard.get("panels", []):
        where = f"panel {panel.get('title')!r}"
        for t in panel.get("targets", []):
            found += [f"{where} target: {e.message}" for e in query.iter_errors(t)]
        kind = PANEL_SCHEMAS.get(panel.get("type", ""))
        if kind is None:
            found.append(f"{where}: no published schema for type {panel.get('type')!r}")
            continue
        options = _validator(kind, "Options")
        found += [f"{where} options: {e.message}" for e in options.iter_errors(panel["options"])]
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
        if custom is not None and "FieldConfig" in _schema(kind)["definitions"]:
            config = _validator(kind, "FieldConfig")
            found += [f"{where} custom: {e.message}" for e in config.iter_errors(custom)]
    return found


@pytest.fixture(params=sorted(DASHBOARDS))
def dashboard(request, repo_root):
    return json.loads((repo_root / dashboard_path(request.param)).read_text())


def panel_exprs(dashboard):
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            yield panel, t["expr"]


def test_zero_findings_against_grafanas_published_schema(dashboard):
    assert schema_findings(dashboard) == []


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["panels"][0].update(span=12),  # grafanalib's legacy width
        lambda d: d["panels"][0]["targets"][0].update(step=10),  # a legacy target key
        lambda d: d.update(rows=[]),
        lambda d: (
            d["panels"][0]["options"].pop("reduceOptions", None)
            or d["panels"][0]["options"].pop("legend", None)
        ),
        lambda d: d["panels"][0]["gridPos"].update(w=25),
    ],
)
def test_the_schema_check_finds_legacy_shapes(repo_root, break_it):
    d = json.loads((repo_root / dashboard_path("fleet")).read_text())
    assert schema_findings(d) == []
    broken = copy.deepcopy(d)
    break_it(broken)
    assert schema_findings(broken)


def test_variables_narrow_cluster_node_model_target_engine(dashboard):
    assert 39 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"].startswith("oomguard-")
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "cluster", "node", "model", "target", "engine"]
    queries = {v["name"]: v.get("query", "") for v in dashboard["templating"]["list"]}
    assert queries["engine"].endswith(", engine)") and '$target"' in queries["engine"]
    for v in dashboard["templating"]["list"][1:]:
        assert v["allValue"] == ".*"  # "All" matches a missing label (no cluster on one box)


def test_links_keep_time_and_variables(dashboard):
    (dashboards,) = [x for x in dashboard["links"] if x["type"] == "dashboards"]
    assert dashboards["keepTime"] and dashboards["includeVars"]
    assert "oomguard" in dashboards["tags"]
    (runbooks,) = [x for x in dashboard["links"] if x["type"] == "link"]
    assert runbooks["url"].endswith("/README.md")
    for panel in dashboard["panels"]:
        for x in panel["fieldConfig"]["defaults"].get("links", []):
            if f"/d/{NODE_UID}/" in x["url"]:
                assert "${__url_time_range}" in x["url"] and "${cluster:queryparam}" in x["url"]


def test_per_engine_fleet_panels_drill_down_to_the_node(repo_root):
    d = json.loads((repo_root / dashboard_path("fleet")).read_text())
    for panel in d["panels"]:
        exprs = " ".join(t["expr"] for t in panel["targets"])
        if panel["type"] == "timeseries" and "target=~" in exprs:
            links = panel["fieldConfig"]["defaults"].get("links", [])
            assert any(f"/d/{NODE_UID}/" in x["url"] for x in links), panel["title"]


def test_the_alerts_table_links_each_runbook(repo_root):
    d = json.loads((repo_root / dashboard_path("fleet")).read_text())
    (table,) = [p for p in d["panels"] if p["title"] == "Firing alerts"]
    (runbook,) = table["fieldConfig"]["defaults"]["links"]
    assert runbook["url"].endswith("/${__data.fields.alertname}.md")


def test_the_pressure_reason_is_shown(dashboard):
    if dashboard["uid"] == "oomguard-remediation":
        return
    exprs = [e for _, e in panel_exprs(dashboard) if "oomguard_engine_pressure_level{" in e]
    assert any("reason" in e or "max by" not in e for e in exprs)


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


def test_every_query_filters_on_the_cluster_variable(dashboard):
    for panel, expr in panel_exprs(dashboard):
        assert '=~"$cluster"' in expr, (panel["title"], expr)
        if "vllm:" in expr:  # vLLM's own series: per model and data-parallel engine
            assert 'model_name=~"$model"' in expr and 'engine=~"$engine"' in expr, panel["title"]


def test_no_stat_reads_zero_when_nothing_reports(dashboard):
    for panel, expr in panel_exprs(dashboard):
        assert "vector(0)" not in expr, panel["title"]


def test_rate_queries_use_rate_interval(dashboard):
    for panel, expr in panel_exprs(dashboard):
        for fn in ("rate(", "increase("):
            if fn in expr and "[1h]" not in expr:
                assert "[$__rate_interval]" in expr, (panel["title"], expr)


def test_rate_interval_spans_two_vllm_samples(repo_root):
    """Grafana's $__rate_interval is at least 4 x the datasource's timeInterval; vLLM is
    scraped every 5 s, so the interval must not be below that scrape interval."""
    import yaml

    source = yaml.safe_load(
        (repo_root / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    prometheus = yaml.safe_load((repo_root / "deploy/prometheus/prometheus.yml").read_text())
    vllm = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "vllm")

    def seconds(d: str) -> int:
        return int(re.fullmatch(r"(\d+)s", d).group(1))  # type: ignore[union-attr]

    assert 4 * seconds(source["jsonData"]["timeInterval"]) >= 2 * seconds(vllm["scrape_interval"])


def test_every_expression_parses_as_promql(dashboard):
    exprs = [substitute_grafana(e) for _, e in panel_exprs(dashboard)]
    exprs += [substitute_grafana(a["expr"]) for a in dashboard["annotations"]["list"]]
    promtool_parses(exprs)


def test_every_metric_in_a_panel_is_exported_and_named_in_its_description(dashboard):
    recorded = {r.record for r in all_recording_rules()}
    known = exported_names() | recorded | VLLM_NAMES | {"ALERTS", "up"}
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


def test_state_timelines_map_values_to_words(dashboard):
    for p in dashboard["panels"]:
        if p["type"] != "state-timeline":
            continue
        options = p["fieldConfig"]["defaults"]["mappings"][0]["options"]
        words = {o["text"] for o in options.values()}
        if "Pressure" in p["title"]:
            assert options["-1"]["text"] == "blind" and options["3"]["text"] == "critical"
        elif p["title"] == "Mode per engine":
            # one word per mode, not the pressure words (every mode used to read "caution")
            assert words == {"serving", "capped", "readmitting", "draining", "restarting", "held"}
        assert len(words) == len(options), p["title"]


def test_no_query_uses_the_deprecated_interval_factor(dashboard):
    """Grafana ignores `intervalFactor` for Prometheus (and drops it on save); grafanalib writes
    it on every target."""
    assert "intervalFactor" not in json.dumps(dashboard)


def test_every_filter_variable_names_a_label_its_series_carry(dashboard):
    """`label=~"$var"` on a series without that label drops every series once a value is
    chosen (the remediator's leader and pass series have no `target`)."""
    from tests.series_labels import ANY, carried, selectors

    exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    exprs += [(v["name"], v["query"]) for v in dashboard["templating"]["list"][1:]]
    for where, expr in exprs:
        for metric, matchers in selectors(expr):
            for label, value in matchers.items():
                if "$" in value and carried(metric) != ANY:
                    assert label in carried(metric), (where, metric, label)
        for metric, label in re.findall(r"label_values\(([\w:]+)\{[^}]*\},\s*(\w+)\)", expr):
            assert label in carried(metric), (where, metric, label)


def test_every_drill_down_link_uses_labels_its_series_carry(dashboard):
    """A link's ${__field.labels.X} needs X on every series of the panel (a GPU panel
    aggregated by node has no `target`; the remediator's mode per target has no node)."""
    from tests.series_labels import labels

    checked = 0
    for panel in dashboard["panels"]:
        for x in panel["fieldConfig"]["defaults"].get("links", []):
            for label in re.findall(r"\$\{__field\.labels\.(\w+)\}", x["url"]):
                for t in panel["targets"]:
                    carried = labels(substitute_grafana(t["expr"]))
                    assert label in carried, (panel["title"], label, sorted(carried))
                    checked += 1
    if dashboard["uid"] != "oomguard-node":
        assert checked


def test_the_label_checks_catch_a_wrong_label():
    """The two checks above fail on the shapes they were written for."""
    from tests.series_labels import carried, labels

    assert "target" not in carried("oomguard_remediator_leader")
    gpu = 'min by (cluster, instance, gpu) (oomguard_gpu_headroom_bytes{job="x"})'
    assert "target" not in labels(gpu) and "instance" in labels(gpu)
    mode = 'max by (cluster, target) (oomguard_remediator_target_mode{mode="held"})'
    assert "instance" not in labels(mode)
