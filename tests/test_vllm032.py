"""The plugin's smoke test (tests/test_vllm_plugin.py: the real `vllm serve` with the model-free
executor) on vLLM 0.32, the oldest release oomguard supports
(vllm_seam/oomguard/vllm_seam/v0_32.py).

It runs in the second vLLM lane, .venv-vllm032: a virtualenv that holds vLLM 0.32.0 and reads
every other package from .venv. `make test-vllm032` sets the lane up and runs this file, and there
a missing lane fails. `make test` does not set it up: its vLLM server, running beside the suite's
own on two cores, cost 2.5 minutes and slowed the latency-sensitive tests past their limits (the
demo's TTFT burn, preflight). Without the lane this file skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import oomguard

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LANE = ROOT / ".venv-vllm032" / "bin" / "python"
SMOKE = "tests/test_vllm_plugin.py"


def lane() -> Path:
    if LANE.exists():
        return LANE
    if os.environ.get("OOMGUARD_VLLM032_LANE") == "required":
        pytest.fail(f"{LANE} is missing (make setup-vllm032)")
    pytest.skip("the vLLM 0.32 lane is not set up (run `make setup-vllm032`)")


def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # the checkout's import roots (the folders holding an oomguard/), then the top for `tests`
    roots = sorted({str(Path(p).resolve().parent) for p in oomguard.__path__})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*roots, str(ROOT)])}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [str(lane()), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_lane_holds_vllm_032_and_the_seam_picks_its_module():
    r = run(
        "-c",
        "import importlib.metadata as m, torch, oomguard.vllm_seam as s; "
        "print(m.version('vllm'), s.chosen.__name__, torch.__version__)",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    version, module, torch = r.stdout.split()
    assert version == "0.32.0"
    assert module == "oomguard.vllm_seam.v0_32"
    assert torch.startswith("2.13.0")  # what vLLM 0.32.0 declares


def test_the_plugin_smoke_test_passes_on_vllm_032(tmp_path):
    r = run(
        "-m",
        "pytest",
        SMOKE,
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "--basetemp",
        str(tmp_path / "lane"),
        "-rxX",
        # hypothesis' pytest plugin imports hypothesis in the terminal summary; pytest's assertion
        # rewriting of it crashed CPython 3.11.7 there (SystemError: AST constructor recursion
        # depth mismatch) after every test had passed. This file uses no hypothesis.
        "-p",
        "no:hypothesispytest",
        # Left out of the lane: the two tests that flood the engine until it preempts. Whether 64
        # requests preempt depends on the machine's load (0.32 did not preempt in one full CI run
        # while the suite's other worker ran), and each costs a minute that `make test`'s 30 does
        # not have. The cap itself is checked on 0.32 by the admission and clamping tests, and
        # 0.32's drain gap by the strict xfail of test_drain_finishes_running_...
        "--deselect",
        f"{SMOKE}::test_lowering_the_cap_under_load_keeps_the_engine_alive_and_cuts_preemptions",
        "--deselect",
        f"{SMOKE}::test_requests_preempted_while_draining_go_elsewhere_too",
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    sys.stdout.write(r.stdout[-2000:])  # the lane's own summary, in this test's captured output
