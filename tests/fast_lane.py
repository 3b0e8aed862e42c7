"""`make check`'s quick lane (pytest -p tests.fast_lane): vLLM and torch count as not installed,
so the tests that need them skip as they do on a machine without them, even in the project's
virtualenv that has them. Loaded only by `make check`."""

from __future__ import annotations

import os
import sys

for _name in ("vllm", "torch"):
    sys.modules[_name] = None  # type: ignore[assignment]  # `import` raises ImportError
# tests/vllm_server.require_vllm() fails rather than skips under CI; this lane is never CI's
os.environ.pop("CI", None)
