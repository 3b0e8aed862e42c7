"""Exporter benchmark: scrape latency, render cost, polling CPU and memory over a soak.

Scenario (issue targets): 8 GPUs with 64 processes (fake NVML returning pynvml's real structs),
8 vLLM engines (8 local servers in a separate process, so their CPU is not counted), the
allocator hand-off with 8 ranks, one cgroup. About 650 series.

Side by side in one run, because this machine is shared and noisy:
- render: oomguard's cached text renderer vs a plain prometheus_client registry;
- scrape over HTTP (keep-alive): oomguard serving pre-rendered bytes vs prometheus_client's own
  server rendering the same families on every scrape.

Usage: python bench/exporter.py [--quick]   (writes bench/results/exporter.json)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import start_http_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oomguard.exporter.collectors.allocator import AllocatorCollector  # noqa: E402
from oomguard.exporter.collectors.cgroup import CgroupCollector  # noqa: E402
from oomguard.exporter.collectors.nvml import NvmlCollector  # noqa: E402
from oomguard.exporter.collectors.vllm import VllmCollector  # noqa: E402
from oomguard.exporter.poller import Poller  # noqa: E402
from oomguard.exporter.render import _FamiliesCollector  # noqa: E402
from oomguard.exporter.server import MetricsServer  # noqa: E402
from oomguard.handoff import AllocatorReport, write_report  # noqa: E402
from tests.fake_nvml import GIB, FakeGpu, FakeNvml  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "vllm" / "vllm-dp2-multiproc.constructed.prom"

SERVER_SCRIPT = r"""
import sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
body = open(sys.argv[1], "rb").read()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        # headers and body in one write, as uvicorn does: no Nagle/delayed-ACK stall
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
ports = []
for _ in range(int(sys.argv[2])):
    s = ThreadingHTTPServer(("127.0.0.1", 0), H)
    s.daemon_threads = True
    threading.Thread(target=s.serve_forever, daemon=True).start()
    ports.append(s.server_address[1])
