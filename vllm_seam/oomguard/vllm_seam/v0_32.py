"""vLLM 0.32: as 0.33 (v0_33.py, every name) except what is overridden here.

The patch points, routes, metric names and defaults oomguard uses are the same in 0.32.0 and
0.33.0 (their sources compared: the patched Scheduler and EngineCore methods keep their
signatures, vllm/v1/metrics/loggers.py is unchanged). 0.32 depends on torch 2.13.0.
"""

from __future__ import annotations

from oomguard.vllm_seam.v0_33 import *  # noqa: F403
from oomguard.vllm_seam.v0_33 import load  # noqa: F401

VERSIONS = ">=0.32,<0.33"
VERSION = "0.32.0"
MINOR = "0.32"
IMAGE = f"ghcr.io/oomguard/vllm-oomguard:{VERSION}"
# 0.32's EngineCoreOutput has no `error` field (0.33 added it, with RequestError.to_exception)
ENGINE_OUTPUT_ERROR = False
