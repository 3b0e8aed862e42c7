"""Draw the generated Grafana dashboards with matplotlib from what a real Prometheus recorded.

Each panel's queries are read from the dashboard JSON (`dashboards/generated/*.json`, or built
from `oomguard.dashboards` where the repository's files are not at hand), with Grafana's
variables filled in as Grafana would for "All" and the demo's time range, and sent to the
Prometheus that scraped the demo. Panels are placed by their `gridPos`, so a picture reads like
the dashboard on screen. Only what the report needs is drawn: time series (lines, units from
`fieldConfig`), stats (last value), state timelines (coloured levels) and tables (one line per
series). No panel query is written here: change the dashboard and the picture follows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.lab.processes import package_dir

GENERATED = package_dir("oomguard.dashboards") / "generated"
NAMES = ("fleet", "node", "remediation")
STATE_COLOURS = ["#73bf69", "#fade2a", "#ff9830", "#f2495c"]  # Grafana's green ... red
# Grafana's named colours, for the value mappings dashboards carry
NAMED_COLOURS = {
    "green": "#73bf69",
    "yellow": "#fade2a",
    "orange": "#ff9830",
    "red": "#f2495c",
    "blue": "#5794f2",
    "purple": "#b877d9",
    "transparent": "#ffffff",
}
QueryRange = Callable[[str, float, float, float], list[dict[str, Any]]]


def load_dashboards() -> dict[str, dict[str, Any]]:
    """The three dashboards as Grafana would import them."""
    out: dict[str, dict[str, Any]] = {}
    for name in NAMES:
        path = GENERATED / f"oomguard-{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    if len(out) < len(NAMES):  # an installed package has no repository files: build them
        from oomguard.dashboards.definitions import DASHBOARDS

        for name in NAMES:
            if name not in out and name in DASHBOARDS:
                out[name] = json.loads(json.dumps(DASHBOARDS[name]()))
    return out


def rate_interval(step: float, scrape: float) -> float:
    """Grafana's $__rate_interval: max(4 x scrape interval, step + scrape interval)."""
    return max(4 * scrape, step + scrape)


def fill(expr: str, step: float, scrape: float) -> str:
    """Grafana's variables as it fills them for "All" and this range."""
    expr = expr.replace("$__rate_interval", f"{math.ceil(rate_interval(step, scrape))}s")
    expr = expr.replace("$__interval", f"{math.ceil(step)}s")
    expr = expr.replace("$__range", f"{math.ceil(step)}s")
    # template variables (job, node, model, engine) at "All"
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", expr)


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{labels.get('__name__', '')}{{{inner}}}"
    return re.sub(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


@dataclass
class Series:
    name: str
    t: list[float]
    v: list[float]


def _unit(panel: dict[str, Any]) -> str:
    return str(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "") or "")


def value_mappings(panel: dict[str, Any]) -> dict[int, tuple[str, str]]:
    """The panel's value mappings as {value: (colour, text)} (state timelines colour by them)."""
    out: dict[int, tuple[str, str]] = {}
    for mapping in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []) or []:
        if not isinstance(mapping, dict) or mapping.get("type") != "value":
            continue
        for key, option in (mapping.get("options") or {}).items():
            try:
                value = int(float(key))
            except ValueError:
                continue
            colour = str(option.get("color", ""))
            out[value] = (
                NAMED_COLOURS.get(colour, colour or "#cccccc"),
                str(option.get("text", key)),
            )
    return out


def _scale(unit: str) -> tuple[float, str]:
    if unit in ("bytes", "decbytes"):
        return 1 / 2**30, "GiB"
    if unit == "percentunit":
        return 100.0, "%"
    return 1.0, {"s": "seconds", "reqps": "req/s", "ops": "ops/s"}.get(unit, unit)


def panel_series(
    panel: dict[str, Any], query: QueryRange, start: float, end: float, step: float, scrape: float
) -> tuple[list[Series], list[str]]:
    """Every series of a panel's queries, and the PromQL sent (for the report)."""
    out: list[Series] = []
    sent: list[str] = []
    for target in panel.get("targets", []):
        expr = target.get("expr")
        if not expr or target.get("hide"):
            continue
        promql = fill(expr, step, scrape)
        sent.append(promql)
        try:
            result = query(promql, start, end, step)
        except Exception as exc:  # one failing panel must not lose the report
            out.append(Series(f"query failed: {exc}", [], []))
            continue
        for r in result:
            points = [(float(t), float(v)) for t, v in r.get("values", [])]
            points = [(t, v) for t, v in points if math.isfinite(v)]
            out.append(
                Series(
                    legend(target.get("legendFormat", ""), r.get("metric", {})),
                    [t - start for t, _ in points],
                    [v for _, v in points],
                )
            )
    return out, sent


