"""Our own files are untrusted input, clocks step, secrets rot: the remediator's state and start-up
under faults (issue 25: defects 3, 11, 13, 15 and the audit path that is a directory)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from oomguard.errors import ConfigError
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import AuthConfig, load
from oomguard.remediator.controller import Controller
from oomguard.remediator.decision import Step
from oomguard.remediator.flags import Flags
from oomguard.remediator.restart import RestartResult, RestartSequence
from oomguard.remediator.restarting import RESTARTED_LIMIT
from oomguard.remediator.safety import EngineView, Safety, SafetyConfig
from oomguard.remediator.server import create_app
from tests.remediator_helpers import Engines, alert, config, payload

FLEET = {"a": EngineView("llama", False, True), "b": EngineView("llama", False, True)}

HOSTILE_LINES = [
    b'{"event": "paused", "reason": "\xff\xfe not UTF-8"}',
    b"[]",
    b"null",
    b"[" * 100_000,
    b'{"event": "acted", "time": ' + b"9" * 5000 + b"}",
    b'{"event": "acted", "target": ["a"], "action": {"x": 1}, "time": "soon"}',
    b'{"event": "acted", "target": "a", "action": "lower_cap", "result": "ok", "time": 1e400}',
    b'{"event": "acted", "target": "a", "action": "restart", "after": {"episodes": [1, null]}}',
    b'{"event": "acted", "target": "a", "action": "restart", "after": []}',
    b'{"event": "intent", "target": "a", "action": "drain", "intent": 7, "time": null}',
    b'{"event": "paused", "time": 1',  # torn
]


def hostile_audit(path: Path) -> None:
    log = AuditLog(path)
    log.record("paused", reason="drill")
    with path.open("ab") as fh:
        for line in HOSTILE_LINES:
            fh.write(line + b"\n")


def test_start_up_never_fails_on_audit_content(tmp_path):
    """Defect 3: one bad audit line (invalid UTF-8, [], null, 100,000 [, a 5,000-digit
    integer) stopped the remediator from starting."""
    hostile_audit(tmp_path / "audit.jsonl")
    engines = Engines.of("a", "b")
    c = Controller(config(tmp_path, "a", "b"), engines, AuditLog(tmp_path / "audit.jsonl"))
    assert c.paused  # the good line before them still counts
    sample = c.metrics.registry.get_sample_value
    skipped = {
        r: sample("oomguard_remediator_audit_skipped_lines", {"reason": r})
        for r in ("not_utf8", "not_object", "too_deep", "not_json")
    }
    assert skipped == {"not_utf8": 1, "not_object": 2, "too_deep": 1, "not_json": 2}
    assert c.view()["audit"]["skipped_lines"]["not_utf8"] == 1
    c.set_paused(False, "test")
    c.receive(_webhook(alert("OomguardMemoryPressure", "a")))
    c.reconcile()
    assert engines.engines["a"].cap == 80  # and it acts: none of the lines held it


def _webhook(*alerts):
    from oomguard.remediator.webhook import parse

    return parse(payload(*alerts))


def test_an_audit_path_that_is_a_directory_is_a_config_error(tmp_path):
    (tmp_path / "audit.jsonl").mkdir()
    cfg = tmp_path / "remediator.yaml"
    cfg.write_text(
        "auth: {allow_unauthenticated: true}\n"
        "targets: [{name: a, url: 'http://127.0.0.1:1'}]\n"
        f"audit_log: {tmp_path / 'audit.jsonl'}\n"
    )
    with pytest.raises(ConfigError, match="is a directory"):
        load(cfg)


# -- clocks -------------------------------------------------------------------------------------
def acted_at(when: float, action: str = "lower_cap", target: str = "a") -> dict:
    return {"event": "acted", "target": target, "action": action, "result": "ok", "time": when}


def test_a_future_dated_action_holds_no_cooldown_but_counts_in_the_budget():
    """Defect 11: after the clock stepped back an hour, an action audited "in the future" held
    its target in cooldown until the clock caught up (a negative age is < every cooldown)."""
    s = Safety(SafetyConfig(cooldown_seconds=600, max_actions=2, window_seconds=3600))
    s.restore([acted_at(time.time() + 3600)])
    assert s.check("a", "lower_cap", FLEET) is None  # no timestamp from a file holds it
    s.restore([acted_at(time.time() + 3600), acted_at(time.time() + 7200)])
    assert s.check("a", "lower_cap", FLEET) == "rate_limit"  # but the budget counts them


class Clocks:
    """A monotonic clock and a wall clock that NTP may step."""

    def __init__(self) -> None:
        self.mono, self.wall = 5000.0, 1.7e9

    def tick(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def test_a_wall_clock_step_neither_stretches_nor_cuts_a_cooldown():
    clocks = Clocks()
    s = Safety(
        SafetyConfig(cooldown_seconds=60, max_actions=5, window_seconds=3600),
        lambda: clocks.mono,
        lambda: clocks.wall,
    )
    s.record("a", "lower_cap")
    clocks.wall -= 3600  # stepped back an hour
    clocks.tick(61)
    assert s.check("a", "lower_cap", FLEET) is None  # 61 s passed: the cooldown is over
    s.record("a", "lower_cap")
    clocks.wall += 7200  # stepped forward two hours
    clocks.tick(1)
    assert s.check("a", "lower_cap", FLEET) == "cooldown"  # 1 s passed, not two hours


def test_an_audited_age_on_the_same_boot_ignores_wall_clock_steps():
    from oomguard.remediator import clocks

    if not clocks.BOOT_ID:
        pytest.skip("no boot id here: ages come from wall time alone")
    s = Safety(SafetyConfig(cooldown_seconds=600, max_actions=5, window_seconds=3600))
    recent = {
        **acted_at(time.time() - 86400),  # the wall clock says a day ago...
        "boot": clocks.BOOT_ID,
        "uptime": clocks.boottime() - 5,  # ...the boot clock says 5 s ago: it was
    }
    s.restore([recent])
    assert s.check("a", "lower_cap", FLEET) == "cooldown"
    old = {**acted_at(time.time()), "boot": clocks.BOOT_ID, "uptime": clocks.boottime() - 200}
    s2 = Safety(SafetyConfig(cooldown_seconds=10, max_actions=1, window_seconds=100))
    s2.restore([old])  # stamped "now" by a wall clock 200 s behind: out of the window
    assert s2.check("a", "lower_cap", FLEET) is None


def test_an_uncommitted_intent_counts_and_a_failed_one_does_not():
    s = Safety(SafetyConfig(cooldown_seconds=0, max_actions=2, window_seconds=3600))
    now = time.time()
    entries = [
        {"event": "intent", "target": "a", "action": "lower_cap", "intent": "i1", "time": now},
        {"event": "intent", "target": "a", "action": "lower_cap", "intent": "i2", "time": now},
        {"event": "failed", "target": "a", "action": "lower_cap", "intent": "i2", "time": now},
        {"event": "intent", "target": "a", "action": "lower_cap", "intent": "i3", "time": now},
        {"event": "acted", "target": "a", "action": "lower_cap", "intent": "i3", "result": "ok"},
    ]
    s.restore(entries)
    assert s.check("a", "lower_cap", FLEET) == "rate_limit"  # i1 (uncommitted) and i3
    assert [e["intent"] for e in s.uncommitted] == ["i1"]


# -- restart episodes ---------------------------------------------------------------------------
def restarts_of(tmp_path: Path):
    from oomguard.remediator.fleet import Fleet
    from oomguard.remediator.metrics import RemediatorMetrics
    from oomguard.remediator.restarting import Restarts

    cfg = config(
        tmp_path,
        "a",
        targets=[
            {
                "name": "a",
                "url": "http://127.0.0.1:1/a",
                "restart": {"supervisor": {"url": "http://127.0.0.1:1"}},
            }
        ],
    )
    return Restarts(
        cfg,
        Fleet(cfg.targets),
        Engines.of("a"),
        AuditLog(tmp_path / "audit.jsonl"),
        RemediatorMetrics(),
        {"a": object()},  # type: ignore[dict-item]  # RestartSequence.run is replaced
        on_done=lambda: None,
    )


episodes = st.lists(st.text("abcdef0123456789", min_size=8, max_size=8), min_size=150, max_size=200)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(episodes)
def test_a_restart_never_forgets_the_episode_it_just_answered(tmp_path, monkeypatch, eps):
    """Defect 13: the answered episodes were a set trimmed with pop(), which can drop the
    episode just added: the same alert restarted an engine twice (18 in 3,000)."""
    monkeypatch.setattr(RestartSequence, "run", lambda *a: RestartResult(True, "done", "ok"))
    # thousands of fsynced intents: on a tmpfs where there is one (fsync is free there)
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path))
    (work / "audit.jsonl").write_bytes(
        b"".join(
            json.dumps(
                {
                    "event": "acted",
                    "target": "a",
                    "action": "restart",
                    "after": {"episode": f"x{i}"},
                }
            ).encode()
            + b"\n"
            for i in range(RESTARTED_LIMIT)  # full already: every new episode evicts one
        )
    )
    try:
        restarts = restarts_of(work)
        restarts.restore(AuditLog(work / "audit.jsonl").entries())
        safety = Safety(SafetyConfig(cooldown_seconds=0, max_actions=10_000))
        for e in eps:
            step = Step("restart", flags=Flags(0.9, 64), episode=e, covers=(e,), reason="test")
            restarts.start("a", step, [], safety)
            answered = restarts.answered("a")
            assert e in answered, f"episode {e} forgotten the moment it was answered"
            assert len(answered) <= RESTARTED_LIMIT
        for thread in list(restarts.running.values()):
            thread.join(5)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- secrets ------------------------------------------------------------------------------------
def test_a_token_file_that_is_not_utf8_is_a_refusal_not_a_500(tmp_path):
    """Defect 15: a token file with invalid UTF-8 answered 500 to every webhook."""
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe\xfd not a token")
    engines = Engines.of("a")
    c = Controller(config(tmp_path, "a"), engines, AuditLog(tmp_path / "audit.jsonl"))
    app = create_app(c, AuthConfig(bearer_token_file=str(token)), 1 << 20)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(
            "/v1/alertmanager",
            content=payload(alert("OomguardMemoryPressure", "a")),
            headers={"Authorization": "Bearer anything"},
        )
        assert r.status_code == 401
        token.write_text("good-token-0123456789")  # rotated to a good one: accepted again
        r = client.post(
            "/v1/alertmanager",
            content=payload(alert("OomguardMemoryPressure", "a")),
            headers={"Authorization": "Bearer good-token-0123456789"},
        )
        assert r.status_code == 200


def test_a_target_token_file_that_is_not_utf8_is_a_config_error(tmp_path):
    bad = tmp_path / "ptoken"
    bad.write_bytes(b"\xff\xfe")
    cfg = tmp_path / "remediator.yaml"
    cfg.write_text(
        "auth: {allow_unauthenticated: true}\n"
        f"targets: [{{name: a, url: 'http://127.0.0.1:1', token_file: {bad}}}]\n"
        f"audit_log: {tmp_path / 'audit.jsonl'}\n"
    )
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(cfg)


def test_an_uncommitted_intent_is_reconciled_once_its_engine_can_be_read(tmp_path, monkeypatch):
    from oomguard.remediator import controller as controller_module

    monkeypatch.setattr(controller_module, "INTENT_RETRY_SECONDS", 0.0)
    log = AuditLog(tmp_path / "audit.jsonl")
    log.record("intent", target="a", action="lower_cap", after={"cap": 80}, intent="k1")
    engines = Engines.of("a", "b")
    engines.down.add("a")
    c = Controller(config(tmp_path, "a", "b"), engines, AuditLog(tmp_path / "audit.jsonl"))
    c.reconcile()
    assert c.view()["audit"]["uncommitted_intents"] == 1  # cannot tell yet: kept, still counted
    assert not [e for e in log.entries() if e["event"] == "reconciled"]
    engines.down.discard("a")
    engines.engines["a"].cap = 80  # the killed remediator's step did reach the engine
    c.reconcile()
    (done,) = [e for e in log.entries() if e["event"] == "reconciled"]
    assert done["intent"] == "k1" and done["result"] == "applied" and done["after"]["cap"] == 80
    assert c.view()["audit"]["uncommitted_intents"] == 0


def test_a_restart_killed_after_its_intent_still_answers_its_episodes(tmp_path):
    """kill -9 between a restart's intent and its commit: the episodes are answered (the next
    remediator does not restart the engine again for the same alert) and the restart counts."""
    log = AuditLog(tmp_path / "audit.jsonl")
    log.record(
        "intent",
        target="a",
        action="restart",
        after={"episode": "e2", "episodes": ["e1", "e2"], "max_num_seqs": 51},
        intent="r1",
    )
    restarts = restarts_of(tmp_path)
    restarts.restore(AuditLog(tmp_path / "audit.jsonl").entries())
    assert restarts.answered("a") == {"e1", "e2"}
    s = Safety(SafetyConfig(cooldown_seconds=600, max_actions=5))
    s.restore(AuditLog(tmp_path / "audit.jsonl").entries())
    assert s.check("a", "restart", FLEET) == "cooldown"
    assert [e["intent"] for e in s.uncommitted] == ["r1"]
