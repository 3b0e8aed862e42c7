"""Incident timelines through the generated rules (promtool) into a real Alertmanager with the
shipped configuration, counted at the receivers: what on-call's pager, the ticket queue and the
remediator would get.

1. A `Timeline` holds the series every component exports during an incident, one value per step
   (None: the series is not exported then; the step after a value becomes a staleness marker, as
   Prometheus writes when a series leaves a scrape).
2. `firing()` runs `promtool test rules` on the generated rule file with one expression test per
   step, `ALERTS{alertstate="firing"}`, expecting nothing: promtool prints what fires at each step
   (the real rule engine: `for`, `keep_firing_for`, every group's order). promtool evaluates all
   groups every step.
3. `replay()` posts those alerts to a real Alertmanager as Prometheus would (each step: every
   firing alert, and an alert that stopped with `endsAt` now) with the shipped routes, receivers
   and inhibitions, every timing (group_wait, group_interval, repeat_interval) divided by a time
   compression factor and the timeline played at the same speed. Stretches of a timeline with
   nothing firing (and nothing left to flush) are skipped. Timelines run side by side in one
   Alertmanager, each under its own `cluster` label (every route groups and every inhibition
   matches by cluster).
4. `Sink` receives every webhook. A page is what a pager (PagerDuty, Opsgenie: the dedup key is
   Alertmanager's group key) would open: a firing notification of a group key that is not open;
   a notification of an open group only updates that incident; a resolved one closes it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from oomguard.alerts.generate import ALERTMANAGER, RULES
from oomguard.lab.processes import Process, free_port

ROOT = Path(__file__).resolve().parents[1]
STALE = "stale"
Value = float | None


def _fmt(v: float) -> str:
    return repr(float(v)) if v != int(v) else str(int(v))


@dataclass
class Timeline:
    """One incident: every series, one value per `step` seconds, for `minutes`."""

    name: str  # the cluster label of every series, so timelines share one Alertmanager
    step: int
    minutes: int
    series: dict[str, list[Value]] = field(default_factory=dict)
    note: str = ""

    @property
    def steps(self) -> int:
        return self.minutes * 60 // self.step

    def times(self) -> list[float]:
        return [i * self.step for i in range(self.steps)]

    def add(self, selector: str, values: Sequence[Value]) -> None:
        assert len(values) == self.steps, (selector, len(values), self.steps)
        assert selector not in self.series, selector
        self.series[selector] = list(values)

    def encoded(self, selector: str) -> str:
        """promtool's values string: `_` where absent, `stale` where a series just left."""
        out, previous = [], None
        for v in self.series[selector]:
            out.append(_fmt(v) if v is not None else (STALE if previous is not None else "_"))
            previous = v
        return " ".join(out)


# -- promtool ------------------------------------------------------------------------------------
Alert = frozenset[tuple[str, str]]
_DURATION = re.compile(r"([0-9.]+)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _seconds(text: str) -> float:
    return sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text)) if text != "0s" else 0.0


def _unit_test(timelines: Sequence[Timeline], rules: Path) -> dict[str, Any]:
    (step,) = {t.step for t in timelines}
    return {
        "rule_files": [str(rules)],
        "evaluation_interval": f"{step}s",
        "tests": [
            {
                "name": t.name,
                "interval": f"{t.step}s",
                "input_series": [{"series": s, "values": t.encoded(s)} for s in sorted(t.series)],
                "promql_expr_test": [
                    {
                        "expr": f'ALERTS{{alertstate="firing", cluster="{t.name}"}}',
                        "eval_time": f"{int(at)}s",
                        "exp_samples": [],
                    }
                    for at in t.times()
                ],
            }
            for t in timelines
        ],
    }


