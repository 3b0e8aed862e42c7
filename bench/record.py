"""Recording a benchmark's results: one JSON file under bench/results/ per benchmark.

Every record carries its provenance, so that a figure can never outlive the code it measured
unnoticed (bench/stale.py lists the results whose measured code changed since):

- `commit`: the HEAD the run measured, and `dirty`: whether the working tree had uncommitted
  changes then (`dirty_measured` names those among the measured paths: the figure then measured
  code that no commit holds);
- `measures`: the source paths the benchmark measures (MEASURES below, one entry per benchmark)
  and `measured_digest`: a digest of those files' contents as run. bench/stale.py compares it with
  the same digest of the current tree, which survives a rebase (the commit hash does not);
- `machine` (CPU count and model, Python, platform) and `load_average` at the start of the run
  (when this module was imported) and when the record was written, with `started` and `when`.

A benchmark that merges several runs into one file (outcome's traces, fleet's cases) gives each
run its own `provenance` (`provenance()` below); bench/stale.py checks every one of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The package's import roots (issue 28: one per component, the core's in core/).
PACKAGE: tuple[str, ...] = (
    "core/oomguard",
    "alerts/oomguard",
    "dashboards/oomguard",
    "exporter/oomguard",
    "forensics/oomguard",
    "lab/oomguard",
    "manifests/oomguard",
    "remediator/oomguard",
    "sizing/oomguard",
    "twin/oomguard",
    "vllm_plugin/oomguard",
    "vllm_seam/oomguard",
)
COMPONENTS = (
    "alerts",
    "dashboards",
    "exporter",
    "forensics",
    "lab",
    "manifests",
    "remediator",
    "sizing",
    "twin",
    "vllm_plugin",
    "vllm_seam",
)

# Results recorded before the move name paths under src/oomguard/. The move changed no file's
# content by itself, so such a result is compared as it was recorded: the files now under the
# new paths, each named in the digest by its old path (`as_recorded`).
OLD_PACKAGE = "src/oomguard"


def current_paths(path: str) -> list[str]:
    """Where a measured path is now: itself, or under the import roots for an old path."""
    if path == OLD_PACKAGE:
        return list(PACKAGE)
    if not path.startswith(OLD_PACKAGE + "/"):
        return [path]
    rest = path.removeprefix(OLD_PACKAGE + "/")
    comp = rest.split("/", 1)[0]
    return [f"{comp}/oomguard/{rest}" if comp in COMPONENTS else f"core/oomguard/{rest}"]


def as_recorded(path: str) -> str:
    """A file's path in the old layout: the inverse of `current_paths` for files."""
    if path.startswith("core/oomguard/"):
        return OLD_PACKAGE + "/" + path.removeprefix("core/oomguard/")
    comp = path.split("/", 1)[0]
    if comp in COMPONENTS and path.startswith(f"{comp}/oomguard/{comp}/"):
        return OLD_PACKAGE + "/" + path.removeprefix(f"{comp}/oomguard/")
    return path


def is_old_layout(paths: tuple[str, ...] | list[str]) -> bool:
    """Old paths in a moved tree (src/oomguard/ may linger there, emptied or holding ignored
    caches: the old package's __init__.py is what tells)."""
    return (
        any(p == OLD_PACKAGE or p.startswith(OLD_PACKAGE + "/") for p in paths)
        and not (ROOT / OLD_PACKAGE / "__init__.py").is_file()
    )


# What each benchmark measures: a result is stale once any file under these paths changes. Keyed
# by the `benchmark` name its record carries. Keep each list to the code whose change can move the
# figures (the bench script itself, the product code it drives, the fixtures it replays).
MEASURES: dict[str, tuple[str, ...]] = {
    "exporter": (
        "bench/exporter.py",
        "exporter/oomguard/exporter",
        "core/oomguard/catalog.py",
        "core/oomguard/handoff.py",
    ),
    "plugin": (
        "bench/plugin.py",
        "vllm_plugin/oomguard/vllm_plugin",
        "twin/oomguard/twin/executor.py",
    ),
    "remediator": (
        "bench/remediator.py",
        "remediator/oomguard/remediator",
        "vllm_plugin/oomguard/vllm_plugin",
    ),
    "detection": (
        "bench/detection.py",
        "exporter/oomguard/exporter",
        "alerts/oomguard/alerts",
        "remediator/oomguard/remediator",
        "core/oomguard/thresholds.py",
        "twin/oomguard/twin/gpu.py",
    ),
    # the whole loop on real vLLM twins: every part of the product can move its figures
    "outcome": ("bench/outcome.py", "bench/census.py", *PACKAGE),
    "matrix": (
        "bench/matrix.py",
        "twin/oomguard/twin",
        "lab/oomguard/lab",
        "exporter/oomguard/exporter",
        "alerts/oomguard/alerts",
        "remediator/oomguard/remediator",
        "core/oomguard/thresholds.py",
    ),
    "matrix-real": ("bench/matrix.py", *PACKAGE),
    "matrix-real-subset": ("bench/matrix.py", *PACKAGE),
    "recovery": (
        "bench/recovery.py",
        "twin/oomguard/twin",
        "lab/oomguard/lab",
        "alerts/oomguard/alerts",
        "remediator/oomguard/remediator",
        "core/oomguard/thresholds.py",
    ),
    "guard": (
        "bench/guard.py",
        "vllm_plugin/oomguard/vllm_plugin",
        "twin/oomguard/twin",
        "lab/oomguard/lab",
    ),
    "step_guard": (
        "bench/step_guard.py",
        "vllm_plugin/oomguard/vllm_plugin",
        "twin/oomguard/twin",
        "lab/oomguard/lab",
    ),
    "fleet": ("bench/fleet.py", "remediator/oomguard/remediator"),
    # scripts/gpu-check on a GPU machine: the code that reads a real GPU, and the checks
    "gpu-check": (
        "scripts/gpu-check",
        "core/oomguard/gpucheck.py",
        "exporter/oomguard/exporter/collectors/nvml.py",
        "exporter/oomguard/exporter/collectors/allocator.py",
        "exporter/oomguard/exporter/pressure.py",
        "core/oomguard/handoff.py",
        "forensics/oomguard/forensics",
        "vllm_plugin/oomguard/vllm_plugin/allocator.py",
        "vllm_plugin/oomguard/vllm_plugin/oom.py",
        "vllm_plugin/oomguard/vllm_plugin/engine.py",
        "vllm_plugin/oomguard/vllm_plugin/guard.py",
    ),
    "routers": (
        "bench/routers.py",
        "tests/test_routers.py",
        "vllm_plugin/oomguard/vllm_plugin",
        "lab/oomguard/lab/routers.py",
        "twin/oomguard/twin/executor.py",
    ),
}

