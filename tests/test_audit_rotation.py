"""The audit log is rotated, and a rotation forgets nothing the safety limits need.

Found: the log was never rotated and was replayed whole at every start and every new leader:
100 MB took 16 s and 235 MB of memory here (a busy fleet's year: minutes, and a liveness probe
that kills the remediator before it is up), and the disk fills until no intent can be recorded
and nothing is done."""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path
from typing import Any

import pytest

from oomguard.remediator import auditrotate
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import RESTORED_EVENTS
from oomguard.remediator.restarting import answered_from
from oomguard.remediator.safety import EngineView, Safety, SafetyConfig

WINDOW = 3600.0
CONFIG = SafetyConfig(cooldown_seconds=600, max_actions=5, window_seconds=WINDOW)
FLEET = {n: EngineView("llama", False, True) for n in ("a", "b", "c")}


def line(event: str, age: float, **fields: Any) -> str:
    """An entry written `age` seconds ago (on another boot: its age is told by wall time)."""
    entry = {"time": time.time() - age, "event": event, "boot": "another-boot", **fields}
    return json.dumps(entry, separators=(",", ":"))


def history(path: Path) -> None:
    lines = []
    for i in range(300):  # old traffic: webhooks and actions long out of the window
        lines.append(line("received", 90_000 - i, result="accepted", reason="x" * 200))
        key = f"old{i}"
        lines.append(line("intent", 90_000 - i, target="a", action="lower_cap", intent=key))
        lines.append(
            line("acted", 90_000 - i, target="a", action="lower_cap", result="ok", intent=key)
        )
    lines.append(line("paused", 80_000, reason="drill"))
    lines.append(line("unpaused", 70_000, reason="done"))
    # a restart long ago still answers its episode (restarts never repeat for one episode)
    after = {"episode": "e-old", "episodes": ["e-old"], "max_num_seqs": 51}
    lines.append(line("intent", 50_000, target="c", action="restart", after=after, intent="r1"))
    lines.append(line("acted", 50_000, target="c", action="restart", result="started", intent="r1"))
    # an intent never committed, long ago: reconciled with its engine, counted meanwhile
    lines.append(line("intent", 40_000, target="b", action="drain", intent="lost"))
    # inside the window: a step whose intent is older than its commit's age cut would be
    lines.append(line("intent", 3_500, target="a", action="drain", intent="w1"))
    lines.append(line("acted", 3_500, target="a", action="drain", result="ok", intent="w1"))
    lines.append(line("intent", 100, target="b", action="lower_cap", intent="w2"))
    lines.append(line("failed", 99, target="b", action="lower_cap", result="refused", intent="w2"))
    lines.append(line("intent", 30, target="b", action="lower_cap", intent="w3"))
    lines.append(line("acted", 30, target="b", action="lower_cap", result="ok", intent="w3"))
    lines.append(line("intent", 5, target="a", action="restart", intent="w4"))
    path.write_text("\n".join(lines) + "\n")


def restored(path: Path) -> tuple[Any, ...]:
    entries = AuditLog(path).entries(RESTORED_EVENTS)
    safety = Safety(CONFIG)
    safety.restore(entries)
    state = safety.state()
    checks = {(t, a): safety.check(t, a, FLEET) for t in FLEET for a in ("lower_cap", "drain")}
    history = {t: sorted(k for _, k in acts) for t, acts in state.history.items() if acts}
    pending = sorted(e["intent"] for e in safety.uncommitted)
    return state.paused, history, pending, checks, answered_from(entries).as_dict()


def test_a_rotation_keeps_every_limit_and_drops_the_rest(tmp_path):
    path = tmp_path / "audit.jsonl"
    history(path)
    before = path.read_bytes()
    expected = restored(path)
    log = AuditLog(path, max_bytes=64 * 1024, backups=3, carry_seconds=WINDOW)
    assert log.rotate()
    assert (tmp_path / "audit.jsonl.1").read_bytes() == before  # the old file, whole
    assert restored(path) == expected
    kept = [json.loads(raw) for raw in path.read_text().splitlines()]
    assert len(kept) == 11 and len(path.read_bytes()) < len(before) / 50
    assert not any(e["event"] == "received" for e in kept)
    assert expected[2] == ["lost", "w4"] and expected[4] == {"c": {"e-old"}, "a": set()}


def test_appends_keep_the_log_near_its_size_and_the_backups_to_their_count(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=32 * 1024, backups=2)
    log.record("paused", reason="drill")
    for i in range(1500):
        log.record("received", result="accepted", reason=f"webhook {i} " + "x" * 100)
        if i % 100 == 0:
            log.record("intent", target="a", action="lower_cap", after={"cap": i}, intent=f"k{i}")
            log.record("acted", target="a", action="lower_cap", result="ok", intent=f"k{i}")
        if log._rotating.locked():
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while log._rotating.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.rotations >= 3 and log.rotation_errors == 0
    assert path.stat().st_size < 2 * 32 * 1024
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "audit.jsonl",
        "audit.jsonl.1",
        "audit.jsonl.2",
    ]
    entries = AuditLog(path).entries(RESTORED_EVENTS)
    safety = Safety(SafetyConfig(max_actions=100))
    safety.restore(entries)
    assert safety.paused  # the pause switch survived every rotation
    assert len(safety.state().history["a"]) == 15  # every action of the hour, none lost


def test_a_rotation_that_cannot_be_written_leaves_the_log_whole(tmp_path, monkeypatch):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=4096, backups=2)

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(auditrotate, "install", full)
    for i in range(60):
        log.record("intent", target="a", action="drain", intent=f"k{i}")
    assert not log.rotate() and log.rotation_errors >= 1
    assert len(log.entries()) == 60 and not (tmp_path / "audit.jsonl.1").exists()
    log.record("acted", target="a", action="drain", result="ok", intent="k59")  # still taken
    assert log.writable and len(log.entries()) == 61


@pytest.mark.parametrize("current", [True, False])
def test_a_rotation_cut_short_by_a_crash_is_completed_or_undone(tmp_path, current):
    path = tmp_path / "audit.jsonl"
    new = line("paused", 1, reason="carried") + "\n"
    auditrotate.pending(path).write_text(new)
    if current:  # crashed before the swap: the old file is whole, the new one is dropped
        path.write_text(line("unpaused", 2, reason="old") + "\n")
    AuditLog(path)
    assert not auditrotate.pending(path).exists()
    events = [e["event"] for e in AuditLog(path).entries()]
    assert events == (["unpaused"] if current else ["paused"])


def test_a_duplicate_intent_id_counts_both_actions(tmp_path):
    """The audit log is untrusted input: a second intent under an id already used (nothing
    oomguard writes: ids are random) replaced the first, and its action left the budget."""
    path = tmp_path / "audit.jsonl"
    path.write_text(
        "\n".join(
            [
                line("intent", 60, target="a", action="drain", intent="dup"),
                line("intent", 50, target="a", action="drain", intent="dup"),
                line("acted", 50, target="a", action="drain", result="ok", intent="dup"),
            ]
        )
        + "\n"
    )
    safety = Safety(SafetyConfig(cooldown_seconds=0, max_actions=2, window_seconds=WINDOW))
    safety.restore(AuditLog(path).entries())
    assert len(safety.state().history["a"]) == 2
    assert safety.check("a", "drain", FLEET) == "rate_limit"
