"""Data parallelism and restarts: every engine gets the call; a restarted server starts clean."""

from __future__ import annotations

import time

import httpx
import pytest

from oomguard.vllm_plugin.api import DRAIN_CACHE_SECONDS
from tests.vllm_server import AUTH, MODEL, VllmServer, require_vllm

pytestmark = pytest.mark.slow


def start(tmp_path, name: str) -> VllmServer:
    return VllmServer(
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "4096",
        "--data-parallel-size",
        "2",
        env={"OOMGUARD_TWIN_KV_BLOCKS": "512"},
        log=tmp_path / f"{name}.log",
        timeout=600,  # two engines take minutes to start on a loaded 2-core box
    )


def test_two_engines_both_obey_and_a_restart_starts_clean(tmp_path):
    require_vllm()
    server = start(tmp_path, "first")
    try:
        state = server.state()
        assert [e["engine"] for e in state["engines"]] == [0, 1]
        r = httpx.put(
            f"{server.url}/oomguard/v1/admission", json={"cap": 5}, headers=AUTH, timeout=10
        ).json()
        assert [e["admission_cap"] for e in r["state"]["engines"]] == [5, 5]
        drained = httpx.post(f"{server.url}/oomguard/v1/drain", headers=AUTH, timeout=10).json()
        assert [e["mode"] for e in drained["engines"]] == ["draining", "draining"]
        assert httpx.get(f"{server.url}/oomguard/v1/ready", timeout=10).status_code == 503
        resumed = httpx.post(f"{server.url}/oomguard/v1/resume", headers=AUTH, timeout=10).json()
        assert [e["mode"] for e in resumed["engines"]] == ["serving", "serving"]
        # DP runs two API server processes; the one that did not take the resume learns of it
        # within DRAIN_CACHE_SECONDS (it may have cached "draining" from the /ready above), so
        # a request there may still get the retryable 503 for that long
        deadline = time.monotonic() + DRAIN_CACHE_SECONDS + 10
        while True:
            ok = httpx.post(
                f"{server.url}/v1/completions",
                json={
                    "model": str(MODEL),
                    "prompt": [11, 12, 13],
                    "max_tokens": 4,
                    "ignore_eos": True,
                },
                timeout=60,
            )
            if ok.status_code != 503 or time.monotonic() > deadline:
                break
            assert ok.headers.get("retry-after"), ok.text
            time.sleep(0.2)
        assert ok.status_code == 200, ok.text
        assert server.state()["admitted_total"] >= 1
    finally:
        server.stop()

    restarted = start(tmp_path, "second")
    try:
        state = restarted.state()
        # the cap is not sticky across restarts: the engine starts at its startup value
        assert [e["admission_cap"] for e in state["engines"]] == [32, 32]
        assert state["mode"] == "serving" and state["admitted_total"] == 0
        r = httpx.put(
            f"{restarted.url}/oomguard/v1/admission", json={"cap": 7}, headers=AUTH, timeout=10
        ).json()
        assert r["admission_cap"] == 7
    finally:
        restarted.stop()
