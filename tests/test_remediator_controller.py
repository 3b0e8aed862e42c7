"""The reconcile loop: alerts -> decisions -> actions, with safety, audit and metrics."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import Controller
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.webhook import parse
from tests.remediator_helpers import Engines, alert, config, payload


def make(tmp_path, engines: Engines, clock=None, **overrides) -> Controller:
    cfg = config(tmp_path, *engines.engines, **overrides)
    kwargs = {"clock": clock} if clock else {}
    return Controller(cfg, engines, AuditLog(cfg.audit_log), RemediatorMetrics(), **kwargs)


def send(c: Controller, *alerts) -> None:
    c.receive(parse(payload(*alerts)))
    c.reconcile()


def sample(c: Controller, name: str, **labels) -> float | None:
    return c.metrics.registry.get_sample_value(name, labels)


def events(c: Controller, kind: str) -> list[dict]:
    return [e for e in c.audit.entries() if e["event"] == kind]


def test_pressure_lowers_the_cap_by_a_step_and_duplicates_do_nothing(tmp_path):
    engines = Engines.of("a")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryPressure", "a"))
    assert engines.engines["a"].cap == 80
    # Alertmanager's retry and an HA peer's copy: no second step within step_seconds
    send(c, alert("OomguardMemoryPressure", "a"))
    send(c, alert("OomguardMemoryPressure", "a"))
    assert engines.calls == [("a", "set_cap", 80)]
    assert (
        sample(c, "oomguard_remediator_actions_total", target="a", action="lower_cap", result="ok")
        == 1
    )
    assert sample(c, "oomguard_remediator_admission_cap", target="a") == 80
    assert sample(c, "oomguard_remediator_target_mode", target="a", mode="capped") == 1
    # sustained pressure: one more step once the engine says step_seconds have passed
    engines.serve("a", 0, seconds=31)
    c.reconcile()
    assert engines.engines["a"].cap == 64
    acted = events(c, "acted")
    assert [e["after"]["cap"] for e in acted] == [80, 64]
    assert acted[0]["before"]["cap"] == 100 and acted[0]["fingerprints"]
    assert acted[0]["reason"] == "pressure: lower the cap"


def test_kv_usage_alone_never_acts(tmp_path):
    engines = Engines.of("a")
    c = make(tmp_path, engines)
    send(c, alert("OomguardKVCacheUsageHigh", "a", oomguard_action="drain"))
    assert engines.calls == []


def test_critical_drains_then_staged_readmission_to_startup(tmp_path):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryCritical", "a"))
    assert engines.engines["a"].draining
    send(c, alert("OomguardMemoryCritical", "a", status="resolved"))
    # cap first, then resume: the engine never admits at its old cap
    assert engines.calls[-2:] == [("a", "set_cap", 1), ("a", "resume", None)]
    caps = [1]
    for _ in range(12):
        c.reconcile()  # without clean admissions nothing moves
        assert engines.engines["a"].cap == caps[-1]
        engines.serve("a", 5)
        c.reconcile()
        caps.append(engines.engines["a"].cap)
        if caps[-1] == 100:
            break
    # the field rule: one at a time, then full admission after 5 clean admissions
    assert caps == [1, 100]
    assert sample(c, "oomguard_remediator_target_mode", target="a", mode="serving") == 1
    assert sample(c, "oomguard_remediator_readmission_stage", target="a") == 0


def test_a_preemption_during_readmission_holds_the_stage(tmp_path):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryCritical", "a"))
    send(c, alert("OomguardMemoryCritical", "a", status="resolved"))
    engines.serve("a", 5)
    engines.engines["a"].preemptions = 1
    c.reconcile()
    assert engines.engines["a"].cap == 1
    assert sample(c, "oomguard_remediator_readmission_stage", target="a") == 1


def test_targets_off_the_allowlist_are_recorded_and_ignored(tmp_path):
    engines = Engines.of("a")
    c = make(tmp_path, engines)
    receipt = c.receive(parse(payload(alert("OomguardMemoryCritical", "evil-host"))))
    c.reconcile()
    assert engines.calls == []
    assert list(receipt.ignored.values()) == [
        "no allowlisted target matches {'target': 'evil-host', 'instance': 'node-1:9840'}"
    ]
    (received,) = events(c, "received")
    assert received["result"] == "ignored" and received["after"]["ignored"]
    assert c.book.firing() == []


def test_label_selectors_route_by_instance_and_refuse_ambiguity(tmp_path):
    engines = Engines.of("node1", "node2")
    cfg = config(tmp_path, "node1", "node2")
    targets = [
        t.model_copy(update={"match": {"instance": f"{t.name}:9840", "target": "vllm"}})
        for t in cfg.targets
    ]
    cfg = cfg.model_copy(update={"targets": targets})
    c = Controller(cfg, engines, AuditLog(cfg.audit_log))
    send(c, alert("OomguardMemoryPressure", "vllm", instance="node2:9840"))
    assert engines.calls == [("node2", "set_cap", 80)]
    ambiguous = targets[0].model_copy(update={"match": {"target": "vllm"}})
    cfg2 = cfg.model_copy(update={"targets": [ambiguous, targets[1]]})
    c2 = Controller(cfg2, engines, AuditLog(tmp_path / "b.jsonl"))
    r = c2.receive(parse(payload(alert("OomguardMemoryCritical", "vllm", instance="node2:9840"))))
    assert "ambiguous" in next(iter(r.ignored.values()))


def test_an_unreachable_engine_is_held_and_reported_once(tmp_path):
    engines = Engines.of("a")
    engines.down.add("a")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryPressure", "a"))
    c.reconcile()
    c.reconcile()
    assert engines.calls == []
    assert c.status["a"].mode == "held"
    assert sample(c, "oomguard_remediator_target_mode", target="a", mode="held") == 1
    assert sample(c, "oomguard_remediator_reconcile_errors_total", target="a") == 3
    assert len(events(c, "held")) == 1
    engines.down.clear()
    c.reconcile()
    assert engines.engines["a"].cap == 80 and c.status["a"].mode == "capped"


def test_the_disruption_budget_caps_instead_of_draining_the_last_replica(tmp_path):
    engines = Engines.of("a", "b", "c")
    c = make(tmp_path, engines)
    send(
        c,
        *(alert("OomguardMemoryCritical", n) for n in ("a", "b", "c")),
    )
    draining = [n for n, e in engines.engines.items() if e.draining]
    assert draining == ["a"]  # max_draining_per_model 1
    for n in ("b", "c"):
        assert engines.engines[n].cap == 80  # held at a lower cap instead
    limited = {e["target"]: e["result"] for e in events(c, "withheld")}
    assert limited == {"b": "disruption_budget", "c": "disruption_budget"}
    assert (
        sample(c, "oomguard_remediator_safety_limited_total", target="b", limit="disruption_budget")
        == 1
    )


def test_never_drains_the_only_ready_engine_of_a_model(tmp_path):
    engines = Engines.of("solo")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryCritical", "solo"))
    assert not engines.engines["solo"].draining
    assert engines.engines["solo"].cap == 80
    # a model's only engine: `single_replica`, which pages (OomguardRemediationLimited), apart
    # from `last_ready`, the last of several, whose fallback cap pages nobody
    assert events(c, "withheld")[0]["result"] == "single_replica"


def test_pause_stops_every_change_until_unpaused(tmp_path):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    c.set_paused(True, "maintenance")
    send(c, alert("OomguardMemoryPressure", "a"))
    assert engines.calls == []
    assert sample(c, "oomguard_remediator_paused") == 1
    assert events(c, "withheld")[0]["result"] == "pause"
    c.set_paused(False, "done")
    c.reconcile()
    assert engines.engines["a"].cap == 80


def test_dry_run_decides_and_records_once_and_changes_nothing(tmp_path):
    from oomguard.remediator.actuator import DryRunActuator

    engines = Engines.of("a", "b")
    cfg = config(tmp_path, "a", "b", dry_run=True)
    dry = DryRunActuator(engines)
    c = Controller(cfg, dry, AuditLog(cfg.audit_log))
    send(c, alert("OomguardMemoryCritical", "a"))
    c.reconcile()
    c.reconcile()
    assert engines.calls == [] and not engines.engines["a"].draining
    assert list(dry.intended) == [("a", "drain", None)]
    (acted,) = events(c, "acted")
    assert acted["result"] == "dry_run" and acted["action"] == "drain"


def test_flapping_alert_is_bounded_by_cooldown_and_rate_limit(tmp_path):
    now = [0.0]
    engines = Engines.of("a")
    c = make(
        tmp_path,
        engines,
        clock=lambda: now[0],
        safety={"cooldown_seconds": 10, "max_actions": 3, "window_seconds": 3600},
        policy={"step_seconds": 0},
    )
    lowerings = []
    for i in range(20):
        now[0] += 2
        status = "firing" if i % 2 == 0 else "resolved"
        send(c, alert("OomguardMemoryPressure", "a", status=status, start=i // 2 * 10))
        engines.serve("a", 5)
        lowerings.append(sum(1 for call in engines.calls if call[2] and call[2] < 100))
    downs = [call for call in engines.calls if call[1] == "set_cap"]
    lowered = [b for a, b in itertools.pairwise([100] + [x[2] for x in downs]) if b < a]
    assert len(lowered) == 3  # max_actions, then stop and report
    assert {e["result"] for e in events(c, "withheld")} >= {"cooldown", "rate_limit"}


def test_a_new_controller_carries_on_a_readmission_in_progress(tmp_path):
    engines = Engines.of("a", "b")
    doubling = {"readmit_stages": "doubling"}
    c = make(tmp_path, engines, policy=doubling)
    send(c, alert("OomguardMemoryCritical", "a"))
    send(c, alert("OomguardMemoryCritical", "a", status="resolved"))
    engines.serve("a", 5)
    c.reconcile()
    assert engines.engines["a"].cap == 2
    c.close()
    # restarted: an empty book, the engine's own state says where the re-admission stands
    c2 = make(tmp_path, engines, policy=doubling)
    c2.reconcile()
    assert engines.engines["a"].cap == 2
    engines.serve("a", 5)
    c2.reconcile()
    assert engines.engines["a"].cap == 4


def test_nothing_is_applied_when_the_audit_log_cannot_be_written(tmp_path):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    c.audit.path = tmp_path / "missing-dir" / "audit.jsonl"
    with pytest.raises(OSError):
        c.receive(parse(payload(alert("OomguardMemoryCritical", "a"))))
    assert c.book.firing() == []
    c.audit.path = tmp_path / "audit.jsonl"
    c.receive(parse(payload(alert("OomguardMemoryCritical", "a"))))  # the retry is applied
    assert len(c.book.firing()) == 1


def test_a_resolved_that_arrives_first_wins_over_its_late_firing(tmp_path):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryPressure", "a", status="resolved"))
    send(c, alert("OomguardMemoryPressure", "a"))
    assert engines.calls == []


def test_the_audit_log_explains_each_action(tmp_path):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryCritical", "a"))
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["event"] for line in lines]
    assert kinds == ["received", "decided", "intent", "acted"]  # write-ahead: intent first
    intent, acted = json.loads(lines[-2]), json.loads(lines[-1])
    assert set(acted) >= {"time", "fingerprints", "target", "action", "before", "after", "result"}
    assert acted["after"] == {"cap": 100, "mode": "draining"}
    assert intent["action"] == "drain" and intent["result"] == "pending"
    assert acted["intent"] == intent["intent"] and intent["time"] <= acted["time"]


# -- properties ---------------------------------------------------------------------------------
NAMES = ["OomguardMemoryPressure", "OomguardMemoryCritical", "OomguardPreemptionRateHigh"]
deliveries = st.lists(
    st.tuples(
        st.sampled_from(NAMES), st.sampled_from(["a", "b", "zz"]), st.booleans(), st.integers(0, 3)
    ),
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(deliveries, st.randoms(use_true_random=False), st.integers(1, 300))
def test_any_order_of_the_same_deliveries_gives_the_same_firing_set(
    tmp_path_factory, batch, rnd, startup
):
    alerts = [
        alert(n, t, status="firing" if firing else "resolved", start=ep * 100)
        for n, t, firing, ep in batch
    ]
    shuffled = alerts + rnd.sample(alerts, len(alerts))  # replays and reorders
    rnd.shuffle(shuffled)
    results = []
    for order in (alerts, shuffled):
        engines = Engines.of("a", "b", startup=startup)
        c = make(tmp_path_factory.mktemp("p"), engines)
        for a in order:
            c.receive(parse(payload(a)))
            c.reconcile()
            engines.serve("a", 3, seconds=15)
            engines.serve("b", 3, seconds=15)
            for e in engines.engines.values():
                assert 1 <= e.cap <= startup
        results.append(sorted(a.fingerprint for a in c.book.firing()))
        # what the loop reads per target is the book itself, routed
        routed = c.firing_by_target()
        assert sorted(a.fingerprint for alerts in routed.values() for a in alerts) == results[-1]
        c.close()
    assert results[0] == results[1]


def test_a_failed_write_is_counted_audited_and_retried_on_the_next_pass(tmp_path):
    engines = Engines.of("a", "b")
    engines.refusing.add("a")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryPressure", "a"))
    assert engines.engines["a"].cap == 100
    assert (
        sample(
            c, "oomguard_remediator_actions_total", target="a", action="lower_cap", result="failed"
        )
        == 1
    )
    (failed,) = events(c, "failed")
    assert failed["result"] == "http_status" and "HTTP 500" in failed["reason"]
    engines.refusing.clear()
    c.reconcile()  # level-triggered: the same decision, tried again
    assert engines.engines["a"].cap == 80


def test_a_resync_from_alertmanager_reaches_the_target(tmp_path, local_server):
    import json as _json

    body = _json.loads(payload(alert("OomguardMemoryPressure", "a")))["alerts"]
    for a in body:
        a["status"] = {"state": "active", "silencedBy": [], "inhibitedBy": []}
    server = local_server(_json.dumps(body))
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines, alertmanager={"url": server.url.removesuffix("/metrics")})
    assert c.resync()
    c.reconcile()
    assert engines.engines["a"].cap == 80  # the rebuilt alert acts, like a webhook would
    server.serve_text("[]")
    assert c.resync()  # gone from Alertmanager: resolved (a lost `resolved` webhook heals)
    assert c.book.firing() == []


class FakeBackend:
    """A restart backend in memory: the 'restarted' engine comes back with the new flags."""

    def __init__(self, engines: Engines, name: str, original, current, changed_at: float):
        from oomguard.remediator.restart import FlagView

        self.engines, self.name = engines, name
        self.view = FlagView(original, current, changed_at)
        self.restarts = []

    def flags(self):
        return self.view

    def restart(self, flags, initial_cap, reason):
        from oomguard.remediator.restart import FlagView

        self.restarts.append((flags, initial_cap, reason))
        self.view = FlagView(self.view.original, flags, time.time())
        e = self.engines.engines[self.name]
        e.startup, e.cap, e.draining = flags.max_num_seqs, initial_cap or flags.max_num_seqs, False
        e.changed()


def test_flags_walk_back_after_a_quiet_period_and_not_under_pressure(tmp_path):
    from oomguard.remediator.flags import Flags

    engines = Engines.of("a", "b", startup=51)
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.86, 51), time.time() - 7200)
    cfg = config(
        tmp_path,
        "a",
        "b",
        flags={"walk_back_after_seconds": 3600},
    )
    from oomguard.remediator.targets import RestartConfig, SupervisorRef

    cfg.targets[0] = cfg.targets[0].model_copy(  # the backend itself is the fake below
        update={
            "restart": RestartConfig(
                supervisor=SupervisorRef(url="http://127.0.0.1:1"),
                drain_timeout_seconds=5,
                ready_timeout_seconds=5,
            )
        }
    )
    c = Controller(cfg, engines, AuditLog(cfg.audit_log), backends={"a": backend})
    # pressure on the engine: no walking back while it lasts
    send(c, alert("OomguardMemoryPressure", "a"))
    assert backend.restarts == []
    send(c, alert("OomguardMemoryPressure", "a", status="resolved"))
    engines.engines["a"].cap = 51  # back at full admission
    c.reconcile()
    deadline = time.monotonic() + 10
    while c._restarting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r[0] for r in backend.restarts] == [Flags(0.9, 64)]  # one step: 0.86 -> 0.9, 51 -> 64
    (acted,) = [e for e in events(c, "acted") if e["action"] == "restart"]
    assert acted["reason"] == "walk flags back"
    # at the original flags there is nothing left to walk back
    c.reconcile()
    assert len(backend.restarts) == 1
    c.close()


def test_a_single_engines_walk_back_waits_and_pages_nobody(tmp_path):
    # found: the walk-back on a model's only engine was withheld by single_replica, which counts
    # oomguard_remediator_safety_limited_total and pages (OomguardRemediationLimited) for a
    # healthy engine an hour after every OOM; it waits now, and says so in the status
    from oomguard.remediator.flags import Flags

    engines = Engines.of("solo", startup=51)
    backend = FakeBackend(engines, "solo", Flags(0.9, 64), Flags(0.86, 51), time.time() - 7200)
    c = restartable(tmp_path, engines, backend, "solo", safety={"allow_last_replica": True})
    for _ in range(2):
        c.reconcile()
    assert backend.restarts == [] and engines.engines["solo"].cap == 51
    limited = sample(
        c, "oomguard_remediator_safety_limited_total", target="solo", limit="single_replica"
    )
    assert limited in (None, 0.0)
    assert events(c, "withheld") == []
    status = c.status["solo"]
    assert status.limited is None
    assert status.waiting == "walk flags back: waits for the single_replica limit"
    # held (the exporter is blind to it): nothing is decided, nothing waits
    send(c, alert("OomguardExporterBlind", "solo", oomguard_action="hold"))
    assert c.status["solo"].mode == "held" and c.status["solo"].waiting is None
    c.close()


def restartable(
    tmp_path, engines: Engines, backend, *names: str, clock=None, **overrides
) -> Controller:
    from oomguard.remediator.targets import RestartConfig, SupervisorRef

    cfg = config(tmp_path, *engines.engines, **overrides)
    restart = RestartConfig(
        supervisor=SupervisorRef(url="http://127.0.0.1:1"),
        drain_timeout_seconds=5,
        ready_timeout_seconds=5,
    )
    cfg.targets = [
        t.model_copy(update={"restart": restart}) if t.name in names else t for t in cfg.targets
    ]
    kwargs = {"clock": clock} if clock else {}
    return Controller(
        cfg, engines, AuditLog(cfg.audit_log), backends=dict.fromkeys(names, backend), **kwargs
    )


def settle(c: Controller) -> None:
    for thread in list(c._restarting.values()):
        thread.join(10)


def test_memory_still_critical_after_the_drain_restarts_with_lower_flags(tmp_path):
    from oomguard.remediator.flags import Flags

    engines = Engines.of("a", "b", startup=64)
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.9, 64), time.time())
    now = [time.time()]
    c = restartable(tmp_path, engines, backend, "a", clock=lambda: now[0])
    engines.engines["a"].running, engines.engines["a"].waiting = 3, 2
    send(c, alert("OomguardMemoryCritical", "a"))
    assert engines.engines["a"].draining and backend.restarts == []
    now[0] += 700
    c.reconcile()  # requests still in flight or queued: a restart now would lose them
    assert backend.restarts == []
    engines.engines["a"].running = engines.engines["a"].waiting = 0
    now[0] -= 640
    c.reconcile()  # idle 60 s after the drain: the alert may be in its hysteresis, or the
    assert backend.restarts == []  # cause may go away by itself (a neighbour process leaves)
    now[0] += 541
    c.reconcile()  # idle and still critical 601 s after the drain: only a restart helps
    settle(c)
    assert [r[0] for r in backend.restarts] == [Flags(0.86, 51)]
    (started,) = [e for e in events(c, "acted") if e["action"] == "restart"]
    assert "memory stays critical after the drain" in started["reason"]
    # back, capped at the first stage; the same episode still firing asks for no more than a cap
    c.reconcile()
    settle(c)
    assert len(backend.restarts) == 1 and not engines.engines["a"].draining
    assert engines.engines["a"].cap == 1
    c.close()


def test_a_restart_after_a_drain_stays_within_the_disruption_budget(tmp_path):
    from oomguard.remediator.flags import Flags

    engines = Engines.of("a", "b", "c", startup=64)
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.9, 64), time.time())
    c = restartable(tmp_path, engines, backend, "a", policy={"restart_after_drain_seconds": 0})
    send(c, alert("OomguardMemoryCritical", "a"))
    assert engines.engines["a"].draining
    engines.engines["b"].draining = True  # a peer went out meanwhile (its own drain)
    engines.engines["c"].draining = True
    c.reconcile()
    assert backend.restarts == []
    withheld = [e for e in events(c, "withheld") if e["action"] == "restart"]
    assert withheld and withheld[-1]["result"] == "disruption_budget"
    engines.engines["b"].draining = engines.engines["c"].draining = False
    c.reconcile()
    settle(c)
    assert len(backend.restarts) == 1
    c.close()


def test_fragmentation_drains_then_restarts_at_once_into_full_admission(tmp_path):
    """The engine's own allocator fragmentation (the alert's reason): drained instead of capped,
    restarted with the same flags as soon as it is idle (not restart_after_drain_seconds, 600 s,
    later), and back at full admission; once per episode, audited."""
    from oomguard.remediator.flags import Flags

    engines = Engines.of("a", "b", startup=64)
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.9, 64), time.time())
    now = [time.time()]
    c = restartable(tmp_path, engines, backend, "a", clock=lambda: now[0])
    frag = alert("OomguardMemoryPressure", "a", reason="allocator_fragmentation")
    engines.engines["a"].running = 3
    send(c, frag)
    assert engines.engines["a"].draining and backend.restarts == []  # not yet idle
    engines.engines["a"].running = 0
    c.reconcile()  # idle now: the fragments of its finished requests may yet coalesce
    now[0] += 30
    c.reconcile()
    assert backend.restarts == []
    now[0] += 16  # idle 46 s, past fragmentation_settle_seconds (45), and the alert still fires
    c.reconcile()
    settle(c)
    assert [(f, cap) for f, cap, _ in backend.restarts] == [(Flags(0.9, 64), None)]
    assert not engines.engines["a"].draining and engines.engines["a"].cap == 64
    intents = [e for e in events(c, "intent") if e["action"] == "restart"]
    assert intents[-1]["after"]["admission"] == "full"
    # the same episode still firing (its alert lags the exporter): no second restart, no
    # drain, and no cap on the new process, which has none of the fragments
    for _ in range(3):
        c.reconcile()
        settle(c)
    a = engines.engines["a"]
    assert len(backend.restarts) == 1 and not a.draining and a.cap == 64
    # the same engine under pressure for another reason (a new episode): capped again
    send(c, alert("OomguardMemoryPressure", "a", reason="neighbour_growth"))
    assert engines.engines["a"].cap < 64 and len(backend.restarts) == 1
    c.close()


def test_a_single_replica_is_drained_and_restarted_only_with_the_opt_in(tmp_path):
    from oomguard.remediator.flags import Flags

    engines = Engines.of("solo", startup=64)
    backend = FakeBackend(engines, "solo", Flags(0.9, 64), Flags(0.9, 64), time.time())
    c = restartable(tmp_path / "off", engines, backend, "solo")
    send(c, alert("OomguardMemoryCritical", "solo"))
    assert not engines.engines["solo"].draining and engines.engines["solo"].cap == 51  # capped
    c.close()

    engines = Engines.of("solo", startup=64)
    backend = FakeBackend(engines, "solo", Flags(0.9, 64), Flags(0.9, 64), time.time())
    c = restartable(
        tmp_path / "on",
        engines,
        backend,
        "solo",
        safety={"allow_last_replica": True},
        policy={"restart_after_drain_seconds": 0},
    )
    send(c, alert("OomguardMemoryCritical", "solo"))
    assert engines.engines["solo"].draining  # 503 + Retry-After beats a CUDA OOM
    c.reconcile()
    settle(c)
    assert [r[0] for r in backend.restarts] == [Flags(0.86, 51)]
    c.close()


def test_an_engine_the_exporter_is_blind_to_is_held_not_readmitted(tmp_path):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    send(c, alert("OomguardMemoryCritical", "a"))
    send(c, alert("OomguardMemoryCritical", "a", status="resolved"))
    assert engines.engines["a"].cap == 1
    blind = alert("OomguardExporterBlind", "a", oomguard_action="hold")
    send(c, blind)
    calls = len(engines.calls)
    engines.serve("a", 5)
    c.reconcile()
    assert len(engines.calls) == calls and engines.engines["a"].cap == 1  # no re-admission
    assert c.status["a"].mode == "held"
    (held,) = [e for e in events(c, "held") if e["target"] == "a"]
    assert held["result"] == "blind"
    send(c, alert("OomguardExporterBlind", "a", status="resolved", oomguard_action="hold"))
    assert engines.engines["a"].cap == 100  # it can see again: 5 clean admissions, full
    c.close()


def test_a_restart_waits_for_queued_requests_too(tmp_path):
    # found: the sequence waited only for running == 0, so queued requests would be dropped
    import threading

    from oomguard.remediator.actuator import Target
    from oomguard.remediator.flags import Flags
    from oomguard.remediator.restart import RestartSequence

    engines = Engines.of("a", startup=64)
    e = engines.engines["a"]
    e.running, e.waiting = 0, 2  # nothing running, two requests still queued
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.9, 64), time.time())
    seq = RestartSequence(engines, backend, AuditLog(tmp_path / "audit.jsonl"), poll=0.05)
    result = []
    t = threading.Thread(
        target=lambda: result.append(seq.run(Target("a", "http://x"), Flags(0.86, 51), "t", []))
    )
    t.start()
    time.sleep(0.5)
    assert backend.restarts == []  # a restart now would drop the queued requests
    e.waiting = 0
    t.join(10)
    assert result[0].ok and [r[0] for r in backend.restarts] == [Flags(0.86, 51)]
