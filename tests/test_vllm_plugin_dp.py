"""Data parallelism: every engine gets the call, and a server starts clean.

One data-parallel start (two engines, two API servers: a minute of CPU on a 2-core machine). The
plugin keeps no state outside its processes, so a second start of the same command ran the same
start path again; the start-up checks it made (both engines at the startup cap, serving, nothing
admitted) are made on the first start instead. A real restart starting clean, with the new
process's cap the one asked for rather than the old one, is tests/test_restart.py's."""

from __future__ import annotations

import time

import httpx
import pytest

from oomguard.vllm_plugin.api import DRAIN_CACHE_SECONDS
from tests.vllm_server import AUTH, MODEL, VllmServer, require_vllm

pytestmark = pytest.mark.slow


def start(tmp_path) -> VllmServer:
    return VllmServer(
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "4096",
        "--data-parallel-size",
        "2",
        env={"OOMGUARD_TWIN_KV_BLOCKS": "512"},
        log=tmp_path / "vllm.log",
        timeout=600,  # two engines take minutes to start on a loaded 2-core box
    )


def test_two_engines_start_clean_and_both_obey(tmp_path):
    require_vllm()
    server = start(tmp_path)
    try:
        state = server.state()
        assert [e["engine"] for e in state["engines"]] == [0, 1]
        # clean: every engine at its startup value, serving, nothing admitted yet
        assert [e["admission_cap"] for e in state["engines"]] == [32, 32]
        assert state["mode"] == "serving" and state["admitted_total"] == 0
        r = httpx.put(
            f"{server.url}/oomguard/v1/admission", json={"cap": 5}, headers=AUTH, timeout=10
        ).json()
        assert r["admission_cap"] == 5
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
