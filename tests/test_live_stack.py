"""Live: a real Prometheus with the shipped config and rules scrapes a running exporter that
reads a vLLM /metrics endpoint under (simulated) load, dcgm-exporter output, allocator hand-off
files and a cgroup. Every dashboard panel query and every rule then has data and no errors.

The remediation dashboard and the remediator's metrics are left out: the remediator does not
exist yet (it is its own issue), so nothing exports them on this stack.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
from oomguard.alerts.rules import alerts, recording_rules
from oomguard.dashboards.definitions import DASHBOARDS
from oomguard.dashboards.generate import dashboard_path

from oomguard.catalog import exported_names
from oomguard.handoff import AllocatorReport, write_report
from oomguard.thresholds import AlertThresholds
from tests.conftest import DCGM_K8S, VLLM_FIXTURE
from tests.promql import metric_names, substitute_grafana
from tests.stack import Prometheus, growing_metrics, start_exporter, stop

pytestmark = pytest.mark.slow
GIB = 1024**3
LIVE_DASHBOARDS = ("fleet", "node")
REMEDIATOR_METRICS = exported_names("remediator")
NVML_ONLY = "oomguard_gpu_process_memory_used_bytes"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from pathlib import Path

    repo_root = Path(__file__).resolve().parent.parent
    tmp = tmp_path_factory.mktemp("live")
    vllm = growing_metrics(VLLM_FIXTURE.read_text())
    cgroup = tmp / "cg"
    cgroup.mkdir()
    (cgroup / "memory.current").write_text(f"{20 * GIB}\n")
    (cgroup / "memory.max").write_text(f"{64 * GIB}\n")
    (cgroup / "memory.events").write_text("oom 0\noom_kill 0\n")
    stop_writing = threading.Event()

    def publish() -> None:  # a rank inside vLLM publishing its allocator stats every second
        n = 0
        while not stop_writing.is_set():
            n += 1
            write_report(
                tmp / "alloc",
                AllocatorReport(
                    timestamp=time.time(),
                    pid=4242,
                    rank=0,
                    target="llama",
                    engine="0",
                    device_index=0,
                    device_uuid="GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90",
                    allocated_bytes=60 * GIB + n,
                    reserved_bytes=64 * GIB,
                    allocated_peak_bytes=62 * GIB,
                    reserved_peak_bytes=65 * GIB,
                    inactive_split_bytes=GIB,
                    alloc_retries=0,
                    ooms=0,
                    free_after_gc_bytes=9 * GIB,
                    gc_timestamp=time.time(),
                ),
            )
            stop_writing.wait(1)

    # Everything started is registered for shutdown at once, so a failure half-way through
    # start-up leaves no process behind.
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(vllm.close)
        writer = threading.Thread(target=publish, daemon=True)
        writer.start()
        cleanup.callback(writer.join, 5)
        cleanup.callback(stop_writing.set)
        exporter, exporter_addr = start_exporter(
            "--no-nvml",
            "--interval",
            "0.5",
            "--dcgm-file",
            str(DCGM_K8S),
            "--vllm",
            f"llama={vllm.url}",
            "--allocator-dir",
            str(tmp / "alloc"),
            "--cgroup",
            f"vllm={cgroup}",
        )
        cleanup.callback(stop, exporter)
        vllm_addr = vllm.url.removeprefix("http://").removesuffix("/metrics")
        prom = Prometheus(tmp / "prom", {"oomguard-exporter": [exporter_addr], "vllm": [vllm_addr]})
        cleanup.callback(prom.stop)
        # enough samples for rate() over the substituted 1m range and for the recording rules
        prom.wait_for("engine:oomguard_engine_pressure_level:max", 30)
        prom.wait_for("count_over_time(oomguard_vllm_preemptions_total[1m]) >= 8", 30)
        prom.wait_for('ALERTS{alertname="Watchdog"}', 30)
        yield prom, repo_root


def has_data(prom, expr: str, patience: float = 10.0) -> bool:
    """A query has data now or within a few scrapes (a loaded machine can lag a second)."""
    deadline = time.monotonic() + patience
    while True:
        if prom.query(expr):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1)


@pytest.mark.parametrize("name", LIVE_DASHBOARDS)
def test_every_panel_query_returns_data(stack, name):
    prom, repo_root = stack
    dashboard = json.loads((repo_root / dashboard_path(name)).read_text())
    empty_panels, empty_queries = [], []
    for panel in dashboard["panels"]:
        results = [has_data(prom, substitute_grafana(t["expr"])) for t in panel["targets"]]
        if not any(results):
            empty_panels.append(panel["title"])
        empty_queries += [
            t["expr"] for t, ok in zip(panel["targets"], results, strict=True) if not ok
        ]
    assert not empty_panels, f"panels with no data: {empty_panels}"
    # This stack reads GPUs through dcgm-exporter, so the NVML-only per-process series is the
    # one query allowed to be empty (its panel shows the per-pod series instead).
    assert all(NVML_ONLY in q for q in empty_queries), empty_queries


def test_every_rule_evaluates_without_error(stack):
    prom, _ = stack
    rules = prom.rules()
    assert len(rules) == len(alerts(AlertThresholds())) + len(recording_rules())
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad


def test_every_series_an_alert_reads_has_data(stack):
    prom, _ = stack
    names = set()
    for a in alerts(AlertThresholds()):
        names |= metric_names(a.expr)
    names -= REMEDIATOR_METRICS
    missing = [n for n in sorted(names) if not has_data(prom, f"count({n})")]
    assert not missing


def test_healthy_stack_raises_no_pressure_alert(stack):
    prom, _ = stack
    firing = {r["metric"]["alertname"] for r in prom.query('ALERTS{alertstate="firing"}')}
    assert "Watchdog" in firing
    assert not firing & {
        "OomguardMemoryCritical",
        "OomguardMemoryPressure",
        "OomguardGpuMemoryCritical",
        "OomguardEngineDown",
    }


def test_all_dashboards_are_covered():
    assert set(DASHBOARDS) - set(LIVE_DASHBOARDS) == {"remediation"}
