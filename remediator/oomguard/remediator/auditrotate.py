"""Rotating the audit log without forgetting what the safety limits need.

The audit log was never rotated and was read whole at every start and every change of leader: a
busy fleet's log grows without end (until the disk is full, and then no action can be recorded,
so none is taken), and 100 MB took 16 s and 235 MB of memory to replay here (1 GB: minutes, and
a liveness probe that kills the remediator before it is up).

When the file passes `max_bytes` it is rotated: it becomes `<file>.1` (older ones shift up to
`<file>.<backups>`; the oldest is dropped), and the new file starts with the entries the next
replay needs to rebuild the same state (`carry`), copied verbatim so that their ages are still
told by their own stamps:
- the last pause switch (`paused` / `unpaused`);
- every action of the safety window (intent, commit, failure, reconciliation), whole: an entry
  of the window brings its intent's other entries with it;
- every intent without an outcome yet (it counts, and is reconciled with its engine);
- each target's last restarts (the alert episodes they answered; restarting.py keeps 64).
A replay of the new file therefore gives the same pause, cooldowns, budgets, uncommitted intents
and answered episodes as a replay of the old one, and costs at most `max_bytes`.

The swap is crash-safe: the carried entries are written and fsynced to `<file>.rotating`, the
current file gets its backup name as a second (hard) link, and the new file replaces it with one
rename; the log's name never points at a partial file. Where links are not supported the current
file is renamed first, and a start that finds `<file>.rotating` without `<file>` completes it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from oomguard.remediator import clocks

log = logging.getLogger("oomguard.remediator.audit")

ACTION_EVENTS = frozenset({"intent", "acted", "failed", "reconciled"})
PAUSE_EVENTS = frozenset({"paused", "unpaused"})
CARRIED_EVENTS = ACTION_EVENTS | PAUSE_EVENTS


def carry(
    rows: Iterable[tuple[bytes, dict[str, Any]]],
    window_seconds: float,
    wall_now: float,
    uptime_now: float,
    restarts_per_target: int = 64,
    unknown_ages: int = 1000,
) -> list[bytes]:
    """The raw lines of `rows` (the old file's entries, oldest first, with their lines) that the
    new file must start with (module docstring), in their order. An action whose age cannot
    be told (no usable time; dated in the future after a clock step) may be recent: the last
    `unknown_ages` of them are kept, so that junk cannot make every rotation carry it all."""
    rows = list(rows)
    keep: set[int] = set()
    undated: list[int] = []
    last_pause: int | None = None
    groups: dict[str, list[int]] = {}
    settled: set[str] = set()
    restarts: dict[str, list[int]] = {}
    for i, (_, e) in enumerate(rows):
        event = e.get("event")
        if event in PAUSE_EVENTS:
            last_pause = i
            continue
        if event not in ACTION_EVENTS:
            continue
        key = e.get("intent")
        if isinstance(key, str) and key:
            groups.setdefault(key, []).append(i)
            if event != "intent":
                settled.add(key)
        target = e.get("target")
        restart = e.get("action") == "restart" and event in ("intent", "acted")
        if restart and isinstance(target, str):
            restarts.setdefault(target, []).append(i)
        try:
            age = clocks.age(e, wall_now, uptime_now)
        except Exception:  # a field of a shape nothing writes: keep it, the replay judges it
            age = None
        if age is None:
            undated.append(i)
        elif age <= window_seconds:
            keep.add(i)
    keep.update(undated[-unknown_ages:] if unknown_ages > 0 else ())
    for found in restarts.values():
        keep.update(found[-2 * restarts_per_target :])  # an intent and its commit each
    for key, members in groups.items():
        if key not in settled or not keep.isdisjoint(members):
            keep.update(members)
    if last_pause is not None:
        keep.add(last_pause)
    return [rows[i][0] for i in sorted(keep)]


def backup(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def pending(path: Path) -> Path:
    return path.with_name(f"{path.name}.rotating")


def recover(path: Path) -> None:
    """Finish or undo a rotation a crash interrupted (module docstring)."""
    tmp = pending(path)
    if not tmp.exists():
        return
    if path.exists():
        tmp.unlink(missing_ok=True)  # not installed: the current file is whole, start over later
    else:
        os.replace(tmp, path)  # renamed away, not yet replaced: the new file is complete
        fsync_dir(path.parent)


def install(path: Path, lines: list[bytes], backups: int) -> None:
    """Make `lines` the content of `path`, the old content its first backup. Raises OSError
    (then `path` is unchanged, or, where links fail, recover() completes it)."""
    tmp = pending(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        for line in lines:
            view = memoryview(line + b"\n")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    if backups <= 0:
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return
    for n in range(backups - 1, 0, -1):  # .1 -> .2, ...; the oldest is overwritten
        if backup(path, n).exists():
            os.replace(backup(path, n), backup(path, n + 1))
    first = backup(path, 1)
    first.unlink(missing_ok=True)
    try:
        os.link(path, first)  # a second name: `path` itself never goes missing
    except OSError:
        os.replace(path, first)  # no links here: recover() completes a crash right after this
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in `path` durable (the directory's entry)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory: nothing to do
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            log.warning("cannot fsync %s: %s", path, exc)
    finally:
        os.close(fd)
