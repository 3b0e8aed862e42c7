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
      "gc_timestamp": null                 # when that measurement was taken
    }

Unknown keys are ignored, so the format can grow; a missing required key or a wrong type makes
the file invalid (the exporter counts it and serves nothing from it). A file whose timestamp is
older than the exporter's `stale_after_seconds` is stale: its process stopped publishing.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oomguard.errors import HandoffError

SCHEMA = "oomguard.allocator.v1"
MAX_FILE_BYTES = 64 * 1024

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

    @classmethod
    def from_memory_stats(cls, stats: dict[str, Any], **identity: Any) -> AllocatorReport:
        """Build a report from `torch.cuda.memory_stats()` plus identity fields."""
        values = {field: int(stats.get(key, 0)) for field, key in TORCH_STATS_KEYS.items()}
        return cls(**identity, **values)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> AllocatorReport:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HandoffError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise HandoffError("not a JSON object")
        if data.get("schema") != SCHEMA:
            raise HandoffError(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
        try:
            kwargs: dict[str, Any] = {
                "timestamp": _number(data, "timestamp"),
                "pid": _int(data, "pid"),
                "rank": _int(data, "rank"),
                "target": _str(data, "target"),
                "engine": _str(data, "engine"),
                "device_index": _int(data, "device_index"),
                "device_uuid": _str(data, "device_uuid"),
            }
            for name in _INT_FIELDS:
                kwargs[name] = _int(data, name)
            free = data.get("free_after_gc_bytes")
            kwargs["free_after_gc_bytes"] = (
                None if free is None else _int(data, "free_after_gc_bytes")
            )
            gc_ts = data.get("gc_timestamp")
            kwargs["gc_timestamp"] = None if gc_ts is None else _number(data, "gc_timestamp")
        except KeyError as exc:
            raise HandoffError(f"missing field {exc.args[0]!r}") from None
        return cls(**kwargs)


def _int(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HandoffError(f"field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _number(data: dict[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise HandoffError(f"field {key!r} must be a number, got {value!r}")
    return float(value)


def _str(data: dict[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise HandoffError(f"field {key!r} must be a string, got {value!r}")
    return value


def report_path(directory: str | os.PathLike[str], pid: int) -> Path:
    return Path(directory) / f"pid-{pid}.json"


def write_report(directory: str | os.PathLike[str], report: AllocatorReport) -> Path:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    path = report_path(directory, report.pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pid-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(report.to_json())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_reports(
    directory: str | os.PathLike[str], now: float, stale_after: float
) -> tuple[list[AllocatorReport], Counter[str]]:
    """Fresh reports in the directory, and a count of files skipped by reason.

    A missing directory means no rank is publishing: no reports, no problem counted.
    """
    problems: Counter[str] = Counter()
    reports: list[AllocatorReport] = []
    base = Path(directory)
    try:
        entries = sorted(base.glob("pid-*.json"))
    except OSError:
        return reports, problems
    for path in entries:
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                problems["too_large"] += 1
                continue
            report = AllocatorReport.from_json(path.read_text())
        except FileNotFoundError:
            continue  # removed between listing and reading: the process exited
        except (OSError, UnicodeDecodeError, HandoffError):
            problems["invalid_file"] += 1
            continue
        if now - report.timestamp > stale_after:
            problems["stale"] += 1
            continue
        reports.append(report)
    return reports, problems
