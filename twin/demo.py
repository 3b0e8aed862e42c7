"""`oomguard demo`: a GPU memory incident replayed on the real stack, on a machine without a GPU.

What runs, all on 127.0.0.1:
- two real vLLM 0.33 servers (model-free executor) with the oomguard plugin, under steady load;
- two simulated H100s (twin/gpu.py) that the exporter reads through its normal NVML code path;
- the oomguard exporter; the real Prometheus with the generated rules and the real Alertmanager
  with the shipped routes (when installed); the on-call receivers' webhooks land in a local inbox;
- the oomguard remediator: fed by Alertmanager, or, without Prometheus and Alertmanager, in
  standalone mode watching the exporter's pressure levels.

The incident: a neighbour process starts on GPU 0 and grows until free memory falls below the
critical floor, then goes away. The remediator lowers llama-a's cap under pressure, drains it when
memory turns critical (llama-b keeps serving), and re-admits it in stages once the neighbour is
gone. Alert timings are compressed (`DEMO_THRESHOLDS`) so the incident fits in about a minute. The
terminal shows pressure, KV usage, caps, alerts and actions each second; the report folder gets a
Markdown summary, the timeline and the remediator's audit log.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from oomguard.alerts.generate import RULES
from oomguard.alerts.generate import outputs as alert_outputs
from oomguard.exporter.main import Exporter
from oomguard.exporter.render import Family
from oomguard.twin.charts import render
from oomguard.twin.gpu import GIB, TwinGpu, TwinNvml
from oomguard.twin.processes import (
    Alertmanager,
    Process,
    Prometheus,
    RemediatorProcess,
    VllmProcess,
    free_port,
    have_prometheus_stack,
    start_all,
    twin_exporter,
)

from oomguard.thresholds import AlertThresholds, PressureThresholds

NEIGHBOUR_PID = 424242
TARGETS = ("llama-a", "llama-b")
# The shipped timings (pressure held 30 s, 2 minutes of hysteresis) compressed for a 1-minute show
DEMO_THRESHOLDS = AlertThresholds(pressure_for="5s", critical_for="0s", keep_firing_for="8s")
LEVELS = {0: "ok", 1: "caution", 2: "pressure", 3: "CRITICAL"}


@dataclass
class Options:
    duration: float = 75.0
    report_dir: Path = Path("demo-report")
    prometheus: bool = True


class Inbox:
    """Receives the on-call receivers' webhooks (what the pager and the ticket queue would get)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        inbox = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    payload = json.loads(body)
                except json.JSONDecodeError:
                    payload = {}
                inbox.received.append(
                    {
                        "at": time.time(),
                        "receiver": self.path.strip("/"),
                        "auth": self.headers.get("Authorization", ""),
                        "payload": payload,
                    }
                )
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _samples(families: list[Family], name: str) -> list[tuple[dict[str, str], float]]:
    for f in families:
        if f.spec.name == name:
            return [(dict(zip(f.spec.labels, labels, strict=True)), v) for labels, v in f.samples]
    return []


class Load:
    """Steady traffic: a few concurrent requests per engine until stopped."""

    def __init__(self, engines: list[VllmProcess], per_engine: int = 4) -> None:
        self.engines, self.per_engine = engines, per_engine
        self.ok = self.failed = self.rerouted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _worker(self, client: httpx.AsyncClient, engine: VllmProcess, k: int) -> None:
        i = k * 100_000
        others = [e for e in self.engines if e is not engine]
        while not self._stop.is_set():
            i += 1
            body = {
                "model": engine.model,
                "max_tokens": 48,
                "ignore_eos": True,
                "prompt": [(i * 7919 + j * 31) % 30000 + 10 for j in range(600)],
            }
            try:
                r = await client.post(f"{engine.url}/v1/completions", json=body)
                if r.status_code == 503 and others:
                    # a draining engine says 503 + Retry-After: the gateway sends it elsewhere
                    self.rerouted += 1
                    r = await client.post(f"{others[0].url}/v1/completions", json=body)
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed += 1
                    await asyncio.sleep(0.5)
            except httpx.HTTPError:
                self.failed += 1
                await asyncio.sleep(0.5)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(
                *(
                    self._worker(client, e, n * 10 + k)
                    for n, e in enumerate(self.engines)
                    for k in range(self.per_engine)
                )
            )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(70)


