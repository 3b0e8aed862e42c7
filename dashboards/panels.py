"""Panel helpers over grafanalib: every panel gets the datasource variable, a unit, a
description naming its metrics, a legend, and a grid position from a simple row layout.

grafanalib 0.7.1 leaves some fields in shapes current Grafana drops (legend settings, threshold
steps, string datasources); `finish()` writes them the way Grafana 10-12 stores them.
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

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
LEVEL_MAPPINGS = [
    {
        "type": "value",
        "options": {
            "0": {"text": "ok", "color": "green", "index": 0},
            "1": {"text": "caution", "color": "yellow", "index": 1},
            "2": {"text": "pressure", "color": "orange", "index": 2},
            "3": {"text": "critical", "color": "red", "index": 3},
        },
    }
]
LEVEL_STEPS = [
    {"color": "green", "value": None},
    {"color": "yellow", "value": 1},
    {"color": "orange", "value": 2},
    {"color": "red", "value": 3},
]


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> Target:
    return Target(
        expr=expr,
        legendFormat=legend,
        refId=ref,
        instant=instant,
        format="table" if instant else "time_series",
    )


@dataclass
class Layout:
    """Places panels left to right in rows of 24 columns."""

    x: int = 0
    y: int = 0
    row_height: int = 0
    panels: list[Any] = field(default_factory=list)
    stat_steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # by panel id

    def place(self, w: int, h: int) -> GridPos:
        if self.x + w > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        pos = GridPos(h=h, w=w, x=self.x, y=self.y)
        self.x += w
        self.row_height = max(self.row_height, h)
        return pos

    def timeseries(
        self,
        title: str,
        description: str,
        unit: str,
        targets: list[Target],
        w: int = 12,
        h: int = 8,
        stack: bool = False,
        **kw: Any,
    ) -> None:
        self.panels.append(
            TimeSeries(
                title=title,
                description=description,
                unit=unit,
                targets=targets,
                gridPos=self.place(w, h),
                dataSource=DATASOURCE,
                stacking={"mode": "normal", "group": "A"} if stack else {},
                legendDisplayMode="table",
                legendPlacement="bottom",
                legendCalcs=["lastNotNull", "max"],
                **kw,
            )
        )

    def stat(
        self,
        title: str,
        description: str,
        unit: str,
        targets: list[Target],
        w: int = 6,
        h: int = 4,
        steps: list[dict[str, Any]] | None = None,
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
        )
        self.panels.append(panel)
        self.stat_steps[len(self.panels)] = steps or [{"color": "green", "value": None}]

    def levels(
        self, title: str, description: str, targets: list[Target], w: int = 24, h: int = 7
    ) -> None:
        self.panels.append(
            StateTimeline(
                title=title,
                description=description,
                targets=targets,
                gridPos=self.place(w, h),
                dataSource=DATASOURCE,
                mappings=LEVEL_MAPPINGS,
            )
        )

    def table(
        self, title: str, description: str, targets: list[Target], w: int = 24, h: int = 7
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


def variables() -> Templating:
    def query(name: str, label: str, expr: str) -> Template:
        return Template(
            name=name,
            label=label,
            query=expr,
            dataSource=DATASOURCE,
            multi=True,
            includeAll=True,
            allValue=".*",
            default="$__all",
            refresh=2,
            sort=1,
        )

    return Templating(
        list=[
            Template(
                name="datasource",
                label="Data source",
                query="prometheus",
                type="datasource",
                default="Prometheus",
            ),
            query("job", "Job", "label_values(oomguard_exporter_build_info, job)"),
            query(
                "node", "Node", 'label_values(oomguard_exporter_build_info{job=~"$job"}, instance)'
            ),
            query(
                "model",
                "Model",
                'label_values(oomguard_vllm_requests_running{job=~"$job", instance=~"$node"}, '
                "model_name)",
            ),
            query(
                "engine",
                "Engine",
                'label_values(oomguard_vllm_requests_running{job=~"$job", instance=~"$node", '
                'model_name=~"$model"}, target)',
            ),
        ]
    )


def finish(dashboard: Dashboard, steps_of: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Encode, then fix what grafanalib leaves in shapes that Grafana drops or migrates."""
    data: dict[str, Any] = json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder))
    for i, panel in enumerate(data["panels"], start=1):
        panel["id"] = i
        panel["datasource"] = DATASOURCE
        for t in panel.get("targets", []):
            t["datasource"] = DATASOURCE
        defaults = panel.setdefault("fieldConfig", {}).setdefault("defaults", {})
        if panel["type"] == "state-timeline":
            defaults["unit"] = "none"
            defaults["thresholds"] = {"mode": "absolute", "steps": LEVEL_STEPS}
            defaults["min"], defaults["max"] = 0, 3
        if panel["type"] == "stat":
            defaults["thresholds"] = {"mode": "absolute", "steps": steps_of[i]}
        options = panel.setdefault("options", {})
        if "legend" in options:
            options["legend"]["showLegend"] = True
    data["schemaVersion"] = SCHEMA_VERSION
    return data
