"""Detection-to-action latency, end to end, through the real Prometheus and Alertmanager.

A critical memory condition appears on a twin GPU (another process takes all but 1 GiB of it);
the time until the engine on that GPU is drained is measured hop by hop:
  1. exporter: its /metrics shows pressure level 3 for the engine;
  2. Prometheus: OomguardMemoryCritical is firing (`ALERTS`), scraping and evaluating every 1 s;
  3. Alertmanager -> remediator: the webhook is recorded (the audit log's `received` entry);
  4. engine: the plugin reports `draining`.
The shipped Prometheus and Alertmanager configuration is used (1 s scrape and evaluation,
`group_wait: 0s` on the remediator route); the rules are the generated ones with a short
`keep_firing_for`, so that rounds can follow each other (it only delays the resolution), and
a re-fire for the same engine waits for the remediator route's `group_interval` (2 s; with 10 s
re-fires took up to 6-8 s here).

Usage: python bench/detection.py [--rounds N]   (writes bench/results/detection.json)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from oomguard.alerts.generate import RULES  # noqa: E402
from oomguard.alerts.generate import outputs as alert_outputs  # noqa: E402
from oomguard.exporter.config import ExporterConfig, VllmTarget  # noqa: E402
from oomguard.exporter.main import Exporter  # noqa: E402
from oomguard.thresholds import AlertThresholds  # noqa: E402
from oomguard.twin.gpu import GIB, TwinGpu, TwinNvml  # noqa: E402
from oomguard.twin.processes import (  # noqa: E402
    Alertmanager,
    Prometheus,
    RemediatorProcess,
    VllmProcess,
    free_port,
)

TOKEN = "detection-token"
NEIGHBOUR = 424242


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "detection.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="oomguard-detection-"))
    (work / "token").write_text(TOKEN)
    procs: list = []
    exporter = None
    hops: list[dict[str, float]] = []
    try:
        engines = [
            VllmProcess(
                "--max-num-seqs",
                "16",
                "--max-model-len",
                "2048",
                log=work / f"vllm{i}.log",
                token=TOKEN,
            )
            for i in range(2)
        ]
        procs += engines
        gpus = [TwinGpu(f"GPU-twin-{i}", minor=i) for i in range(2)]
        nvml = TwinNvml(gpus)
        for i, e in enumerate(engines):
            # at its planned peak: vLLM's default gmu 0.92 x the CUDA total (NVML's less reserved)
            nvml.set_process(i, e.proc.pid, int(0.92 * (gpus[i].total - gpus[i].reserved)))
        port = free_port()
        exporter = Exporter(
            ExporterConfig(
                listen=f"127.0.0.1:{port}",
                interval_seconds=0.5,
                hostname="twin-node",
                vllm=[
                    VllmTarget(name=f"llama-{i}", url=f"{e.url}/metrics", gpus=[str(i)])
                    for i, e in enumerate(engines)
                ],
                cgroups=[],
                allocator={"directory": str(work / "allocator")},
            ),
            nvml_backend=nvml,
        )
        exporter.start()
        listen = f"127.0.0.1:{free_port()}"
        am = Alertmanager(
            work / "am", f"http://{listen}", work / "token", remediator=f"http://{listen}"
        )
        procs.append(am)
        rules = work / "rules.yaml"
        rules.write_text(
            alert_outputs(
                AlertThresholds(
                    keep_firing_for="3s", action_keep_firing_for="3s", rule_interval="1s"
                )
            )[RULES]
        )
        prom = Prometheus(
            work / "prom",
            {"oomguard-exporter": [f"127.0.0.1:{port}"]},
            alertmanager=am.url.removeprefix("http://"),
            rules=rules,
        )
        procs.append(prom)
        rem = RemediatorProcess(
            work / "rem",
            {
                "listen": listen,
                "auth": {"bearer_token_file": str(work / "token")},
                "targets": [
                    {
                        "name": f"llama-{i}",
                        "url": e.url,
                        "model": "tiny",
                        "token_file": str(work / "token"),
                    }
                    for i, e in enumerate(engines)
                ],
                "safety": {"cooldown_seconds": 0, "max_actions": 1000},
                "audit_log": str(work / "audit.jsonl"),
                "reconcile_seconds": 1.0,
            },
        )
        procs.append(rem)
        prom.wait_for('up{job="oomguard-exporter"} == 1', 30)
        time.sleep(3)
        client = httpx.Client(timeout=5)
        for r in range(args.rounds):
            gpu = gpus[0]
            audit_lines = (
                len((work / "audit.jsonl").read_text().splitlines())
                if (work / "audit.jsonl").exists()
                else 0
            )
            t0 = time.time()
            # leaves 0.25 GiB free: the engine's next peak no longer has its headroom (critical)
            nvml.set_process(0, NEIGHBOUR, gpu.free - GIB // 4)
            marks: dict[str, float] = {}
            deadline = time.monotonic() + 30
            while len(marks) < 4 and time.monotonic() < deadline:
                now = time.time()
                if "exporter" not in marks:
                    text = client.get(f"http://127.0.0.1:{port}/metrics").text
                    if any(
                        line.startswith("oomguard_engine_pressure_level{")
                        and 'target="llama-0"' in line
                        and float(line.rsplit(" ", 1)[1]) == 3
                        for line in text.splitlines()
                    ):
                        marks["exporter"] = now
                if "prometheus" not in marks and prom.query(
                    'ALERTS{alertname="OomguardMemoryCritical",alertstate="firing",target="llama-0"}'
                ):
                    marks["prometheus"] = now
                if "remediator" not in marks and (work / "audit.jsonl").exists():
                    for line in (work / "audit.jsonl").read_text().splitlines()[audit_lines:]:
                        entry = json.loads(line)
                        if entry["event"] == "received":
                            marks["remediator"] = entry["time"]
                            break
                if "engine" not in marks:
                    state = client.get(f"{engines[0].url}/oomguard/v1/state").json()
                    if state["mode"] == "draining":
                        marks["engine"] = now
                time.sleep(0.02)
            hops.append({k: round(v - t0, 3) for k, v in marks.items()})
            print(f"round {r + 1}: {hops[-1]}", flush=True)
            # clear: the neighbour leaves, the alert resolves, the engine is re-admitted
            nvml.set_process(0, NEIGHBOUR, None)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                state = client.get(f"{engines[0].url}/oomguard/v1/state").json()
                if state["mode"] == "serving" and not prom.query(
                    'ALERTS{alertname="OomguardMemoryCritical",alertstate="firing"}'
                ):
                    break
                time.sleep(0.5)
            time.sleep(2)
            # re-admission needs traffic; set the cap back so the next round starts at full
            client.put(
                f"{engines[0].url}/oomguard/v1/admission",
                json={"cap": 16},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            time.sleep(2)
    finally:
        if exporter is not None:
            exporter.stop()
        for p in reversed(procs):
            p.stop()
    complete = [h for h in hops if len(h) == 4]
    summary: dict[str, dict[str, float]] = {}
    for hop in ("exporter", "prometheus", "remediator", "engine"):
        values = [h[hop] for h in complete]
        if values:
            summary[hop] = {
                "p50": round(statistics.median(values), 3),
                "p95": round(pct(values, 0.95), 3),
                "max": round(max(values), 3),
            }
    engine_p95 = summary.get("engine", {}).get("p95")
    targets = {"detection_to_action_p95_under_5s": engine_p95 is not None and engine_p95 < 5}
    print(json.dumps(summary, indent=2))
    print("targets:", json.dumps(targets))
    record.write(
        args.out,
        "detection",
        False,
        rounds=hops,
        cumulative_seconds_from_condition=summary,
        targets_met=targets,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
