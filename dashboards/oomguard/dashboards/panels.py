"""Panel helpers over grafanalib: every panel gets the datasource variable, a unit, a
description naming its metrics, a legend, and a grid position from a simple row layout.

grafanalib 0.7.1 writes a dashboard model older than the one Grafana 10-12 stores: nulls for
unset fields, `rows`, `span`/`height`, templating `tags`, targets with `metric`/`step`, stat and
table options without their newer required fields. `finish()` turns its output into the model
Grafana's published JSON schema describes (tests/fixtures/grafana, checked in
tests/test_dashboards.py): zero findings, so Grafana neither migrates nor drops anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    Dashboard,
    GridPos,
    Stat,
    StateTimeline,
    Table,
    Target,
    Template,
    Templating,
    TimeSeries,
)

from oomguard.thresholds import AlertThresholds

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
LEVEL_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "-1": {"text": "blind", "color": "purple", "index": 0},
            "0": {"text": "ok", "color": "green", "index": 1},
            "1": {"text": "caution", "color": "yellow", "index": 2},
            "2": {"text": "pressure", "color": "orange", "index": 3},
            "3": {"text": "critical", "color": "red", "index": 4},
        },
    }
]
LEVEL_STEPS: list[dict[str, Any]] = [
    {"color": "purple", "value": None},
    {"color": "green", "value": 0},
    {"color": "yellow", "value": 1},
    {"color": "orange", "value": 2},
    {"color": "red", "value": 3},
]
# grafanalib 0.7.1 leftovers the current dashboard model does not have
LEGACY_DASHBOARD_KEYS = ("__inputs", "hideControls", "rows", "sharedCrosshair", "style")
LEGACY_PANEL_KEYS = ("editable", "error", "height", "minSpan", "span")
# `intervalFactor` is deprecated (Grafana ignores it for Prometheus since 7.x and drops it on
# save); grafanalib still writes it on every target
LEGACY_TARGET_KEYS = ("intervalFactor", "metric", "query", "step", "target")
LEGACY_VARIABLE_KEYS = ("tags", "tagsQuery", "tagValuesQuery", "useTags")
LEGACY_TABLE_KEYS = ("color", "columns", "fontSize", "mappings")  # the Angular table's


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> Target:
    return Target(
        expr=expr,
        legendFormat=legend,
        refId=ref,
        instant=instant,
        format="table" if instant else "time_series",
    )


def link(title: str, url: str, new_tab: bool = False) -> dict[str, Any]:
    """A data link (Grafana interpolates ${...} from the clicked series or row), written in the
    link shape the dashboard schema gives field links."""
    return {
        "title": title,
        "type": "link",
        "url": url,
        "icon": "external link",
        "tooltip": "",
        "tags": [],
        "asDropdown": False,
        "targetBlank": new_tab,
        # the URL carries time range and variables itself (${__url_time_range}, :queryparam)
        "includeVars": False,
        "keepTime": False,
    }


@dataclass
class Layout:
    """Places panels left to right in rows of 24 columns."""

    x: int = 0
    y: int = 0
    row_height: int = 0
    panels: list[Any] = field(default_factory=list)
    # set on the finished JSON, by panel id (grafanalib has no field for them)
    stat_steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    mappings: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    data_links: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def place(self, w: int, h: int) -> GridPos:
        if self.x + w > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        pos = GridPos(h=h, w=w, x=self.x, y=self.y)
        self.x += w
        self.row_height = max(self.row_height, h)
        return pos

    def _added(self, links: list[dict[str, Any]] | None) -> int:
        pid = len(self.panels) - 1  # the panel just appended
        if links:
            self.data_links[pid] = links
        return pid

    def timeseries(
        self,
        title: str,
        description: str,
        unit: str,
        targets: list[Target],
        w: int = 12,
        h: int = 8,
        stack: bool = False,
        links: list[dict[str, Any]] | None = None,
    ) -> None:
        self.panels.append(
            TimeSeries(
                title=title,
                description=description,
                unit=unit,
                targets=targets,
                gridPos=self.place(w, h),
                dataSource=DATASOURCE,
                stacking={"mode": "normal", "group": "A"} if stack else {"mode": "none"},
                legendDisplayMode="table",
                legendPlacement="bottom",
                legendCalcs=["lastNotNull", "min", "max"],
            )
        )
        self._added(links)

    def stat(
        self,
        title: str,
        description: str,
        unit: str,
        targets: list[Target],
        w: int = 4,
        h: int = 4,
        steps: list[dict[str, Any]] | None = None,
        links: list[dict[str, Any]] | None = None,
    ) -> None:
        panel = Stat(
            title=title,
            description=description,
            format=unit,
            targets=targets,
            gridPos=self.place(w, h),
            dataSource=DATASOURCE,
            reduceCalc="lastNotNull",
            graphMode="none",
            # "No data" in grey, never a green 0: an empty answer means nothing is reporting
            noValue="no data",
        )
        self.panels.append(panel)
        pid = self._added(links)
        self.stat_steps[pid] = steps or [{"color": "green", "value": None}]

    def levels(
        self,
        title: str,
        description: str,
        targets: list[Target],
        w: int = 24,
        h: int = 7,
        mappings: list[dict[str, Any]] | None = None,
        links: list[dict[str, Any]] | None = None,
    ) -> None:
        self.panels.append(
            StateTimeline(
                title=title,
                description=description,
                targets=targets,
                gridPos=self.place(w, h),
                dataSource=DATASOURCE,
            )
        )
        pid = self._added(links)
        self.mappings[pid] = mappings or LEVEL_MAPPINGS

    def table(
        self,
        title: str,
        description: str,
        targets: list[Target],
        w: int = 24,
        h: int = 7,
        links: list[dict[str, Any]] | None = None,
    ) -> None:
        self.panels.append(
            Table(
                title=title,
                description=description,
                targets=targets,
                gridPos=self.place(w, h),
                dataSource=DATASOURCE,
                unit="short",
                transformations=[{"id": "merge", "options": {}}],
            )
        )
        self._added(links)


def variables(t: AlertThresholds) -> Templating:
    """Cluster, node, model, target and data-parallel engine, each narrowing the next."""
    c = t.cluster_label

    def query(name: str, label: str, expr: str) -> Template:
        return Template(
            name=name,
            label=label,
            query=expr,
            dataSource=DATASOURCE,
            multi=True,
            includeAll=True,
            # matches a missing label too: on a single box there is no cluster label
            allValue=".*",
            default="$__all",
            refresh=2,
            sort=1,
        )

    engines = f'oomguard_vllm_requests_running{{job="{t.exporter_job}", {c}=~"$cluster"'
    return Templating(
        list=[
            Template(
                name="datasource",
                label="Data source",
                query="prometheus",
                type="datasource",
                default="Prometheus",
            ),
            query(
                "cluster",
                "Cluster",
                # the label a central ruler or remote-write adds (none on a single box)
                f'label_values(up{{job="{t.exporter_job}"}}, {c})',
            ),
            query(
                "node",
                "Node",
                # the exporter's instance: the node's name on Kubernetes
                f'label_values(up{{job="{t.exporter_job}", {c}=~"$cluster"}}, instance)',
            ),
            query(
                "model",
                "Model",
                f'label_values({engines}, instance=~"$node"}}, model_name)',
            ),
            query(
                "target",
                "Target",
                # a vLLM server, as the exporter and the remediator name it
                f'label_values({engines}, instance=~"$node", model_name=~"$model"}}, target)',
            ),
            query(
                "engine",
                "DP engine",
                f'label_values({engines}, instance=~"$node", model_name=~"$model", '
                'target=~"$target"}, engine)',  # vLLM's data-parallel engine index
            ),
        ]
    )


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


# First step of a thresholds list is "from -Infinity": Grafana stores it as null, and the schema
# allows exactly that there.
def _steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"color": s["color"], "value": s["value"]} for s in steps]


def finish(
    dashboard: Dashboard, layout: Layout, links: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Encode, then write what grafanalib leaves in older shapes the way Grafana stores it."""
    data: dict[str, Any] = _drop_nulls(
        json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder))
    )
    for key in LEGACY_DASHBOARD_KEYS:
        data.pop(key, None)
    data.get("timepicker", {}).pop("time_options", None)
    for variable in data["templating"]["list"]:
        for key in LEGACY_VARIABLE_KEYS:
            variable.pop(key, None)
            variable.get("current", {}).pop(key, None)
    for i, panel in enumerate(data["panels"]):
        _finish_panel(panel, i, layout)
    data["links"] = links or []
    data["schemaVersion"] = SCHEMA_VERSION
    return data


