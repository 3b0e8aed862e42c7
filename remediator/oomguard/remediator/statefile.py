"""Small state files of `oomguard serve` (flags.json, restarts.json): written whole or not at all,
read as untrusted input.

A write goes to a temporary file in the same directory, is fsynced and renamed over the old one
(and the directory fsynced), so a crash or a full disk at any point leaves the old file or the
new one, never half of either; a failed write removes its temporary file and raises OSError, and
the caller keeps its state as it was (what is reported is what is in force and on disk). A read
goes through the bounded reader; a file whose content cannot be used is moved aside
(`<name>.bad`, kept for the post-mortem) and reported, never a reason not to start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from oomguard import bounded
from oomguard.remediator import clocks

log = logging.getLogger("oomguard.supervisor")

LIMITS = bounded.DEFAULT.with_(max_bytes=1 << 20, max_depth=16)


def write(path: Path, data: Any) -> None:
    """Replace `path` with `data` as JSON, atomically and durably. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read(path: Path) -> tuple[Any, str | None]:
    """(the parsed content, None); (None, None) when there is no file; (None, why) when there
    is one that cannot be read or parsed: it is moved aside to `<name>.bad`."""
    try:
        value = bounded.read_json(path, LIMITS)
    except bounded.InputError as exc:
        if exc.reason == "not_found":
            return None, None
        return None, set_aside(path, str(exc))
    if not isinstance(value, dict):  # every state file holds an object
        return None, set_aside(path, f"{path}: not a JSON object")
    return value, None


def set_aside(path: Path, why: str) -> str:
    """Move an unusable state file out of the way (kept for the post-mortem); the reason."""
    aside = path.with_name(f"{path.name}.bad")
    try:
        os.replace(path, aside)
        why = f"{why} (moved to {aside.name})"
    except OSError as exc:
        why = f"{why} (could not move it aside: {exc.strerror or exc})"
    log.error("state file unusable, starting without it: %s", why)
    return why


def now_stamp() -> dict[str, Any]:
    """A moment as recorded in a state file: wall time and the boot clock (clocks.py)."""
    return {"time": time.time(), **clocks.stamp()}
