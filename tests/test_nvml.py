from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.nvml import MIG_RECHECK_SECONDS, NvmlCollector
from oomguard.exporter.render import FamilyBuilder
from oomguard.twin.gpu import TwinGpu, TwinNvml
from tests.fake_nvml import GIB, FakeGpu, FakeMig, FakeNvml


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu("GPU-aaaa", processes=[(101, 40 * GIB), (102, None)]),
        FakeGpu("GPU-bbbb", bus_id="00000000:2A:00.0", minor=1, used=1 * GIB, free=78 * GIB),
    ]


def test_reads_memory_v2_identity_and_processes(monkeypatch):
    FakeNvml(monkeypatch, two_gpus())
    reading = NvmlCollector("node-1").collect()
    assert [g.identity.uuid for g in reading.gpus] == ["GPU-aaaa", "GPU-bbbb"]
    g0 = reading.gpus[0]
    assert (g0.total, g0.used, g0.free, g0.reserved) == (80 * GIB, 60 * GIB, 19 * GIB, 1 * GIB)
    assert g0.identity.labels() == (
        "0",
        "GPU-aaaa",
        "00000000:18:00.0",
        "nvidia0",
        "NVIDIA H100 80GB HBM3",
        "node-1",
        "",
        "",
    )
    assert reading.gpus[1].identity.device == "nvidia1"
    # a process whose memory NVML cannot report is dropped and counted, not exported as 0
    assert [(i.uuid, pid, used) for i, pid, used in reading.processes] == [
        ("GPU-aaaa", 101, 40 * GIB)
    ]
    assert reading.invalid["not_available"] == 1
    assert not reading.errors


def test_falls_back_to_v1_memory_info(monkeypatch):
    fake = FakeNvml(monkeypatch, two_gpus())
    fake.v2_supported = False
    reading = NvmlCollector("n").collect()
    g0 = reading.gpus[0]
    assert g0.reserved is None  # v1 cannot separate reserved memory
    assert g0.used == 61 * GIB and g0.free == 19 * GIB


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (pynvml.NVMLError_LibraryNotFound, "library_not_found"),
        (pynvml.NVMLError_DriverNotLoaded, "driver_not_loaded"),
        (pynvml.NVMLError_NoPermission, "no_permission"),
        (pynvml.NVMLError_Unknown, "unknown"),
    ],
)
def test_init_failures_are_collector_errors_with_a_reason(monkeypatch, error, reason):
    fake = FakeNvml(monkeypatch, two_gpus())
    fake.init_error = error
    collector = NvmlCollector("n")
    with pytest.raises(CollectorError) as exc:
        collector.collect()
    assert exc.value.reason == reason
    # init is retried on the next poll, so a driver that comes back is picked up
    fake.init_error = None
    assert len(collector.collect().gpus) == 2
    assert fake.init_calls == 2


def test_a_lost_gpu_does_not_hide_the_others(monkeypatch):
    gpus = two_gpus()
    gpus[0].fail = pynvml.NVMLError_GpuIsLost
    FakeNvml(monkeypatch, gpus)
    reading = NvmlCollector("n").collect()
    assert [g.identity.uuid for g in reading.gpus] == ["GPU-bbbb"]
    assert reading.errors == {"gpu_is_lost": 1}


def test_process_listing_not_supported_is_skipped(monkeypatch):
    fake = FakeNvml(monkeypatch, two_gpus())
    fake.process_error = pynvml.NVMLError_NoPermission
    reading = NvmlCollector("n").collect()
    assert len(reading.gpus) == 2 and reading.processes == [] and not reading.errors


def test_mig_instances_are_reported_with_the_parent_uuid(monkeypatch):
    gpu = FakeGpu(
        "GPU-mig",
        mig=[
            FakeMig(2, "3g.40gb", 40 * GIB, 38 * GIB, 2 * GIB),
            FakeMig(9, "1g.10gb", 10 * GIB, 0, 10 * GIB),
        ],
    )
    FakeNvml(monkeypatch, [gpu])
    reading = NvmlCollector("n").collect()
    instances = [g for g in reading.gpus if g.identity.gpu_instance_id]
    assert [
        (g.identity.uuid, g.identity.gpu_instance_id, g.identity.gpu_instance_profile)
        for g in instances
    ] == [("GPU-mig", "2", "3g.40gb"), ("GPU-mig", "9", "1g.10gb")]
    assert instances[0].free == 2 * GIB


