"""The allocator hand-off: how ranks inside vLLM publish PyTorch allocator statistics.

Only a process that owns a CUDA context can read `torch.cuda.memory_stats()`, and the exporter
must never create one. So each rank (the oomguard vLLM plugin, or the GPU twin) writes one small
JSON file per process into a shared directory, atomically (write, then rename), and the exporter
reads the directory on every poll.

File: `<directory>/pid-<pid>.json`, one JSON object:

    {
      "schema": "oomguard.allocator.v1",
      "timestamp": 1764420000.25,          # unix seconds when the stats were read
      "pid": 4242, "rank": 0,              # host PID and the worker's rank
      "target": "llama-8b", "engine": "0", # vLLM target name and engine index ("" if unknown)
      "device_index": 0, "device_uuid": "GPU-...",
      "allocated_bytes": 1, "reserved_bytes": 2,
      "allocated_peak_bytes": 3, "reserved_peak_bytes": 4,
      "inactive_split_bytes": 5,
      "alloc_retries": 0, "ooms": 0,       # cumulative counts since the process started
      "free_after_gc_bytes": null,         # device free bytes right after empty_cache(), if run
      "gc_timestamp": null,                # when that measurement was taken
      "step_shrinks": {"fewer_prefill_tokens/activations": 3}  # optional: the plugin's step
                                           # guard's shrinks by "action/reason", cumulative
    }

Unknown keys are ignored, so the format can grow; a missing required key or a wrong type makes
the file invalid (the exporter counts it and serves nothing from it). A file whose timestamp is
older than the exporter's `stale_after_seconds` is stale: its process stopped publishing.

The directory is untrusted input (any process that can write to it can put anything there), so
the reader is strict, and each refusal is counted under a reason:
- only regular files named exactly `pid-<pid>.json` are read, opened with O_NOFOLLOW|O_NONBLOCK
  and checked with fstat: symlinks (`symlink`), FIFOs and device files (`not_regular_file`) are
  never read, so a FIFO cannot block the collector and a link to /dev/zero cannot be read;
- at most MAX_FILE_BYTES are read from a file (`too_large`), at most MAX_FILES files per poll
  (`too_many_files`);
- the bytes go through oomguard.bounded: strict UTF-8 (`not_utf8`), JSON (`not_json`), no
  nesting (`too_deep`), no number over 20 digits (`number_too_long`), none infinite
  (`not_finite`);
- numbers must be integers in [0, 2**63) (ids below 2**31) or finite timestamps (`out_of_range`):
  a 400-digit integer cannot reach the renderer;
- the pid inside must match the file name (`name_mismatch`): one (pid, rank) has one file, so two
  files cannot alternate their counts and fake an OOM on every poll;
- a timestamp further in the future than `stale_after` (`future_timestamp`) would never go stale.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import threading
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from oomguard import bounded
from oomguard.errors import HandoffError

SCHEMA = "oomguard.allocator.v1"
MAX_FILE_BYTES = 64 * 1024
# A report is one flat object: nothing in it nests, and no real count has 20 digits.
LIMITS = bounded.Limits(max_bytes=MAX_FILE_BYTES, max_depth=4, max_digits=20, timeout=2.0)
REPORT_MODE = 0o644
MAX_FILES = 1024  # ranks on one node: 8 GPUs x a few processes; far more is a runaway writer
MAX_COUNT = 2**63 - 1  # torch's counters are int64; anything larger is not a real figure
MAX_ID = 2**31 - 1  # pid, rank, device index
MAX_TEXT = 256  # target, engine, device UUID: label values, kept short

_NAME = re.compile(r"pid-([1-9][0-9]{0,9})\.json")

# The step guard's shrinks (vllm_plugin/step_guard.py): only these "action/reason" keys are
# accepted, so a hostile file cannot invent label values.
STEP_ACTIONS = ("fewer_prefill_tokens", "decode_only", "wait")
STEP_REASONS = ("activations", "prompt_logprobs_logits", "sampling_logits")
STEP_SHRINK_KEYS = frozenset(f"{a}/{r}" for a in STEP_ACTIONS for r in STEP_REASONS)

_INT_FIELDS = (
    "allocated_bytes",
    "reserved_bytes",
    "allocated_peak_bytes",
    "reserved_peak_bytes",
    "inactive_split_bytes",
    "alloc_retries",
    "ooms",
)

# torch.cuda.memory_stats() key for each hand-off field.
TORCH_STATS_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "allocated_peak_bytes": "allocated_bytes.all.peak",
    "reserved_peak_bytes": "reserved_bytes.all.peak",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


class InvalidReport(HandoffError):
    """A hand-off file that is refused; `reason` is the invalid-sample label value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class AllocatorReport:
    timestamp: float
    pid: int
    rank: int
    target: str
    engine: str
    device_index: int
    device_uuid: str
    allocated_bytes: int
    reserved_bytes: int
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    ooms: int
    free_after_gc_bytes: int | None = None
    gc_timestamp: float | None = None
    step_shrinks: dict[str, int] | None = None

    @classmethod
    def from_memory_stats(cls, stats: dict[str, Any], **identity: Any) -> AllocatorReport:
        """Build a report from `torch.cuda.memory_stats()` plus identity fields."""
        values = {field: int(stats.get(key, 0)) for field, key in TORCH_STATS_KEYS.items()}
        fields: dict[str, Any] = {**identity, **values}
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> AllocatorReport:
        try:
            data = bounded.parse_json(text, "allocator report", LIMITS)
        except bounded.InputError as exc:  # not_utf8, not_json, too_deep, number_too_long...
            raise InvalidReport(exc.reason, str(exc)) from None
        if not isinstance(data, dict):
            raise InvalidReport("not_json", "not a JSON object")
        if data.get("schema") != SCHEMA:
            raise InvalidReport(
                "schema", f"schema is {str(data.get('schema'))[:64]!r}, expected {SCHEMA!r}"
            )
        try:
            kwargs: dict[str, Any] = {
                "timestamp": _timestamp(data, "timestamp"),
                "pid": _int(data, "pid", MAX_ID),
                "rank": _int(data, "rank", MAX_ID),
                "target": _str(data, "target"),
                "engine": _str(data, "engine"),
                "device_index": _int(data, "device_index", MAX_ID),
                "device_uuid": _str(data, "device_uuid"),
            }
            for name in _INT_FIELDS:
                kwargs[name] = _int(data, name)
            free = data.get("free_after_gc_bytes")
            kwargs["free_after_gc_bytes"] = (
                None if free is None else _int(data, "free_after_gc_bytes")
            )
            gc_ts = data.get("gc_timestamp")
            kwargs["gc_timestamp"] = None if gc_ts is None else _timestamp(data, "gc_timestamp")
            kwargs["step_shrinks"] = _shrinks(data.get("step_shrinks"))
        except KeyError as exc:
            raise InvalidReport("missing_field", f"missing field {exc.args[0]!r}") from None
        return cls(**kwargs)


