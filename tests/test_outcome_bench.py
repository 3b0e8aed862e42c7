"""The outcome benchmark runs in CI: one trace, the oomguard configuration, on real vLLM twins.

vLLM alone crashing on the same kind of incident is proven by the demo's side-by-side run
(tests/test_demo.py) and the twin's physics (tests/test_twin_physics.py); running the `default`
configuration here as well cost another two vLLM starts and a reload (about 3 minutes)."""

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
            "-m",
            "bench.outcome",
            "--trace",
            "neighbour-growth",
            # the trace's own clock (x20): at --quick's x40 the alerting path's wall seconds
            # are more trace time than the level's lead on a 2-core machine
            "--compression",
            "20",
            "--config",
            "oomguard",
            "--out",
            str(out),
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = json.loads(out.read_text())
    # the quick lane of bench/outcome.py (tests/test_bench_quick.py has the others): the record's
    # schema is the recorded one's, and the trace carries the commit it measured
    recorded = json.loads((repo_root / "bench" / "results" / "outcome.json").read_text())
    assert record["provenance"]["commit"] and record["provenance"]["measures"]
    result = record["traces"]["neighbour-growth"]
    assert result["provenance"]["commit"] == record["provenance"]["commit"]
    # every field of the recorded run is still produced (docs/benchmarks.md is rendered from
    # them); a field added since (`router`) waits for the next recording (bench/stale.py)
    assert set(recorded["traces"]["neighbour-growth"]) <= set(result)
    core = {"requests", "lost", "crashes", "goodput_tokens_per_s", "ttft_p99_s", "recovery_s"}
    assert core <= set(result["outcomes"]["oomguard"])
    assert core <= set(recorded["traces"]["neighbour-growth"]["outcomes"]["oomguard"])
    outcomes = result["outcomes"]
    assert set(outcomes) == {"oomguard"}
    assert outcomes["oomguard"]["requests"] > 100
    # 8.6 GiB of neighbour is more than the headroom of a full prefill chunk: oomguard drained
    # engine 0 before that (its peer kept serving) and brought it back
    assert outcomes["oomguard"]["crashes"] == 0 and outcomes["oomguard"]["lost"] == 0
    assert "engine-0:drain" in outcomes["oomguard"]["actions"]
    assert "engine-0:resume" in outcomes["oomguard"]["actions"]
    assert result["targets"]["oomguard_zero_crashes"] is True
    # the replay's CPU by role (bench/census.py): the run's own processes found and measured
    cpu = outcomes["oomguard"]["cpu"]["percent_of_one_core"]
    assert cpu["engine_core"] > 10 and cpu["api_server"] > 1 and cpu["runner"] > 1, cpu
    assert {"supervisor", "remediator"} <= set(cpu), cpu