def test_process_families_carry_gpu_labels_and_pid(monkeypatch):
    FakeNvml(monkeypatch, two_gpus())
    collector = NvmlCollector("n")
    out = FamilyBuilder()
    collector.families(collector.collect(), out)
    (family,) = out.families()
    assert family.spec.name == "oomguard_gpu_process_memory_used_bytes"
    assert family.samples[0][0][-1] == "101"


def test_a_pid_listed_twice_on_one_gpu_is_exported_once(monkeypatch):
    FakeNvml(monkeypatch, [FakeGpu("GPU-aaaa", processes=[(101, 40 * GIB), (101, 2 * GIB)])])
    collector = NvmlCollector("node-1")
    reading = collector.collect()
    assert [(pid, used) for _, pid, used in reading.processes] == [(101, 40 * GIB)]
    assert reading.invalid == {"duplicate_process": 1}
    out = FamilyBuilder()
    collector.families(reading, out)
    (family,) = out.families()
    assert len(family.samples) == 1


def _listing(collector: NvmlCollector) -> tuple[list[tuple[str, str, int, float]], dict]:
    reading = collector.collect()
    rows = [(i.uuid, i.gpu_instance_id, pid, used) for i, pid, used in reading.processes]
    return rows, dict(reading.invalid)


def test_the_direct_process_listing_reads_what_pynvml_lists(monkeypatch):
    # The collector reads NVML's process array itself (one unpack, no object per process);
    # pynvml's own listing over the same C function must give the same processes, through
    # lists that grow past the collector's first array and shrink again.
    many = [(1000 + p, (p + 1) * GIB // 8) for p in range(300)]
    gpus = [
        FakeGpu("GPU-aaaa", processes=[(101, 40 * GIB), (102, None), (101, 2 * GIB)]),
        FakeGpu(
            "GPU-mig",
            minor=1,
            mig=[FakeMig(2, "3g.40gb", 40 * GIB, 38 * GIB, 2 * GIB, processes=many)],
        ),
    ]
    FakeNvml(monkeypatch, gpus)
    direct, pynvml_listing = NvmlCollector("n"), NvmlCollector("n")
    pynvml_listing._direct = False
    assert direct._direct
    for processes in (many, many[:5], [], [*many, (9, 1)]):
        gpus[1].mig[0].processes = processes
        rows, invalid = _listing(direct)
        assert (rows, invalid) == _listing(pynvml_listing)
        assert [pid for _, iid, pid, _ in rows if iid == "2"] == [p for p, _ in processes]
        assert invalid == {"not_available": 1, "duplicate_process": 1}
    assert direct._direct  # it did read the array itself


def test_without_the_c_function_pynvml_lists_the_processes(monkeypatch):
    FakeNvml(monkeypatch, two_gpus())

    def missing(name: str) -> None:
        raise pynvml.NVMLError_FunctionNotFound()

    collector = NvmlCollector("n")
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", missing)
    monkeypatch.setattr(
        pynvml,
        "nvmlDeviceGetComputeRunningProcesses",
        lambda handle: (
            [pynvml.nvmlFriendlyObject({"pid": 7, "usedGpuMemory": GIB})]
            if handle == ("gpu", 0)
            else []
        ),
    )
    rows, _ = _listing(collector)
    assert not collector._direct
    assert rows == [("GPU-aaaa", "", 7, float(GIB))]


def test_an_unchanged_process_list_is_reused_and_a_changed_one_read_again(monkeypatch):
    # Each device's list is read again only when the driver's rows differ from the last poll's:
    # an unchanged device's entries are the same objects (nothing per process), a changed one
    # shows its new figures, a process gone is gone, and what a list drops counts every poll.
    gpus = [
        FakeGpu("GPU-aaaa", processes=[(101, 40 * GIB), (102, None), (101, 2 * GIB)]),
        FakeGpu(
            "GPU-mig",
            minor=1,
            mig=[FakeMig(2, "3g.40gb", 40 * GIB, 38 * GIB, 2 * GIB, processes=[(7, GIB)])],
        ),
    ]
    FakeNvml(monkeypatch, gpus)
    for direct in (True, False):
        collector = NvmlCollector("n")
        collector._direct = direct
        first = collector.collect()
        again = collector.collect()
        assert again.processes == first.processes
        assert all(a is b for a, b in zip(again.processes, first.processes, strict=True))
        assert again.invalid == first.invalid == {"not_available": 1, "duplicate_process": 1}
        gpus[1].mig[0].processes = [(7, 3 * GIB), (8, GIB)]
        moved = collector.collect()
        assert [(i.uuid, pid, used) for i, pid, used in moved.processes] == [
            ("GPU-aaaa", 101, 40.0 * GIB),
            ("GPU-mig", 7, 3.0 * GIB),
            ("GPU-mig", 8, 1.0 * GIB),
        ]
        assert moved.processes[0] is first.processes[0]  # GPU-aaaa's list did not change
        gpus[0].processes = [(101, 40 * GIB)]
        gpus[1].mig[0].processes = []
        gone = collector.collect()
        assert [(i.uuid, pid) for i, pid, _ in gone.processes] == [("GPU-aaaa", 101)]
        assert not gone.invalid
        gpus[0].processes = [(101, 40 * GIB), (102, None), (101, 2 * GIB)]
        gpus[1].mig[0].processes = [(7, GIB)]


# -- MIG mode and layout: read rarely (MIG_RECHECK_SECONDS), through the GPU twin's NVML ---------
MIG_SLICE = "H100-MIG-1g.10gb"  # a twin GPU of this model is the one instance of a MIG GPU


class CountingTwin(TwinNvml):
    """The twin's NVML, counting the calls of each function. A GPU in `failing` fails every
    read (NVML_ERROR_UNKNOWN, as a GPU being reset does); a MIG instance's handle fails once
    its GPU is no longer cut (a destroyed instance's handle: whatever NVML answers then, it is
    an NVMLError). `fail_at[name] = n`: that function's n-th call from now fails."""

    def __init__(self, gpus: list[TwinGpu]) -> None:
        super().__init__(gpus)
        self.calls: Counter[str] = Counter()
        self.failing: set[int] = set()
        self.fail_at: dict[str, int] = {}
        for name in dir(TwinNvml):
            if name.startswith("nvmlDevice"):
                setattr(self, name, self._counted(name, getattr(self, name)))

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(handle: Any = None, *args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if name in self.fail_at:
                self.fail_at[name] -= 1
                if not self.fail_at[name]:
                    del self.fail_at[name]
                    raise pynvml.NVMLError_Unknown()
            if handle is None:
                return fn()
            index = handle[1] if isinstance(handle, tuple) else handle
            if index in self.failing:
                raise pynvml.NVMLError_Unknown()
            if isinstance(handle, tuple) and not self.gpus[index].spec.mig_profile:
                raise pynvml.NVMLError_NotFound()
            return fn(handle, *args, **kwargs)

        return call


def twin_collector(*models: str) -> tuple[CountingTwin, NvmlCollector, list[float]]:
    twin = CountingTwin([TwinGpu(f"GPU-{i}", model, minor=i) for i, model in enumerate(models)])
    clock = [0.0]
    return twin, NvmlCollector("h", backend=twin, clock=lambda: clock[0]), clock


def instances(reading: Any) -> list[tuple[str, str, str]]:
    return [
        (g.identity.gpu, g.identity.gpu_instance_id, g.identity.gpu_instance_profile)
        for g in reading.gpus
        if g.identity.gpu_instance_id
    ]


def test_mig_mode_is_read_at_most_once_per_recheck_interval():
    twin, collector, clock = twin_collector("H100", MIG_SLICE)
    polls = 100  # one a second
    for second in range(polls):
        clock[0] = float(second)
        twin.set_process(1, 500, second * GIB)  # the instance's memory moves every poll
        reading = collector.collect()
        assert instances(reading) == [("1", "1", "1g.10gb")] and not reading.errors
        assert reading.gpus[-1].used == second * GIB  # read every poll, from the cached handle
    rechecks = -(-polls // int(MIG_RECHECK_SECONDS))  # at 0 s, 30 s, 60 s, 90 s
    assert twin.calls["nvmlDeviceGetMigMode"] == 2 * rechecks
    assert twin.calls["nvmlDeviceGetMaxMigDeviceCount"] == rechecks
    assert twin.calls["nvmlDeviceGetMigDeviceHandleByIndex"] <= 2 * rechecks  # slot 0, then 1
    assert twin.calls["nvmlDeviceGetGpuInstanceId"] == rechecks
    assert twin.calls["nvmlDeviceGetMemoryInfo"] == 3 * polls  # two GPUs and the instance


def test_mig_switched_on_and_off_shows_within_the_recheck_interval():
    twin, collector, clock = twin_collector("H100", "H100")
    assert instances(collector.collect()) == []
    twin.gpus[1].model = MIG_SLICE  # an administrator enables MIG and cuts the GPU
    clock[0] = MIG_RECHECK_SECONDS - 1
    assert instances(collector.collect()) == []  # the layout read at 0 s still holds
    clock[0] = MIG_RECHECK_SECONDS
    assert instances(collector.collect()) == [("1", "1", "1g.10gb")]
    assert twin.calls["nvmlDeviceGetMigMode"] == 4  # 2 GPUs, at 0 s and at 30 s
    twin.gpus[1].model = "H100"  # and disables it again
    clock[0] = 2 * MIG_RECHECK_SECONDS
    reading = collector.collect()
    assert instances(reading) == [] and not reading.errors
    assert [g.identity.gpu for g in reading.gpus] == ["0", "1"]


def test_an_nvml_error_makes_the_mig_layout_read_again_at_once():
    twin, collector, clock = twin_collector("H100", "H100")
    collector.collect()
    twin.gpus[1].model = MIG_SLICE  # MIG enabled: the GPU is reset, its reads fail meanwhile
    twin.failing.add(1)
    clock[0] = 1.0
    failed = collector.collect()
    assert failed.errors == {"unknown": 1} and [g.identity.gpu for g in failed.gpus] == ["0"]
    twin.failing.clear()
    clock[0] = 2.0  # well within the interval: the error dropped the layout
    assert instances(collector.collect()) == [("1", "1", "1g.10gb")]


def test_a_destroyed_instance_makes_the_layout_read_again_in_the_same_poll():
    twin, collector, clock = twin_collector(MIG_SLICE, MIG_SLICE)
    twin.set_process(1, 500, GIB)
    first = collector.collect()
    assert instances(first) == [("0", "1", "1g.10gb"), ("1", "1", "1g.10gb")]
    twin.gpus[1].model = "H100"  # GPU 1's instance destroyed, MIG disabled (its process with it)
    twin.set_process(1, 500, None)
    clock[0] = 1.0
    reading = collector.collect()
    # no failed poll, no half-read instance left behind: GPU 1 read as it is now
    assert not reading.errors and instances(reading) == [("0", "1", "1g.10gb")]
    assert [g.identity.gpu for g in reading.gpus] == ["0", "0", "1"]
    assert reading.processes == [] and reading.process_runs == []
    assert twin.calls["nvmlDeviceGetMigMode"] == 3  # both at 0 s, GPU 1's again at 1 s


def test_mig_disabled_is_cached_too(monkeypatch):
    # a GPU that can run MIG with MIG off answers DISABLE (the twin's whole GPUs: NotSupported)
    fake = FakeNvml(monkeypatch, two_gpus())
    calls = Counter[str]()
    read = fake.nvmlDeviceGetMigMode

    def counted(handle: Any) -> list[int]:
        calls["mig_mode"] += 1
        return read(handle)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", counted)
    clock = [0.0]
    collector = NvmlCollector("n", clock=lambda: clock[0])
    for second in range(int(MIG_RECHECK_SECONDS)):
        clock[0] = float(second)
        collector.collect()
    assert calls["mig_mode"] == 2
    fake.gpus[1].mig = [FakeMig(3, "3g.40gb", 40 * GIB, GIB, 39 * GIB)]
    clock[0] = MIG_RECHECK_SECONDS
    reading = collector.collect()
    assert instances(reading) == [("1", "3", "3g.40gb")] and calls["mig_mode"] == 4


def test_a_failed_read_of_a_cached_instance_leaves_nothing_half_read():
    twin, collector, clock = twin_collector("H100", MIG_SLICE)
    twin.set_process(1, 500, GIB)
    first = collector.collect()
    assert instances(first) == [("1", "1", "1g.10gb")]
    # the instance's memory read, then its process listing fails (GPU 0's, GPU 1's, then the
    # instance's): the layout is read again and the instance read from it, once
    twin.fail_at["nvmlDeviceGetComputeRunningProcesses"] = 3
    clock[0] = 1.0
    again = collector.collect()
    assert not again.errors and again.gpus == first.gpus
    assert again.processes == first.processes and again.process_runs == first.process_runs
    assert twin.calls["nvmlDeviceGetMigMode"] == 3