def _shrinks(value: Any) -> dict[str, int] | None:
    """The optional `step_shrinks` object: known "action/reason" keys, counts as counters."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidReport("bad_type", "field 'step_shrinks' must be an object")
    unknown = [str(k)[:64] for k in value if k not in STEP_SHRINK_KEYS]
    if unknown:
        raise InvalidReport("bad_type", f"field 'step_shrinks' has unknown key {unknown[0]!r}")
    return {key: _int(value, key) for key in sorted(value)}


def _shown(value: Any) -> str:
    return repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"


def _int(data: dict[str, Any], key: str, limit: int = MAX_COUNT) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidReport(
            "bad_type", f"field {key!r} must be a non-negative integer, got {_shown(value)[:64]}"
        )
    if not 0 <= value <= limit:
        raise InvalidReport(
            "out_of_range",
            f"field {key!r} must be a non-negative integer up to {limit}, got {_shown(value)}",
        )
    return value


def _timestamp(data: dict[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidReport("bad_type", f"field {key!r} must be a number, got {_shown(value)[:64]}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise InvalidReport(
            "out_of_range", f"field {key!r} must be a finite unix time, got {_shown(value)}"
        )
    return number


def _str(data: dict[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise InvalidReport("bad_type", f"field {key!r} must be a string, got {_shown(value)[:64]}")
    if len(value) > MAX_TEXT:
        raise InvalidReport("out_of_range", f"field {key!r} is over {MAX_TEXT} characters")
    return value


def report_path(directory: str | os.PathLike[str], pid: int) -> Path:
    return Path(directory) / f"pid-{pid}.json"


# One process has two writers of its own report: the periodic publisher (a thread) and the OOM
# observer (whichever thread hit the OOM). The publisher reads memory_stats(), then writes; an
# OOM observed in between wrote `ooms` + 1, and the publisher's older snapshot would replace it
# (in a process about to die, for good: the exporter never sees the OOM). So writes of this
# process's report are serialised, and its OOM count never goes down.
_write_lock = threading.RLock()  # re-entrant: an observer may fire in a thread mid-write
_ooms_written: dict[str, int] = {}  # report path -> highest `ooms` this process wrote there


def _after_fork_in_child() -> None:
    global _write_lock
    _write_lock = threading.RLock()  # another thread may have held it at the fork
    _ooms_written.clear()  # the child has a pid, and a report, of its own


os.register_at_fork(after_in_child=_after_fork_in_child)


def write_report(directory: str | os.PathLike[str], report: AllocatorReport) -> Path:
    """Write atomically: a reader sees the old file or the new one, never half of one.

    For this process's own report, `ooms` is at least what it last wrote there, whichever of
    its writers' snapshots is older."""
    path = report_path(directory, report.pid)
    if report.pid != os.getpid():
        return _replace_file(path, report)  # a report written for another process (tests, bench)
    with _write_lock:
        key = str(path)
        report = replace(report, ooms=max(report.ooms, _ooms_written.get(key, 0)))
        _replace_file(path, report)
        _ooms_written[key] = report.ooms
        return path


