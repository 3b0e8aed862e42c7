"""The vLLM seam: what oomguard knows of vLLM, one module per supported vLLM range.

Every vLLM patch point, HTTP route, `vllm:` metric name and version-dependent default lives in
`v0_<minor>.py` (v0_33.py is the newest and describes every name; an older one imports it and
overrides what its release does differently). This package exports the names of the module for
the installed vLLM, found by its distribution's version without importing vLLM; where vLLM is
absent (the exporter and remediator images) or unknown, the newest. Supporting a new vLLM
version is one new module here (found by its name) plus the build files (pyproject.toml's range,
requirements/, Makefile). tests/test_vllm_seam.py keeps vLLM's names out of the rest of oomguard.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from importlib import metadata
from pathlib import Path
from types import ModuleType

from oomguard.vllm_seam.v0_33 import *  # noqa: F403  (the names, as type checkers see them)
from oomguard.vllm_seam.v0_33 import load  # noqa: F401


def modules() -> dict[tuple[int, int], str]:
    """The seam's modules by the (major, minor) they describe: `v0_33` -> (0, 33)."""
    found = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        m = re.fullmatch(r"v(\d+)_(\d+)", info.name)
        if m:
            found[(int(m[1]), int(m[2]))] = f"{__name__}.{info.name}"
    return found


def installed() -> str | None:
    """The installed vLLM's version, or None (vLLM is not imported: that takes seconds)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def module_for(version: str | None) -> ModuleType:
    """The seam module for a vLLM version: its major.minor's, else the newest."""
    table = modules()
    m = re.match(r"(\d+)\.(\d+)", version or "")
    key = (int(m[1]), int(m[2])) if m else None
    return importlib.import_module(table[key] if key in table else table[max(table)])


def newest() -> ModuleType:
    """The newest supported vLLM's module: what generated files and images name, whatever vLLM
    this environment holds."""
    return module_for(None)


chosen = module_for(installed())
globals().update({k: v for k, v in vars(chosen).items() if k.isupper()})
