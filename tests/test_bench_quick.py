"""The quick lane of every benchmark in bench/: its code path, its result's schema, a loose bound.

Each test runs the benchmark's own functions in a small configuration (seconds: one shared vLLM
server for the plugin and remediator lanes) and compares what it measures with the recorded
result under bench/results/, measured the same way, with a wide margin: BOUND times the recorded
figure plus a slack for a loaded machine. A broken benchmark fails here (an exception, a missing
key, a record the recorder refuses), and so does a gross regression; no timing is asserted
tighter than a shared 2-core machine can hold (lowest of a few repetitions where the measure
allows it, CPU time rather than wall time where the benchmark has both). The outcome benchmark's
lane is tests/test_outcome_bench.py (one trace on real vLLM twins).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BOUND = 3.0  # a measured figure this many times the recorded one (plus slack) fails


def recorded(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def assert_within(what: str, measured: float, recorded_value: float, slack: float) -> None:
    bound = BOUND * recorded_value + slack
    assert measured <= bound, (
        f"{what}: {measured:.4g} against {recorded_value:.4g} recorded (bound {bound:.4g}): "
        "a regression, or a broken benchmark"
    )


# -- the recorder: every benchmark's name has its measured paths ---------------------------------
def test_the_recorder_writes_what_the_lanes_read(tmp_path: Path) -> None:
    from bench import record

    rec = record.write(tmp_path / "x.json", "matrix", True, cells=[])
    assert json.loads((tmp_path / "x.json").read_text()) == rec
    assert rec["provenance"]["measures"] == list(record.MEASURES["matrix"])


# -- exporter -------------------------------------------------------------------------------------
@pytest.mark.slow  # the scenario's vLLM pages come from a subprocess
def test_exporter_quick_lane() -> None:
    from bench import exporter

    rec = recorded("exporter")["scenarios"]["node"]["results"]
    scenario = exporter.node(rec["series"])
    with exporter.running(scenario) as poller:
        snapshot = poller.render()
        assert sum(len(f.samples) for f in snapshot.families) == rec["series"]
        # MIG mode read when the layout is (MIG_RECHECK_SECONDS), not every poll of every GPU
        nvml = exporter.fake_driver_ms(poller, 3)
        assert nvml["calls_per_poll"].get("nvmlDeviceGetMigMode", 0) < len(scenario.gpus)
        registry = exporter.plain_registry(snapshot.families)
        render = exporter.measure_render(poller, registry, 2, snapshot.families)
        assert set(render) == set(rec["render_ms"])
        scrape = exporter.measure_scrape(poller, registry, n=20, rounds=1)
        assert set(scrape) == set(rec["scrape_ms"])
        prom = exporter.measure_prometheus_scrapes(poller, registry, 3)
        cycle = exporter.poll_cycle_ms(poller, cycles=3)
        assert set(cycle) == set(rec["poll_cycle_cpu_ms"])
        steady = min(
            exporter.measure_render(poller, registry, 1, snapshot.families)["oomguard_median"]
            for _ in range(2)
        )
    assert_within("steady render, ms", steady, rec["render_ms"]["oomguard_median"], slack=2.0)
    assert_within(
        "render with every value changed, ms",
        render["oomguard_every_value_changed_median"],
        rec["render_ms"]["oomguard_every_value_changed_median"],
        slack=10.0,
    )
    assert_within(
        "gzip scrape p50, ms",
        scrape["gzip"]["oomguard_p50"],
        rec["scrape_ms"]["gzip"]["oomguard_p50"],
        slack=2.0,
    )
    assert_within(
        "poll cycle CPU, ms", cycle["total"], rec["poll_cycle_cpu_ms"]["total"], slack=10.0
    )
    if "prometheus_scrape_ms" in rec:
        # every recorded figure is still measured; one added since (the lean client's) is
        # recorded by the next run
        assert set(rec["prometheus_scrape_ms"]) <= set(prom)
        assert {"oomguard_lean_client_p50", "oomguard_lean_client_p99"} <= set(prom)
        assert_within(
            "CPU per Prometheus scrape of a new snapshot, ms",
            prom["oomguard_cpu_ms_p50"],
            rec["prometheus_scrape_ms"]["oomguard_cpu_ms_p50"],
            slack=10.0,
        )
    targets = exporter.targets(
        "node",
        {
            **rec,
            "scrape_ms": scrape,
            "prometheus_scrape_ms": prom,
            "poll_cpu_percent_of_one_core": {"1.0s": 0.0},
            "soak": {"growth_bytes": 0},
        },
    )
    assert set(targets) == set(recorded("exporter")["scenarios"]["node"]["targets_met"])


# -- guard: decision cost, in-process -------------------------------------------------------------
def test_guard_quick_lane() -> None:
    from bench import guard

    rec = recorded("guard")
    speed = guard.machine_speed()  # ns per iteration of a fixed loop, now
    reqs = guard.requests(300)
    one = min(
        (guard.measure(1, reqs, rounds=3) for _ in range(2)),
        key=lambda r: r["us_per_decision_median"],
    )
    assert set(one) == set(rec["results"][0])
    # scaled by the machine's speed now and then: a busy machine slows both alike
    then = rec["results"][0]["us_per_decision_median"] / rec["ns_per_reference_loop_iteration"]
    assert_within("decision µs per loop ns", one["us_per_decision_median"] / speed, then, 0.05)


# -- step guard: its cost per step inside vLLM's engine, on the real server -----------------------
@pytest.mark.slow
def test_step_guard_quick_lane(tmp_path: Path) -> None:
    from bench import step_guard

    rec = recorded("step_guard")
    row = step_guard.phase("enforce", "pressed", seconds=8.0, clients=4, work=tmp_path)
    then = next(p for p in rec["phases"] if (p["mode"], p["gpu"]) == ("enforce", "pressed"))
    assert set(row) == set(then)
    assert row["shrinks"] and set(row["requests"]) == {"200"}  # it shrank, nothing failed
    assert_within(
        "step guard cost, share of a step",
        row["cost_share_of_step"],
        then["cost_share_of_step"],
        0.01,
    )


# -- matrix and recovery: simulated time ----------------------------------------------------------
def test_matrix_quick_lane() -> None:
    from bench import matrix
    from oomguard.lab.matrix import run

    rec = recorded("matrix")
    started = time.perf_counter()
    cells = run(("H100",), (0.92,), ("neighbour-growth",))  # and the steady cell beside it
    elapsed = time.perf_counter() - started
    then = {(c["gpu"], c["gmu"], c["scenario"]): c for c in rec["cells"]}
    for cell in cells:
        row = {**cell.record(), "met": matrix.judge(cell)}
        same = then[(row["gpu"], row["gmu"], row["scenario"])]
        assert set(row) == set(same)
        assert row["met"] is True
        if same["lead_s"] is not None:  # less lead is worse: a third of it at least
            assert_within("lead, s (recorded against now)", same["lead_s"], row["lead_s"], 0.0)
    per_cell = rec["seconds"] / rec["cells_total"]
    assert_within("seconds per cell", elapsed / len(cells), per_cell, slack=5.0)


def test_recovery_quick_lane() -> None:
    from bench import recovery
    from bench.outcome import with_horizon
    from oomguard.lab.matrix import trace_levels
    from oomguard.lab.recovery import alertmanager_path, simulate_recovery
    from oomguard.twin.traces import Trace

    rec = {(r["trace"], r["variant"], r["path"]): r for r in recorded("recovery")["rows"]}
    path = alertmanager_path()
    base = Trace.load("neighbour-growth")
    v = recovery.variants(path)["shipped"]
    r = simulate_recovery(
        recovery.loaded(base, v),
        trace_levels(with_horizon(base)),
        path=v.path,
        policy=v.policy,
        slowdown=v.slowdown,
        counts_prefills=v.counts_prefills,
    )
    row = {"trace": "neighbour-growth", "variant": "shipped", **r.record()}
    then = rec[("neighbour-growth", "shipped", row["path"])]
    assert set(row) == set(then)
    assert r.recovery_s is not None and not r.retriggered
    assert_within("recovery, s", r.recovery_s, then["recovery_s"], slack=10.0)


# -- plugin and remediator: one real vLLM server (the model-free executor) ------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.vllm_server import VllmServer, require_vllm

    require_vllm()
    s = VllmServer(
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "4096",
        env={"OOMGUARD_TWIN_STEP_SECONDS": "0", "OOMGUARD_TWIN_KV_BLOCKS": "4096"},
        log=tmp_path_factory.mktemp("vllm") / "vllm.log",
    )
    yield s
    s.stop()


@pytest.mark.slow
def test_plugin_quick_lane(engine: Any) -> None:
    from bench import plugin

    rec = recorded("plugin")["results"]
    wrapper = min(plugin.wrapper_overhead_us(20_000) for _ in range(3))
    assert_within("plugin work per step, µs", wrapper, rec["wrapper_us_per_step"], slack=0.5)
    per_step = asyncio.run(plugin.workload(engine, 8, 0))
    assert per_step > 0
    recorded_rounds = rec["engine_cpu_us_per_step"]["plugin_on"]
    assert_within("EngineCore CPU per step, µs", per_step, max(recorded_rounds), slack=500.0)
    lat = asyncio.run(plugin.cap_latencies(engine, 6))
    assert_within(
        "cap change to effect p50, ms",
        statistics.median(lat) * 1e3,
        rec["cap_change_ms"]["p50"],
        slack=50.0,
    )


@pytest.mark.slow
def test_remediator_quick_lane(engine: Any, tmp_path: Path) -> None:
    from bench import remediator as bench_rem
    from oomguard.lab.processes import RemediatorProcess
    from tests.vllm_server import AUTH, TOKEN

    rec = recorded("remediator")["results"]
    (tmp_path / "rtoken").write_text(bench_rem.RTOKEN)
    (tmp_path / "ptoken").write_text(TOKEN)
    rem = RemediatorProcess(
        tmp_path / "rem",
        {
            "auth": {"bearer_token_file": str(tmp_path / "rtoken")},
            "targets": [
                {
                    "name": "llama",
                    "url": engine.url,
                    "model": "tiny",
                    "token_file": str(tmp_path / "ptoken"),
                }
            ],
            "policy": {"step_seconds": 3600},
            "safety": {"cooldown_seconds": 0, "max_actions": 100000},
            "audit_log": str(tmp_path / "audit.jsonl"),
            "reconcile_seconds": 1.0,
        },
    )
    try:
        _client, handling = bench_rem.storm(rem.url, bench_rem.storm_payloads(0, 20, 20), senders=2)
        bench_rem.storm(rem.url, bench_rem.storm_payloads(0, 20, 20, resolve=True), senders=2)
        time.sleep(1.5)
        actions, dupes = bench_rem.duplicate_actions(tmp_path / "audit.jsonl")
        httpx.put(f"{engine.url}/oomguard/v1/admission", json={"cap": 64}, headers=AUTH)
        lat = bench_rem.webhook_to_cap(rem, engine, 3)
    finally:
        rem.stop()
        httpx.put(f"{engine.url}/oomguard/v1/admission", json={"cap": 64}, headers=AUTH)
    assert actions >= 1 and dupes == 0
    assert_within(
        "payload handling p50, ms",
        statistics.median(handling) * 1e3,
        rec["storm"]["handling_ms"]["p50"],
        slack=5.0,
    )
    assert_within(
        "webhook → cap p50, ms",
        statistics.median(lat) * 1e3,
        rec["webhook_to_cap_ms"]["p50"],
        slack=100.0,
    )


# -- fleet: a small stand-in fleet ---------------------------------------------------------------
@pytest.mark.slow
def test_fleet_quick_lane(tmp_path: Path) -> None:
    from bench import fleet as bench_fleet

    rec = recorded("fleet")["results"]
    fleet = bench_fleet.Fleet(200, seconds=300)
    try:
        base = fleet.stats()["reads"]
        rem = bench_fleet.remediator(tmp_path / "rem", fleet, 200)
        try:
            idle = bench_fleet.idle(rem, fleet, window=3.0, base=base)
            lat = bench_fleet.webhook_rounds(rem, fleet, 2, first=50, start=1000)  # 50, 150
        finally:
            rem.stop()
    finally:
        fleet.stop()
    assert set(idle) == set(rec["idle_50"])
    assert idle["state_reads_per_s"] > 0
    assert_within(
        "idle CPU, % of a core",
        idle["cpu_percent_of_a_core"],
        rec["idle_50"]["cpu_percent_of_a_core"],
        3.0,
    )
    assert_within(
        "webhook → cap p50, ms",
        statistics.median(lat) * 1e3,
        rec["one_percent_firing"]["webhook_to_cap_ms"]["p50"],
        slack=200.0,
    )
    assert "idle_cpu_under_5_percent_defaults" in bench_fleet.met({"idle_fleet": idle})


# -- detection: the real Prometheus and Alertmanager, one round ----------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_detection_quick_lane(tmp_path: Path) -> None:
    """One round of each kind (an engine's first critical alert, the same alert again while its
    Alertmanager group is kept, an escalation from pressure), the pressure alert's `for`
    shortened: detection to action within 3x of the recorded p95 (plus slack for a loaded
    machine), every round acted on, no page, no notification storm."""
    from tests.vllm_server import require_vllm

    require_vllm()
    out = tmp_path / "detection.json"
    r = subprocess.run(
        [sys.executable, "-m", "bench.detection", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    now, then = json.loads(out.read_text()), recorded("detection")
    assert now["quick"] and now["provenance"]["commit"] and now["provenance"]["measures"]
    hops = now["cumulative_seconds_from_condition"]
    assert set(hops) == set(then["cumulative_seconds_from_condition"])
    assert [x["kind"] for x in now["rounds"]] == ["first", "again", "escalation"]
    met = now["targets_met"]
    assert met["every_round_acted_on"] and met["no_page"], met
    assert met["at_most_3_webhooks_per_alert_and_round"], now["rounds"]
    for kind, measured in now["detection_to_action_seconds"].items():
        assert_within(
            f"detection → action ({kind}), s",
            measured["max"],
            then["detection_to_action_all"]["p95"],
            slack=2.0,
        )
    assert_within(
        "condition → engine drained, s",
        hops["engine"]["max"],
        then["cumulative_seconds_from_condition"]["engine"]["p95"],
        slack=5.0,
    )
