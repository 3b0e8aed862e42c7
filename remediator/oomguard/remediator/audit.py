"""The append-only audit log: one JSON object per line, fsynced before `record` returns.

Every decision the remediator records (received, intent, acted, withheld, held, failed) lands
here with the alert fingerprints behind it, so a 3 AM action can be explained at 9 AM. The
receiver answers Alertmanager only after its record is on disk: nothing acknowledged is lost; an
action is recorded as an intent before the engine is called (convergence.py): nothing is done
that was not first recorded.

Writing survives a full disk: a line that could not be written whole is taken back (truncated)
at once, and a torn tail found later (a crash or ENOSPC mid-line, perhaps in another process) is
cut off before the next line is appended, so the next acknowledged record starts on a line of
its own instead of being glued to the fragment and lost on replay. While appends fail,
`writable` is False (the remediator's /healthz turns degraded and
oomguard_remediator_audit_writable drops to 0).

Reading treats the file as untrusted input, since anything may have written it: a line that is
not UTF-8, not JSON, nested too deeply, holds a 5,000-digit number, is not an object or is
longer than MAX_LINE_BYTES is counted by reason and skipped (`Replay.skipped`); reading never
raises on content.

The file is rotated once it passes `max_bytes` (auditrotate.py): the old one is kept as
`<file>.1` ... `<file>.<backups>`, and the new one starts with what a replay needs (the pause
switch, the actions of the safety window `carry_seconds`, uncommitted intents, recent restarts),
so a start reads at most about `max_bytes` whatever the log's age. The rotation runs in a thread
of its own after the append that crossed the size; appends wait only for its final swap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from oomguard.errors import ConfigError
from oomguard.remediator import auditrotate, clocks

log = logging.getLogger("oomguard.remediator.audit")

MAX_LINE_BYTES = 1 << 20  # an audit line is a few hundred bytes; a longer one is not ours
SHOWN_BAD_LINES = 5  # line numbers named in the log per replay
DEFAULT_MAX_BYTES = 32 << 20  # about 80,000 entries; replayed in seconds
DEFAULT_BACKUPS = 10


@dataclass
class Replay:
    """What reading the log found: the entries kept, and the lines skipped by reason."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)

    def skip(self, number: int, reason: str) -> None:
        self.skipped[reason] += 1
        if len(self.bad_lines) < SHOWN_BAD_LINES:
            self.bad_lines.append((number, reason))


def parse_line(raw: bytes) -> dict[str, Any] | str:
    """One line as an entry, or the reason it is not one. Never raises."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8"
    try:
        value = json.loads(text)
    except RecursionError:
        return "too_deep"
    except ValueError:  # not JSON, or an integer beyond Python's digit limit
        return "not_json"
    except Exception:  # MemoryError and anything else the parser may raise on hostile input
        return "unreadable"
    if not isinstance(value, dict):
        return "not_object"
    if not isinstance(value.get("event"), str):
        return "no_event"
    return value


def _lines(fh: IO[bytes]) -> Iterator[bytes | None]:
    """The file's lines without their newline; None for a line over MAX_LINE_BYTES (skipped
    without holding it in memory)."""
    while True:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := fh.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield line.rstrip(b"\n")


def check_path(path: Path, what: str = "audit_log") -> None:
    """A configuration error when `path` cannot be an audit log (a directory, a device)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is a directory; give the path of a file")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file")


