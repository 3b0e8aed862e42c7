"""`oomguard demo`: the same GPU memory incident with and without oomguard, and a healthy GPU left
alone, on the real stack, on a machine without a GPU.

Three fleets run at once, all on 127.0.0.1, each on twin GPUs (twin/physics.py) behind real
vLLM 0.33 servers (model-free executor, oomguard plugin) under `oomguard serve`:

- **vLLM alone**: two engines on twin H100s replaying the seeded `neighbour-growth` incident (a
  process on GPU 0 grows to 8.6 GiB). Nothing watches them: engine 0 hits a CUDA OOM, dies with
  its in-flight requests and reloads the model (12 minutes of trace time).
- **vLLM + oomguard**: the same two engines, the same requests and the same GPU events, plus the
  exporter, the real Prometheus with the generated rules, the real Alertmanager with the shipped
  routes, and the remediator: it lowers engine 0's cap, drains it (the gateway sends its requests
  to engine 1) and re-admits it in stages once the neighbour is gone.
- **Do no harm**: one engine on a 24 GB twin GPU at vLLM's default gpu_memory_utilization 0.92
  under heavy steady load (KV cache full, requests queueing), watched by the same stack. oomguard
  must not alert or act.

Alert and remediator timings are the shipped ones divided by the incident's time compression. The
terminal shows both incident runs side by side each second; the report folder gets `report.html`
(one self-contained page), `summary.md`, `summary.json`, the PNGs (side by side, do no harm, the
three Grafana dashboards drawn from what Prometheus recorded), the remediator's audit log and the
webhooks on-call received. Without Prometheus and Alertmanager (`--no-prometheus`) the remediator
watches the exporters itself (standalone mode) and the report has no dashboards.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from oomguard import vllm_seam
from oomguard.alerts.generate import dump
from oomguard.alerts.rules import rule_groups
from oomguard.exporter.render import Family
from oomguard.lab.processes import (
    Alertmanager,
    Inbox,
    Prometheus,
    RemediatorProcess,
    free_port,
    have_prometheus_stack,
)
from oomguard.lab.report import describe, read_audit, write_report
from oomguard.lab.runner import RECOVERY_WATCH_S, Fleet, remediator_timings
from oomguard.thresholds import AlertThresholds
from oomguard.twin.gpu import GIB
from oomguard.twin.traces import TRACES, Trace

INCIDENT = TRACES / "demo" / "neighbour-incident.json"
DO_NO_HARM = TRACES / "demo" / "do-no-harm-24gb.json"
LEVELS = {0: "ok", 1: "caution", 2: "pressure", 3: "CRITICAL"}
# node names the report and Prometheus use (the exporters' `instance` label)
GUARDED_NODE, HEALTHY_NODE = "gpu-node-a", "gpu-node-24gb"
PERIOD = 0.25  # wall seconds between the fleets' GPU driver passes (five engines share 2 cores)
START_TIMEOUT = 600.0  # five vLLMs loading at once on a busy 2-core machine take minutes


@dataclass
class Options:
    report_dir: Path = Path("demo-report")
    prometheus: bool = True
    quick: bool = False  # a shorter healthy segment; no waiting for the crashed engine's reload
    router: str = "gateway"  # in front of each fleet's engines: lab/routers.py ROUTERS


def demo_thresholds(compression: float) -> AlertThresholds:
    """The shipped alert timings, divided by the incident's time compression."""

    def scaled(seconds: float) -> str:
        return f"{max(1, round(1000 * seconds / compression))}ms"

    wanted = {
        "rule_interval": "1s",
        "pressure_for": scaled(30),
        "critical_for": "0s",
        "keep_firing_for": scaled(120),
        "action_keep_firing_for": scaled(30),
    }
    fields = AlertThresholds.model_fields
    return AlertThresholds(**{k: v for k, v in wanted.items() if k in fields})


def _samples(families: list[Family], name: str) -> list[tuple[dict[str, str], float]]:
    for f in families:
        if f.spec.name == name:
            return [(dict(zip(f.spec.labels, labels, strict=True)), v) for labels, v in f.samples]
    return []