@dataclass
class Demo:
    opts: Options
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="oomguard-demo-")))
    processes: list[Process] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    t0_wall: float = 0.0

    def say(self, text: str) -> None:
        print(text, flush=True)

    def start_engines(self, token: str) -> list[VllmProcess]:
        self.say("starting two vLLM 0.33 servers (model-free executor, oomguard plugin)...")

        def launch(i: int) -> Callable[[], VllmProcess]:
            return lambda: VllmProcess(
                "--max-num-seqs",
                "32",
                "--max-model-len",
                "4096",
                log=self.workdir / f"vllm-{i}.log",
                token=token,
                env={"OOMGUARD_TWIN_KV_BLOCKS": "1024", "OOMGUARD_TWIN_STEP_SECONDS": "0.01"},
            )

        engines = start_all([launch(0), launch(1)])
        self.processes.extend(engines)
        return engines

    def run(self) -> int:
        plugin_token = secrets.token_hex(16)
        remediator_token = secrets.token_hex(16)
        (self.workdir / "plugin-token").write_text(plugin_token)
        token_file = self.workdir / "remediator-token"
        token_file.write_text(remediator_token)
        inbox: Inbox | None = None
        exporter: Exporter | None = None
        load: Load | None = None
        try:
            engines = self.start_engines(plugin_token)
            gpus = [
                TwinGpu(f"GPU-twin-{i}-0000-0000-0000-00000000000{i}", minor=i) for i in range(2)
            ]
            nvml = TwinNvml(gpus)
            for i, engine in enumerate(engines):
                # vLLM takes gpu_memory_utilization (0.9) of the device at start: weights + pool
                nvml.set_process(i, engine.proc.pid, int(0.9 * gpus[i].total) - gpus[i].reserved)
            exporter, port = twin_exporter(
                {TARGETS[i]: e.url for i, e in enumerate(engines)},
                nvml,
                self.workdir / "allocator",
            )
            self.say(f"exporter on http://127.0.0.1:{port}/metrics reading 2 simulated H100s")
            prom: Prometheus | None = None
            config = self.remediator_config(engines, token_file)
            if self.opts.prometheus and have_prometheus_stack():
                inbox = Inbox()
                listen = f"127.0.0.1:{free_port()}"
                am = Alertmanager(
                    self.workdir / "alertmanager",
                    inbox.url,
                    token_file,
                    remediator=f"http://{listen}",
                )
                self.processes.append(am)
                rules = self.workdir / "oomguard.rules.yaml"
                rules.write_text(alert_outputs(DEMO_THRESHOLDS)[RULES])
                prom = Prometheus(
                    self.workdir / "prometheus",
                    {
                        "oomguard-exporter": [f"127.0.0.1:{port}"],
                        "vllm": [e.url.removeprefix("http://") for e in engines],
                    },
                    alertmanager=am.url.removeprefix("http://"),
                    rules=rules,
                )
                self.processes.append(prom)
                config.update(listen=listen, alertmanager={"url": am.url, "resync_seconds": 10})
                self.say(f"Prometheus {prom.url} (generated rules), Alertmanager {am.url}")
            else:
                config.update(
                    mode="standalone",
                    standalone={
                        "exporters": [f"http://127.0.0.1:{port}/metrics"],
                        "interval_seconds": 0.5,
                        "pressure_for_seconds": 5,
                        "critical_for_seconds": 0,
                        "keep_firing_seconds": 8,
                    },
                )
                self.say(
                    "Prometheus/Alertmanager not installed (or --no-prometheus): the remediator "
                    "runs in standalone mode on the exporter's pressure levels; `make demo` "
                    "installs them"
                )
            remediator = RemediatorProcess(self.workdir / "remediator", config)
            self.processes.append(remediator)
            self.say(f"remediator {remediator.url} ({config.get('mode', 'alertmanager')} mode)")
            load = Load(engines)
            load.start()
            self.replay(nvml, gpus, exporter, engines, prom, inbox)
        except KeyboardInterrupt:
            self.say("\ninterrupted: stopping every process")
        finally:
            if load is not None:
                load.stop()
            if exporter is not None:
                exporter.stop()
            for p in reversed(self.processes):
                p.stop()
            if inbox is not None:
                inbox.close()
        return self.report(inbox, load)

    def remediator_config(self, engines: list[VllmProcess], token_file: Path) -> dict[str, Any]:
        return {
            "auth": {"bearer_token_file": str(token_file)},
            "targets": [
                {
                    "name": TARGETS[i],
                    "url": e.url,
                    "model": "tiny-llama",
                    "token_file": str(self.workdir / "plugin-token"),
                }
                for i, e in enumerate(engines)
            ],
            # compressed like the alert timings: one lowering step every 5 s
            "policy": {"step_seconds": 5},
            "safety": {"cooldown_seconds": 2},
            "audit_log": str(self.workdir / "remediator-audit.jsonl"),
            "reconcile_seconds": 0.5,
        }

    def actions(self) -> list[dict[str, Any]]:
        path = self.workdir / "remediator-audit.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if entry["event"] in ("acted", "withheld", "failed", "held"):
                    out.append(entry)
        return out

    def replay(
        self,
        nvml: TwinNvml,
        gpus: list[TwinGpu],
        exporter: Exporter,
        engines: list[VllmProcess],
        prom: Prometheus | None,
        inbox: Inbox | None,
    ) -> None:
        d = self.opts.duration
        floor = PressureThresholds().floor_for(gpus[0].total)
        start_free = gpus[0].free
        grow_from, grow_to, leave_at = 0.15 * d, 0.45 * d, 0.65 * d
        target = start_free - 0.5 * floor  # the neighbour takes all but half the floor
        self.say(
            f"\nincident: a neighbour job starts on GPU 0 at {grow_from:.0f}s and grows to "
            f"{target / GIB:.1f} GiB (critical floor {floor / GIB:.1f} GiB), leaves at "
            f"{leave_at:.0f}s. Ctrl-C stops.\n"
        )
        t0 = time.monotonic()
        self.t0_wall = time.time()
        fired: set[str] = set()
        seen_actions = 0
        while (t := time.monotonic() - t0) < d:
            if grow_from <= t < leave_at:
                share = min(1.0, (t - grow_from) / (grow_to - grow_from))
                nvml.set_process(0, NEIGHBOUR_PID, int(target * share))
            elif t >= leave_at:
                nvml.set_process(0, NEIGHBOUR_PID, None)
            row = self.sample(t, exporter, engines, prom, inbox)
            for name in row["alerts"]:
                if name not in fired:
                    fired.add(name)
                    self.events.append((t, f"alert firing: {name}"))
            for name in fired - set(row["alerts"]):
                fired.discard(name)
                self.events.append((t, f"alert resolved: {name}"))
            actions = self.actions()
            for a in actions[seen_actions:]:
                self.events.append((a["time"] - self.t0_wall, f"remediator: {describe(a)}"))
            seen_actions = len(actions)
            row["actions"] = seen_actions
            self.show(row, d)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - t)))

    def sample(
        self,
        t: float,
        exporter: Exporter,
        engines: list[VllmProcess],
        prom: Prometheus | None,
        inbox: Inbox | None,
    ) -> dict[str, Any]:
        families = exporter.poller.latest.families
        free = {s["gpu"]: v for s, v in _samples(families, "oomguard_gpu_memory_free_bytes")}
        gpu_level = {
            s["gpu"]: (int(v), s["reason"])
            for s, v in _samples(families, "oomguard_gpu_pressure_level")
        }
        kv = {s["target"]: v for s, v in _samples(families, "oomguard_vllm_kv_cache_usage_ratio")}
        preempted: dict[str, float] = {}
        for s, v in _samples(families, "oomguard_vllm_preemptions_total"):
            preempted[s["target"]] = preempted.get(s["target"], 0.0) + v
        states = {}
        for i, e in enumerate(engines):
            try:
                states[TARGETS[i]] = httpx.get(f"{e.url}/oomguard/v1/state", timeout=2).json()
            except httpx.HTTPError:
                states[TARGETS[i]] = {}
        alerts: list[str] = []
        if prom is not None:
            with contextlib.suppress(httpx.HTTPError, RuntimeError):
                firing = prom.query('ALERTS{alertstate="firing", alertname!="Watchdog"}')
                alerts = sorted({r["metric"]["alertname"] for r in firing})
        row = {
            "t": round(t, 1),
            "gpu0_free_gib": round(free.get("0", 0) / GIB, 2),
            "gpu0_level": gpu_level.get("0", (0, "ok"))[0],
            "gpu0_reason": gpu_level.get("0", (0, "ok"))[1],
            "gpu1_free_gib": round(free.get("1", 0) / GIB, 2),
            "gpu1_level": gpu_level.get("1", (0, "ok"))[0],
            "alerts": alerts,
            "webhooks": len(inbox.received) if inbox else 0,
        }
        for name, st in states.items():
            row[f"{name}_kv"] = round(kv.get(name, 0.0), 3)
            row[f"{name}_preemptions"] = preempted.get(name, 0.0)
            row[f"{name}_cap"] = st.get("admission_cap")
            row[f"{name}_mode"] = st.get("mode")
            row[f"{name}_running"] = st.get("running")
            row[f"{name}_waiting"] = st.get("waiting")
        self.timeline.append(row)
        return row

    def show(self, row: dict[str, Any], duration: float) -> None:
        bar = "#" * int(30 * row["t"] / duration)
        lines = [
            f"[{bar:<30}] {row['t']:5.1f}s / {duration:.0f}s",
            f"  GPU 0  free {row['gpu0_free_gib']:6.2f} GiB  level {LEVELS[row['gpu0_level']]:<9}"
            f" ({row['gpu0_reason']})",
            f"  GPU 1  free {row['gpu1_free_gib']:6.2f} GiB  level {LEVELS[row['gpu1_level']]}",
        ]
        for name in TARGETS:
            lines.append(
                f"  {name}  KV {100 * row.get(f'{name}_kv', 0):5.1f} %  cap "
                f"{row.get(f'{name}_cap')!s:>3}  {row.get(f'{name}_mode')!s:<8}  running "
                f"{row.get(f'{name}_running')}  waiting {row.get(f'{name}_waiting')}"
            )
        lines.append(f"  alerts firing: {', '.join(row['alerts']) or '-'}")
        lines.extend(f"  {t:5.1f}s  {e}" for t, e in sorted(self.events)[-4:])
        if sys.stdout.isatty():
            print("\x1b[H\x1b[2J" + "\n".join(lines), flush=True)
        elif int(row["t"]) % 5 == 0:
            print("\n".join(lines), flush=True)

    def report(self, inbox: Inbox | None, load: Load | None) -> int:
        out = self.opts.report_dir
        out.mkdir(parents=True, exist_ok=True)
        if self.timeline:
            fields = list(dict.fromkeys(k for row in self.timeline for k in row))
            with (out / "timeline.csv").open("w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=fields)
                writer.writeheader()
                for row in self.timeline:
                    writer.writerow({**row, "alerts": " ".join(row["alerts"])})
        webhooks = inbox.received if inbox else []
        (out / "webhooks.json").write_text(json.dumps(webhooks, indent=2))
        audit = self.workdir / "remediator-audit.jsonl"
        if audit.exists():
            (out / "remediator-audit.jsonl").write_text(audit.read_text())
        actions = [a for a in self.actions() if a["event"] == "acted"]
        chart = "(no chart: no samples)"
        if self.timeline:
            floor = PressureThresholds().floor_for(TwinGpu("x").total) / GIB
            render(self.timeline, self.events, TARGETS, floor, out / "timeline.png")
            chart = "![timeline](timeline.png)"
        worst = max((r["gpu0_level"] for r in self.timeline), default=0)
        caps = [r.get("llama-a_cap") for r in self.timeline if r.get("llama-a_cap") is not None]
        lowest = min(caps, default=None)
        back = bool(caps) and caps[-1] == max(caps)
        lines = [
            "# oomguard demo report",
            "",
            f"- duration: {self.opts.duration:.0f} s, samples: {len(self.timeline)}",
            f"- worst GPU 0 pressure level: {worst} ({LEVELS[worst]})",
            f"- remediator actions: {len(actions)}; llama-a cap went down to {lowest} and "
            + ("came back to its startup value" if back else "had not come back yet"),
            f"- requests completed: {load.ok if load else 0}, failed: {load.failed if load else 0}"
            f", sent to the other engine while one drained: {load.rerouted if load else 0}",
            f"- alert webhooks to on-call receivers: "
            f"{sum(1 for w in webhooks if w['receiver'] != 'remediator')}",
            "",
            "## Timeline",
            "",
            chart,
            "",
            *(f"- {t:5.1f}s  {e}" for t, e in sorted(self.events)),
            "",
            "## Dashboards",
            "",
            "Import `dashboards/generated/oomguard-*.json` into Grafana (Dashboards > New >",
            "Import), or provision them with `deploy/grafana/provisioning/`. They read the",
            "Prometheus that scrapes the exporters (`deploy/prometheus/prometheus.yml`).",
            "",
            "Files: `timeline.png`, `timeline.csv` (one row per second),",
            "`remediator-audit.jsonl` (every decision and action), `webhooks.json` (what on-call",
            "receivers were sent).",
        ]
        (out / "summary.md").write_text("\n".join(lines) + "\n")
        self.say(f"\nreport written to {out}/summary.md")
        self.say("load the dashboards: import dashboards/generated/*.json into Grafana")
        return 0


def describe(entry: dict[str, Any]) -> str:
    after = entry.get("after") or {}
    what = {
        "lower_cap": f"lowered {entry['target']}'s cap to {after.get('cap')}",
        "raise_cap": f"raised {entry['target']}'s cap to {after.get('cap')}",
        "readmit": f"set {entry['target']}'s cap to {after.get('cap')} to re-admit",
        "drain": f"drained {entry['target']}",
        "resume": f"resumed {entry['target']}",
    }.get(entry.get("action", ""), f"{entry['event']} {entry.get('action', '')} {entry['target']}")
    if entry["event"] != "acted":
        what = f"{entry['event']} {entry.get('action', '')} on {entry['target']}: {entry['result']}"
    return f"{what} ({entry.get('reason', '')})"


def run(opts: Options) -> int:
    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return Demo(opts).run()
