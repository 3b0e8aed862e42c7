from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from oomguard import handoff
from oomguard.errors import CollectorError, HandoffError
from oomguard.exporter.collectors.allocator import AllocatorCollector, AllocatorReading
from oomguard.exporter.render import FamilyBuilder, TextRenderer
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
        (lambda d: d.update(timestamp=float("nan")), "NaN is not JSON"),
        (lambda d: d.update(timestamp="1000"), "must be a number"),
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
    assert problems == {"stale": 1, "not_json": 1, "too_large": 1}


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


# -- the directory is untrusted input: each hostile file below was first reproduced ------------


def raw(pid: int = 4242, **changes) -> dict:
    data = json.loads(report(pid=pid).to_json())
    data.update(changes)
    return data


def put(directory, name: str, data: dict | str) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    (directory / name).write_text(text)


def _render(collector: AllocatorCollector, reading) -> tuple[dict, FamilyBuilder, TextRenderer]:
    """What the poller does with a reading each poll: families, then one text render."""
    out = FamilyBuilder()
    out.add("oomguard_exporter_build_info", ("test",), 1)
    collector.families(reading, out)
    renderer = TextRenderer()
    text = renderer.render(out.families()).decode()
    series = {
        (s.name, s.labels.get("pid", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    return series, out, renderer


def test_a_400_digit_integer_is_refused_and_every_other_metric_keeps_being_served(tmp_path):
    # Before: the report was accepted and float(10**400) raised OverflowError while the
    # snapshot was built, on every poll: the exporter served its last snapshot forever.
    put(tmp_path, "pid-1.json", raw(pid=1, allocated_bytes=10**400))
    write_report(tmp_path, report(pid=2, ts=1000.0))
    collector = AllocatorCollector(str(tmp_path), "node-1", clock=lambda: 1000.0)
    reading = collector.collect()
    assert reading.invalid == {"number_too_long": 1}
    series, _, _ = _render(collector, reading)
    assert series[("oomguard_allocator_allocated_bytes", "2")] == 30 * GIB
    assert ("oomguard_allocator_allocated_bytes", "1") not in series
    assert series[("oomguard_exporter_build_info", "")] == 1


def test_a_huge_value_that_reaches_the_renderer_anyway_is_dropped_not_fatal():
    # Second line of defence: a report built in-process (no reader checks) with an int that
    # no float can hold is dropped and counted by the renderer, the rest is served.
    collector = AllocatorCollector("/nonexistent", "node-1")
    reading = AllocatorReading(reports=[report(pid=1), report(pid=2)])
    object.__setattr__(reading.reports[0], "allocated_bytes", 10**400)
    series, out, _ = _render(collector, reading)
    assert ("oomguard_allocator_allocated_bytes", "1") not in series
    assert series[("oomguard_allocator_allocated_bytes", "2")] == 30 * GIB
    assert series[("oomguard_allocator_reserved_bytes", "1")] == 34 * GIB
    assert out.dropped == {"unrenderable": 1}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('"allocated_bytes": 9223372036854775808', "out_of_range"),  # 2**63
        ('"ooms": 1e300', "bad_type"),  # a float where a count belongs
        ('"timestamp": 1e999', "not_finite"),  # json reads it as inf
        ('"timestamp": Infinity', "not_finite"),
        ('"timestamp": NaN', "not_finite"),
        ('"timestamp": ' + "9" * 400, "number_too_long"),  # float() of it overflows
        ('"pid": 4294967296', "out_of_range"),
        ('"reserved_bytes": ' + "9" * 5000, "number_too_long"),  # past Python's digit limit
        ('"reserved_bytes": ' + "9" * 21, "number_too_long"),  # no int64 count has 21 digits
        ('"target": "' + "x" * 300 + '"', "out_of_range"),
    ],
)
def test_numbers_and_strings_out_of_range_are_refused_with_a_reason(tmp_path, text, reason):
    body = json.dumps(raw(pid=9))
    key = text.split(":", 1)[0]
    start = body.index(key)
    end = body.index(",", start)
    put(tmp_path, "pid-9.json", body[:start] + text + body[end:])
    reports, problems = read_reports(tmp_path, now=1000.0, stale_after=30.0)
    assert reports == [] and problems == {reason: 1}


def test_largest_int64_values_are_accepted(tmp_path):
    put(tmp_path, "pid-9.json", raw(pid=9, allocated_bytes=2**63 - 1, ooms=2**63 - 1))
    (r,), problems = read_reports(tmp_path, now=1000.0, stale_after=30.0)
    assert r.allocated_bytes == 2**63 - 1 and problems == {}


def test_deep_nesting_and_bad_utf8_are_refused_by_reason(tmp_path):
    put(tmp_path, "pid-1.json", "[" * 50_000 + "]" * 50_000)
    (tmp_path / "pid-2.json").write_bytes(b'{"schema": "\xff\xfe"}')
    (tmp_path / "pid-3.json").write_text('{"target": "\\udc80"}')  # a lone surrogate
    refused = {"not_utf8": 2, "too_large": 1}
    assert read_reports(tmp_path, 1000.0, 30.0) == ([], refused)
    (tmp_path / "pid-1.json").write_text("[" * 20_000 + "]" * 20_000)
    assert read_reports(tmp_path, 1000.0, 30.0) == ([], {"not_utf8": 2, "too_deep": 1})


def test_two_files_claiming_one_pid_serve_only_the_one_named_for_it(tmp_path):
    # Before: both were served; their OOM counts (0 and 1) alternated under one (pid, rank),
    # and the pressure evaluator saw "a new OOM" on every poll: a permanent allocator_oom 3.
    put(tmp_path, "pid-5.json", raw(pid=5, ooms=0))
    put(tmp_path, "pid-6.json", raw(pid=5, ooms=1))
    put(tmp_path, "pid-05.json", raw(pid=5, ooms=1))
    put(tmp_path, "pid-x.json", raw(pid=5, ooms=1))
    reports, problems = read_reports(tmp_path, now=1000.0, stale_after=30.0)
    assert [(r.pid, r.ooms) for r in reports] == [(5, 0)]
    assert problems == {"name_mismatch": 1, "bad_name": 2}
    assert len({(r.pid, r.rank) for r in reports}) == len(reports)


def _read_in_thread(directory) -> tuple[threading.Thread, list]:
    result: list = []
    t = threading.Thread(
        target=lambda: result.append(read_reports(directory, 1000.0, 30.0)), daemon=True
    )
    t.start()
    t.join(5.0)
    return t, result


def test_a_fifo_is_refused_without_blocking_the_collector(tmp_path):
    # Before: read_text() on the FIFO blocked forever and wedged the collector for good.
    fifo = tmp_path / "pid-7.json"
    os.mkfifo(fifo)
    write_report(tmp_path, report(pid=8))
    t, result = _read_in_thread(tmp_path)
    if t.is_alive():  # release the blocked reader so the test process can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not t.is_alive(), "reading the hand-off directory blocked on a FIFO"
    reports, problems = result[0]
    assert [r.pid for r in reports] == [8] and problems == {"not_regular_file": 1}


def test_symlinks_are_never_followed(tmp_path):
    # Before: a link to /dev/zero was read without bound on every poll, and a link to a
    # report outside the directory was served as if a rank had written it.
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    real = write_report(outside, report(pid=3))
    inside = tmp_path / "handoff"
    inside.mkdir()
    (inside / "pid-3.json").symlink_to(real)
    (inside / "pid-4.json").symlink_to("/dev/zero")
    t0 = time.perf_counter()
    t, result = _read_in_thread(inside)
    assert not t.is_alive()
    assert result[0] == ([], {"symlink": 2})
    assert time.perf_counter() - t0 < 1.0


def test_a_symlink_swapped_in_after_listing_is_refused_by_o_nofollow(tmp_path, monkeypatch):
    (tmp_path / "pid-3.json").symlink_to("/dev/zero")
    monkeypatch.setattr(handoff, "_candidates", lambda fd, problems: [("pid-3.json", 3)])
    assert read_reports(tmp_path, 1000.0, 30.0) == ([], {"symlink": 1})


def test_a_device_file_is_never_opened(tmp_path):
    try:
        os.mknod(tmp_path / "pid-3.json", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    assert read_reports(tmp_path, 1000.0, 30.0) == ([], {"not_regular_file": 1})


def test_a_huge_sparse_file_is_refused_without_reading_it(tmp_path):
    with open(tmp_path / "pid-3.json", "wb") as fh:
        fh.truncate(1 << 30)
    t0 = time.perf_counter()
    assert read_reports(tmp_path, 1000.0, 30.0) == ([], {"too_large": 1})
    assert time.perf_counter() - t0 < 1.0


def test_a_file_growing_after_fstat_is_still_bounded(tmp_path, monkeypatch):
    path = tmp_path / "pid-3.json"
    path.write_text(" " * (handoff.MAX_FILE_BYTES + 10))
    real_fstat = os.fstat
    monkeypatch.setattr(
        handoff.os,
        "fstat",
        lambda fd: os.stat_result((*real_fstat(fd)[:6], 10, *real_fstat(fd)[7:])),
    )
    assert read_reports(tmp_path, 1000.0, 30.0) == ([], {"too_large": 1})


def test_more_files_than_the_limit_are_counted_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(handoff, "MAX_FILES", 2)
    for pid in (1, 2, 3):
        write_report(tmp_path, report(pid=pid))
    reports, problems = read_reports(tmp_path, 1000.0, 30.0)
    assert len(reports) == 2 and problems == {"too_many_files": 1}


def test_a_timestamp_in_the_future_is_refused(tmp_path):
    write_report(tmp_path, report(pid=1, ts=1000.0 + 31.0))
    write_report(tmp_path, report(pid=2, ts=1000.0 + 5.0))  # clock jitter is fine
    reports, problems = read_reports(tmp_path, now=1000.0, stale_after=30.0)
    assert [r.pid for r in reports] == [2] and problems == {"future_timestamp": 1}


def test_an_unreadable_directory_is_a_collector_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(CollectorError) as exc:
        AllocatorCollector(str(not_a_dir), "node-1").collect()
    assert exc.value.reason == "unreadable_directory"


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=300),
    st.lists(st.integers(), max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(sorted(raw())), _JSON_VALUES, max_size=4))
