"""Simulated GPUs behind NVML's interface, so the exporter reads them through its normal code.

`TwinNvml` offers the pynvml functions the NVML collector calls and returns pynvml's own ctypes
structures and error classes; the exporter takes it as its NVML backend. A `TwinGpu` holds
device memory as the sum of its processes (vLLM's weights and KV pool, a neighbour job, ...)
plus driver-reserved memory, and scenarios change those processes while it runs.

This is the memory half of the GPU twin in its first form; the step-time model and activation
peaks are to come (docs/twin.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml

MIB = 1024**2
GIB = 1024**3

# Device memory as NVML reports it, and its driver-reserved part (MiB), by model.
MODELS: dict[str, tuple[str, int, int]] = {
    "H100": ("NVIDIA H100 80GB HBM3", 81559, 567),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920, 543),
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960, 470),
    "RTX4090": ("NVIDIA GeForce RTX 4090", 24564, 346),
}


@dataclass
class TwinGpu:
    uuid: str
    model: str = "H100"
    minor: int = 0
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes

    @property
    def name(self) -> str:
        return MODELS[self.model][0]

    @property
    def total(self) -> int:
        return MODELS[self.model][1] * MIB

    @property
    def reserved(self) -> int:
        return MODELS[self.model][2] * MIB

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

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.gpus[handle].name

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        info = pynvml.nvmlPciInfo_t()
        info.busId = f"00000000:{0x18 + 0x11 * handle:02X}:00.0".encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        with self.lock:
            gpu = self.gpus[handle]
            total, reserved, used, free = gpu.total, gpu.reserved, gpu.used, gpu.free
        if version is None:
            v1 = pynvml.c_nvmlMemory_t()
            v1.total, v1.used, v1.free = total, used + reserved, free
            return v1
        v2 = pynvml.c_nvmlMemory_v2_t()
        v2.version = version
        v2.total, v2.reserved, v2.used, v2.free = total, reserved, used, free
        return v2

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        with self.lock:
            items = list(self.gpus[handle].processes.items())
        out = []
        for pid, used in items:
            info = pynvml.c_nvmlProcessInfo_v2_t()
            info.pid, info.usedGpuMemory = pid, used
            out.append(pynvml.nvmlStructToFriendlyObject(info))
        return out

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        raise pynvml.NVMLError_NotSupported()

    def set_process(self, gpu: int, pid: int, used: int | None) -> None:
        """Start, resize (bytes) or end (None) a process on a GPU."""
        with self.lock:
            if used is None:
                self.gpus[gpu].processes.pop(pid, None)
            else:
                self.gpus[gpu].processes[pid] = int(used)
