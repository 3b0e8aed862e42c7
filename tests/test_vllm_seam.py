"""One vLLM seam (issue 28): what depends on vLLM's version lives in vllm_seam/oomguard/vllm_seam/
only.

An AST scan of every other module of the oomguard package (every import root) fails on
- an import of `vllm` or `vllm.*` (patch points are loaded through `vllm_seam.load`);
- a string constant that names a vLLM metric (`vllm:...`) or a vLLM module path (`vllm.v1...`);
- a string constant that names the supported vLLM release (`0.33`, `vllm==0.33.0`, ...);
- the float of a vLLM default (gpu_memory_utilization's 0.92).
Docstrings are prose and not scanned; comments are not in the AST. So upgrading vLLM is a new
seam module (plus the build files) and nothing else in src/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import oomguard
from oomguard import vllm_seam
from oomguard.vllm_seam import v0_33

ROOT = Path(__file__).resolve().parents[1]
# every folder of the oomguard package: one per import root (core/oomguard, exporter/oomguard, ...)
PACKAGE = [Path(p).resolve() for p in oomguard.__path__]
SEAM = Path(vllm_seam.__file__).resolve().parent
METRIC = re.compile(r"\bvllm:[a-z_]")
# vllm.v1.engine..., vllm.entrypoints.openai... (not a file name such as vllm.log)
MODULE_PATH = re.compile(
    r"\bvllm\.(v1|entrypoints|distributed|config|engine|outputs|exceptions|model_executor|utils)\b"
)


def _release_pattern() -> re.Pattern[str]:
    minors = {".".join(m.VERSION.split(".")[:2]) for m in map(vllm_seam.module_for, _versions())}
    alternatives = "|".join(re.escape(m) for m in sorted(minors))
    return re.compile(rf"(?<![\d.])({alternatives})(\.\d+)?(?![\d])")


def _versions() -> list[str]:
    return [f"{major}.{minor}" for major, minor in vllm_seam.modules()]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    release = _release_pattern()
    name = path.relative_to(ROOT) if ROOT in path.parents else path
    out = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [
                f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] == "vllm"
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and id(node) not in docs:
            value = node.value
            if isinstance(value, str):
                if METRIC.search(value):
                    out.append(f"{where}: vLLM metric name in {value[:60]!r}")
                if MODULE_PATH.search(value):
                    out.append(f"{where}: vLLM module path in {value[:60]!r}")
                if release.search(value):
                    out.append(f"{where}: vLLM release in {value[:60]!r}")
            elif isinstance(value, float) and value == v0_33.GPU_MEMORY_UTILIZATION:
                out.append(f"{where}: vLLM's default gpu_memory_utilization {value}")
    return out


def test_nothing_outside_the_seam_depends_on_vllms_version():
    found = [
        f
        for path in sorted(p for base in PACKAGE for p in base.rglob("*.py"))
        if SEAM not in path.parents
        for f in findings(path)
    ]
    assert not found, "vLLM-version-specific names outside oomguard.vllm_seam:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    src = tmp_path / "scan_sample.py"
    sample = (
        '"""A docstring may say vllm:num_requests_running and vLLM 0.33."""\n'
        "from vllm.v1.engine import FinishReason\n"
        "import vllm.distributed\n"
        'KV = "vllm:kv_cache_usage_perc"\n'
        'POINT = "vllm.v1.core.sched.scheduler"\n'
        'IMAGE = "ghcr.io/x/vllm:0.33.0"\n'
        'rule = f"rate(vllm:request_success_total{{{1}}}[5m])"\n'
        "GMU = 0.92\n"
        "OTHER = 0.33 * 2\n"
    )
    src.write_text(sample)
    found = findings(src)
    kinds = [f.split(": ", 1)[1].split(" in ")[0] for f in found]
    assert len(found) == 7, found
    assert sum(k.startswith("vLLM metric") for k in kinds) == 2


def test_the_seam_module_follows_the_installed_vllm():
    assert vllm_seam.module_for("0.33.0") is v0_33
    assert vllm_seam.module_for("0.32.0").VERSION == "0.32.0"
    # unknown or absent: the newest
    assert vllm_seam.module_for(None) is vllm_seam.newest()
    assert vllm_seam.module_for("9.9.9") is vllm_seam.newest()
    assert (
        max(
            (m.VERSION for m in map(vllm_seam.module_for, _versions())),
            key=lambda v: tuple(map(int, v.split("."))),
        )
        == vllm_seam.newest().VERSION
    )
    assert vllm_seam.chosen is vllm_seam.module_for(vllm_seam.installed())


@pytest.mark.parametrize("minor", _versions())
def test_every_seam_module_defines_every_name(minor):
    module = vllm_seam.module_for(minor + ".0")
    newest = {k for k in vars(vllm_seam.newest()) if k.isupper()}
    assert newest <= {k for k in vars(module) if k.isupper()}
    assert module.VERSIONS.startswith(">=" + minor)


def test_the_pyproject_range_covers_every_seam_module():
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^vllm = \["vllm>=([\d.]+),<([\d.]+)"\]', text, re.MULTILINE)
    assert m, "pyproject.toml's `vllm` extra"
    low, high = (tuple(map(int, v.split("."))) for v in m.groups())
    for major, minor in vllm_seam.modules():
        assert low <= (major, minor) < high, (major, minor, m.group(0))
