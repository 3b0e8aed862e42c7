"""Recording a benchmark's results: one JSON file under bench/results/ per benchmark."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def write(path: str | Path, benchmark: str, quick: bool, **fields: Any) -> dict[str, Any]:
    """Write {benchmark, quick, when, machine, **fields} to `path` and print where."""
    record = {
        "benchmark": benchmark,
        "quick": quick,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        **fields,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"recorded {out}")
    return record
