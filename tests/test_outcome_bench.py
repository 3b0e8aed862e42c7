"""The outcome benchmark runs in CI (`--quick`, one trace): real vLLM twins, three configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.vllm_server import require_vllm

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1300)
def test_quick_outcome_benchmark_on_the_neighbour_trace(repo_root, tmp_path):
    require_vllm()
    out = tmp_path / "outcome.json"
    r = subprocess.run(
        [
            sys.executable,
            str(repo_root / "bench" / "outcome.py"),
            "--trace",
            "neighbour-growth",
            # the trace's own clock (x20): at --quick's x40 the alerting path's wall seconds
            # are more trace time than the level's lead on a 2-core machine
            "--compression",
            "20",
            "--config",
            "default",
            "--config",
            "oomguard",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())["traces"]["neighbour-growth"]
    outcomes = result["outcomes"]
    assert set(outcomes) == {"default", "oomguard"}
    for o in outcomes.values():
        assert o["requests"] == outcomes["default"]["requests"] > 100  # the same seeded trace
    # the physics: 8.6 GiB of neighbour is more than the headroom of a full prefill chunk
    assert outcomes["default"]["crashes"] >= 1
    # oomguard drained engine 0 before that (its peer kept serving) and brought it back
    assert outcomes["oomguard"]["crashes"] == 0 and outcomes["oomguard"]["lost"] == 0
    assert "engine-0:drain" in outcomes["oomguard"]["actions"]
    assert "engine-0:resume" in outcomes["oomguard"]["actions"]
    assert result["targets"]["oomguard_zero_crashes"] is True
