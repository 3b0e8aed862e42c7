"""The append-only audit log: one JSON object per line, flushed and fsynced before returning.

Every decision the remediator records (received, acted, withheld, held, failed) lands here with
the alert fingerprints behind it, so a 3 AM action can be explained at 9 AM. The receiver answers
Alertmanager only after its record is on disk: nothing acknowledged is lost.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class AuditLog:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def record(
        self,
        event: str,
        target: str = "",
        action: str = "",
        before: Any = None,
        after: Any = None,
        result: str = "",
        reason: str = "",
        fingerprints: Iterable[str] = (),
    ) -> dict[str, Any]:
        entry = {
            "time": time.time(),
            "event": event,
            "target": target,
            "action": action,
            "before": before,
            "after": after,
            "result": result,
            "reason": reason,
            "fingerprints": sorted(fingerprints),
        }
        line = json.dumps(entry, separators=(",", ":"), default=str) + "\n"
        with self._lock, self.path.open("a") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        return entry

    def entries(self) -> list[dict[str, Any]]:
        """Every well-formed entry (a torn last line after a crash is skipped)."""
        out: list[dict[str, Any]] = []
        if not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
