"""The demo's report: one self-contained HTML page, a Markdown summary, JSON numbers and PNGs.

Sections, in the order a newcomer asks the questions:
1. the same incident side by side (vLLM alone vs vLLM + oomguard): CUDA OOMs, engine deaths,
   requests lost, time to serve normally again, goodput over the same horizon;
2. do no harm: a healthy 24 GB GPU at gpu_memory_utilization 0.92 under heavy load, no alert and
   no action;
3. what on-call would see: the three Grafana dashboards drawn from the demo's Prometheus with the
   dashboards' own queries, the alerts that fired with their runbooks, the remediator's audit.

`report.html` inlines every image as a data: URI and links only to anchors inside itself, so it
can be mailed or attached to a ticket as one file.
"""

from __future__ import annotations

import base64
import contextlib
import html
import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from oomguard import vllm_seam
from oomguard.actions import BY_NAME
from oomguard.lab import charts
from oomguard.paths import runbooks_dir
from oomguard.twin.gpu import GIB

if TYPE_CHECKING:
    from oomguard.lab.processes import Inbox, Prometheus
    from oomguard.lab.runner import Fleet

RUNBOOKS = runbooks_dir()
RUN_LABELS = {"alone": "vLLM alone", "oomguard": "vLLM + oomguard"}
INTAKE = frozenset({"received", "resynced"})  # audit records of input, not of decisions


class DemoRun(Protocol):
    """What the report reads of the demo's run (lab/demo.py's `Demo`): its clock, its working
    folder (the remediator's audit log) and the healthy GPU's rows."""

    t0_wall: float
    t_end: float
    workdir: Path
    healthy_rows: list[dict[str, Any]]


# -- the remediator's audit log, read and told ---------------------------------------------------