print(" ".join(map(str, ports)), flush=True)
sys.stdin.read()
"""


def one_engine_fixture(tmp: Path) -> Path:
    """The DP=2 fixture reduced to engine 0: one engine per server, eight servers."""
    lines = [ln for ln in FIXTURE.read_text().splitlines() if 'engine="1"' not in ln]
    path = tmp / "vllm-one-engine.prom"
    path.write_text("\n".join(lines) + "\n")
    return path


def gpus() -> list[FakeGpu]:
    return [
        FakeGpu(
            f"GPU-{i:08d}-bench",
            bus_id=f"00000000:{0x18 + i:02X}:00.0",
            minor=i,
            free=(10 + i) * GIB,
            processes=[(10_000 + i * 8 + p, (4 + p) * GIB) for p in range(8)],
        )
        for i in range(8)
    ]


def build_poller(ports: list[int], alloc_dir: Path, cgroup_dir: Path, interval: float) -> Poller:
    for rank in range(8):
        write_report(
            alloc_dir,
            AllocatorReport(
                timestamp=time.time() + 3600,
                pid=20_000 + rank,
                rank=rank,
                target=f"e{rank}",
                engine="0",
                device_index=rank,
                device_uuid=f"GPU-{rank:08d}-bench",
                allocated_bytes=30 * GIB,
                reserved_bytes=34 * GIB,
                allocated_peak_bytes=33 * GIB,
                reserved_peak_bytes=35 * GIB,
                inactive_split_bytes=GIB,
                alloc_retries=0,
                ooms=0,
            ),
        )
    collectors = [NvmlCollector("bench-node")]
    collectors += [
        VllmCollector(f"e{i}", f"http://127.0.0.1:{port}/metrics", timeout=2)
        for i, port in enumerate(ports)
    ]
    collectors.append(AllocatorCollector(str(alloc_dir), "bench-node", stale_after=7200))
    collectors.append(CgroupCollector("self", str(cgroup_dir), "bench-node"))
    return Poller(collectors, interval=interval, engine_gpus={f"e{i}": [str(i)] for i in range(8)})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scrape_latencies(port: int, n: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t0)
    conn.close()
    return out


def measure(args: argparse.Namespace) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp_s, pytest.MonkeyPatch.context() as mp:
        tmp = Path(tmp_s)
        FakeNvml(mp, gpus())
        cgroup = tmp / "cg"
        cgroup.mkdir()
        (cgroup / "memory.current").write_text("1073741824\n")
        (cgroup / "memory.max").write_text("68719476736\n")
        (cgroup / "memory.events").write_text("oom 0\noom_kill 0\n")
        servers = subprocess.Popen(
            [sys.executable, "-c", SERVER_SCRIPT, str(one_engine_fixture(tmp)), "8"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert servers.stdout is not None  # stdout=PIPE
            ports = [int(p) for p in servers.stdout.readline().split()]
            poller = build_poller(ports, tmp / "alloc", cgroup, interval=1.0)
            for state in poller.states:
                poller.poll(state)
            snapshot = poller.render()
            families = snapshot.families
            n_series = sum(len(f.samples) for f in families)
            results["series"] = n_series
            print(f"scenario: 8 GPUs, 64 processes, 8 engines, 8 ranks -> {n_series} series")

            # -- render, side by side -----------------------------------------------------
            registry = CollectorRegistry()
            registry.register(_FamiliesCollector(families))
            reps = 50 if args.quick else 300
            plain, ours = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                generate_latest(registry)
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                poller.renderer.render(families)
                ours.append(time.perf_counter() - t0)
            results["render_ms"] = {
                "prometheus_client_median": statistics.median(plain) * 1e3,
                "oomguard_median": statistics.median(ours) * 1e3,
            }
            print(
                "render median: prometheus_client {:.3f} ms, oomguard {:.3f} ms".format(
                    *results["render_ms"].values()
                )
            )

            # -- scrape over HTTP, side by side --------------------------------------------
            ours_srv = MetricsServer(("127.0.0.1", 0), lambda: snapshot, max_snapshot_age=1e9)
            ours_srv.start()
            plain_srv, _plain_thread = start_http_server(0, addr="127.0.0.1", registry=registry)
            n = 300 if args.quick else 3000
            scrape_latencies(ours_srv.port, 50)  # warm-up
            scrape_latencies(plain_srv.server_address[1], 50)
            ours_lat, plain_lat = [], []
            for _ in range(5):  # interleave to share the noise
                ours_lat += scrape_latencies(ours_srv.port, n // 5)
                plain_lat += scrape_latencies(plain_srv.server_address[1], n // 5)
            ours_srv.stop()
            plain_srv.shutdown()
            results["scrape_ms"] = {
                "oomguard_p50": percentile(ours_lat, 0.5) * 1e3,
                "oomguard_p99": percentile(ours_lat, 0.99) * 1e3,
                "prometheus_client_p50": percentile(plain_lat, 0.5) * 1e3,
                "prometheus_client_p99": percentile(plain_lat, 0.99) * 1e3,
            }
            results["scrape_speedup_p99"] = (
                results["scrape_ms"]["prometheus_client_p99"] / results["scrape_ms"]["oomguard_p99"]
            )
            s = results["scrape_ms"]
            print(
                f"scrape p50/p99: oomguard {s['oomguard_p50']:.3f}/{s['oomguard_p99']:.3f} ms, "
                f"prometheus_client {s['prometheus_client_p50']:.3f}/"
                f"{s['prometheus_client_p99']:.3f} ms "
                f"({results['scrape_speedup_p99']:.1f}x at p99)"
            )

            # -- polling CPU at 1 s and 100 ms ---------------------------------------------
            results["poll_cpu_percent_of_one_core"] = {}
            for interval, seconds in (
                (1.0, 6 if args.quick else 20),
                (0.1, 4 if args.quick else 10),
            ):
                p = build_poller(ports, tmp / "alloc", cgroup, interval)
                p.start()
                time.sleep(interval * 2)
                c0, w0 = time.process_time(), time.monotonic()
                time.sleep(seconds)
                c1, w1 = time.process_time(), time.monotonic()
                p.stop()
                pct = 100 * (c1 - c0) / (w1 - w0)
                results["poll_cpu_percent_of_one_core"][f"{interval}s"] = pct
                print(f"polling CPU at {interval}s interval: {pct:.2f} % of one core")

            # -- memory over a soak ----------------------------------------------------------
            polls = 500 if args.quick else args.soak_polls
            p = build_poller(ports, tmp / "alloc", cgroup, 1.0)
            tracemalloc.start()
            marks = {}
            t0 = time.monotonic()
            for i in range(1, polls + 1):
                for state in p.states:
                    p.poll(state)
                p.render()
                if i in (polls // 4, polls):
                    marks[i] = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            first, last = marks[polls // 4], marks[polls]
            results["soak"] = {
                "polls": polls,
                "seconds": time.monotonic() - t0,
                "traced_bytes_at_25pct": first,
                "traced_bytes_at_end": last,
                "growth_bytes": last - first,
                "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
            print(
                f"soak {polls} polls: traced memory {first / 1e6:.2f} MB at 25 % -> "
                f"{last / 1e6:.2f} MB at the end ({(last - first) / 1e3:+.1f} kB)"
            )
        finally:
            if servers.stdin is not None:
                servers.stdin.close()
            servers.wait(10)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI)")
    parser.add_argument("--soak-polls", type=int, default=10_000)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "exporter.json"))
    args = parser.parse_args()
    results = measure(args)
    targets = {
        "scrape_p99_under_1ms": results["scrape_ms"]["oomguard_p99"] < 1.0,
        "scrape_5x_faster_than_plain_registry": results["scrape_speedup_p99"] >= 5.0,
        "poll_cpu_under_2pct_at_1s": results["poll_cpu_percent_of_one_core"]["1.0s"] < 2.0,
        "poll_cpu_under_10pct_at_100ms": results["poll_cpu_percent_of_one_core"]["0.1s"] < 10.0,
        # flat: under 1 MB of traced growth between 25 % and 100 % of the soak (bounded caches
        # in urllib and httpx fill during the first ~2,500 polls, then stay put)
        "memory_flat_over_soak": results["soak"]["growth_bytes"] < 1_000_000,
    }
    record = {
        "benchmark": "exporter",
        "quick": args.quick,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "results": results,
        "targets_met": targets,
    }
    for name, ok in targets.items():
        print(f"{'PASS' if ok else 'MISS'}  {name}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"recorded {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
