"""The GPU host's install resolves: requirements/gpu-lock.txt holds vLLM 0.33.0 with its CUDA
torch 2.14.0 and oomguard's requirements, and docs/single-box.md installs with it.

requirements/lock.txt pins the CPU torch 2.13.0 the tests run on; with it as constraints a GPU
host's `pip install ... vllm==0.33.0` was unresolvable (vLLM 0.33 requires torch 2.14.0)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.wheel_env import ROOT

GPU_LOCK = ROOT / "requirements" / "gpu-lock.txt"
VLLM_ENV = ROOT / "requirements" / "vllm-0.33-env.txt"
EXTRAS = ("remediator", "generate")


def pins(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec:
            name, sep, version = spec.partition("==")
            assert sep and version, f"{path.name}: {line!r} is not NAME==VERSION"
            out[canonicalize_name(name)] = version
    return out


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_the_gpu_lock_is_vllms_tree_with_its_cuda_torch():
    lock = pins(GPU_LOCK)
    assert lock["vllm"] == "0.33.0" and lock["torch"] == "2.14.0"
    # vLLM 0.33's own resolved set, unchanged: the plugin changes nothing in vLLM's environment
    env = pins(VLLM_ENV)
    assert {k: lock.get(k) for k in env if lock.get(k) != env[k]} == {}
    for req in requirements():  # oomguard's own ranges and extras are met by the pins
        name = canonicalize_name(req.name)
        assert name in lock, f"{req} is not in the GPU lock"
        assert req.specifier.contains(lock[name], prereleases=True), (str(req), lock[name])
    cpu = pins(ROOT / "requirements" / "lock.txt")
    assert cpu["torch"] == "2.13.0"  # the CPU set stays what the tests run


def test_the_docs_install_with_the_gpu_lock():
    text = (ROOT / "docs" / "single-box.md").read_text()
    installs = re.findall(r"^\S*pip install (.*)$", text, re.M)
    # the GPU host's install (step 1, upgrade); the rehearsal machine's CPU build is apart
    gpu = [line for line in installs if "vllm==0.33.0" in line and "--no-deps" not in line]
    assert gpu, "single-box.md does not install vLLM"
    for line in gpu:
        assert "-c requirements/gpu-lock.txt" in line, line
        assert ".[remediator,generate]" in line, line  # `generate --thresholds` needs grafanalib


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_install_resolves_to_the_lock(wheel, tmp_path):
    """pip's resolver, against PyPI, for a Linux x86_64 GPU host: the docs' install step with
    the lock as constraints resolves (no conflict) and to exactly the lock's versions."""
    report = tmp_path / "report.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "--disable-pip-version-check",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--only-binary=:all:",
            "--index-url",
            "https://pypi.org/simple",
            "--report",
            str(report),
            "-c",
            str(GPU_LOCK),
            f"{wheel}[{','.join(EXTRAS)}]",
            "vllm==0.33.0",
        ],
        capture_output=True,
        text=True,
        timeout=840,
        env={"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null", "HOME": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert resolved.pop("oomguard") == "0.1.0"
    assert resolved == pins(GPU_LOCK)
