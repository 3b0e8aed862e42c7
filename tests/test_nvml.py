from __future__ import annotations

import pynvml
import pytest

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.nvml import NvmlCollector
from oomguard.exporter.render import FamilyBuilder
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
