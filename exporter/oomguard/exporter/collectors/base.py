"""What every collector shares: the Collector protocol and the GPU memory reading.

A collector reads one source and returns a typed reading; it raises CollectorError when the
source cannot be read. Partial trouble (one GPU lost of eight, a NaN sample) goes into the
reading's `problems` so that the rest is still served. Collectors hold no lock and never touch
the HTTP path: the poller runs them on its lane thread, or one on its own thread (lanes.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from oomguard.exporter.render import FamilyBuilder


@dataclass
class Reading:
    """Base of every reading: problems found while reading, by reason."""

    errors: Counter[str] = field(default_factory=Counter)  # partial failures: collector not up
    invalid: Counter[str] = field(default_factory=Counter)  # dropped samples: collector still up


class Collector(Protocol):
    name: str  # collector label, e.g. "nvml"
    target: str  # target label for multi-target collectors, "" otherwise
    timeout: float  # seconds after which a poll still running counts as failed

    def collect(self) -> Reading: ...

    def families(self, reading: Any, out: FamilyBuilder) -> None: ...


@dataclass(frozen=True)
class GpuIdentity:
    gpu: str
    uuid: str
    pci_bus_id: str
    device: str
    model_name: str
    hostname: str
    gpu_instance_id: str = ""
    gpu_instance_profile: str = ""

    def labels(self) -> tuple[str, ...]:
        return self._labels

    @cached_property  # frozen: one tuple per identity, reused by every series of this GPU
    def _labels(self) -> tuple[str, ...]:
        return (
            self.gpu,
            self.uuid,
            self.pci_bus_id,
            self.device,
            self.model_name,
            self.hostname,
            self.gpu_instance_id,
            self.gpu_instance_profile,
        )

    @cached_property  # frozen: computed once, read per process and GPU on every render
    def key(self) -> tuple[str, str]:
        """A GPU or MIG instance: the parent's UUID plus the GPU instance id. Without a UUID
        (a source that does not label it) the index stands in, so two GPUs never merge."""
        return (self.uuid or f"index:{self.gpu}", self.gpu_instance_id)


@dataclass
class GpuMemory:
    identity: GpuIdentity
    total: float | None
    used: float | None
    free: float | None
    reserved: float | None

    def add_to(self, out: FamilyBuilder) -> None:
        labels = self.identity.labels()
        out.add("oomguard_gpu_memory_total_bytes", labels, self.total)
        out.add("oomguard_gpu_memory_used_bytes", labels, self.used)
        out.add("oomguard_gpu_memory_free_bytes", labels, self.free)
        out.add("oomguard_gpu_memory_reserved_bytes", labels, self.reserved)


@dataclass
class GpuReading(Reading):
    """GPU memory from one source (NVML or dcgm-exporter)."""

    gpus: list[GpuMemory] = field(default_factory=list)
    processes: list[tuple[GpuIdentity, int, float]] = field(default_factory=list)  # pid, bytes
    # The processes in runs of one GPU or MIG instance each, (its key, start, end) in order,
    # when the source lists them device by device (NVML): what takes a device's processes
    # whole takes a slice, not each process. None: not grouped.
    process_runs: list[tuple[tuple[str, str], int, int]] | None = None
    pods: list[tuple[GpuIdentity, str, str, str, float]] = field(default_factory=list)
    last_xid: list[tuple[GpuIdentity, float]] = field(default_factory=list)
    xid_counts: list[tuple[GpuIdentity, int, float]] = field(default_factory=list)  # xid, count
