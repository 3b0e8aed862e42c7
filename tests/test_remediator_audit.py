from __future__ import annotations

import json
import logging
import threading

import pytest

from oomguard.errors import ConfigError
from oomguard.remediator.audit import AuditLog
from tests.faults import fill, free, small_fs

MAX_LINE_BYTES = 1 << 20  # audit.MAX_LINE_BYTES
KEYS = {
    "time",
    "event",
    "target",
    "action",
    "before",
    "after",
    "result",
    "reason",
    "fingerprints",
    "boot",
    "uptime",
}


def test_entries_append_as_json_lines_and_survive_a_torn_tail(tmp_path):
    log = AuditLog(tmp_path / "audit" / "remediator.jsonl")
    log.record(
        "acted",
        "llama",
        "set_cap",
        before=64,
        after=51,
        result="ok",
        reason="pressure: lower the cap",
        fingerprints=["b", "a"],
    )
    log.record("withheld", "llama", "drain", result="limited", reason="last_ready")
    with log.path.open("a") as fh:
        fh.write('{"event": "acted", "targ')  # a crash mid-write
    entries = log.entries()
    assert [e["event"] for e in entries] == ["acted", "withheld"]
    assert entries[0]["fingerprints"] == ["a", "b"] and entries[0]["after"] == 51
    first = json.loads(log.path.read_text().splitlines()[0])
    assert set(first) == KEYS  # boot and uptime: its age survives a wall-clock step
    assert log.last_replay.skipped == {"not_json": 1}


def test_concurrent_writers_never_interleave_lines(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl")

    def write(n: int) -> None:
        for i in range(50):
            log.record("received", reason=f"{n}-{i}-" + "x" * 500)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(log.entries()) == 200


HOSTILE = {
    "not_utf8": b'{"event": "paused", "reason": "\xff\xfe"}',
    "not_object": b"[]",
    "null": b"null",
    "too_deep": b"[" * 100_000,
    "huge_int": b'{"event": "acted", "time": ' + b"9" * 5000 + b"}",
    "no_event": b'{"time": 1.0}',
    "event_not_text": b'{"event": 7}',
    "surrogate": b'{"event": "acted", "target": "\\ud800"}',
}


def test_every_unreadable_line_is_counted_and_skipped_never_raised(tmp_path):
    """Defect 3: invalid UTF-8, [], null, 100,000 [ and a 5,000-digit integer each stopped the
    remediator's start-up (only JSONDecodeError was caught)."""
    log = AuditLog(tmp_path / "a.jsonl")
    log.record("paused", reason="drill")
    with log.path.open("ab") as fh:
        for line in HOSTILE.values():
            fh.write(line + b"\n")
        fh.write(b"x" * (MAX_LINE_BYTES + 10) + b"\n")  # longer than any line of ours
    log.record("unpaused", reason="done")
    replay = log.replay()
    # a lone surrogate is valid JSON text; it reads, and its consumers check its fields
    assert [e["event"] for e in replay.entries] == ["paused", "acted", "unpaused"]
    assert replay.skipped == {
        "not_utf8": 1,
        "not_object": 2,
        "too_deep": 1,
        "not_json": 1,
        "no_event": 2,
        "too_long": 1,
    }
    assert replay.bad_lines[0] == (2, "not_utf8")


def test_an_audit_path_that_is_a_directory_is_a_config_error(tmp_path):
    (tmp_path / "audit.jsonl").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        AuditLog(tmp_path / "audit.jsonl")


def test_a_torn_tail_left_by_another_writer_is_cut_before_the_next_append(tmp_path):
    """Defect 5: the next acknowledged record was appended to the fragment and never parsed."""
    log = AuditLog(tmp_path / "a.jsonl")
    log.record("paused", reason="one")
    with log.path.open("ab") as fh:
        fh.write(b'{"event":"acted","target":"llama","act')  # kill -9 or ENOSPC mid-line
    fresh = AuditLog(log.path)  # the next process
    fresh.record("unpaused", reason="acknowledged")
    assert [e["event"] for e in fresh.entries()] == ["paused", "unpaused"]
    assert fresh.last_replay.skipped == {}  # the fragment is gone, not skipped every replay
    assert fresh.torn_repaired == 1


def test_a_full_disk_takes_back_the_torn_line_and_loses_no_acknowledged_record(tmp_path):
    """Defect 5 on a real full file system: ENOSPC mid-line, then space comes back."""
    with small_fs(tmp_path / "fs") as fs:
        log = AuditLog(fs / "audit.jsonl")
        log.record("paused", reason="before the disk filled")
        filler = fill(fs)
        failed = 0
        for i in range(200):  # until a line no longer fits in the last page
            try:
                log.record("received", reason=f"payload {i} " + "x" * 300)
            except OSError:
                failed += 1
                break
        assert failed == 1
        acknowledged = [e["reason"] for e in log.entries()]
        free(filler)
        log.record("unpaused", reason="acknowledged after the disk had room again")
        reasons = [e["reason"] for e in log.entries()]
        assert reasons == [*acknowledged, "acknowledged after the disk had room again"]
        assert log.last_replay.skipped == {}  # no fragment was left behind to skip
        assert log.writable and log.write_errors == 1


def test_a_full_disk_is_logged_once_per_outage_and_counted_every_time(tmp_path, caplog):
    """Every pass may try a record while the disk is full: one ERROR line, not one a pass."""
    with small_fs(tmp_path / "fs") as fs:
        log = AuditLog(fs / "audit.jsonl")
        filler = fill(fs)
        caplog.set_level(logging.DEBUG, logger="oomguard.remediator.audit")
        for i in range(20):
            with pytest.raises(OSError):
                log.record("received", reason=f"payload {i} " + "x" * 4096)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "cannot append" in errors[0].getMessage()
        assert log.write_errors == 20 and not log.writable
        free(filler)
        caplog.clear()
        log.record("unpaused", reason="room again")
        (back,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert "writable again (20 records failed)" in back.getMessage()
        # the next outage is logged again
        filler = fill(fs)
        caplog.clear()
        with pytest.raises(OSError):
            log.record("received", reason="y" * 4096)
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
        free(filler)