def test_any_field_values_are_refused_with_a_reason_or_render_cleanly(fields):
    text = json.dumps({**raw(pid=9), **fields})
    try:
        r = AllocatorReport.from_json(text)
    except handoff.InvalidReport as exc:
        assert exc.reason in {
            *("not_json", "schema", "missing_field", "bad_type", "out_of_range"),
            *("number_too_long", "not_finite"),
        }
        return
    collector = AllocatorCollector("/nonexistent", "node-1")
    _, out, renderer = _render(collector, AllocatorReading(reports=[r]))
    assert not out.dropped and not renderer.dropped  # accepted means renderable


def test_reports_are_readable_by_an_exporter_running_as_another_user(tmp_path):
    import stat

    from oomguard.handoff import AllocatorReport, write_report

    report = AllocatorReport(1.0, 42, 0, "t", "0", 0, "GPU-a", 1, 2, 3, 4, 0, 0, 0)
    path = write_report(tmp_path, report)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def _ooms_on_disk(directory, pid: int) -> int:
    return int(json.loads(report_path(directory, pid).read_text())["ooms"])


def with_ooms(pid: int, ooms: int, ts: float = 1000.0) -> AllocatorReport:
    return dataclasses.replace(report(pid=pid, ts=ts), ooms=ooms)


