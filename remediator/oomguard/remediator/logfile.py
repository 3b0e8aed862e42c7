"""vLLM's output under `oomguard serve`: a log file rotated by size, that never stops the reader.

vLLM writes everything to stdout/stderr, and a busy server writes a lot (one line per request
at INFO). The supervisor copies that stream to `<state-dir>/vllm.log`; without rotation the file
grows until the disk is full. Here the file is rotated when the next line would take it past
`max_bytes`: `vllm.log` becomes `vllm.log.1`, `.1` becomes `.2`, ... and the oldest beyond
`backups` is deleted, so the log never holds more than about (backups + 1) x max_bytes.

A write that fails (full disk, the directory removed) must not stop the thread that reads vLLM's
pipe: a pipe nobody reads fills up and vLLM blocks on its next log line, serving nothing. So a
failed write drops the line, counts it, logs once, and the file is reopened on a later line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

log = logging.getLogger("oomguard.supervisor")

DEFAULT_MAX_BYTES = 100 * 2**20
DEFAULT_BACKUPS = 5
RETRY_SECONDS = 5.0  # after a failed write, the next attempt to open the file


class RotatingLog:
    """Append lines (bytes) to `path`, rotating by size. `max_bytes` 0 turns rotation off."""

    def __init__(
        self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = max(0, backups)
        self.dropped = 0  # lines lost to failed writes
        self._out: BinaryIO | None = None
        self._size = 0
        self._failed_at: float | None = None

    def __enter__(self) -> RotatingLog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def write(self, line: bytes) -> None:
        """Append one line; never raises."""
        try:
            out = self._open()
            if out is None:
                self.dropped += 1
                return
            if self.max_bytes and self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
                out = self._open()
                if out is None:
                    self.dropped += 1
                    return
            out.write(line)
            out.flush()
            self._size += len(line)
        except OSError as exc:
            self._fail(exc)
            self.dropped += 1

    @property
    def failing(self) -> bool:
        """True from a failed write until the file takes lines again."""
        return self._failed_at is not None

    def _open(self) -> BinaryIO | None:
        if self._out is not None:
            return self._out
        if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_SECONDS:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out = self.path.open("ab")
            self._size = self._out.tell()
        except OSError as exc:
            self._fail(exc)
            return None
        if self._failed_at is not None:
            log.warning("writing vLLM's log again: %d lines were lost", self.dropped)
            self._failed_at = None
        return self._out

    def _rotate(self) -> None:
        self.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for n in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def _fail(self, exc: OSError) -> None:
        if self._failed_at is None:
            log.error("cannot write vLLM's log %s (lines are dropped): %s", self.path, exc)
        self._failed_at = time.monotonic()
        self.close()

    def close(self) -> None:
        if self._out is not None:
            with contextlib.suppress(OSError):
                self._out.close()
            self._out = None
