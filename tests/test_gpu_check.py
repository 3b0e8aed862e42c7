"""scripts/gpu-check (issue 25 item 9): its CPU dry run, here in CI, and the checks' own logic.

No GPU here: the dry run drives every check's code against a simulated GPU (the twin's NVML and
a simulated caching allocator), says that nothing about a GPU was measured, and leaves the
result file alone. The checks must also be able to fail: each is run against a simulated GPU
that disagrees with oomguard (an nvidia-smi off by 1 GiB, a publisher that drops a field, an
observer that records nothing, a headroom that is not there, a level that never rises).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from oomguard import gpucheck
from oomguard.gpucheck import GIB, SimDevice, run_checks

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OOM observer's per-process state as in a new process; vLLM absent, as on the GPU
    machine (the plugin's rank lookup would import it)."""
    from oomguard.vllm_plugin import oom

    monkeypatch.setitem(sys.modules, "vllm", None)
    for name, value in (("_step", None), ("_steps", 0), ("_flags", {}), ("_recorder", None)):
        monkeypatch.setattr(oom, name, value)
    monkeypatch.setattr(oom, "_active", None)


@pytest.mark.slow  # imports torch and runs every check once in a subprocess
def test_the_dry_run_says_what_it_could_not_check_and_exercises_every_check(tmp_path):
    out = tmp_path / "dry.json"
    r = script("--dry-run", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == gpucheck.SCHEMA and doc["dry_run"] is True
    assert [c["name"] for c in doc["checks"]] == list(gpucheck.CHECKS)
    for c in doc["checks"]:
        assert c["status"] == "not_checked", c
        assert "nothing about a GPU was measured" in c["reason"]
        assert "no CUDA device" in c["reason"] or "not installed" in c["reason"], c["reason"]
        assert c["dry_run"]["outcome"] == "pass", c["dry_run"]
        assert "measured" not in c  # figures of a simulation are kept under dry_run only
    assert doc["summary"] == {"not_checked": len(gpucheck.CHECKS)}
    assert len(doc["not_checked"]) == len(gpucheck.CHECKS)
    assert "simulated GPU" in doc["note"]
    lines = r.stderr.strip().splitlines()
    assert all("not_checked" in line and "simulated: pass" in line for line in lines[-5:])
    # the simulated run went through the real workload: fragmentation, an OOM, four levels
    by = {c["name"]: c["dry_run"]["measured"] for c in doc["checks"]}
    assert by["allocator"]["inactive_split_bytes"] > 0
    assert by["oom"]["type"] == "long_prompt" and by["oom"]["confidence"] == "confirmed"
    assert [s["level"] for s in by["pressure"]["stages"]] == [0, 1, 2, 3]


def test_without_a_gpu_a_real_run_exits_2_and_records_nothing(tmp_path):
    out = tmp_path / "gpu-check.json"
    r = script("--out", str(out))
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("gpu-check: ") and "nothing checked" in line and "--dry-run" in line
    assert not out.exists()


def test_the_simulated_gpu_passes_every_check(fresh_plugin):
    outcomes = run_checks(SimDevice())
    assert {n: o["outcome"] for n, o in outcomes.items()} == dict.fromkeys(gpucheck.CHECKS, "pass")


def test_the_nvml_check_times_the_exporter_s_poll_per_gpu(fresh_plugin):
    """What a poll costs is read from the collector as the exporter keeps it: its figures are
    per GPU, ordered, and move with what each poll costs."""

    class Slow:
        calls = 0

        def collect(self) -> None:
            Slow.calls += 1
            end = time.process_time() + 0.002  # 2 ms of CPU a poll, over 2 GPUs
            while time.process_time() < end:
                pass

    cost = gpucheck.poll_cost(Slow(), gpus=2, samples=20)
    assert Slow.calls == 21  # one warm-up poll, then the timed ones
    assert cost["polls"] == 20 and 900 <= cost["p50"] <= cost["p99"]
    assert 900 <= cost["mean"] < 5000
    [o] = run_checks(SimDevice(), ("nvml",)).values()
    assert o["outcome"] == "pass" and o["measured"]["poll_cpu_us_per_gpu"]["polls"] > 0


def test_nvml_check_fails_when_nvidia_smi_disagrees(fresh_plugin):
    [o] = run_checks(SimDevice(smi_skew_bytes=1 * GIB), ("nvml",)).values()
    assert o["outcome"] == "fail" and o["detail"].startswith("free:"), o


def test_allocator_check_fails_when_the_report_loses_a_field(fresh_plugin, monkeypatch):
    from oomguard import handoff

    real = handoff.AllocatorReport.from_memory_stats.__func__  # type: ignore[attr-defined]

    def lossy(cls: Any, stats: dict[str, Any], **identity: Any) -> Any:
        return real(cls, {**stats, "inactive_split_bytes.all.current": 0}, **identity)

    monkeypatch.setattr(handoff.AllocatorReport, "from_memory_stats", classmethod(lossy))
    [o] = run_checks(SimDevice(), ("allocator",)).values()
    assert o["outcome"] == "fail" and "inactive_split_bytes" in o["detail"], o


def test_oom_check_fails_when_nothing_is_recorded(fresh_plugin, monkeypatch):
    monkeypatch.setattr(SimDevice, "attach_oom_observer", lambda self, h, i: True)
    [o] = run_checks(SimDevice(), ("oom",)).values()
    assert o["outcome"] == "fail" and "0 OOM records" in o["detail"], o


def test_headroom_check_fails_when_the_guard_overestimates(fresh_plugin, monkeypatch):
    from oomguard.vllm_plugin import engine

    real = engine.worker_memory
    monkeypatch.setattr(
        engine, "worker_memory", lambda w: {**real(w), "now": real(w)["now"] + 2 * GIB}
    )
    [o] = run_checks(SimDevice(), ("headroom",)).values()
    assert o["outcome"] == "fail" and o["detail"].startswith("now:"), o


def test_pressure_check_fails_when_the_level_does_not_rise(fresh_plugin, monkeypatch):
    from oomguard.exporter import pressure

    real = pressure.PressureEvaluator._gpu_level

    def stuck(self: Any, g: Any, plan: Any, reports: Any) -> Any:
        found = real(self, g, plan, reports)
        found.level = pressure.LEVEL_OK  # an evaluator that never sees the neighbour
        return found

    monkeypatch.setattr(pressure.PressureEvaluator, "_gpu_level", stuck)
    [o] = run_checks(SimDevice(), ("pressure",)).values()
    assert o["outcome"] == "fail" and "below caution: level 0" in o["detail"], o


def test_bundled_wheels_are_chosen_by_python_and_platform():
    loader = importlib.machinery.SourceFileLoader("gpu_check_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check_script", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    me = f"cp{sys.version_info.major}{sys.version_info.minor}"
    import platform

    arch = platform.machine()
    other_arch = "aarch64" if arch == "x86_64" else "x86_64"
    assert module._fits("pydantic-2.14.4-py3-none-any.whl")
    assert module._fits(
        f"pydantic_core-2.50.5-{me}-{me}-manylinux2014_{arch}.manylinux_2_17_{arch}.whl"
    )
    assert not module._fits(f"pydantic_core-2.50.5-{me}-{me}-manylinux2014_{other_arch}.whl")
    assert not module._fits(f"pydantic_core-2.50.5-cp39-cp39-manylinux2014_{arch}.whl")
