"""bench/census.py: the CPU each role of a benchmark run used, read from real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.census import Census, role

BURN = """
import sys, time
while time.process_time() < float(sys.argv[1]):
    pass
print("burnt", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.parametrize(
    ("name", "cmdline", "expected"),
    [
        ("VLLM::EngineCor", ["VLLM::EngineCore"], "engine_core"),
        (
            "python",
            ["/w/.venv/bin/python", "/w/.venv/bin/vllm", "serve", "/m", "--port", "1"],
            "api_server",
        ),
        # the supervisor's command line carries vLLM's after it: it is the supervisor
        (
            "python",
            ["python", "-m", "oomguard.cli", "serve", "--", "vllm", "serve", "/m"],
            "supervisor",
        ),
        (
            "python",
            ["python", "-m", "oomguard.cli", "remediator", "--config", "r.yaml"],
            "remediator",
        ),
        ("oomguard", ["/w/.venv/bin/oomguard", "remediator"], "remediator"),
        ("vllm-router", ["/w/.venv/bin/vllm-router", "--worker-urls", "x"], "router"),
        ("nginx", ["nginx: master process"], "router"),
        ("python", ["python", "-c", "pass"], "other"),
        ("python", [], "other"),  # a zombie's command line is empty
    ],
)
def test_roles_from_the_labs_command_lines(name: str, cmdline: list[str], expected: str) -> None:
    assert role(name, cmdline, runner=False) == expected
    assert role(name, cmdline, runner=True) == "runner"


def test_a_process_that_exits_keeps_its_cpu_and_what_came_before_does_not_count() -> None:
    # before the window: 0.4 s of CPU, then idle (it looks like vLLM's API server)
    before = subprocess.Popen(
        [sys.executable, "-c", BURN, "0.4", "30", "vllm", "serve"],
        stdout=subprocess.PIPE,
        text=True,
    )
    during: subprocess.Popen[str] | None = None
    try:
        assert before.stdout is not None and before.stdout.readline().strip() == "burnt"
        with Census(every=0.1) as census:
            # in the window: a process that spends 0.5 s of CPU, idles 0.5 s (sampled in
            # between) and exits before the window ends
            during = subprocess.Popen([sys.executable, "-c", BURN, "0.5", "0.5"])
            during.wait(timeout=60)
            time.sleep(0.3)
        result = census.result()
    finally:
        before.kill()
        before.wait()
        if during is not None and during.poll() is None:
            during.kill()
    window = result["window_s"]
    cpu_s = {k: v / 100 * window for k, v in result["percent_of_one_core"].items()}
    assert cpu_s.get("other", 0.0) >= 0.45, result  # counted up to its last sample before exit
    assert cpu_s.get("api_server", 0.0) < 0.1, result  # its 0.4 s came before the window
    assert result["run_total_percent"] >= result["percent_of_one_core"]["other"]
    assert result["cpus"] >= 1
    busy = result["machine_busy_percent_of_all_cpus"]
    assert busy is not None and 0 < busy <= 100


RENAMED = """
import time, setproctitle
while time.process_time() < 0.3:
    pass
setproctitle.setproctitle("VLLM::EngineCore")
while time.process_time() < 0.6:
    pass
print("renamed", flush=True)
time.sleep(30)
"""


def test_a_process_that_renames_itself_counts_under_its_last_name() -> None:
    # vLLM's engine core starts as `python -c "from multiprocessing.spawn ..."` and renames
    # itself: a restarted engine's core was counted as "other" when named only once
    child: subprocess.Popen[str] | None = None
    with Census(every=0.05) as census:
        child = subprocess.Popen([sys.executable, "-c", RENAMED], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "renamed"
            time.sleep(0.2)
        finally:
            child.kill()
            child.wait()
    result = census.result()
    cpu_s = {k: v / 100 * result["window_s"] for k, v in result["percent_of_one_core"].items()}
    assert cpu_s.get("engine_core", 0.0) >= 0.5, result
    assert cpu_s.get("other", 0.0) < 0.1, result
