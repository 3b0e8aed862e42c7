"""End to end: `oomguard exporter` as a real process, scraped over HTTP."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DCGM_K8S, VLLM_FIXTURE, free_port
from tests.stack import start_exporter, stop

pytestmark = pytest.mark.slow


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_exporter_serves_all_sources_and_reports_failures(local_server, tmp_path):
    vllm = local_server(VLLM_FIXTURE.read_text())
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    proc, addr = start_exporter(
        "--interval",
        "0.2",
        "--vllm",
        f"llama={vllm.url}",
        "--vllm",
        f"gone={dead}",
        "--dcgm-file",
        str(DCGM_K8S),
        "--allocator-dir",
        str(tmp_path / "alloc"),
        "--cgroup",
        f"missing={tmp_path / 'nope'}",
    )
    base = f"http://{addr}"
    try:
        time.sleep(0.6)
        r = httpx.get(f"{base}/metrics", timeout=2)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        got = samples(r.text)
        up = {
            s.labels.get("target", "") + "/" + s.labels["collector"]: s.value
            for s in got["oomguard_exporter_collector_up"]
        }
        assert up["llama/vllm"] == 1 and up["gone/vllm"] == 0
        assert up["/nvml"] == 0  # no GPU here: down with a reason, exporter still serving
        assert up["missing/cgroup"] == 0
        reasons = {
            (s.labels["collector"], s.labels["reason"])
            for s in got["oomguard_exporter_collector_errors_total"]
        }
        assert {
            ("nvml", "library_not_found"),
            ("vllm", "unreachable"),
            ("cgroup", "not_found"),
        } <= reasons
        kv = {s.labels["engine"]: s.value for s in got["oomguard_vllm_kv_cache_usage_ratio"]}
        assert kv == {"0": 0.9731, "1": 0.4407}
        assert len(got["oomguard_gpu_memory_free_bytes"]) == 2
        assert {s.labels["reason"] for s in got["oomguard_gpu_pressure_level"]} == {"ok"}
        # compressed and OpenMetrics forms
        raw = httpx.get(f"{base}/metrics", headers={"Accept-Encoding": "gzip"}, timeout=2)
        assert b"oomguard_vllm_up" in raw.content  # httpx decodes gzip for us
        om = httpx.get(
            f"{base}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
            timeout=2,
        )
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF")
        assert httpx.get(f"{base}/nope", timeout=2).status_code == 404
        # an engine that dies stops being served as fresh
        vllm.responder = lambda _h: (503, b"down", "text/plain")
        time.sleep(1.0)
        got = samples(httpx.get(f"{base}/metrics", timeout=2).text)
        assert "oomguard_vllm_kv_cache_usage_ratio" not in got
        assert {s.labels["target"]: s.value for s in got["oomguard_vllm_up"]}["llama"] == 0
    finally:
        log = stop(proc)
    assert "library_not_found" in log and log.count("NVML library not found") == 1


def test_gzip_body_is_valid(local_server):
    proc, addr = start_exporter("--no-nvml", "--interval", "0.5")
    base = f"http://{addr}"
    try:
        with httpx.Client() as c:
            r = c.get(f"{base}/metrics", headers={"Accept-Encoding": "gzip"})
            assert r.headers.get("content-encoding") == "gzip"
            # httpx already decoded; decode the raw stream ourselves too
            raw = c.send(
                c.build_request("GET", f"{base}/metrics", headers={"Accept-Encoding": "gzip"}),
                stream=True,
            )
            body = gzip.decompress(b"".join(raw.iter_raw()))
            assert b"oomguard_exporter_build_info" in body
    finally:
        stop(proc)


def test_bad_config_exits_2_with_a_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("interval_seconds: fast\n")
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "exporter", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "interval_seconds" in r.stderr


def test_port_in_use_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "oomguard",
                "exporter",
                "--no-nvml",
                "--listen",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ},
        )
    assert r.returncode == 2 and "cannot listen" in r.stderr


def test_the_started_exporter_moves_what_it_holds_out_of_the_collectors_sight():
    import gc

    from oomguard.exporter.main import YOUNG_COLLECTION_AFTER, settle_gc

    threshold = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_COLLECTION_AFTER, *threshold[1:])
        assert gc.collect() >= 0  # collections still run, over what was made since
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