def test_an_older_snapshot_written_after_an_oom_keeps_the_oom_counted(tmp_path):
    """The periodic publisher read its stats (0 OOMs), the OOM observer wrote 1 OOM, then the
    publisher's write landed: this process's report still says 1, and counts on from there."""
    me = os.getpid()
    stale = with_ooms(me, 0, ts=1000.0)
    write_report(tmp_path, with_ooms(me, 1, ts=1000.1))  # the observer's
    write_report(tmp_path, stale)  # the publisher's, read before the OOM
    assert _ooms_on_disk(tmp_path, me) == 1
    write_report(tmp_path, with_ooms(me, 3, ts=1001.0))
    assert _ooms_on_disk(tmp_path, me) == 3
    # another directory is another report: its count is its own
    write_report(tmp_path / "other", with_ooms(me, 0, ts=1001.0))
    assert _ooms_on_disk(tmp_path / "other", me) == 0


def test_reports_written_for_other_processes_are_written_as_given(tmp_path):
    write_report(tmp_path, with_ooms(4242, 5))
    write_report(tmp_path, with_ooms(4242, 0))
    assert _ooms_on_disk(tmp_path, 4242) == 0


@pytest.mark.parametrize("first_lands", ["publisher", "observer"])
def test_the_two_writers_in_two_threads_never_lose_the_oom(tmp_path, first_lands):
    """The same race with real threads: the publisher holds a pre-OOM snapshot while the
    observer writes, in either order of landing."""
    me = os.getpid()
    snapshot_taken, observer_done = threading.Event(), threading.Event()

    def publisher() -> None:
        stale = with_ooms(me, 0)
        snapshot_taken.set()
        if first_lands == "observer":
            observer_done.wait(10)
        write_report(tmp_path, stale)

    thread = threading.Thread(target=publisher)
    thread.start()
    assert snapshot_taken.wait(10)
    if first_lands == "publisher":
        thread.join(10)
    write_report(tmp_path, with_ooms(me, 1))
    observer_done.set()
    thread.join(10)
    assert not thread.is_alive()
    assert _ooms_on_disk(tmp_path, me) == 1


def test_a_forked_child_writes_its_own_count_from_zero(tmp_path):
    """The memory of what was written is per process: a child forked while the parent held
    1 OOM has a report of its own, with its own count (and a lock no other thread holds)."""
    write_report(tmp_path, with_ooms(os.getpid(), 1))
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            write_report(tmp_path, with_ooms(os.getpid(), 0))
            code = 0 if _ooms_on_disk(tmp_path, os.getpid()) == 0 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
