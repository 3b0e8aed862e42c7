"""Patch pynvml so that it reports fake GPUs through its real types and real error classes.

Only the functions oomguard calls are replaced (the process listing at NVML's C function, under
pynvml's own wrapper); structs are pynvml's own ctypes structures and
errors are pynvml's own NVMLError subclasses, so `except pynvml.NVMLError_...` works as on a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

GIB = 1024**3


@dataclass
class FakeMig:
    instance_id: int
    profile: str
    total: int
    used: int
    free: int
    # what NVML lists for the MIG device handle: the processes inside that instance
    processes: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GIB
    used: int = 60 * GIB
    free: int = 19 * GIB
    reserved: int = 1 * GIB
    bus_id: str = "00000000:18:00.0"
    minor: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    mig: list[FakeMig] = field(default_factory=list)
    fail: type[pynvml.NVMLError] | None = None  # raised by memory reads of this GPU


class FakeNvml:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.init_error: type[pynvml.NVMLError] | None = None
        self.v2_supported = True
        self.process_error: type[pynvml.NVMLError] | None = None
        self.init_calls = 0
        self._filled: dict[Any, Any] = {}  # the driver's process arrays, per handle and list
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, getattr(self, name))
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", self._nvmlGetFunctionPointer)

    # handles are ("gpu", index) or ("mig", index, slot)
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error:
            raise self.init_error()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return ("gpu", index)

    def _gpu(self, handle: Any) -> FakeGpu:
        return self.gpus[handle[1]]

    def nvmlDeviceGetUUID(self, handle: Any) -> bytes:
        return self._gpu(handle).uuid.encode()  # this pynvml returns bytes

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu = self._gpu(handle)
        if handle[0] == "mig":
            return f"{gpu.name} MIG {gpu.mig[handle[2]].profile}"
        return gpu.name

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._gpu(handle).minor

    def nvmlDeviceGetPciInfo(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        info = pynvml.nvmlPciInfo_t()
        info.busId = self._gpu(handle).bus_id.encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu(handle)
        if gpu.fail:
            raise gpu.fail()
        if handle[0] == "mig":
            m = gpu.mig[handle[2]]
            total, used, free, reserved = m.total, m.used, m.free, 0
        else:
            total, used, free, reserved = gpu.total, gpu.used, gpu.free, gpu.reserved
        if version is not None:
            if not self.v2_supported:
                raise pynvml.NVMLError_FunctionNotFound()
            s = pynvml.c_nvmlMemory_v2_t()
            s.version = version
            s.total, s.used, s.free, s.reserved = total, used, free, reserved
            return s
        s1 = pynvml.c_nvmlMemory_t()
        s1.total, s1.used, s1.free = total, used + reserved, free
        return s1

    def _compute_processes_v3(self, handle: Any, count: Any, array: Any) -> int:
        """NVML's C function nvmlDeviceGetComputeRunningProcesses_v3, as pynvml calls it (and
        the exporter's own listing): `count` by reference, `array` of c_nvmlProcessInfo_v3_t or
        None; the answer an NVML return code. The rows are built once while the list does not
        change and copied into the caller's array in C, as the driver fills it."""
        if self.process_error:
            return int(self.process_error().value)
        gpu = self._gpu(handle)
        listed = gpu.mig[handle[2]].processes if handle[0] == "mig" else gpu.processes
        key = (handle, tuple(listed))
        c_procs = self._filled.get(key)
        if c_procs is None:
            c_procs = (pynvml.c_nvmlProcessInfo_v3_t * len(listed))()
            for i, (pid, used) in enumerate(listed):
                c_procs[i].pid = pid
                c_procs[i].usedGpuMemory = (
                    used if used is not None else pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                )
            self._filled = {k: v for k, v in self._filled.items() if k[0] != handle}
            self._filled[key] = c_procs
        n = len(listed)
        counter = count._obj  # ctypes.byref(c_uint)
        if not n:
            counter.value = 0
            return int(pynvml.NVML_SUCCESS)
        if array is None or counter.value < n:
            counter.value = n
            return int(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        ctypes.memmove(array, c_procs, ctypes.sizeof(c_procs))
        counter.value = n
        return int(pynvml.NVML_SUCCESS)

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        """pynvml's look-up of a C function in the NVML library: the process listing's (the
        one C function the fake provides; pynvml's own Python wrapper runs above it)."""
        if name == "nvmlDeviceGetComputeRunningProcesses_v3":
            return self._compute_processes_v3
        raise pynvml.NVMLError_FunctionNotFound()

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        enabled = bool(self._gpu(handle).mig)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, slot: int) -> Any:
        if slot >= len(self._gpu(handle).mig):
            raise pynvml.NVMLError_NotFound()
        return ("mig", handle[1], slot)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        return self._gpu(handle).mig[handle[2]].instance_id