def firing(timelines: Sequence[Timeline], rules: Path | None = None) -> dict[str, list[set[Alert]]]:
    """What fires at every step of each timeline, as the generated rules decide."""
    rules = rules or ROOT / RULES
    out: dict[str, list[set[Alert]]] = {t.name: [set() for _ in range(t.steps)] for t in timelines}
    by_step: dict[int, list[Timeline]] = {}
    for t in timelines:
        by_step.setdefault(t.step, []).append(t)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for step, group in by_step.items():
            path = Path(tmp) / f"timelines-{step}s.yaml"
            path.write_text(yaml.safe_dump(_unit_test(group, rules)))
            runs.append(
                subprocess.Popen(
                    ["promtool", "test", "rules", path.name],
                    cwd=tmp,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for run in runs:
            stdout, stderr = run.communicate(timeout=600)
            for found in re.finditer(
                r"expr: \"ALERTS\{[^\n]*cluster=\\\"([^\\]+)\\\"\}\", time: (\S+),\n\s+exp: nil\n"
                r"\s+got: ([^\n]*)",
                stderr,
            ):
                name, at, got = found.groups()
                steps = {t.name: t.step for t in timelines}
                i = round(_seconds(at) / steps[name])
                for sample in re.findall(r"\{[^}]*\}", got):
                    labels = {
                        k: v
                        for k, v in _LABEL.findall(sample)
                        if k not in ("__name__", "alertstate")
                    }
                    out[name][i].add(frozenset(labels.items()))
            errors = [line for line in stderr.splitlines() if "err:" in line]
            assert not errors, "\n".join(errors[:20])
            assert run.returncode in (0, 1), stdout + stderr
    return out


# -- Alertmanager ----------------------------------------------------------------------------------
def _scaled(duration: str, compression: float) -> str:
    return f"{max(10, round(1000 * _seconds(duration) / compression))}ms"


def alertmanager_config(sink: str, compression: float) -> dict[str, Any]:
    """The shipped configuration, every webhook at the sink, every timing compressed."""
    config = yaml.safe_load((ROOT / ALERTMANAGER).read_text())

    def scale(route: dict[str, Any]) -> None:
        for key in ("group_wait", "group_interval", "repeat_interval"):
            if key in route:
                route[key] = _scaled(route[key], compression)
        for child in route.get("routes", []):
            scale(child)

    scale(config["route"])
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{sink}/{receiver['name']}"
            hook.pop("http_config", None)  # the sink takes no token
    return config


class AlertmanagerProcess(Process):
    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        super().__init__(
            [
                binary or "alertmanager",
                f"--config.file={path}",
                f"--storage.path={workdir / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            workdir / "alertmanager.log",
        )
        self.wait_http(f"{self.url}/-/ready", 60)


@dataclass
class Notification:
    at: float  # monotonic
    receiver: str
    body: dict[str, Any]

    @property
    def cluster(self) -> str:
        for alert in self.body.get("alerts", []):
            return str(alert.get("labels", {}).get("cluster", ""))
        return ""


class Sink:
    """Every webhook Alertmanager sends, by receiver (the URL path)."""

    def __init__(self) -> None:
        self.received: list[Notification] = []
        lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with lock:
                    sink.received.append(Notification(time.monotonic(), self.path.strip("/"), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class Outcome:
    """What one timeline's incident sent to each receiver."""

    pages: list[set[str]] = field(default_factory=list)  # alert names of each page opened
    tickets: list[set[str]] = field(default_factory=list)
    # an alert that is a page and a ticket at once (one SLO burn, fast and slow): opened while
    # the other is open
    paged_and_ticketed: set[str] = field(default_factory=set)
    webhooks: dict[str, int] = field(default_factory=dict)  # notifications per receiver
    remediator_alerts: set[str] = field(default_factory=set)
    # each remediator group (one alert): when it was notified (real seconds, monotonic)
    remediator_groups: dict[str, list[float]] = field(default_factory=dict)
    lag: float = 0.0  # how late the replay's latest post was, in timeline seconds


def outcome(notifications: Sequence[Notification], cluster: str) -> Outcome:
    out = Outcome()
    open_groups: dict[tuple[str, str], bool] = {}
    open_names: dict[tuple[str, str], set[str]] = {}
    for n in sorted(notifications, key=lambda n: n.at):
        if n.cluster != cluster:
            continue
        out.webhooks[n.receiver] = out.webhooks.get(n.receiver, 0) + 1
        names = {a["labels"]["alertname"] for a in n.body["alerts"] if a.get("status") == "firing"}
        if n.receiver == "remediator":
            out.remediator_alerts |= names
            out.remediator_groups.setdefault(n.body["groupKey"], []).append(n.at)
        key = (n.receiver, n.body["groupKey"])
        firing = n.body["status"] == "firing"
        if firing and not open_groups.get(key):
            if n.receiver == "oncall-pager":
                out.pages.append(names)
            elif n.receiver == "oncall-ticket":
                out.tickets.append(names)
        open_groups[key] = firing
        open_names[key] = names if firing else set()
        paged = {x for (r, _), v in open_names.items() if r == "oncall-pager" for x in v}
        ticketed = {x for (r, _), v in open_names.items() if r == "oncall-ticket" for x in v}
        out.paged_and_ticketed |= paged & ticketed
    return out


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def replay(
    am_url: str,
    timeline: Timeline,
    steps: list[set[Alert]],
    compression: float,
    tail_seconds: float,
) -> float:
    """Post one timeline's alerts as Prometheus would, at `compression` times real speed.
    Returns how late the latest post was, in timeline seconds (a loaded machine's lag)."""
    tick = timeline.step / compression
    tail = max(1, round(tail_seconds / timeline.step))
    started: dict[Alert, datetime] = {}
    nxt = time.monotonic()
    lag = 0.0
    with httpx.Client(timeout=10) as client:
        for i, now_firing in enumerate(steps):
            live = any(steps[j] for j in range(max(0, i - tail), i + 1))
            if not live:
                nxt = time.monotonic()  # nothing firing, nothing to flush: no time passes
                continue
            time.sleep(max(0.0, nxt - time.monotonic()))
            lag = max(lag, (time.monotonic() - nxt) * compression)
            nxt += tick
            now = datetime.now(UTC)
            body = []
            for alert in now_firing:
                first = started.setdefault(alert, now)
                body.append(
                    {
                        "labels": dict(alert),
                        "startsAt": _iso(first),
                        "endsAt": _iso(now + timedelta(seconds=20 * tick)),
                    }
                )
            for alert in [a for a in started if a not in now_firing]:
                body.append(
                    {
                        "labels": dict(alert),
                        "startsAt": _iso(started.pop(alert)),
                        "endsAt": _iso(now),
                    }
                )
            if body:
                client.post(f"{am_url}/api/v2/alerts", json=body).raise_for_status()
    return lag
