from __future__ import annotations

import json

import pytest
from oomguard.exporter.collectors.allocator import AllocatorCollector
from oomguard.exporter.render import FamilyBuilder

from oomguard.errors import HandoffError
from oomguard.handoff import AllocatorReport, read_reports, report_path, write_report

GIB = 1024**3


def report(pid: int = 4242, ts: float = 1000.0, **kw) -> AllocatorReport:
    stats = {
        "allocated_bytes.all.current": 30 * GIB,
        "reserved_bytes.all.current": 34 * GIB,
        "allocated_bytes.all.peak": 33 * GIB,
        "reserved_bytes.all.peak": 35 * GIB,
        "inactive_split_bytes.all.current": 1 * GIB,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }
    identity = dict(
        timestamp=ts,
        pid=pid,
        rank=0,
        target="llama",
        engine="0",
        device_index=0,
        device_uuid="GPU-aaaa",
    )
    identity.update(kw)
    return AllocatorReport.from_memory_stats(stats, **identity)


def test_torch_stats_keys_map_to_fields_and_round_trip(tmp_path):
    r = report(free_after_gc_bytes=5 * GIB, gc_timestamp=999.5)
    assert (r.allocated_bytes, r.reserved_bytes, r.inactive_split_bytes) == (
        30 * GIB,
        34 * GIB,
        1 * GIB,
    )
    assert (r.alloc_retries, r.ooms) == (2, 1)
    path = write_report(tmp_path, r)
    assert path == report_path(tmp_path, 4242)
    assert AllocatorReport.from_json(path.read_text()) == r
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("pid"), "missing field 'pid'"),
        (lambda d: d.update(schema="other.v9"), "schema"),
        (lambda d: d.update(allocated_bytes=-1), "non-negative integer"),
        (lambda d: d.update(ooms="3"), "non-negative integer"),
        (lambda d: d.update(timestamp=float("nan")), "must be a number"),
        (lambda d: d.update(target=7), "must be a string"),
    ],
)
def test_malformed_reports_are_refused_clearly(mutate, message):
    data = json.loads(report().to_json())
    mutate(data)
    with pytest.raises(HandoffError, match=message):
        AllocatorReport.from_json(json.dumps(data))


def test_unknown_fields_are_ignored():
    data = {**json.loads(report().to_json()), "future_field": [1, 2]}
    assert AllocatorReport.from_json(json.dumps(data)) == report()


def test_reader_skips_stale_invalid_and_oversized_files(tmp_path):
    write_report(tmp_path, report(pid=1, ts=1000.0))
    write_report(tmp_path, report(pid=2, ts=900.0))  # stale at now=1000, stale_after=30
    (tmp_path / "pid-3.json").write_text("{not json")
    (tmp_path / "pid-4.json").write_text(" " * 70_000)
    (tmp_path / "unrelated.txt").write_text("ignored")
    reports, problems = read_reports(tmp_path, now=1000.0, stale_after=30.0)
    assert [r.pid for r in reports] == [1]
    assert problems == {"stale": 1, "invalid_file": 1, "too_large": 1}


def test_missing_directory_is_no_reports(tmp_path):
    assert read_reports(tmp_path / "absent", 0.0, 30.0) == ([], {})


def test_collector_exports_every_field_per_rank(tmp_path):
    write_report(tmp_path, report(pid=7, ts=100.0, free_after_gc_bytes=3 * GIB, gc_timestamp=99.0))
    collector = AllocatorCollector(str(tmp_path), "node-1", stale_after=30, clock=lambda: 110.0)
    reading = collector.collect()
    out = FamilyBuilder()
    collector.families(reading, out)
    fams = {f.spec.name: f.samples for f in out.families()}
    labels = ("node-1", "0", "GPU-aaaa", "llama", "0", "0", "7")
    assert fams["oomguard_allocator_reserved_bytes"] == [(labels, 34 * GIB)]
    assert fams["oomguard_allocator_ooms_total"] == [(labels, 1)]
    assert fams["oomguard_allocator_free_after_gc_bytes"] == [(labels, 3 * GIB)]
    assert len(fams) == 9