_STARTED = time.time()
_LOAD_AT_START = os.getloadavg()


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _git(*args: str) -> str | None:
    """`git <args>` in the repository, or None where git or the repository is missing."""
    try:
        r = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def digest_lines(lines: list[str]) -> str:
    """One digest over `path blob` lines, in path order."""
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()[:16]


def tree_digest(paths: tuple[str, ...] | list[str], commit: str | None = None) -> str | None:
    """Digest of the files under `paths`: as committed at `commit`, or in the working tree.

    The working tree's form hashes each tracked file as it is on disk (uncommitted changes
    included, untracked files left out), so that a dirty run's digest is what it measured.
    """
    if commit is not None:
        out = _git("ls-tree", "-r", commit, "--", *paths)
        if out is None:
            return None
        entries = [ln.split("\t", 1) for ln in out.splitlines()]  # "<mode> blob <hash>\t<path>"
        return digest_lines([f"{path} {meta.split()[2]}" for meta, path in entries])
    old = is_old_layout(paths)
    if old:
        paths = [q for p in paths for q in current_paths(p)]
    listed = _git("ls-files", "-s", "--", *paths)
    if listed is None:
        return None
    entries = [ln.split("\t", 1) for ln in listed.splitlines()]  # "<mode> <hash> <stage>\t<path>"
    blobs = {path: meta.split()[1] for meta, path in entries}
    changed = _git("diff", "--name-only", "HEAD", "--", *paths)
    for path in (changed or "").split():
        if path in blobs:
            if (ROOT / path).exists():
                hashed = _git("hash-object", "--", path)
                blobs[path] = hashed.strip() if hashed else "unreadable"
            else:
                del blobs[path]  # deleted in the working tree: not part of what ran
    if old:
        blobs = {as_recorded(path): blob for path, blob in blobs.items()}
    return digest_lines([f"{path} {blob}" for path, blob in blobs.items()])


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def provenance(benchmark: str) -> dict[str, Any]:
    """Where a run's figures come from: commit, tree state, measured paths, load, times."""
    measures = MEASURES.get(benchmark)
    if measures is None:
        raise KeyError(f"bench/record.py MEASURES has no entry for benchmark {benchmark!r}")
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    # the results themselves are written by the run: not a change to the measured code
    dirty = [ln[3:] for ln in status.splitlines() if not ln[3:].startswith("bench/results/")]
    measured = tuple(measures)
    return {
        "commit": head.strip() if head else None,
        "dirty": bool(dirty),
        "dirty_measured": [p for p in dirty if any(_under(p, m) for m in measured)],
        "backfilled": False,
        "measures": list(measured),
        "measured_digest": tree_digest(measured),
        "started": _utc(_STARTED),
        "when": _utc(time.time()),
        "load_average": {
            "at_start": [round(x, 2) for x in _LOAD_AT_START],
            "at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }


def _under(path: str, measured: str) -> bool:
    return path == measured or path.startswith(measured.rstrip("/") + "/")


def write(path: str | Path, benchmark: str, quick: bool, **fields: Any) -> dict[str, Any]:
    """Write {benchmark, quick, when, machine, provenance, **fields} to `path`; print where.

    `benchmark` names its MEASURES entry; a name without one raises before anything is written.
    """
    record: dict[str, Any] = {
        "benchmark": benchmark,
        "quick": quick,
        "when": _utc(time.time()),
        "machine": machine(),
        "provenance": provenance(benchmark),
    }
    # a merged record passes the old file's other keys back: the recorder's own are this run's
    record.update({k: v for k, v in fields.items() if k not in record})
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"recorded {out}")
    return record
