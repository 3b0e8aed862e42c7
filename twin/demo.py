"""`oomguard demo`: a GPU memory incident replayed on the real stack, on a machine without a GPU.

What runs, all on 127.0.0.1:
- two real vLLM 0.33 servers (model-free executor) with the oomguard plugin, under steady load;
- two simulated H100s (twin/gpu.py) that the exporter reads through its normal NVML code path;
- the oomguard exporter; the real Prometheus with the generated rules and the real Alertmanager
  with the shipped routes (when installed), whose webhooks land in a local inbox.

The incident: a neighbour process starts on GPU 0 and grows until free memory falls below the
critical floor, then goes away. The terminal shows pressure, KV usage, caps and alerts each
second; the report folder gets a Markdown summary and the timeline.

The remediator is not part of oomguard yet: the demo shows the alerts that would drive it
arriving at its webhook, and the plugin state it would act on.
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
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from oomguard.exporter.config import ExporterConfig, VllmTarget
from oomguard.exporter.main import Exporter
from oomguard.exporter.render import Family
from oomguard.twin.gpu import GIB, TwinGpu, TwinNvml
from oomguard.twin.processes import (
    Alertmanager,
    Process,
    Prometheus,
    VllmProcess,
    free_port,
    have_prometheus_stack,
)

from oomguard.thresholds import PressureThresholds

NEIGHBOUR_PID = 424242
LEVELS = {0: "ok", 1: "caution", 2: "pressure", 3: "CRITICAL"}


@dataclass
class Options:
    duration: float = 75.0
    report_dir: Path = Path("demo-report")
    prometheus: bool = True


class Inbox:
    """Receives Alertmanager webhooks (what the remediator and the pager would get)."""

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
        self.ok = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _worker(self, client: httpx.AsyncClient, engine: VllmProcess, k: int) -> None:
        i = k * 100_000
        while not self._stop.is_set():
            i += 1
            try:
                r = await client.post(
                    f"{engine.url}/v1/completions",
                    json={
                        "model": engine.model,
                        "max_tokens": 48,
                        "ignore_eos": True,
                        "prompt": [(i * 7919 + j * 31) % 30000 + 10 for j in range(600)],
                    },
                )
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
    events: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        print(text, flush=True)

    def start_engines(self, token: str) -> list[VllmProcess]:
        self.say("starting two vLLM 0.33 servers (model-free executor, oomguard plugin)...")
        engines: list[VllmProcess | BaseException] = [None, None]  # type: ignore[list-item]

        def launch(i: int) -> None:
            try:
                engines[i] = VllmProcess(
                    "--max-num-seqs",
                    "32",
                    "--max-model-len",
                    "4096",
                    log=self.workdir / f"vllm-{i}.log",
                    token=token,
                    env={"OOMGUARD_TWIN_KV_BLOCKS": "1024", "OOMGUARD_TWIN_STEP_SECONDS": "0.01"},
                )
            except BaseException as exc:  # reported below, in the main thread
                engines[i] = exc

        threads = [threading.Thread(target=launch, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        started = [e for e in engines if isinstance(e, VllmProcess)]
        self.processes.extend(started)
        failed = [e for e in engines if not isinstance(e, VllmProcess)]
        if failed:
            raise RuntimeError(f"a vLLM server did not start: {failed[0]}")
        return started  # type: ignore[return-value]

    def run(self) -> int:
        token = secrets.token_hex(16)
        token_file = self.workdir / "remediator-token"
        token_file.write_text(token)
        inbox: Inbox | None = None
        exporter: Exporter | None = None
        load: Load | None = None
        try:
            engines = self.start_engines(token)
            gpus = [
                TwinGpu(f"GPU-twin-{i}-0000-0000-0000-00000000000{i}", minor=i) for i in range(2)
            ]
            nvml = TwinNvml(gpus)
            for i, engine in enumerate(engines):
                # vLLM takes gpu_memory_utilization (0.9) of the device at start: weights + pool
                nvml.set_process(i, engine.proc.pid, int(0.9 * gpus[i].total) - gpus[i].reserved)
            port = free_port()
            exporter = Exporter(
                ExporterConfig(
                    listen=f"127.0.0.1:{port}",
                    interval_seconds=0.5,
                    hostname="twin-node",
                    vllm=[
                        VllmTarget(name=f"llama-{'ab'[i]}", url=f"{e.url}/metrics", gpus=[str(i)])
                        for i, e in enumerate(engines)
                    ],
                    cgroups=[],
                    allocator={"directory": str(self.workdir / "allocator")},
                ),
                nvml_backend=nvml,
            )
            exporter.start()
            self.say(f"exporter on http://127.0.0.1:{port}/metrics reading 2 simulated H100s")
            prom: Prometheus | None = None
            if self.opts.prometheus and have_prometheus_stack():
                inbox = Inbox()
                am = Alertmanager(self.workdir / "alertmanager", inbox.url, token_file)
                self.processes.append(am)
                prom = Prometheus(
                    self.workdir / "prometheus",
                    {
                        "oomguard-exporter": [f"127.0.0.1:{port}"],
                        "vllm": [e.url.removeprefix("http://") for e in engines],
                    },
                    alertmanager=am.url.removeprefix("http://"),
                )
                self.processes.append(prom)
                self.say(f"Prometheus {prom.url} (generated rules), Alertmanager {am.url}")
            else:
                self.say(
                    "Prometheus/Alertmanager not installed (or --no-prometheus): showing "
                    "the exporter's pressure levels only; `make demo` installs them"
                )
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
        return self.report(inbox)

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
        fired: set[str] = set()
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
                    self.events.append(f"{t:5.1f}s  alert firing: {name}")
            for name in fired - set(row["alerts"]):
                fired.discard(name)
                self.events.append(f"{t:5.1f}s  alert resolved: {name}")
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
        states = {}
        for i, e in enumerate(engines):
            try:
                states[f"llama-{'ab'[i]}"] = httpx.get(
                    f"{e.url}/oomguard/v1/state", timeout=2
                ).json()
            except httpx.HTTPError:
                states[f"llama-{'ab'[i]}"] = {}
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
            row[f"{name}_cap"] = st.get("admission_cap")
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
        for name in ("llama-a", "llama-b"):
            lines.append(
                f"  {name}  KV {100 * row.get(f'{name}_kv', 0):5.1f} %  cap "
                f"{row.get(f'{name}_cap')}  running {row.get(f'{name}_running')}  "
                f"waiting {row.get(f'{name}_waiting')}"
            )
        lines.append(
            f"  alerts firing: {', '.join(row['alerts']) or '-'}   "
            f"webhooks received: {row['webhooks']}"
        )
        if sys.stdout.isatty():
            print("\x1b[H\x1b[2J" + "\n".join(lines), flush=True)
        elif int(row["t"]) % 5 == 0:
            print("\n".join(lines), flush=True)

    def report(self, inbox: Inbox | None) -> int:
        out = self.opts.report_dir
        out.mkdir(parents=True, exist_ok=True)
        if self.timeline:
            with (out / "timeline.csv").open("w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(self.timeline[0]))
                writer.writeheader()
                for row in self.timeline:
                    writer.writerow({**row, "alerts": " ".join(row["alerts"])})
        webhooks = inbox.received if inbox else []
        (out / "webhooks.json").write_text(json.dumps(webhooks, indent=2))
        worst = max((r["gpu0_level"] for r in self.timeline), default=0)
        remediator = [w for w in webhooks if w["receiver"] == "remediator"]
        actions = sorted(
            {
                a["labels"].get("oomguard_action", "")
                + " "
                + a["labels"]["alertname"]
                + " "
                + a["status"]
                for w in remediator
                for a in w["payload"].get("alerts", [])
            }
        )
        lines = [
            "# oomguard demo report",
            "",
            f"- duration: {self.opts.duration:.0f} s, samples: {len(self.timeline)}",
            f"- worst GPU 0 pressure level: {worst} ({LEVELS[worst]})",
            f"- webhooks received: {len(webhooks)} ({len(remediator)} for the remediator)",
            "",
            "## Events",
            "",
            *(f"- {e}" for e in self.events or ["(none)"]),
            "",
            "## What the remediator was sent",
            "",
            *(f"- `{a}`" for a in actions or ["(nothing)"]),
            "",
            "The remediator is the next part of oomguard to be built; these are the alerts it",
            "will act on (lower the cap, drain) through the plugin routes the engines serve.",
            "",
            "## Dashboards",
            "",
            "Import `dashboards/generated/oomguard-*.json` into Grafana (Dashboards > New >",
            "Import), or provision them with `deploy/grafana/provisioning/`. They read the",
            "Prometheus that scrapes the exporters (`deploy/prometheus/prometheus.yml`).",
            "",
            "Files: `timeline.csv` (one row per second), `webhooks.json` (every payload).",
        ]
        (out / "summary.md").write_text("\n".join(lines) + "\n")
        self.say(f"\nreport written to {out}/summary.md")
        self.say("load the dashboards: import dashboards/generated/*.json into Grafana")
        return 0


def run(opts: Options) -> int:
    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return Demo(opts).run()