def _replace_file(path: Path, report: AllocatorReport) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pid-", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600; the exporter often runs as another user (a DaemonSet's non-root
        # UID beside a root vLLM pod). The stats are not secret: world-readable, like /proc.
        os.fchmod(fd, REPORT_MODE)
        with os.fdopen(fd, "w") as fh:
            fh.write(report.to_json())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _read_file(dir_fd: int, name: str) -> bytes:
    """At most MAX_FILE_BYTES of one regular file, never following a link or blocking."""
    try:
        return bounded.read_bytes(name, LIMITS, follow_symlinks=False, dir_fd=dir_fd)
    except bounded.InputError as exc:
        raise InvalidReport(exc.reason, str(exc)) from None


def _candidates(dir_fd: int, problems: Counter[str]) -> list[tuple[str, int]]:
    """(file name, pid from the name) of the report files, sorted, at most MAX_FILES."""
    found: list[tuple[str, int]] = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            name = entry.name
            if not (name.startswith("pid-") and name.endswith(".json")):
                continue  # temp files of writers, anything else
            match = _NAME.fullmatch(name)
            if match is None:
                problems["bad_name"] += 1
            elif entry.is_symlink():
                problems["symlink"] += 1
            elif not entry.is_file(follow_symlinks=False):
                problems["not_regular_file"] += 1  # FIFOs, devices, sockets: never opened
            elif len(found) >= MAX_FILES:
                problems["too_many_files"] += 1
            else:
                found.append((name, int(match.group(1))))
    found.sort()
    return found


def read_reports(
    directory: str | os.PathLike[str], now: float, stale_after: float
) -> tuple[list[AllocatorReport], Counter[str]]:
    """Fresh reports in the directory, and a count of files refused by reason.

    A missing directory means no rank is publishing: no reports, no problem counted. A directory
    that exists but cannot be listed raises InvalidReport("unreadable_directory").
    """
    problems: Counter[str] = Counter()
    reports: list[AllocatorReport] = []
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return reports, problems
    except OSError as exc:
        raise InvalidReport("unreadable_directory", f"cannot open {directory}: {exc}") from exc
    try:
        try:
            candidates = _candidates(dir_fd, problems)
        except OSError as exc:
            raise InvalidReport("unreadable_directory", f"cannot list {directory}: {exc}") from exc
        for name, pid in candidates:
            try:
                report = AllocatorReport.from_json(_read_file(dir_fd, name))
            except InvalidReport as exc:
                if exc.reason != "not_found":  # removed between listing and reading: it exited
                    problems[exc.reason] += 1
                continue
            if report.pid != pid:
                problems["name_mismatch"] += 1
            elif now - report.timestamp > stale_after:
                problems["stale"] += 1
            elif report.timestamp - now > stale_after:
                problems["future_timestamp"] += 1
            else:
                reports.append(report)
    finally:
        os.close(dir_fd)
    return reports, problems
