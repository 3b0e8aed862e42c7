"""Environment variables that oomguard sets for vLLM and the plugin reads: defined in
oomguard.contract (one place for the whole contract); this name stays importable."""

from __future__ import annotations

from oomguard.contract import INITIAL_CAP_ENV

__all__ = ["INITIAL_CAP_ENV"]
