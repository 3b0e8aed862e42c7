"""Live: a real Prometheus with the shipped config and rules scrapes a running exporter that
reads a vLLM /metrics endpoint under (simulated) load, dcgm-exporter output, allocator hand-off
files and a cgroup; the real remediator (watching a plugin stand-in) and the real Alertmanager
run beside it. Every dashboard panel query, every variable and every rule then has data and no
errors, and a healthy stack pages nobody.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from typing import Any

import pytest

from oomguard.alerts.rules import all_alerts, all_recording_rules
from oomguard.dashboards.definitions import DASHBOARDS
from oomguard.dashboards.generate import dashboard_path
from oomguard.handoff import AllocatorReport, write_report
from oomguard.lab.processes import Alertmanager, RemediatorProcess
from oomguard.thresholds import AlertThresholds
from tests.conftest import DCGM_K8S, VLLM_FIXTURE, LocalServer, free_port
from tests.promql import metric_names, substitute_grafana
from tests.stack import Prometheus, growing_metrics, start_exporter, stop

pytestmark = pytest.mark.slow
GIB = 1024**3
NVML_ONLY = "oomguard_gpu_process_memory_used_bytes"
# Counters the remediator creates on first use (an action taken, a limit hit, a read that
# failed): on a healthy stack that has done nothing, queries over them are empty. Everything
# else, on all three dashboards, must return data.
LAZY_COUNTERS = {
    "oomguard_remediator_actions_total",
    "oomguard_remediator_safety_limited_total",
    "oomguard_remediator_reconcile_errors_total",
    "oomguard_incidents_total",  # a series per classified incident: none on a healthy stack
    "oomguard_requests_lost_total",  # a series per engine that died of an OOM: none either
    "oomguard_step_guard_shrinks_total",  # a series per shrink's action and reason: none either
    "oomguard_remediator_thread_restarts_total",  # a series per restarted thread: none either
}
# Sources this stack does not run: kube-state-metrics (the Kubernetes-only alerts; their labels are
# checked against the operator's scrape in tests/test_operator_scrape.py) and `oomguard serve`'s
# supervisor (a single box: tests/test_rehearsal.py).
OTHER_SOURCES = {"oomguard_supervisor_thread_restarts_total"}
PLUGIN_STATE = {
    "startup_max_num_seqs": 64,
    "admission_cap": 64,
    "mode": "serving",
    "running": 3,
    "waiting": 0,
    "drained": False,
    "kv_cache_usage": 0.4,
    "since_cap_change": {"seconds": 600.0, "admitted": 100, "finished": 97, "preemptions": 0},
}


def plugin_stand_in() -> LocalServer:
    """The oomguard plugin's state route of a healthy, uncapped engine (the remediator only
    reads it here: with nothing firing it has nothing to change)."""

    def respond(handler: Any) -> tuple[int, bytes, str]:
        if handler.path.rstrip("/").endswith("/oomguard/v1/state"):
            return 200, json.dumps(PLUGIN_STATE).encode(), "application/json"
        return 404, b"{}", "application/json"

    return LocalServer(respond)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from pathlib import Path

    repo_root = Path(__file__).resolve().parent.parent
    tmp = tmp_path_factory.mktemp("live")
    # the fixture preempts 1.4 % of its requests, over the 1 % a healthy engine stays under
    vllm = growing_metrics(VLLM_FIXTURE.read_text(), frozen=("vllm:num_preemptions_total",))
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
        plugin = plugin_stand_in()
        cleanup.callback(plugin.close)
        (tmp / "token").write_text("live-stack-token\n")
        listen = f"127.0.0.1:{free_port()}"
        am = Alertmanager(
            tmp / "am",
            f"http://127.0.0.1:{free_port()}",
            tmp / "token",
            remediator=f"http://{listen}",
        )
        cleanup.callback(am.stop)
        remediator = RemediatorProcess(
            tmp / "rem",
            {
                "listen": listen,
                "auth": {"bearer_token_file": str(tmp / "token")},
                # named as the exporter names the engine: the rules join on `target`
                "targets": [
                    {"name": "llama", "url": plugin.url.removesuffix("/metrics"), "model": "m"}
                ],
                "alertmanager": {"url": am.url, "resync_seconds": 5},
                "audit_log": str(tmp / "audit.jsonl"),
            },
        )
        cleanup.callback(remediator.stop)
        vllm_addr = vllm.url.removeprefix("http://").removesuffix("/metrics")
        t = AlertThresholds()
        prom = Prometheus(
            tmp / "prom",
            {
                t.exporter_job: [exporter_addr],
                t.vllm_job: [vllm_addr],
                t.remediator_job: [listen],
                "alertmanager": [am.url.removeprefix("http://")],
            },
        )
        cleanup.callback(prom.stop)
        # enough samples for rate() over the substituted 1m range and for the recording rules
        prom.wait_for("engine:oomguard_engine_pressure_level:max", 30)
        prom.wait_for("count_over_time(oomguard_vllm_preemptions_total[1m]) >= 8", 30)
        prom.wait_for("count_over_time(vllm:request_success_total[1m]) >= 3", 40)
        prom.wait_for("oomguard_remediator_admission_cap", 40)
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


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_query_returns_data(stack, name):
    prom, repo_root = stack
    dashboard = json.loads((repo_root / dashboard_path(name)).read_text())
    unexplained = []
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            expr = substitute_grafana(t["expr"])
            # This stack reads GPUs through dcgm-exporter, so the NVML-only per-process series
            # may be empty (its panel shows the per-pod series too); the remediator's lazy
            # counters are empty until it acts. Nothing else may be. Those two are asked once
            # (Prometheus must still evaluate them): waiting has_data's patience (10 s each)
            # for data they need not have only made the test a minute longer.
            if NVML_ONLY in t["expr"] or metric_names(expr) & LAZY_COUNTERS:
                prom.query(expr)
                continue
            if not has_data(prom, expr):
                unexplained.append((panel["title"], t["expr"]))
    assert not unexplained, f"panel queries without data: {unexplained}"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_variable_lists_values(stack, name):
    """Each variable's label_values() source has series carrying the label (cluster only
    exists behind a central ruler or remote-write, so it is empty on this single box)."""
    prom, repo_root = stack
    dashboard = json.loads((repo_root / dashboard_path(name)).read_text())
    for v in dashboard["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", v.get("query", ""), re.S)
        if not m or m.group(2) == AlertThresholds().cluster_label:
            continue
        selector, label = m.groups()
        values = {r["metric"].get(label) for r in prom.query(substitute_grafana(selector))}
        assert values - {None}, (v["name"], selector)


def test_every_rule_evaluates_without_error(stack):
    prom, _ = stack
    # A group evaluated once a minute (the SLO ratios) may not have run yet, its rules' health
    # "unknown": wait for every rule's first evaluation, bounded. (This test used to run after a
    # minute of the panel test's waiting and never had to.)
    deadline = time.monotonic() + 90
    rules = prom.rules()
    while any(r["health"] == "unknown" for r in rules) and time.monotonic() < deadline:
        time.sleep(1)
        rules = prom.rules()
    assert len(rules) == len(all_alerts()) + len(all_recording_rules())
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad


def test_every_series_a_rule_reads_has_data(stack):
    prom, _ = stack
    names = set()
    for expr in [a.expr for a in all_alerts()] + [r.expr for r in all_recording_rules()]:
        names |= metric_names(expr)
    names -= LAZY_COUNTERS | OTHER_SOURCES
    names = {n for n in names if not n.startswith("kube_")}
    # The SLO group evaluates once a minute: its first pass may have come before any rate had
    # two samples, so a series it records may take up to one more interval to appear.
    missing = [
        n for n in sorted(names) if not has_data(prom, f"count({{__name__={n!r}}})", patience=75)
    ]
    assert not missing


def test_capacity_withheld_is_recorded_per_model(stack):
    prom, _ = stack
    (series,) = prom.wait_for("model_name:oomguard_capacity_withheld_seqs:sum", 30)
    assert series["value"][1] == "0"  # an uncapped, serving engine withholds nothing
    assert series["metric"]["model_name"]


def test_a_healthy_stack_pages_nobody_and_orders_nothing(stack):
    prom, _ = stack
    firing = prom.query('ALERTS{alertstate="firing"}')
    names = {r["metric"]["alertname"] for r in firing}
    assert "Watchdog" in names
    pages = {r["metric"]["alertname"] for r in firing if r["metric"]["severity"] == "critical"}
    orders = {r["metric"]["alertname"] for r in firing if "oomguard_action" in r["metric"]}
    assert not pages and not orders, (pages, orders)


def test_all_dashboards_are_covered():
    assert set(DASHBOARDS) == {"fleet", "node", "remediation"}