class AuditLog:
    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        carry_seconds: float = 3600.0,
    ) -> None:
        """`max_bytes`, `backups`: rotation (module docstring); `carry_seconds`: the safety
        window whose actions a rotation carries into the new file (the controller sets it)."""
        self.path = Path(path)
        check_path(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            auditrotate.recover(self.path)  # a rotation a crash interrupted
        except OSError as exc:
            raise ConfigError(
                f"audit_log {self.path}: cannot create its directory: {exc.strerror or exc}"
            ) from exc
        self.max_bytes, self.backups, self.carry_seconds = max_bytes, backups, carry_seconds
        self._rotate_at = max_bytes
        self._rotating = threading.Lock()
        self.rotations = 0
        self.rotation_errors = 0
        self._lock = threading.Lock()
        self._check_tail = True  # at the first append, and after a failed one
        self.writable = True
        self.write_errors = 0
        self._errors_reported = 0  # write_errors as of the last "writable again"
        self.last_error: str | None = None
        self.torn_repaired = 0  # torn tails cut off before an append
        self.last_replay = Replay()

    # -- writing ---------------------------------------------------------------------------------
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
        intent: str | None = None,
    ) -> dict[str, Any]:
        """Append one entry, durably. Raises OSError when it cannot be written (disk full,
        read-only, gone): nothing is half-written then."""
        entry: dict[str, Any] = {
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
        if intent is not None:
            entry["intent"] = intent
        entry.update(clocks.stamp())
        line = (json.dumps(entry, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            try:
                size = self._append(line)
            except OSError as exc:
                # once per outage: a full disk fails every record of every pass, and the
                # count (write_errors, the AuditFailing alert) says how many
                log.log(
                    logging.ERROR if self.writable else logging.DEBUG,
                    "cannot append to the audit log %s: %s",
                    self.path,
                    exc,
                )
                self.writable = False
                self.write_errors += 1
                self.last_error = f"{exc.strerror or exc}"
                self._check_tail = True
                raise
            if not self.writable:
                log.warning(
                    "the audit log %s is writable again (%d records failed)",
                    self.path,
                    self.write_errors - self._errors_reported,
                )
                self._errors_reported = self.write_errors
            self.writable, self.last_error = True, None
            due = size >= self._rotate_at and not self._rotating.locked()
        if due:
            threading.Thread(target=self.rotate, name="audit-rotate", daemon=True).start()
        return entry

    def try_record(self, event: str, **fields: Any) -> dict[str, Any] | None:
        """`record` for what is worth noting but must not stop the caller (a hold, a withheld
        step): None when it could not be written (counted in `write_errors`)."""
        try:
            return self.record(event, **fields)
        except OSError:
            return None

    def _append(self, line: bytes) -> int:
        """Append `line` whole, durably; the file's size after it."""
        created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            if self._check_tail:
                self._repair_tail(fd)
                self._check_tail = False
            size = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError:
                # take the partial line back: the next record must start on a line of its own
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
        if created:  # the file's name must be as durable as its first line
            auditrotate.fsync_dir(self.path.parent)
        return size + len(line)

    # -- rotation --------------------------------------------------------------------------------
    def rotate(self) -> bool:
        """Rotate now (auditrotate.py); False when another rotation runs or it failed (then
        the file keeps growing, and the next try comes after another quarter of max_bytes).
        The old file is read without holding appends up; only what was appended meanwhile is
        read, and the files swapped, under the append lock."""
        if not self._rotating.acquire(blocking=False):
            return False
        try:
            with self._lock:
                head_end = os.stat(self.path).st_size  # appends leave whole lines
            rows = self._rows(0, head_end)
            with self._lock:
                end = os.stat(self.path).st_size
                rows += self._rows(head_end, end)
                lines = auditrotate.carry(rows, self.carry_seconds, time.time(), clocks.boottime())
                auditrotate.install(self.path, lines, self.backups)
                kept = sum(len(line) + 1 for line in lines)
                # carried entries alone near the limit: do not rotate again at every append
                self._rotate_at = max(self.max_bytes, 2 * kept)
        except OSError as exc:
            self.rotation_errors += 1
            with contextlib.suppress(OSError):
                self._rotate_at = os.stat(self.path).st_size + max(1, self.max_bytes // 4)
            log.error("cannot rotate the audit log %s: %s (it keeps growing)", self.path, exc)
            return False
        finally:
            self._rotating.release()
        self.rotations += 1
        log.info(
            "audit log %s rotated at %d bytes to %s; %d entries carried into the new file",
            self.path,
            end,
            auditrotate.backup(self.path, 1) if self.backups > 0 else "nothing (no backups)",
            len(lines),
        )
        return True

    def _rows(self, start: int, end: int) -> list[tuple[bytes, dict[str, Any]]]:
        """The entries a rotation may carry between byte offsets `start` and `end`, with their
        lines (everything else, mostly `received`, is not held)."""
        out: list[tuple[bytes, dict[str, Any]]] = []
        if end <= start:
            return out
        with self.path.open("rb") as fh:
            fh.seek(start)
            for raw in _lines(fh):
                if raw is not None and raw.strip():  # a line too long is skipped, as in replay
                    parsed = parse_line(raw)
                    if isinstance(parsed, dict) and parsed["event"] in auditrotate.CARRIED_EVENTS:
                        out.append((raw, parsed))
                if fh.tell() >= end:
                    break
        return out

    def _repair_tail(self, fd: int) -> None:
        """Cut off a torn last line (no newline after it): it was never acknowledged."""
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return
        end = size
        keep = 0
        while end > 0:  # the last newline, read backwards in blocks
            start = max(0, end - 65536)
            block = os.pread(fd, end - start, start)
            at = block.rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        os.ftruncate(fd, keep)
        os.fsync(fd)
        self.torn_repaired += 1
        log.warning(
            "audit log %s ended in a torn line (%d bytes, never acknowledged): cut off",
            self.path,
            size - keep,
        )

    # -- reading ---------------------------------------------------------------------------------
    def replay(self, events: Collection[str] | None = None) -> Replay:
        """Every well-formed entry (only those whose event is in `events`, when given), oldest
        first, and what was skipped. Raises OSError only when the file cannot be read at all;
        content never raises."""
        out = Replay()
        try:
            fh = self.path.open("rb")
        except FileNotFoundError:
            self.last_replay = out
            return out
        with fh:
            for number, raw in enumerate(_lines(fh), 1):
                if raw is None:
                    out.skip(number, "too_long")
                    continue
                if not raw.strip():
                    continue
                parsed = parse_line(raw)
                if isinstance(parsed, str):
                    out.skip(number, parsed)
                elif events is None or parsed["event"] in events:
                    out.entries.append(parsed)
        if out.skipped:
            log.warning(
                "audit log %s: skipped %d unreadable lines (%s); first at %s",
                self.path,
                sum(out.skipped.values()),
                ", ".join(f"{k} {v}" for k, v in sorted(out.skipped.items())),
                ", ".join(f"line {n} ({why})" for n, why in out.bad_lines),
            )
        self.last_replay = out
        return out

    def entries(self, events: Collection[str] | None = None) -> list[dict[str, Any]]:
        """Every well-formed entry (a torn or foreign line is counted and skipped)."""
        return self.replay(events).entries


def new_intent() -> str:
    """A fresh intent id: pairs an action's intent with its commit or failure."""
    return uuid.uuid4().hex[:16]
