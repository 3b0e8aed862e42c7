"""GPU memory from NVML (nvidia-ml-py, module `pynvml`).

The backend is the pynvml module by default; the GPU twin passes an object with the same
functions and error classes, so the exporter reads a simulated GPU through this same code.
Identity is cached per device index (it does not change while the driver is loaded) and the
cache is dropped whenever NVML reports an error that may mean the GPU set changed. A GPU's MIG
mode and instance layout are cached too, and read again every MIG_RECHECK_SECONDS, after such an
error, or when a cached instance cannot be read (see _read_mig).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.base import GpuIdentity, GpuMemory, GpuReading
from oomguard.exporter.render import FamilyBuilder

_MIG_PROFILE = re.compile(r"MIG\s+(\S+)")
_MAX_MIG_SLOTS = 7  # GPU instances per GPU at most (NVIDIA's MIG user guide: A100, H100)
# How long a GPU's MIG mode and instance layout are used before they are read again. MIG mode
# changes only by an administrator's command and a GPU reset (whose errors drop the cache at
# once), the layout only by an administrator creating or destroying instances; yet
# nvmlDeviceGetMigMode alone costs 160-173 us of CPU on an H200 (driver 580, MIG off), two thirds
# of a GPU's poll (~1.4 ms/s on an 8-GPU node at a 1 s interval). 30 s: a new instance shows
# within it, sooner than an engine started on it loads its weights and serves; a destroyed
# one is noticed at its first failed read (then the layout is read again in the same poll).
MIG_RECHECK_SECONDS = 30.0


def _row_format() -> struct.Struct | None:
    """The (pid, usedGpuMemory) layout of pynvml's c_nvmlProcessInfo_v3_t as a struct format, or
    None if this pynvml's struct is not the one NVML's headers describe (then pynvml's own
    listing is used)."""
    try:
        row = pynvml.c_nvmlProcessInfo_v3_t
        pid, used = row.pid, row.usedGpuMemory
        size = ctypes.sizeof(row)
    except AttributeError:
        return None
    if (pid.offset, pid.size, used.offset, used.size) != (0, 4, 8, 8) or size < 16:
        return None
    return struct.Struct(f"=I4xQ{size - 16}x")


_ROW = _row_format()
_NOT_AVAILABLE = 0xFFFF_FFFF_FFFF_FFFF  # NVML_VALUE_NOT_AVAILABLE (unsigned long long)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _reason(exc: Exception) -> str:
    """`NVMLError_GpuIsLost` -> `gpu_is_lost`: a stable label value for the error class."""
    name = type(exc).__name__.removeprefix("NVMLError_") or "unknown"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


_Entry = tuple[GpuIdentity, int, float]  # a process: its GPU or MIG instance, pid, bytes


def _add_run(reading: GpuReading, identity: GpuIdentity, entries: list[_Entry]) -> None:
    """A device's processes onto the reading, and their run (GpuReading.process_runs)."""
    start = len(reading.processes)
    reading.processes.extend(entries)
    if entries and reading.process_runs is not None:
        reading.process_runs.append((identity.key, start, len(reading.processes)))


@dataclass
class _Device:
    identity: GpuIdentity
    handle: Any


@dataclass
class _MigLayout:
    """A GPU's MIG instances as last read: (instance handle, identity) each; none when MIG is
    off or not supported. `read_at`: the collector's clock when they were read."""

    read_at: float
    instances: list[tuple[Any, GpuIdentity]]