def _draw_panel(ax: Any, panel: dict[str, Any], series: list[Series], span: float) -> None:
    kind = panel.get("type", "")
    ax.set_title(panel.get("title", ""), fontsize=8, loc="left")
    ax.tick_params(labelsize=6)
    factor, unit = _scale(_unit(panel))
    if kind == "stat":
        ax.set_axis_off()
        values = [s.v[-1] for s in series if s.v]
        text = "no data" if not values else _fmt(sum(values) * factor, unit)
        ax.text(0.5, 0.4, text, ha="center", va="center", fontsize=18, transform=ax.transAxes)
        return
    if kind == "table":
        ax.set_axis_off()
        names = sorted({s.name for s in series if s.v})
        body = "\n".join(names[:8]) or "no rows"
        if len(names) > 8:
            body += f"\n... {len(names) - 8} more"
        ax.text(0.01, 0.95, body, va="top", fontsize=6, family="monospace", transform=ax.transAxes)
        return
    ax.set_xlim(0, span)
    ax.grid(alpha=0.3)
    if kind == "state-timeline":
        rows = [s for s in series if s.v]
        mapped = value_mappings(panel)
        seen: set[int] = set()
        for y, s in enumerate(rows):
            # one span per run of equal values, one broken_barh call per colour (fast)
            spans: dict[str, list[tuple[float, float]]] = {}
            start = 0
            for i in range(1, len(s.v) + 1):
                if i < len(s.v) and int(s.v[i]) == int(s.v[start]):
                    continue
                value = int(s.v[start])
                end = s.t[i] if i < len(s.t) else s.t[-1] + 1.0
                colour = mapped.get(value, (STATE_COLOURS[max(0, min(3, value))], ""))[0]
                spans.setdefault(colour, []).append((s.t[start], end - s.t[start]))
                seen.add(value)
                start = i
            for colour, bars in spans.items():
                ax.broken_barh(bars, (y - 0.4, 0.8), color=colour, linewidth=0)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_yticks(range(len(rows)), [s.name[:40] for s in rows], fontsize=6)
        if not rows:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes, fontsize=8)
        elif mapped:
            import matplotlib.patches as mpatches

            keys = sorted(v for v in mapped if v in seen)
            ax.legend(
                [mpatches.Patch(color=mapped[v][0]) for v in keys],
                [mapped[v][1] for v in keys],
                fontsize=6,
                loc="upper right",
                ncol=len(keys) or 1,
            )
        return
    drawn = 0
    for s in series:
        if s.v:
            ax.plot(s.t, [v * factor for v in s.v], linewidth=0.9, label=s.name[:48])
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes, fontsize=8)
    else:
        ax.legend(fontsize=5, loc="upper left", ncol=1 if drawn < 5 else 2)
    if unit:
        ax.set_ylabel(unit, fontsize=6)


def _fmt(value: float, unit: str) -> str:
    if unit == "GiB":
        return f"{value:.1f} GiB"
    if abs(value - round(value)) < 1e-9:
        return f"{round(value)}"
    return f"{value:.3g}"


def draw(
    dashboard: dict[str, Any],
    query: QueryRange,
    start: float,
    end: float,
    out: Path,
    scrape: float = 1.0,
) -> list[dict[str, Any]]:
    """One PNG of the dashboard; returns each panel's title, type and the PromQL it sent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard.get("panels", []) if p.get("type") != "row" and "gridPos" in p]
    rows = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels), default=1)
    span = max(1.0, end - start)
    step = max(1.0, math.ceil(span / 300))
    fig = plt.figure(figsize=(16, 0.33 * rows + 0.6))
    fig.suptitle(f"{dashboard.get('title', '')} (drawn from the demo's Prometheus)", fontsize=11)
    top = 1 - 0.5 / (0.33 * rows + 0.6)
    record: list[dict[str, Any]] = []
    for p in panels:
        g = p["gridPos"]
        left, width = g["x"] / 24, g["w"] / 24
        bottom = top * (1 - (g["y"] + g["h"]) / rows)
        height = top * g["h"] / rows
        ax = fig.add_axes(
            (left + 0.035 * width, bottom + 0.25 * height / g["h"], width * 0.93, height * 0.72)
        )
        series, sent = panel_series(p, query, start, end, step, scrape)
        _draw_panel(ax, p, series, span)
        record.append(
            {
                "title": p.get("title", ""),
                "type": p.get("type", ""),
                "queries": sent,
                "series": sum(1 for s in series if s.v),
            }
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return record
