"""Host memory of a cgroup: usage, limit and kernel OOM kills (the exit-137 class of OOM).

cgroup v2 files: memory.current, memory.max, memory.events (`oom_kill N`). On a cgroup v1 host
the memory controller's usage_in_bytes, limit_in_bytes and memory.oom_control are read instead.
A limit of "max" (or v1's page-rounded 2**63) means unlimited: the host's MemTotal is reported as
the limit so that "used against limit" panels stay meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.base import Reading
from oomguard.exporter.render import FamilyBuilder

_V1_UNLIMITED = 2**62  # v1 reports 9223372036854771712 for "no limit"


@dataclass
class HostMemoryReading(Reading):
    used: float | None = None
    limit: float | None = None
    oom_kills: float | None = None
    version: int = 2


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CollectorError("not_found", f"cannot read {path}: {exc.strerror or exc}") from exc


def _int(text: str, path: Path) -> int:
    try:
        return int(text.strip())
    except ValueError as exc:
        raise CollectorError(
            "parse_error", f"{path}: expected an integer, got {text[:40]!r}"
        ) from exc


def _key_value(text: str, key: str, path: Path) -> int:
    for line in text.splitlines():
        parts = line.split()  # "oom_kill 3" or "MemTotal:  24576000 kB"
        if len(parts) >= 2 and parts[0] == key:
            return _int(parts[1], path)
    raise CollectorError("parse_error", f"{path}: no {key!r} line")


class CgroupCollector:
    name = "cgroup"

    def __init__(
        self,
        name: str,
        path: str,
        hostname: str,
        meminfo_path: str = "/proc/meminfo",
        timeout: float = 2.0,
    ) -> None:
        self.target = name
        self.path = Path(path)
        self.hostname = hostname
        self.meminfo_path = Path(meminfo_path)
        self.timeout = timeout

    def _mem_total(self) -> float | None:
        try:
            return _key_value(_read(self.meminfo_path), "MemTotal:", self.meminfo_path) * 1024.0
        except CollectorError:
            return None

    def collect(self) -> HostMemoryReading:
        if (self.path / "memory.current").exists():
            return self._v2()
        if (self.path / "memory" / "memory.usage_in_bytes").exists():
            return self._v1(self.path / "memory")
        if (self.path / "memory.usage_in_bytes").exists():
            return self._v1(self.path)
        raise CollectorError(
            "not_found",
            f"{self.path} has neither memory.current (cgroup v2) nor memory.usage_in_bytes (v1)",
        )

    def _v2(self) -> HostMemoryReading:
        current = self.path / "memory.current"
        limit_path = self.path / "memory.max"
        events = self.path / "memory.events"
        used = _int(_read(current), current)
        raw_limit = _read(limit_path).strip()
        limit = self._mem_total() if raw_limit == "max" else float(_int(raw_limit, limit_path))
        kills = _key_value(_read(events), "oom_kill", events)
        return HostMemoryReading(used=used, limit=limit, oom_kills=kills, version=2)

    def _v1(self, base: Path) -> HostMemoryReading:
        usage = base / "memory.usage_in_bytes"
        limit_path = base / "memory.limit_in_bytes"
        control = base / "memory.oom_control"
        used = _int(_read(usage), usage)
        raw = _int(_read(limit_path), limit_path)
        limit = self._mem_total() if raw >= _V1_UNLIMITED else float(raw)
        try:
            kills: int | None = _key_value(_read(control), "oom_kill", control)
        except CollectorError:
            kills = None  # kernels before 4.13 do not count kills in v1
        return HostMemoryReading(used=used, limit=limit, oom_kills=kills, version=1)

    def families(self, reading: HostMemoryReading, out: FamilyBuilder) -> None:
        labels = (self.hostname, self.target)
        out.add("oomguard_host_memory_used_bytes", labels, reading.used)
        out.add("oomguard_host_memory_limit_bytes", labels, reading.limit)
        out.add("oomguard_host_oom_kills_total", labels, reading.oom_kills)