class NvmlCollector:
    name = "nvml"
    target = ""

    def __init__(
        self,
        hostname: str,
        backend: Any = None,
        process_metrics: bool = True,
        timeout: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nvml = backend if backend is not None else pynvml
        self.hostname = hostname
        self.process_metrics = process_metrics
        self.timeout = timeout
        self.clock = clock  # for MIG_RECHECK_SECONDS
        self._initialized = False
        self._identities: dict[int, GpuIdentity] = {}
        # MIG layout per device index, dropped with its identity (see MIG_RECHECK_SECONDS)
        self._mig_layouts: dict[int, _MigLayout] = {}
        # MIG instances as last seen: the same identity object while nothing about it changes,
        # so that an unchanged process list compares equal by reference (see families)
        self._mig_identities: dict[GpuIdentity, GpuIdentity] = {}
        # the per-process series of the last render, and the process list they came from
        self._last_processes: list[tuple[GpuIdentity, int, float]] = []
        self._last_series: list[tuple[tuple[str, ...], float]] = []
        self._memory_v2 = True
        # Process lists straight from NVML's C function into a reused array, read with one
        # struct unpack: pynvml's own listing makes a Python object per process (two thirds of
        # a poll's CPU at thousands of processes). Only for the real pynvml module; a backend
        # object (the GPU twin) is called through its functions.
        self._direct = backend is None and _ROW is not None
        self._buffers: dict[int, Any] = {}  # ctypes array per array length, reused each poll
        # Per GPU or MIG instance: its process list as the driver last gave it (the raw rows, or
        # pynvml's (pid, bytes) pairs), the entries read from it and what it dropped. Most lists
        # do not move between polls: an equal list (compared in C) reuses its entries, so that
        # neither this read nor the render after it touches each process again.
        self._listed: dict[GpuIdentity, tuple[Any, list[_Entry], Counter[str]]] = {}

    # -- NVML lifecycle ------------------------------------------------------------------------
    def _ensure_init(self) -> None:
        if self._initialized:
            return
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound as exc:
            raise CollectorError(
                "library_not_found",
                "NVML library not found: no NVIDIA driver on this host, or libnvidia-ml is not "
                "mounted into the container",
            ) from exc
        except nvml.NVMLError_DriverNotLoaded as exc:
            raise CollectorError("driver_not_loaded", "NVIDIA driver is not loaded") from exc
        except nvml.NVMLError_NoPermission as exc:
            raise CollectorError("no_permission", "no permission to open NVML devices") from exc
        except nvml.NVMLError as exc:
            raise CollectorError(_reason(exc), f"nvmlInit failed: {exc}") from exc
        self._initialized = True

    def close(self) -> None:
        if self._initialized:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()
            self._initialized = False

    def _reset(self) -> None:
        self._identities.clear()
        self._mig_layouts.clear()
        self._mig_identities.clear()
        self._listed.clear()
        self.close()

    # -- reading ---------------------------------------------------------------------------------
    def collect(self) -> GpuReading:
        self._ensure_init()
        nvml = self.nvml
        reading = GpuReading(process_runs=[])
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            self._reset()
            raise CollectorError(_reason(exc), f"nvmlDeviceGetCount failed: {exc}") from exc
        for index in range(count):
            try:
                device = self._device(index)
                self._read_device(index, device, reading)
            except nvml.NVMLError as exc:
                # One GPU failing (lost, reset needed) must not hide the others.
                reading.errors[_reason(exc)] += 1
                self._identities.pop(index, None)
                self._mig_layouts.pop(index, None)  # a reset may have switched MIG mode
        if reading.errors and not reading.gpus:
            self._reset()
        return reading

    def _device(self, index: int) -> _Device:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        identity = self._identities.get(index)
        if identity is None:
            try:
                minor = nvml.nvmlDeviceGetMinorNumber(handle)
                device_name = f"nvidia{minor}"
            except nvml.NVMLError_NotSupported:
                device_name = f"nvidia{index}"
            identity = GpuIdentity(
                gpu=str(index),
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                device=device_name,
                model_name=_text(nvml.nvmlDeviceGetName(handle)),
                hostname=self.hostname,
            )
            self._identities[index] = identity
        return _Device(identity, handle)

    def _memory(self, handle: Any) -> tuple[float, float, float, float | None]:
        """(total, used, free, reserved). v2 separates driver-reserved memory; v1 cannot."""
        nvml = self.nvml
        if self._memory_v2:
            try:
                m = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                return float(m.total), float(m.used), float(m.free), float(m.reserved)
            except nvml.NVMLError_FunctionNotFound:
                self._memory_v2 = False  # old driver: fall back for good
        m = nvml.nvmlDeviceGetMemoryInfo(handle)
        return float(m.total), float(m.used), float(m.free), None

    def _read_device(self, index: int, device: _Device, reading: GpuReading) -> None:
        total, used, free, reserved = self._memory(device.handle)
        reading.gpus.append(GpuMemory(device.identity, total, used, free, reserved))
        if self.process_metrics:
            self._read_processes(device.identity, device.handle, reading)
        self._read_mig(index, device, reading)

    def _process_rows(self, handle: Any) -> tuple[Any, list[tuple[int, int | None]] | None]:
        """The device's compute processes as the driver lists them: (a key equal between two
        polls only if the list is, and the (pid, usedGpuMemory or None) rows, or None when the
        key holds them itself and they are read from it only if needed: _rows)."""
        nvml = self.nvml
        if self._direct:
            try:
                fn = nvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
            except (nvml.NVMLError, AttributeError):
                self._direct = False  # an NVML without it: pynvml's listing says why
            else:
                return self._process_rows_direct(fn, handle), None
        rows = [
            (int(p.pid), getattr(p, "usedGpuMemory", None))
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        ]
        return rows, rows

    def _process_rows_direct(self, fn: Any, handle: Any) -> bytes:
        """pynvml's nvmlDeviceGetComputeRunningProcesses_v3 without its per-process objects: ask
        the count, fill an array (oversized, as pynvml does, for processes starting meanwhile),
        and return the filled rows' bytes (unpacked in C by _rows, when they changed)."""
        nvml = self.nvml
        count = ctypes.c_uint(0)
        ret = fn(handle, ctypes.byref(count), None)
        if ret == nvml.NVML_SUCCESS:
            return b""
        if ret != nvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise nvml.NVMLError(ret)
        size = 64
        while size < count.value * 2 + 5:
            size *= 2  # a few array sizes, each kept: no new array every poll
        rows = self._buffers.get(size)
        if rows is None:
            if len(self._buffers) > 8:
                self._buffers.clear()
            rows = self._buffers[size] = (nvml.c_nvmlProcessInfo_v3_t * size)()
        count.value = size
        ret = fn(handle, ctypes.byref(count), rows)
        if ret != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(ret)
        assert _ROW is not None  # _direct implies it
        n = min(count.value, size)
        return bytes(memoryview(rows).cast("B")[: n * _ROW.size])

    @staticmethod
    def _rows(raw: bytes) -> list[tuple[int, int | None]]:
        assert _ROW is not None
        return [
            (pid, None if used == _NOT_AVAILABLE else used) for pid, used in _ROW.iter_unpack(raw)
        ]

    def _read_processes(self, identity: GpuIdentity, handle: Any, reading: GpuReading) -> None:
        nvml = self.nvml
        try:
            key, processes = self._process_rows(handle)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission):
            return
        last = self._listed.get(identity)
        if last is not None and last[0] == key:
            # the same list as the last poll: the same entries
            _add_run(reading, identity, last[1])
            if last[2]:
                reading.invalid.update(last[2])
            return
        if processes is None:
            processes = self._rows(key)
        entries: list[_Entry] = []
        dropped: Counter[str] = Counter()
        seen: set[int] = set()
        keep, append = seen.add, entries.append  # thousands a poll on a busy node
        for pid, used in processes:
            if used is None:
                dropped["not_available"] += 1
                continue
            if pid in seen:
                # One series per (GPU, pid): a repeat would be a duplicate series on our page.
                dropped["duplicate_process"] += 1
                continue
            keep(pid)
            append((identity, pid, float(used)))
        if len(self._listed) > 4 * (_MAX_MIG_SLOTS + 1) * (len(self._identities) or 1):
            self._listed.clear()  # devices come and go (MIG reconfigured): start over
        self._listed[identity] = (key, entries, dropped)
        _add_run(reading, identity, entries)
        if dropped:
            reading.invalid.update(dropped)

    def _read_mig(self, index: int, device: _Device, reading: GpuReading) -> None:
        """The GPU's MIG instances, by the layout read at most MIG_RECHECK_SECONDS ago. A cached
        instance that cannot be read (destroyed, or the GPU reset, since the layout was read)
        makes the layout read again at once and the instances read from it, what the failed
        read added taken back: a routine reconfiguration is no failed poll. An error then is
        the GPU's (collect counts it and drops the caches)."""
        layout = self._mig_layouts.get(index)
        now = self.clock()
        if layout is not None and 0 <= now - layout.read_at < MIG_RECHECK_SECONDS:
            if not layout.instances:
                return
            runs = reading.process_runs
            mark = (
                len(reading.gpus),
                len(reading.processes),
                len(runs) if runs is not None else 0,
                Counter(reading.invalid),
            )
            try:
                self._read_instances(layout.instances, reading)
                return
            except self.nvml.NVMLError:
                del reading.gpus[mark[0] :], reading.processes[mark[1] :]
                if runs is not None:
                    del runs[mark[2] :]
                reading.invalid.clear()
                reading.invalid.update(mark[3])
        self._mig_layouts.pop(index, None)
        layout = self._mig_layouts[index] = _MigLayout(now, self._mig_instances(device))
        self._read_instances(layout.instances, reading)

    def _mig_instances(self, device: _Device) -> list[tuple[Any, GpuIdentity]]:
        """The GPU's MIG instances from NVML: (handle, identity) each."""
        nvml = self.nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(device.handle)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
            return []
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return []
        instances = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(device.handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device.handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # empty slot
            instance_id = str(nvml.nvmlDeviceGetGpuInstanceId(mig))
            match = _MIG_PROFILE.search(_text(nvml.nvmlDeviceGetName(mig)))
            identity = GpuIdentity(
                gpu=device.identity.gpu,
                uuid=device.identity.uuid,  # dcgm-exporter labels MIG series with the parent's
                pci_bus_id=device.identity.pci_bus_id,
                device=device.identity.device,
                model_name=device.identity.model_name,
                hostname=device.identity.hostname,
                gpu_instance_id=instance_id,
                gpu_instance_profile=match.group(1) if match else "",
            )
            if len(self._mig_identities) > 4 * _MAX_MIG_SLOTS * (len(self._identities) or 1):
                self._mig_identities.clear()  # reconfigured again and again: start over
            instances.append((mig, self._mig_identities.setdefault(identity, identity)))
        return instances

    def _read_instances(
        self, instances: list[tuple[Any, GpuIdentity]], reading: GpuReading
    ) -> None:
        for mig, identity in instances:
            total, used, free, reserved = self._memory(mig)
            reading.gpus.append(GpuMemory(identity, total, used, free, reserved))
            if self.process_metrics:
                self._read_processes(identity, mig, reading)

    def families(self, reading: GpuReading, out: FamilyBuilder) -> None:
        # A node can list thousands of processes, most of them unchanged since the last poll:
        # the same list (identities are kept, so this compares references, in C) gives the same
        # series, and the renderer then finds the family unchanged as well.
        if reading.processes != self._last_processes:
            # built here from the driver's ints and floats: labels are strings, values floats
            self._last_series = [
                ((*identity.labels(), str(pid)), used) for identity, pid, used in reading.processes
            ]
            self._last_processes = reading.processes
        out.extend("oomguard_gpu_process_memory_used_bytes", self._last_series)
