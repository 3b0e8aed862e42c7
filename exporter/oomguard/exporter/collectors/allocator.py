"""PyTorch caching-allocator statistics per rank, from the plugin's hand-off directory.

The exporter never calls torch.cuda itself (that would create a CUDA context on every GPU).
Ranks inside vLLM publish their statistics as files (format: handoff.py); this collector
reads the fresh ones. Stale files (a process that stopped publishing) and malformed or hostile
ones (handoff.py lists the checks) are counted as invalid, by reason, and serve nothing;
a directory that exists but cannot be read makes the collector fail with a reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.base import Reading
from oomguard.exporter.render import FamilyBuilder
from oomguard.handoff import AllocatorReport, InvalidReport, read_reports


@dataclass
class AllocatorReading(Reading):
    reports: list[AllocatorReport] = field(default_factory=list)


class AllocatorCollector:
    name = "allocator"
    target = ""

    def __init__(
        self,
        directory: str,
        hostname: str,
        stale_after: float = 30.0,
        timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.hostname = hostname
        self.stale_after = stale_after
        self.timeout = timeout
        self._clock = clock

    def collect(self) -> AllocatorReading:
        try:
            reports, problems = read_reports(self.directory, self._clock(), self.stale_after)
        except InvalidReport as exc:
            raise CollectorError(exc.reason, str(exc)) from exc
        reading = AllocatorReading(reports=reports)
        reading.invalid.update(problems)
        return reading

    def labels(self, r: AllocatorReport) -> tuple[str, ...]:
        return (
            self.hostname,
            str(r.device_index),
            r.device_uuid,
            r.target,
            r.engine,
            str(r.rank),
            str(r.pid),
        )

    def families(self, reading: AllocatorReading, out: FamilyBuilder) -> None:
        for r in reading.reports:
            labels = self.labels(r)
            out.add("oomguard_allocator_allocated_bytes", labels, r.allocated_bytes)
            out.add("oomguard_allocator_reserved_bytes", labels, r.reserved_bytes)
            out.add("oomguard_allocator_allocated_peak_bytes", labels, r.allocated_peak_bytes)
            out.add("oomguard_allocator_reserved_peak_bytes", labels, r.reserved_peak_bytes)
            out.add("oomguard_allocator_inactive_split_bytes", labels, r.inactive_split_bytes)
            out.add("oomguard_allocator_alloc_retries_total", labels, r.alloc_retries)
            out.add("oomguard_allocator_ooms_total", labels, r.ooms)
            out.add("oomguard_allocator_free_after_gc_bytes", labels, r.free_after_gc_bytes)
            out.add("oomguard_allocator_report_timestamp_seconds", labels, r.timestamp)
            for kind, count in (r.step_shrinks or {}).items():
                action, reason = kind.split("/", 1)  # keys checked by the hand-off reader
                out.add("oomguard_step_guard_shrinks_total", (*labels, action, reason), count)