def read_audit(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                out.append(entry)
    return out


def describe(entry: dict[str, Any]) -> str:
    """One audit entry as a sentence."""
    after = entry.get("after")
    after = after if isinstance(after, dict) else {}
    target = entry.get("target", "?")
    spec = BY_NAME.get(str(entry.get("action", "")))
    if spec is not None and spec.told:
        what = spec.told.format(target=target, cap=after.get("cap"))
    else:
        what = f"{entry.get('event')} {entry.get('action', '')} {target}"
    event = entry.get("event")
    if event == "decided":
        return f"decided for {target}: {entry.get('reason', '')}"
    if event != "acted":
        what = f"{event} {entry.get('action', '')} on {target}: {entry.get('result')}"
    return f"{what} ({entry.get('reason', '')})"


def _seconds(at: Any, t0: float) -> str:
    """An audit timestamp as seconds since `t0` (the log is input: a bad value shows as '?')."""
    try:
        return f"{float(at) - t0:.1f}"
    except (TypeError, ValueError):
        return "?"


# -- numbers -------------------------------------------------------------------------------------
def run_series(fleet: Fleet) -> dict[str, Any]:
    """A fleet's replay as plain series for the charts (trace seconds)."""
    history = [views for views in fleet.history if views[0].t > 0 or fleet.t0 == 0]
    t = [views[0].t for views in history]
    served = [s for s in fleet.sent if s.status == "ok" and s.done_s is not None]
    lost_at = sorted(s.done_s for s in fleet.sent if s.status == "lost" and s.done_s is not None)
    slo = fleet.trace.ttft_slo_s
    horizon = fleet.trace.duration_s
    buckets = [0.0] * (int(horizon // 60) + 1)
    for s in served:
        good = s.first_token_s is not None and s.first_token_s - s.request.at_s <= slo
        if good and s.done_s is not None and s.done_s < horizon:
            buckets[int(s.done_s // 60)] += s.tokens / 60
    edges = [i for i in range(len(buckets))]
    return {
        "t": t,
        "free_gib": [views[0].gpu_free / GIB for views in history],
        "neighbour_gib": [views[0].neighbour / GIB for views in history],
        "mode0": [views[0].mode for views in history],
        "crashes": list(fleet.crash_times),
        "lost_at": lost_at,
        "goodput_per_min": (edges, buckets),
        "pressure_ends_s": fleet.trace.pressure_ends_s,
    }


def downtime(fleet: Fleet) -> dict[str, float]:
    """Trace seconds engine 0 spent in each mode during the replay (down = dead or reloading)."""
    out: dict[str, float] = {}
    hist = [views[0] for views in fleet.history if views[0].t > 0]
    for a, b in itertools.pairwise(hist):
        out[a.mode] = out.get(a.mode, 0.0) + (b.t - a.t)
    return {k: round(v, 1) for k, v in out.items()}


def side_numbers(fleet: Fleet) -> dict[str, Any]:
    o = fleet.outcome()
    modes = downtime(fleet)
    lost = [
        {"at_s": x.request.at_s, "ended_s": x.done_s, "engine": x.engine, "why": x.why}
        for x in fleet.sent
        if x.status != "ok"
    ]
    return {
        **asdict(o),
        "lost_requests": lost[:50],
        "engine_deaths": len(fleet.crash_times),
        "down_s": modes.get("down", 0.0),
        "draining_s": modes.get("draining", 0.0),
        "capped_s": modes.get("capped", 0.0),
        "horizon_s": fleet.trace.duration_s,
        # how long after the pressure ended the demo kept watching for recovery
        "watched_s": round(fleet.ended_s - (fleet.trace.pressure_ends_s or 0), 1),
        "ttft_slo_s": fleet.trace.ttft_slo_s,
    }


# -- what Prometheus and Alertmanager recorded -----------------------------------------------------
def alerts_fired(
    prom: Prometheus | None, inbox: Inbox | None, start: float, end: float
) -> list[dict[str, Any]]:
    """Every alert that fired (Watchdog aside): where, when, who was told, and its runbook."""
    if prom is None:
        return []
    rows = prom.query_range('ALERTS{alertstate="firing", alertname!="Watchdog"}', start, end, 1.0)
    annotations: dict[str, dict[str, str]] = {}
    for rule in prom.rules():
        if rule.get("type") == "alerting":
            annotations[rule["name"]] = rule.get("annotations", {})
            annotations[rule["name"]]["severity"] = rule.get("labels", {}).get("severity", "")
    told: dict[tuple[str, str], set[str]] = {}
    rendered: dict[tuple[str, str], dict[str, str]] = {}
    for hook in inbox.received if inbox else []:
        for a in hook.get("payload", {}).get("alerts", []):
            labels = a.get("labels", {})
            key = (labels.get("alertname", ""), labels.get("target") or labels.get("instance", ""))
            told.setdefault(key, set()).add(hook.get("receiver", ""))
            rendered[key] = a.get("annotations", {})
    out = []
    for r in rows:
        m = r["metric"]
        name = m.get("alertname", "")
        where = m.get("target") or m.get("instance", "")
        times = [float(t) for t, _ in r.get("values", [])]
        notes = {**annotations.get(name, {}), **rendered.get((name, where), {})}
        out.append(
            {
                "alert": name,
                "severity": m.get("severity") or notes.get("severity", ""),
                "instance": m.get("instance", ""),
                "target": m.get("target", ""),
                "action": m.get("oomguard_action", ""),
                "from_s": round(min(times) - start, 1) if times else None,
                "to_s": round(max(times) - start, 1) if times else None,
                "summary": notes.get("summary", ""),
                "runbook_url": notes.get("runbook_url", ""),
                "notified": sorted(
                    told.get((name, where), set())
                    # the shipped routes send every alert with an action to the remediator
                    | ({"remediator"} if m.get("oomguard_action") else set())
                ),
                "model_name": m.get("model_name", ""),
            }
        )
    return sorted(out, key=lambda a: (a["from_s"] or 0, a["alert"]))


def runbook_text(url: str) -> str | None:
    """The runbook a runbook_url names, from the repository's runbooks/ (None if not at hand)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    path = RUNBOOKS / name
    if not name.endswith(".md") or not path.is_file():
        return None
    return path.read_text()


# -- the page ------------------------------------------------------------------------------------
def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _count(items: list[Any]) -> str:
    """A count that should be zero: green when it is, red when not."""
    return f'<span class="{"bad" if items else "good"}">{len(items)}</span>'


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "not yet"
    return f"{seconds:.0f} s ({seconds / 60:.1f} min)"


STYLE = """
body{font-family:system-ui,sans-serif;max-width:1180px;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#f4f4f4}img{max-width:100%;border:1px solid #eee}
.bad{color:#c4162a;font-weight:bold}.good{color:#37872d;font-weight:bold}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto;font-size:.8em;max-height:28em}
nav a{margin-right:1em}code{font-size:.9em}
"""


def write_report(
    demo: DemoRun, fleets: dict[str, Fleet], prom: Prometheus | None, inbox: Inbox | None, out: Path
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    start, end = demo.t0_wall, demo.t_end or time.time()
    alone, guarded, healthy = fleets["alone"], fleets["oomguard"], fleets["healthy"]
    audit_path = demo.workdir / "remediator-audit.jsonl"
    audit = read_audit(audit_path)
    if audit_path.exists():
        (out / "remediator-audit.jsonl").write_text(audit_path.read_text())
    (out / "webhooks.json").write_text(json.dumps(inbox.received if inbox else [], indent=2))

    sides = {"alone": side_numbers(alone), "oomguard": side_numbers(guarded)}
    fired = alerts_fired(prom, inbox, start, end)
    healthy_target, healthy_node = healthy.names[0], healthy.hostname
    healthy_model = healthy.served_name or ""
    healthy_alerts = [
        a
        for a in fired
        if a["target"] == healthy_target
        or a["instance"] == healthy_node
        or (healthy_model and a["model_name"] == healthy_model)
    ]
    healthy_actions = [
        e for e in audit if e.get("target") == healthy_target and e.get("event") != "received"
    ]
    h = healthy.outcome()
    levels = [r["level"] for r in demo.healthy_rows]
    summary: dict[str, Any] = {
        "incident": {"trace": alone.trace.name, "description": alone.trace.description},
        "side_by_side": sides,
        "do_no_harm": {
            "trace": healthy.trace.name,
            "description": healthy.trace.description,
            "gpu": healthy.trace.gpu,
            "gpu_memory_utilization": healthy.trace.engine.gpu_memory_utilization,
            "requests": h.requests,
            "completed": h.completed,
            "lost": h.lost,
            "crashes": h.crashes,
            "goodput_tokens_per_s": h.goodput_tokens_per_s,
            "max_pressure_level": max(levels, default=0),
            "kv_usage_max": max((r["kv"] for r in demo.healthy_rows), default=0.0),
            "waiting_max": max((r["waiting"] for r in demo.healthy_rows), default=0),
            "alerts": healthy_alerts,
            "actions": healthy_actions,
            "prometheus": prom is not None,
        },
        "alerts": fired,
        "audit_entries": len(audit),
        "wall_s": round(end - start, 1),
    }

    # pictures
    charts.side_by_side(
        {"alone": run_series(alone), "oomguard": run_series(guarded)}, out / "side-by-side.png"
    )
    charts.do_no_harm(
        demo.healthy_rows,
        len(healthy_actions),
        f"Do no harm: Llama-3-8B on a {healthy.trace.gpu} at gpu_memory_utilization "
        f"{healthy.trace.engine.gpu_memory_utilization}, heavy steady load",
        out / "do-no-harm.png",
    )
    panels: dict[str, list[dict[str, Any]]] = {}
    if prom is not None:
        from oomguard.lab.report_dashboards import draw, load_dashboards

        for name, board in load_dashboards().items():
            panels[name] = draw(board, prom.query_range, start, end, out / f"dashboard-{name}.png")
    summary["dashboards"] = panels
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(markdown(summary, demo, audit))
    (out / "report.html").write_text(page(summary, demo, audit, out))
    return summary


def _lost(side: dict[str, Any]) -> str:
    why = "; ".join(f"{n} {reason}" for reason, n in sorted(side.get("lost_why", {}).items()))
    return f"{side['lost']} of {side['requests']}" + (f" ({why})" if why else "")


def _recovery(side: dict[str, Any]) -> str:
    if side["recovery_s"] is not None:
        return _minutes(side["recovery_s"])
    return f"not back {_minutes(side['watched_s'])} later, when the demo stopped watching"


def _verdict(sides: dict[str, Any]) -> list[list[str]]:
    a, g = sides["alone"], sides["oomguard"]

    def cell(value: Any, bad: bool) -> str:
        return f'<span class="{"bad" if bad else "good"}">{_e(value)}</span>'

    return [
        ["CUDA out-of-memory errors", cell(a["crashes"], a["crashes"] > 0),
         cell(g["crashes"], g["crashes"] > 0)],
        ["engine deaths (model reloads)", cell(a["engine_deaths"], a["engine_deaths"] > 0),
         cell(g["engine_deaths"], g["engine_deaths"] > 0)],
        ["requests lost", cell(_lost(a), a["lost"] > 0), cell(_lost(g), g["lost"] > 0)],
        ["engine 0 dead or reloading", _e(_minutes(a["down_s"])), _e(_minutes(g["down_s"]))],
        ["engine 0 draining (its peer serves)", _e(_minutes(a["draining_s"])),
         _e(_minutes(g["draining_s"]))],
        ["engine 0 at a lowered cap", _e(_minutes(a["capped_s"])), _e(_minutes(g["capped_s"]))],
        ["time to serve normally again (after the neighbour left; reload included)",
         _e(_recovery(a)), _e(_recovery(g))],
        [f"goodput over the same {a['horizon_s']:.0f} s (output tokens/s, TTFT within "
         f"{a['ttft_slo_s']:.0f} s)", _e(a["goodput_tokens_per_s"]),
         _e(g["goodput_tokens_per_s"])],
        ["p99 time to first token (s)", _e(a["ttft_p99_s"]), _e(g["ttft_p99_s"])],
        ["remediator actions", "none (no oomguard)", _e(len(g["actions"]))],
    ]  # fmt: skip


def page(summary: dict[str, Any], demo: DemoRun, audit: list[dict[str, Any]], out: Path) -> str:
    sides, dnh = summary["side_by_side"], summary["do_no_harm"]
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<title>oomguard demo report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>oomguard demo: the same incident with and without oomguard</h1>",
        "<nav><a href='#side-by-side'>Side by side</a><a href='#do-no-harm'>Do no harm</a>"
        "<a href='#on-call'>What on-call saw</a><a href='#alerts'>Alerts</a>"
        "<a href='#audit'>Remediator audit</a></nav>",
        f"<p>{_e(summary['incident']['description'])} The incident "
        f"(<code>{_e(summary['incident']['trace'])}</code>) was replayed twice at once with the "
        f"same seed, the same requests and the same GPU events, on real vLLM {vllm_seam.MINOR} "
        "servers whose "
        "model-free executor runs the GPU twin's memory and step-time physics. Times are trace "
        f"seconds. Wall time of the replay: {summary['wall_s']:.0f} s.</p>",
        "<h2 id='side-by-side'>1. Side by side</h2>",
        _table(["", "vLLM alone", "vLLM + oomguard"], _verdict(sides)),
        _img(out / "side-by-side.png", "side by side: GPU memory, engine state, losses, goodput"),
        "<h2 id='do-no-harm'>2. Do no harm</h2>",
        f"<p>{_e(dnh['description'])} One engine on a twin {_e(dnh['gpu'])} (24 GB) at "
        f"vLLM's default <code>gpu_memory_utilization</code> {_e(dnh['gpu_memory_utilization'])}"
        " under heavy steady load, watched by the same exporter, Prometheus, Alertmanager and "
        "remediator.</p>",
        _table(
            [
                "alerts fired",
                "remediator actions",
                "highest pressure level",
                "KV cache peak",
                "most requests waiting",
                "requests served / lost",
                "CUDA OOMs",
            ],
            [
                [
                    _count(dnh["alerts"]),
                    _count(dnh["actions"]),
                    _e(dnh["max_pressure_level"]),
                    f"{100 * dnh['kv_usage_max']:.0f} %",
                    _e(dnh["waiting_max"]),
                    f"{dnh['completed']} / {dnh['lost']}",
                    _e(dnh["crashes"]),
                ]
            ],
        ),
        _img(out / "do-no-harm.png", "do no harm: free memory, pressure level, KV usage"),
    ]
    if not dnh["prometheus"]:
        parts.append("<p>(No Prometheus in this run: alerts could not fire or be counted.)</p>")
    parts.append("<h2 id='on-call'>3. What on-call would see</h2>")
    if summary["dashboards"]:
        parts.append(
            "<p>The three generated Grafana dashboards (<code>dashboards/generated/*.json</code>)"
            ", drawn from what the demo's Prometheus recorded, with each panel's own PromQL "
            '(Grafana\'s variables at "All"; <code>$__rate_interval</code> as Grafana computes '
            "it for 1 s scrapes).</p>"
        )
        for name, record in summary["dashboards"].items():
            parts.append(f"<h3 id='dashboard-{name}'>Dashboard: {_e(name)}</h3>")
            parts.append(_img(out / f"dashboard-{name}.png", f"{name} dashboard"))
            rows = [
                [_e(p["title"]), _e(p["type"]), _e(p["series"]),
                 "<br>".join(f"<code>{_e(q)}</code>" for q in p["queries"])]
                for p in record
            ]  # fmt: skip
            parts.append(
                "<details><summary>panels and the queries sent</summary>"
                + _table(["panel", "type", "series", "PromQL"], rows)
                + "</details>"
            )
    else:
        parts.append("<p>No Prometheus in this run: no dashboards to draw.</p>")
    parts.append("<h3 id='alerts'>Alerts that fired</h3>")
    runbooks: dict[str, str] = {}
    rows = []
    for a in summary["alerts"]:
        book = runbook_text(a["runbook_url"]) if a["runbook_url"] else None
        name = a["runbook_url"].rstrip("/").rsplit("/", 1)[-1].removesuffix(".md")
        if book is not None:
            runbooks[name] = book
            link = f"<a href='#runbook-{_e(name)}'>runbook</a> <code>{_e(a['runbook_url'])}</code>"
        else:
            link = f"<code>{_e(a['runbook_url'] or '-')}</code>"
        rows.append(
            [_e(a["alert"]), _e(a["severity"]), _e(a["target"] or a["instance"]),
             f"{_e(a['from_s'])} to {_e(a['to_s'])} s", _e(", ".join(a["notified"]) or "-"),
             _e(a["summary"]), link]
        )  # fmt: skip
    if rows:
        parts.append(
            "<p>Wall seconds from the start of the replay. Receivers: Alertmanager's shipped "
            "routes (the remediator gets alerts that carry an action; critical pages, warnings "
            "open tickets).</p>"
        )
        parts.append(
            _table(["alert", "severity", "where", "firing", "sent to", "summary", "runbook"], rows)
        )
    else:
        parts.append("<p>No alert fired.</p>")
    parts.append("<h3 id='audit'>The remediator's audit, in order</h3>")
    # decisions and what came of them; the intake (webhooks, resyncs) is counted, not listed
    intake = [e for e in audit if e.get("event") in INTAKE]
    arows = [
        [_e(_seconds(e.get("time"), demo.t0_wall)), _e(e.get("event")), _e(e.get("target")),
         _e(e.get("action")), _e(describe(e))]
        for e in audit
        if e.get("event") not in INTAKE
    ]  # fmt: skip
    parts.append(
        f"<p>Wall seconds from the start of the replay. Besides these, the log holds "
        f"{len(intake)} intake records (Alertmanager webhooks received, resyncs of the firing "
        "alerts) in <code>remediator-audit.jsonl</code>.</p>"
    )
    parts.append(
        _table(["s", "event", "target", "action", "what and why"], arows)
        if arows
        else "<p>The remediator decided nothing.</p>"
    )
    if runbooks:
        parts.append("<h2 id='runbooks'>Runbooks of the alerts that fired</h2>")
        for name, text in sorted(runbooks.items()):
            parts.append(f"<h3 id='runbook-{_e(name)}'>{_e(name)}</h3><pre>{_e(text)}</pre>")
    parts.append(
        "<h2 id='files'>Files</h2><p>Beside this page: <code>summary.md</code>, "
        "<code>summary.json</code> (every number above), the PNGs, "
        "<code>remediator-audit.jsonl</code>, <code>webhooks.json</code> (what on-call "
        "receivers got).</p></body></html>"
    )
    return "\n".join(parts)


def markdown(summary: dict[str, Any], demo: DemoRun, audit: list[dict[str, Any]]) -> str:
    a, g = summary["side_by_side"]["alone"], summary["side_by_side"]["oomguard"]
    d = summary["do_no_harm"]
    lines = [
        "# oomguard demo report",
        "",
        f"Incident `{summary['incident']['trace']}`: {summary['incident']['description']}",
        "Replayed twice at once, same seed, same requests, same GPU events. Open `report.html`"
        " for the whole page.",
        "",
        "| | vLLM alone | vLLM + oomguard |",
        "|---|---|---|",
        f"| CUDA OOMs | {a['crashes']} | {g['crashes']} |",
        f"| engine deaths | {a['engine_deaths']} | {g['engine_deaths']} |",
        f"| requests lost | {_lost(a)} | {_lost(g)} |",
        f"| engine 0 dead or reloading (s) | {a['down_s']} | {g['down_s']} |",
        f"| time to serve normally again | {_recovery(a)} | {_recovery(g)} |",
        f"| goodput over {a['horizon_s']:.0f} s (tokens/s) | {a['goodput_tokens_per_s']} | "
        f"{g['goodput_tokens_per_s']} |",
        f"| remediator actions | - | {len(g['actions'])} |",
        "",
        "![side by side](side-by-side.png)",
        "",
        f"## Do no harm ({d['gpu']}, gpu_memory_utilization {d['gpu_memory_utilization']})",
        "",
        f"- alerts fired: {len(d['alerts'])}; remediator actions: {len(d['actions'])}",
        f"- highest pressure level: {d['max_pressure_level']}; KV cache peak "
        f"{100 * d['kv_usage_max']:.0f} %; most requests waiting: {d['waiting_max']}",
        f"- requests served {d['completed']}, lost {d['lost']}, CUDA OOMs {d['crashes']}",
        "",
        "![do no harm](do-no-harm.png)",
        "",
        "## What on-call would see",
        "",
        *(f"![{name} dashboard](dashboard-{name}.png)" for name in summary["dashboards"]),
        "",
        "Alerts that fired:",
        "",
        *(
            f"- {x['alert']} ({x['severity']}) on {x['target'] or x['instance']}, "
            f"{x['from_s']}-{x['to_s']} s, sent to {', '.join(x['notified']) or '-'}; runbook "
            f"{x['runbook_url']}"
            for x in summary["alerts"]
        ),
        "",
        "Remediator actions, in order:",
        "",
        *(
            f"- {_seconds(e.get('time'), demo.t0_wall)} s {describe(e)}"
            for e in audit
            if e.get("event") in ("acted", "failed", "withheld")
        ),
        "",
    ]
    return "\n".join(lines)
