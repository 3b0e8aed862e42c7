"""Simulated GPUs behind NVML's interface, so the exporter reads them through its normal code.

`TwinNvml` offers the pynvml functions the NVML collector calls and returns pynvml's own ctypes
structures and error classes; the exporter takes it as its NVML backend. A `TwinGpu` holds
device memory as the sum of its processes (vLLM's weights and KV pool, a neighbour job, ...)
plus driver-reserved memory, and scenarios change those processes while it runs. A MIG slice is
a `TwinGpu` of a MIG model: NVML shows it as the only MIG instance of its parent GPU.

`GPU_MODELS` is the twin's catalogue of the GPUs vLLM commonly runs on (docs/twin.md): the rows
of the one GPU table `oomguard.gpus` marked `twin`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml

from oomguard.gpus import GPUS, TWIN_GPUS, GpuSpec

MIB = 1024**2
GIB = 1024**3


# The twin's catalogue is the rows of the one GPU table (oomguard.gpus) marked `twin`, which
# `budget` and `preflight` read too: a GPU's memory means the same to all of them.
GPU_MODELS: dict[str, GpuSpec] = {key: GPUS[key] for key in TWIN_GPUS}


@dataclass
class TwinGpu:
    uuid: str
    model: str = "H100"
    minor: int = 0
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes

    @property
    def spec(self) -> GpuSpec:
        return GPU_MODELS[self.model]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def total(self) -> int:
        return self.spec.total_mib * MIB

    @property
    def reserved(self) -> int:
        return self.spec.reserved_mib * MIB

    @property
    def used(self) -> int:
        return sum(self.processes.values())

    @property
    def free(self) -> int:
        return max(0, self.total - self.reserved - self.used)


class TwinNvml:
    """A pynvml-compatible backend over TwinGpus (thread-safe: scenarios mutate, exporter reads)."""

    def __init__(self, gpus: list[TwinGpu]) -> None:
        self.gpus = gpus
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # Error classes and constants (NVMLError_*, nvmlMemory_v2, NVML_DEVICE_MIG_ENABLE) are
        # pynvml's own, so the collector's `except` clauses work unchanged.
        if name.startswith(("NVMLError", "NVML_", "nvmlMemory")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return index

    def nvmlDeviceGetMinorNumber(self, handle: int) -> int:
        return self.gpus[handle].minor

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.gpus[handle].uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu = self.gpus[_index(handle)]
        if gpu.spec.mig_profile and not _is_mig(handle):
            return GPU_MODELS[gpu.spec.parent].name
        return gpu.name

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"00000000:{0x18 + 0x11 * handle:02X}:00.0".encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        with self.lock:
            gpu = self.gpus[_index(handle)]
            if gpu.spec.mig_profile and not _is_mig(handle):
                # The parent of a MIG slice: its own size, with the slice's use in it.
                parent = GPU_MODELS[gpu.spec.parent]
                total, reserved = parent.total_mib * MIB, parent.reserved_mib * MIB
                used = gpu.used
                free = max(0, total - reserved - used)
            else:
                total, reserved, used, free = gpu.total, gpu.reserved, gpu.used, gpu.free
        if version is None:
            v1 = pynvml.c_nvmlMemory_t()
            v1.total, v1.used, v1.free = total, used + reserved, free
            return v1
        v2 = pynvml.c_nvmlMemory_v2_t()
        v2.version = version
        v2.total, v2.reserved, v2.used, v2.free = total, reserved, used, free
        return v2

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        with self.lock:
            gpu = self.gpus[_index(handle)]
            # With MIG on, processes are listed on the instance that runs them.
            items = [] if gpu.spec.mig_profile and not _is_mig(handle) else gpu.processes.items()
            items = list(items)
        out = []
        for pid, used in items:
            info = pynvml.c_nvmlProcessInfo_v2_t()
            info.pid, info.usedGpuMemory = pid, used
            out.append(pynvml.nvmlStructToFriendlyObject(info))
        return out

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        if not self.gpus[_index(handle)].spec.mig_profile:
            raise pynvml.NVMLError_NotSupported()
        return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return 1

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, slot: int) -> Any:
        if slot != 0:
            raise pynvml.NVMLError_NotFound()
        return ("mig", _index(handle))

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        return 1 if self.gpus[_index(handle)].spec.mig_profile.startswith("1g") else 2

    def set_process(self, gpu: int, pid: int, used: int | None) -> None:
        """Start, resize (bytes) or end (None) a process on a GPU."""
        with self.lock:
            if used is None:
                self.gpus[gpu].processes.pop(pid, None)
            else:
                self.gpus[gpu].processes[pid] = int(used)


def _index(handle: Any) -> int:
    """A whole-GPU handle is its index; a MIG instance's handle is ("mig", parent index)."""
    return handle[1] if isinstance(handle, tuple) else handle


def _is_mig(handle: Any) -> bool:
    return isinstance(handle, tuple)
