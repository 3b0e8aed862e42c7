"""The fleet runner behind a real router (issue 27 item 3): the outcome benchmark's and the
demo's fleet with vllm-router in front (readiness health checks, as docs/vllm-plugin.md sets it
up) instead of the twin's gateway; every request goes through the router and is served. The
incidents behind each router are recorded by `python -m bench.outcome --router ...`
(docs/benchmarks.md)."""

from __future__ import annotations

import httpx
import pytest

from oomguard.contract import API_PREFIX
from oomguard.lab.runner import Fleet
from oomguard.twin.traces import Trace
from tests.vllm_server import require_vllm

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)
def test_the_fleet_runs_behind_vllm_router(tmp_path):
    require_vllm()
    # a minute of the healthy trace's traffic (6 s of wall time at its x10)
    trace = Trace.load("do-no-harm").model_copy(update={"duration_s": 60.0})
    fleet = Fleet(trace, "default", tmp_path, router="vllm-router", start_timeout=600)
    try:
        fleet.start()
        assert fleet.front is not None
        assert sorted(fleet.front.workers()) == sorted(e.url for e in fleet.engines)
        fleet.replay()
        o = fleet.outcome()
        admitted = [
            httpx.get(f"{e.url}{API_PREFIX}/state", timeout=10).json()["admitted_total"]
            for e in fleet.engines
        ]
    finally:
        fleet.stop()
    assert o.router == "vllm-router"
    assert o.requests > 20 and o.lost == 0 and o.completed == o.requests, o.lost_why
    assert all(s.path and all(e == -1 for _, e in s.path) for s in fleet.sent)  # via the router
    assert sum(admitted) >= o.requests  # the engines served them (retries counted once each)
    assert fleet.front.proc.poll() is not None  # stopped with the fleet
