"""Reading the incident directory: every valid record in it, the files refused counted by reason.

The directory is untrusted (anything that can write there can put anything there): only regular
files named as the writers name them are read, with O_NOFOLLOW|O_NONBLOCK (no symlink, no FIFO,
no device), at most MAX_FILE_BYTES each and MAX_FILES in all; JSON is validated strictly; a file
that fails is counted under a reason and never raises.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

from pydantic import ValidationError

from oomguard import bounded
from oomguard.incident_records import (
    EXIT_NAME,
    EXIT_SCHEMA,
    OOM_NAME,
    OOM_SCHEMA,
    ExitRecord,
    OomRecord,
)

log = logging.getLogger("oomguard.incidents")

MAX_FILE_BYTES = 256 * 1024  # an OOM record with a 512-request batch is about 80 KB
# Records nest 4 levels (batch.largest[i].params); no count or time in them has 20 digits.
LIMITS = bounded.Limits(max_bytes=MAX_FILE_BYTES, max_depth=8, max_digits=20, timeout=2.0)
MAX_FILES = 4096


@dataclass
class Loaded:
    ooms: list[OomRecord] = field(default_factory=list)
    exits: list[ExitRecord] = field(default_factory=list)
    invalid: Counter[str] = field(default_factory=Counter)  # files refused, by reason


class IncidentDirError(Exception):
    """The directory itself cannot be read; `reason` is a short label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _read_file(dir_fd: int, name: str) -> bytes:
    """At most MAX_FILE_BYTES of one regular file, never following a link or blocking."""
    try:
        return bounded.read_bytes(name, LIMITS, follow_symlinks=False, dir_fd=dir_fd)
    except bounded.InputError as exc:
        raise _Refused(exc.reason) from None


def _parse(name: str, data: bytes) -> OomRecord | ExitRecord:
    try:
        doc = bounded.parse_json(data, name, LIMITS)
    except bounded.InputError as exc:  # not_utf8, not_json, too_deep, number_too_long...
        raise _Refused(exc.reason) from None
    if not isinstance(doc, dict):
        raise _Refused("not_json")
    oom = name.startswith("oom-")
    if doc.get("schema") != (OOM_SCHEMA if oom else EXIT_SCHEMA):
        raise _Refused("schema")
    model: type[OomRecord] | type[ExitRecord] = OomRecord if oom else ExitRecord
    try:
        # JSON mode: strict types (no "5" for 5, no NaN), arrays for tuples
        record = model.model_validate_json(data).model_copy(update={"name": name})
    except ValidationError:
        raise _Refused("invalid_record") from None
    match = (OOM_NAME if oom else EXIT_NAME).fullmatch(name)
    if match is None or int(match.group(1)) != record.pid:
        raise _Refused("name_mismatch")  # one process, one name: no file can pose as another
    return record


# what a file was last time: (inode, size, mtime) -> the record, or the reason it was refused
ParseCache = dict[str, tuple[tuple[int, int, int], OomRecord | ExitRecord | str]]


def _cached_parse(dir_fd: int, name: str, cache: ParseCache | None) -> OomRecord | ExitRecord:
    """A file parsed once while it does not change (a long-running reader polls every second)."""
    key: tuple[int, int, int] | None = None
    if cache is not None:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        hit = cache.get(name)
        if hit is not None and hit[0] == key:
            if isinstance(hit[1], str):
                raise _Refused(hit[1])
            return hit[1]
    try:
        record = _parse(name, _read_file(dir_fd, name))
    except _Refused as exc:
        if cache is not None and key is not None:
            cache[name] = (key, exc.reason)
        raise
    if cache is not None and key is not None:
        cache[name] = (key, record)
    return record


def load(
    directory: str | os.PathLike[str], missing_ok: bool = True, cache: ParseCache | None = None
) -> Loaded:
    """Every valid record in the directory; refused files counted by reason, never raised.

    A missing directory holds no incidents (no writer ran yet) unless `missing_ok` is False;
    a directory that cannot be opened or listed raises IncidentDirError. With `cache` (kept by
    the caller between calls) an unchanged file is not read again.
    """
    loaded = Loaded()
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        if missing_ok:
            return loaded
        raise IncidentDirError("not_found", f"{directory}: no such directory") from exc
    except OSError as exc:
        raise IncidentDirError(
            "unreadable_directory", f"{directory}: {exc.strerror or exc}"
        ) from exc
    try:
        names: list[str] = []
        try:
            with os.scandir(dir_fd) as it:
                for entry in it:
                    name = entry.name
                    if not (name.startswith(("oom-", "exit-")) and name.endswith(".json")):
                        continue  # writers' temp files, anything else
                    if not (OOM_NAME.fullmatch(name) or EXIT_NAME.fullmatch(name)):
                        loaded.invalid["bad_name"] += 1
                    elif entry.is_symlink():
                        loaded.invalid["symlink"] += 1
                    elif not entry.is_file(follow_symlinks=False):
                        loaded.invalid["not_regular_file"] += 1  # never opened
                    elif len(names) >= MAX_FILES:
                        loaded.invalid["too_many_files"] += 1
                    else:
                        names.append(name)
        except OSError as exc:
            raise IncidentDirError(
                "unreadable_directory", f"cannot list {directory}: {exc.strerror or exc}"
            ) from exc
        if cache is not None:
            for gone in set(cache) - set(names):
                del cache[gone]
        for name in sorted(names):
            try:
                record = _cached_parse(dir_fd, name, cache)
            except _Refused as exc:
                if exc.reason != "not_found":  # removed between listing and reading
                    loaded.invalid[exc.reason] += 1
                continue
            except FileNotFoundError:
                continue  # removed between listing and reading
            except OSError:
                loaded.invalid["unreadable"] += 1
                continue
            if isinstance(record, OomRecord):
                loaded.ooms.append(record)
            else:
                loaded.exits.append(record)
    finally:
        os.close(dir_fd)
    return loaded
