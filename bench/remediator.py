"""Remediator benchmark: an alert storm, and the time from a webhook to the cap changed.

Real parts: `oomguard remediator` as its own process, over HTTP, acting on a real vLLM 0.33
server with the plugin (CPU platform, model-free executor) under steady load.

1. Alert storm: 10,000 alerts in 500 payloads; each payload is posted twice (as two Alertmanager
   HA peers do) by 8 concurrent sender processes. Per-payload handling time as the remediator
   reports it (Server-Timing: read, parse, fsynced audit record, apply), and the round trip the
   senders see (on this 2-core machine it includes the senders' own CPU and queueing behind
   each other); duplicate actions on the engine (an action that re-applies a state already in
   effect); the remediator's RSS after each of three storms (new episodes of the same 10,000
   alerts, as a fleet's repeated incidents are), each ended by resolving its alerts (memory flat:
   the third storm adds nothing to what the second left).
2. Webhook to cap: post a firing pressure alert, poll the engine's own state until its cap has
   dropped; reset the cap between rounds. Side by side in the same run: the same change made by a
   direct PUT to the plugin (the floor the remediator adds to).

Usage: python -m bench.remediator [--quick]   (writes bench/results/remediator.json)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench import record
from oomguard.lab.processes import RemediatorProcess
from tests.remediator_helpers import alert, payload
from tests.vllm_server import AUTH, TOKEN, SteadyLoad, VllmServer

ROOT = Path(__file__).resolve().parents[1]

RTOKEN = "bench-remediator-token"
HEADERS = {"Authorization": f"Bearer {RTOKEN}"}
NAMES = ["OomguardMemoryPressure", "OomguardPreemptionRateHigh", "OomguardKVCacheUsageHigh"]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values) * 1e3, 2),
        "p95": round(pct(values, 0.95) * 1e3, 2),
        "p99": round(pct(values, 0.99) * 1e3, 2),
        "max": round(max(values) * 1e3, 2),
        "n": len(values),
    }


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _send_share(url: str, bodies: list[bytes]) -> list[tuple[float, float]]:
    """One sender process: (client-side seconds, server-side handling seconds) per request."""
    out = []
    with httpx.Client(timeout=30) as client:
        for body in bodies:
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/alertmanager", content=body, headers=HEADERS)
            elapsed = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            server = float(r.headers["Server-Timing"].split("dur=")[1]) / 1e3
            out.append((elapsed, server))
    return out


def storm_payloads(round_: int, payloads: int, per: int, resolve: bool = False) -> list[bytes]:
    """One storm: `payloads` groups of `per` alerts, new episodes; a quarter resolved
    (or, with `resolve`, every one of them resolved: the end of the storm)."""
    bodies = []
    for p in range(payloads):
        alerts = []
        for k in range(per):
            i = p * per + k
            resolved = resolve or (i // len(NAMES)) % 4 == 3
            alerts.append(
                alert(
                    NAMES[i % len(NAMES)],
                    "llama",
                    status="resolved" if resolved else "firing",
                    start=round_ * 10_000 + p,
                    fingerprint=f"alert-{i:05d}",  # a fleet's alerts: new episodes, same labels
                    engine=str(i % 8),
                )
            )
        bodies.append(payload(*alerts, group=f"storm-{round_}-{p}"))
    return bodies


def storm(url: str, bodies: list[bytes], senders: int = 8) -> tuple[list[float], list[float]]:
    """Post every body twice (two HA peers) from `senders` processes."""
    doubled = [b for body in bodies for b in (body, body)]
    shares = [doubled[k::senders] for k in range(senders)]
    with ProcessPoolExecutor(senders, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_send_share, [url] * senders, shares))
    client = [c for share in results for c, _ in share]
    server = [s for share in results for _, s in share]
    return client, server


def duplicate_actions(audit: Path) -> tuple[int, int]:
    """(actions, actions that re-applied the state already in effect)."""
    acted = [e for e in map(json.loads, audit.read_text().splitlines()) if e["event"] == "acted"]
    dupes = sum(
        1
        for e in acted
        if e["before"]["cap"] == e["after"]["cap"]
        and (e["action"] not in ("drain", "resume") or e["before"]["mode"] == e["after"]["mode"])
    )
    return len(acted), dupes


def webhook_to_cap(rem: RemediatorProcess, engine: VllmServer, rounds: int) -> list[float]:
    out = []
    with httpx.Client(timeout=10) as c:
        startup = c.get(f"{engine.url}/oomguard/v1/state").json()["startup_max_num_seqs"]
        for i in range(rounds):
            fired = alert(
                "OomguardMemoryPressure", "llama", start=100_000 + i, fingerprint=f"lat{i}"
            )
            t0 = time.perf_counter()
            r = c.post(f"{rem.url}/v1/alertmanager", content=payload(fired), headers=HEADERS)
            assert r.status_code == 200
            while c.get(f"{engine.url}/oomguard/v1/state").json()["admission_cap"] >= startup:
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError("the cap did not change within 10 s")
            out.append(time.perf_counter() - t0)
            resolved = alert(
                "OomguardMemoryPressure",
                "llama",
                status="resolved",
                start=100_000 + i,
                fingerprint=f"lat{i}",
            )
            c.post(f"{rem.url}/v1/alertmanager", content=payload(resolved), headers=HEADERS)
            c.put(f"{engine.url}/oomguard/v1/admission", json={"cap": startup}, headers=AUTH)
            time.sleep(0.05)
    return out


def direct_put(engine: VllmServer, rounds: int) -> list[float]:
    out = []
    with httpx.Client(timeout=10) as c:
        for i in range(rounds):
            t0 = time.perf_counter()
            r = c.put(
                f"{engine.url}/oomguard/v1/admission",
                json={"cap": 12 if i % 2 else 16},
                headers=AUTH,
            )
            assert r.status_code == 200
            out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "remediator.json"))
    args = parser.parse_args()
    payloads, per, rounds = (100, 20, 20) if args.quick else (500, 20, 100)
    work = Path(tempfile.mkdtemp(prefix="oomguard-bench-remediator-"))
    (work / "rtoken").write_text(RTOKEN)
    (work / "ptoken").write_text(TOKEN)
    engine = VllmServer("--max-num-seqs", "16", "--max-model-len", "2048", log=work / "vllm.log")
    rem = None
    load = SteadyLoad(engine.url, clients=4, max_tokens=8, timeout=120)
    try:
        rem = RemediatorProcess(
            work / "rem",
            {
                "auth": {"bearer_token_file": str(work / "rtoken")},
                "targets": [
                    {
                        "name": "llama",
                        "url": engine.url,
                        "model": "tiny",
                        "token_file": str(work / "ptoken"),
                    }
                ],
                "policy": {"step_seconds": 3600},  # one step per incident: count each once
                "safety": {"cooldown_seconds": 0, "max_actions": 100000},
                "audit_log": str(work / "audit.jsonl"),
                "reconcile_seconds": 1.0,
            },
        )
        pid = rem.proc.pid
        rss = [rss_kib(pid)]
        storm_times, server_times = [], []
        for r in range(3):  # three storms (new episodes of the same alerts), each resolved
            client_s, server_s = storm(rem.url, storm_payloads(r, payloads, per))
            storm_times += client_s
            server_times += server_s
            storm(rem.url, storm_payloads(r, payloads, per, resolve=True), senders=2)
            time.sleep(2)
            rss.append(rss_kib(pid))
        actions, dupes = duplicate_actions(work / "audit.jsonl")
        httpx.put(f"{engine.url}/oomguard/v1/admission", json={"cap": 16}, headers=AUTH)
        time.sleep(2)
        lat = webhook_to_cap(rem, engine, rounds)
        direct = direct_put(engine, rounds)
    finally:
        load.close()
        if rem:
            rem.stop()
        engine.stop()
    results: dict[str, Any] = {
        "storm": {
            "storms": 3,
            "alerts_per_storm": payloads * per,
            "payloads_per_storm": payloads,
            "requests": 6 * payloads,
            "senders": 8,
            "handling_ms": summary_ms(server_times),
            "client_round_trip_ms": summary_ms(storm_times),
            "actions": actions,
            "duplicate_actions": dupes,
            "rss_kib_at_start_and_after_each_storm": rss,
        },
        "webhook_to_cap_ms": summary_ms(lat),
        "direct_plugin_put_ms": summary_ms(direct),
        "load_requests_failed": sum(1 for s in load.statuses if s != 200),
    }
    s = results["storm"]
    print(
        f"storms: 3 x {payloads} payloads x 2 senders: handling p50 "
        f"{s['handling_ms']['p50']} ms, p99 {s['handling_ms']['p99']} ms (round trip seen by "
        f"the senders p50 {s['client_round_trip_ms']['p50']} ms, p99 "
        f"{s['client_round_trip_ms']['p99']} ms); actions {actions}, "
        f"duplicates {dupes}; RSS KiB {rss}"
    )
    print(
        f"webhook -> cap changed: p50 {results['webhook_to_cap_ms']['p50']} ms, p99 "
        f"{results['webhook_to_cap_ms']['p99']} ms (direct PUT p99 "
        f"{results['direct_plugin_put_ms']['p99']} ms)"
    )
    targets = {
        "storm_p99_under_20ms": s["handling_ms"]["p99"] < 20,
        "zero_duplicate_actions": dupes == 0,
        "memory_flat_third_storm_under_5MiB": rss[3] - rss[2] < 5 * 1024,
        "webhook_to_cap_p99_under_100ms": results["webhook_to_cap_ms"]["p99"] < 100,
    }
    print("targets:", json.dumps(targets))
    record.write(args.out, "remediator", args.quick, results=results, targets_met=targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