@dataclass
class Demo:
    opts: Options
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="oomguard-demo-")))
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (wall s, run, text)
    healthy_rows: list[dict[str, Any]] = field(default_factory=list)
    alert_rows: list[tuple[float, list[str]]] = field(default_factory=list)
    t0_wall: float = 0.0
    t0: float = 0.0
    t_end: float = 0.0  # wall clock when the replay ended

    def say(self, text: str) -> None:
        print(text, flush=True)

    # -- set-up --------------------------------------------------------------------------------
    def traces(self) -> tuple[Trace, Trace]:
        incident, healthy = Trace.load(INCIDENT), Trace.load(DO_NO_HARM)
        if self.opts.quick:  # the same incident; a shorter healthy segment
            healthy = healthy.model_copy(update={"duration_s": healthy.duration_s / 2})
        return incident, healthy

    def run(self) -> int:
        w = self.workdir
        incident, healthy_trace = self.traces()
        c = incident.time_compression
        self.say(
            f"oomguard demo (work files in {w})\n"
            f"  incident: {incident.description}\n"
            f"  replayed twice with the same seed and GPU events: vLLM alone, vLLM + oomguard "
            f"(x{c:g} time compression)\n"
            f"  do no harm: {healthy_trace.description}"
        )
        stack = self.opts.prometheus and have_prometheus_stack()
        token_file = w / "remediator-token"
        token_file.write_text(secrets.token_hex(16))
        audit = w / "remediator-audit.jsonl"
        alone = Fleet(
            incident,
            "default",
            w / "alone",
            self._log,
            prefix="alone",
            hostname="alone",
            period=PERIOD,
            start_timeout=START_TIMEOUT,
            served_name=incident.model,
            router=self.opts.router,
            # long enough for the crashed engine's model reload (12 minutes of trace time) and
            # its restart; --quick does not wait for it
            recovery_watch_s=100 if self.opts.quick else 2 * RECOVERY_WATCH_S,
        )
        guarded = Fleet(
            incident,
            "oomguard",
            w / "guarded",
            self._log,
            prefix="llama",
            hostname=GUARDED_NODE,
            own_remediator=False,
            period=PERIOD,
            start_timeout=START_TIMEOUT,
            served_name=incident.model,
            audit=audit,
            router=self.opts.router,
        )
        healthy = Fleet(
            healthy_trace,
            "oomguard",
            w / "healthy",
            self._log,
            engines=1,
            prefix="llama-24gb",
            hostname=HEALTHY_NODE,
            own_remediator=False,
            period=PERIOD,
            start_timeout=START_TIMEOUT,
            served_name=f"{healthy_trace.model}-24gb",
            audit=audit,
            router=self.opts.router,
        )
        fleets = {"alone": alone, "oomguard": guarded, "healthy": healthy}
        inbox: Inbox | None = None
        am: Alertmanager | None = None
        prom: Prometheus | None = None
        remediator: RemediatorProcess | None = None
        started = time.monotonic()
        try:
            listen = f"127.0.0.1:{free_port()}"
            if stack:
                inbox = Inbox()
                am = Alertmanager(w / "alertmanager", inbox.url, token_file, f"http://{listen}")
                self.say(f"Alertmanager {am.url} (shipped routes; on-call webhooks to {inbox.url})")
            else:
                self.say(
                    "Prometheus/Alertmanager not installed (or --no-prometheus): the remediator "
                    "watches the exporters itself (standalone mode), no dashboards in the report; "
                    "`make demo` installs them"
                )
            self.start_fleets(fleets)
            config: dict[str, Any] = {
                "listen": listen,
                "auth": {"bearer_token_file": str(token_file)},
                "targets": guarded.remediator_targets() + healthy.remediator_targets(),
                # behind vllm-router: out of its rotation before a drain (admin API)
                "routers": guarded.remediator_routers() + healthy.remediator_routers(),
                **remediator_timings(c),
                "audit_log": str(audit),
            }
            if am is not None:
                rules = w / "oomguard.rules.yaml"
                rules.write_text(dump(rule_groups(demo_thresholds(c))))
                exporters = {
                    f"127.0.0.1:{guarded.exporter_port}": GUARDED_NODE,
                    f"127.0.0.1:{healthy.exporter_port}": HEALTHY_NODE,
                }
                prom = Prometheus(
                    w / "prometheus",
                    {
                        "oomguard-exporter": list(exporters),
                        "vllm": [
                            e.url.removeprefix("http://") for e in guarded.engines + healthy.engines
                        ],
                        "oomguard-remediator": [listen],
                    },
                    alertmanager=am.url.removeprefix("http://"),
                    rules=rules,
                    labels={address: {"instance": node} for address, node in exporters.items()},
                    every_job_at="1s",
                )
                # Alertmanager's routes are the shipped ones, not scaled (the remediator route
                # sends each alert at once and flushes a resolve within its short
                # group_interval). Re-reading the firing alerts each second keeps the remediator
                # in step with the compressed trace all the same.
                config["alertmanager"] = {"url": am.url, "resync_seconds": 1}
                self.say(f"Prometheus {prom.url} (generated rules, timings /{c:g})")
            else:
                config["mode"] = "standalone"
                config["standalone"] = {
                    "exporters": [
                        f"http://127.0.0.1:{f.exporter_port}/metrics" for f in (guarded, healthy)
                    ],
                    "interval_seconds": 0.25,
                    "pressure_for_seconds": 30 / c,
                    "critical_for_seconds": 0,
                    "keep_firing_seconds": 120 / c,
                }
            remediator = RemediatorProcess(w / "remediator", config)
            self.say(
                f"remediator {remediator.url} ({config.get('mode', 'alertmanager')} mode); "
                f"set-up took {time.monotonic() - started:.0f} s\n"
            )
            self.replay(fleets, prom, audit)
        except KeyboardInterrupt:
            self.say("\ninterrupted: stopping every process")
            self.stop(fleets, remediator, prom, am, inbox)
            return 130
        except BaseException:
            self.stop(fleets, remediator, prom, am, inbox)
            raise
        # everything but Prometheus stops first: the report needs only its data and the CPU
        self.say("\nstopping the engines; writing the report (Prometheus, dashboards)...")
        self.stop(fleets, remediator, am)
        try:
            write_report(self, fleets, prom, inbox, self.opts.report_dir)
        finally:
            self.stop({}, prom, inbox)
        self.say(f"report: {self.opts.report_dir / 'report.html'} (and summary.md)")
        return 0

    def _log(self, text: str) -> None:
        pass  # the live view says what the fleets do

    def start_fleets(self, fleets: dict[str, Fleet]) -> None:
        """Start every fleet at once (each vLLM takes seconds to load); all or none."""
        n = sum(f.n for f in fleets.values())
        self.say(
            f"starting {n} vLLM {vllm_seam.MINOR} servers (model-free executor, oomguard plugin)..."
        )
        errors: list[BaseException] = []
        done: list[str] = []

        def start(name: str, fleet: Fleet) -> None:
            try:
                fleet.start()
                done.append(name)
            except BaseException as exc:  # reported below, in this thread
                errors.append(exc)

        threads = [
            threading.Thread(target=start, args=item, daemon=True) for item in fleets.items()
        ]
        t0 = said = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if time.monotonic() - said >= 5:
                said = time.monotonic()
                self.say(f"  {said - t0:4.0f} s: ready: {', '.join(done) or '-'}")
        if errors:
            raise RuntimeError(f"a fleet did not start: {errors[0]}") from errors[0]

    def stop(self, fleets: dict[str, Fleet], *procs: Any) -> None:
        """Stop fleets and processes, all at once (each vLLM takes seconds to shut down)."""

        def stop_one(part: Any) -> None:
            with contextlib.suppress(Exception):
                part.close() if isinstance(part, Inbox) else part.stop()

        parts = [*fleets.values(), *(p for p in procs if p is not None)]
        threads = [threading.Thread(target=stop_one, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # -- the replay ----------------------------------------------------------------------------
    def replay(self, fleets: dict[str, Fleet], prom: Prometheus | None, audit: Path) -> None:
        threads = {
            name: threading.Thread(target=fleet.replay, daemon=True)
            for name, fleet in fleets.items()
        }
        self.t0, self.t0_wall = time.monotonic(), time.time()
        for t in threads.values():
            t.start()
        expect = self.expected_seconds(fleets)
        fired: set[str] = set()
        seen_actions = 0
        modes: dict[str, str] = {}
        crashes = {name: 0 for name in fleets}
        while any(t.is_alive() for t in threads.values()):
            now = time.monotonic() - self.t0
            alerts = self.firing(prom)
            self.alert_rows.append((now, alerts))
            for a in sorted(set(alerts) - fired):
                self.events.append((now, "oomguard", f"alert firing: {a}"))
            for a in sorted(fired - set(alerts)):
                self.events.append((now, "oomguard", f"alert resolved: {a}"))
            fired = set(alerts)
            entries = [e for e in read_audit(audit) if e.get("event") in ("acted", "failed")]
            for e in entries[seen_actions:]:
                self.events.append(
                    (float(e.get("time") or self.t0_wall) - self.t0_wall, "oomguard", describe(e))
                )
            seen_actions = len(entries)
            for name, fleet in fleets.items():
                if len(fleet.crash_times) > crashes[name]:
                    crashes[name] = len(fleet.crash_times)
                    self.events.append((now, name, "engine 0: CUDA out of memory, engine died"))
                mode = fleet.views[0].mode
                if modes.get(name) != mode and name != "healthy":
                    self.events.append((now, name, f"engine 0 {mode}"))
                modes[name] = mode
            self.sample_healthy(fleets["healthy"], alerts)
            self.show(fleets, alerts, now, expect)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - self.t0 - now)))
        self.t_end = time.time()
        self.say(f"replay done in {time.monotonic() - self.t0:.0f} s")

    def expected_seconds(self, fleets: dict[str, Fleet]) -> float:
        """Rough wall length: the longest trace, plus a reload and a restart for the crash."""
        longest = max(f.trace.duration_s / f.trace.time_compression for f in fleets.values())
        alone = fleets["alone"].trace
        return max(longest, (700 + alone.reload_s) / alone.time_compression + 15)

    def firing(self, prom: Prometheus | None) -> list[str]:
        if prom is None:
            return []
        with contextlib.suppress(httpx.HTTPError, RuntimeError, ValueError):
            rows = prom.query('ALERTS{alertstate="firing", alertname!="Watchdog"}')
            return sorted(
                {
                    f"{r['metric']['alertname']}"
                    f"({r['metric'].get('target') or r['metric'].get('instance', '')})"
                    for r in rows
                }
            )
        return []

    def sample_healthy(self, fleet: Fleet, alerts: list[str]) -> None:
        """The do-no-harm engine as the exporter sees it (pressure level, free memory)."""
        level, reason = 0, "ok"
        if fleet.exporter is not None:
            for labels, v in _samples(
                fleet.exporter.poller.latest.families, "oomguard_gpu_pressure_level"
            ):
                if int(v) >= level:
                    level, reason = int(v), labels.get("reason", "")
        view = fleet.views[0]
        self.healthy_rows.append(
            {
                "t": round(fleet.now(), 1),
                "free_gib": round(view.gpu_free / GIB, 3),
                "level": level,
                "reason": reason,
                "kv": view.kv,
                "running": view.running,
                "waiting": view.waiting,
                "alerts": [a for a in alerts if fleet.names[0] in a or HEALTHY_NODE in a],
            }
        )

    def show(self, fleets: dict[str, Fleet], alerts: list[str], now: float, expect: float) -> None:
        bar = "#" * min(30, int(30 * now / expect))
        a, g, h = fleets["alone"], fleets["oomguard"], fleets["healthy"]

        def engine(f: Fleet, i: int) -> str:
            v = f.views[i]
            if v.mode == "down":
                return "DOWN: CUDA OOM, reloading" if f.crash_times else "down"
            if v.mode in ("capped", "draining"):
                return f"{v.mode} (cap {v.cap})"
            return f"{v.mode} (running {v.running})"

        def served(f: Fleet) -> str:
            ok, lost, flying = f.counts()
            return f"{ok} ok, {lost} lost, {flying} in flight"

        lines = [
            f"[{bar:<30}] {now:4.0f} s of about {expect:.0f} s",
            f"{'':16}{'vLLM alone':<34}vLLM + oomguard",
            f"{'trace time':16}{a.now():<34.0f}{g.now():.0f} s",
            f"{'GPU 0 neighbour':16}{a.views[0].neighbour / GIB:<34.1f}"
            f"{g.views[0].neighbour / GIB:.1f} GiB",
            f"{'GPU 0 free':16}{a.views[0].gpu_free / GIB:<34.1f}"
            f"{g.views[0].gpu_free / GIB:.1f} GiB",
            f"{'engine 0':16}{engine(a, 0):<34}{engine(g, 0)}",
            f"{'engine 1':16}{engine(a, 1):<34}{engine(g, 1)}",
            f"{'requests':16}{served(a):<34}{served(g)}",
            f"{'CUDA OOMs':16}{len(a.crash_times):<34}{len(g.crash_times)}",
        ]
        row = self.healthy_rows[-1] if self.healthy_rows else {}
        ok, lost, _ = h.counts()
        lines.append(
            f"do no harm ({h.trace.gpu} at gmu {h.trace.engine.gpu_memory_utilization}): KV "
            f"{100 * row.get('kv', 0):3.0f} %, running {row.get('running', 0)}, waiting "
            f"{row.get('waiting', 0)}, free {row.get('free_gib', 0):.1f} GiB, level "
            f"{LEVELS.get(row.get('level', 0), '?')}, alerts {len(row.get('alerts', []))}, "
            f"served {ok}, lost {lost}"
        )
        lines.append(f"alerts firing: {', '.join(alerts) or '-'}")
        lines.extend(f"  {t:5.1f}s  [{run}] {e}" for t, run, e in sorted(self.events)[-5:])
        if sys.stdout.isatty():
            print("\x1b[H\x1b[2J" + "\n".join(lines), flush=True)
        elif int(now) % 5 == 0:
            print("\n".join(lines) + "\n", flush=True)


def run(opts: Options) -> int:
    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    demo = Demo(opts)
    # The in-process exporter and its HTTP server log to stderr (a scrape cut short prints a
    # traceback): keep the live view readable and put them in a file named on failure.
    log = demo.workdir / "demo.log"
    with log.open("w") as fh, contextlib.redirect_stderr(fh):
        logging.getLogger().handlers.clear()
        logging.basicConfig(stream=fh, level=logging.INFO, force=True)
        try:
            return demo.run()
        except Exception as exc:
            print(f"demo failed: {exc} (details in {log})", file=sys.__stderr__, flush=True)
            raise
