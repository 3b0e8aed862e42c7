from __future__ import annotations

import json
import threading

from oomguard.remediator.audit import AuditLog


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
    assert set(first) == {
        "time",
        "event",
        "target",
        "action",
        "before",
        "after",
        "result",
        "reason",
        "fingerprints",
    }


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