def _finish_panel(panel: dict[str, Any], i: int, layout: Layout) -> None:
    panel["id"] = i + 1
    panel["datasource"] = DATASOURCE
    for key in LEGACY_PANEL_KEYS:
        panel.pop(key, None)
    for t in panel.get("targets", []):
        for key in LEGACY_TARGET_KEYS:
            t.pop(key, None)
        t["datasource"] = DATASOURCE
    config = panel.setdefault("fieldConfig", {})
    defaults = config.setdefault("defaults", {})
    config["overrides"] = []
    if i in layout.data_links:
        defaults["links"] = layout.data_links[i]
    options = panel.setdefault("options", {})
    kind = panel["type"]
    if kind == "state-timeline":
        defaults["unit"] = "none"
        defaults["mappings"] = layout.mappings[i]
        defaults["thresholds"] = {"mode": "absolute", "steps": _steps(LEVEL_STEPS)}
        defaults["color"] = {"mode": "thresholds"}
    if kind == "stat":
        defaults["thresholds"] = {"mode": "absolute", "steps": _steps(layout.stat_steps[i])}
        options["wideLayout"] = True
        options["showPercentChange"] = False
        options["percentChangeColorMode"] = "standard"
    if kind == "table":
        for key in LEGACY_TABLE_KEYS:
            panel.pop(key, None)
        options["cellHeight"] = "sm"
        options["frameIndex"] = 0
        options["showHeader"] = True
        options["footer"] = {"show": False, "reducer": ["sum"], "countRows": False}
        defaults.setdefault("custom", {})["inspect"] = False
    if "legend" in options:
        options["legend"]["showLegend"] = True
        options["legend"].setdefault("calcs", [])
    if "tooltip" in options:
        options["tooltip"].setdefault("sort", "none")
