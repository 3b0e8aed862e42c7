"""Attention-driven reads: a pass reads the engines that need it, the rest on a slow resync, and
the remediator does exactly what it did when it read every engine every pass."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomguard.remediator.attention import Attention, AttentionConfig
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import Controller
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.webhook import parse
from tests.remediator_helpers import Engines, alert, config, payload

FLEET = {"attention": {"read_all_below": 0, "quiet_resync_seconds": 3600}}


class Counting(Engines):
    """The in-memory fleet, counting state reads per engine."""

    def __init__(self, engines: Engines) -> None:
        super().__init__(engines.engines)
        self.reads: dict[str, int] = {}

        self._writing = False

    def state(self, target):  # type: ignore[no-untyped-def]
        if not self._writing:  # a write answers with the state: not a read
            self.reads[target.name] = self.reads.get(target.name, 0) + 1
        return super().state(target)

    def _write(self, method, target, *args):  # type: ignore[no-untyped-def]
        self._writing = True
        try:
            return method(target, *args)
        finally:
            self._writing = False

    def set_cap(self, target, cap):  # type: ignore[no-untyped-def]
        return self._write(super().set_cap, target, cap)

    def drain(self, target):  # type: ignore[no-untyped-def]
        return self._write(super().drain, target)

    def resume(self, target):  # type: ignore[no-untyped-def]
        return self._write(super().resume, target)


def make(tmp_path, engines: Engines, names=None, **overrides) -> Controller:
    cfg = config(tmp_path, *(names or engines.engines), **{**FLEET, **overrides})
    return Controller(cfg, engines, AuditLog(cfg.audit_log), RemediatorMetrics())


def reads_in_a_pass(c: Controller, engines: Counting) -> dict[str, int]:
    engines.reads.clear()
    c.reconcile()
    return dict(engines.reads)


def test_a_quiet_fleet_is_read_once_then_only_on_the_resync(tmp_path):
    engines = Counting(Engines.of(*(f"e{i}" for i in range(50))))
    c = make(tmp_path, engines)
    assert len(reads_in_a_pass(c, engines)) == 50  # never read: everyone needs attention
    for _ in range(5):
        assert reads_in_a_pass(c, engines) == {}
    assert c.metrics.registry.get_sample_value("oomguard_remediator_engines_read") == 0
    assert c.metrics.registry.get_sample_value("oomguard_remediator_targets", {"state": "quiet"})
    c.close()


def test_engines_never_read_come_in_batches_but_an_alerting_model_at_once(tmp_path):
    engines = Counting(Engines.of(*(f"e{i}" for i in range(30))))
    c = make(tmp_path, engines, attention={**FLEET["attention"], "first_read_batch": 10})
    c.receive(parse(payload(alert("OomguardMemoryCritical", "e25"))))
    first = reads_in_a_pass(c, engines)
    # the alerting engine's whole model (here: everyone) before a drain is decided
    assert len(first) == 30 and engines.engines["e25"].draining
    c.close()
    engines = Counting(Engines.of(*(f"e{i}" for i in range(30))))
    c = make(tmp_path, engines, attention={**FLEET["attention"], "first_read_batch": 10})
    assert [len(reads_in_a_pass(c, engines)) for _ in range(4)] == [10, 10, 10, 0]
    c.close()
    engines = Counting(Engines.of(*(f"e{i}" for i in range(30))))
    c = make(tmp_path, engines, attention={**FLEET["attention"], "first_read_batch": 10})
    c.receive(parse(payload(alert("OomguardMemoryPressure", "e25"))))
    assert reads_in_a_pass(c, engines) == {"e25": 1}  # a cap needs no peers: it goes first
    assert engines.engines["e25"].cap == 80
    c.close()


def test_small_fleets_are_read_every_pass_as_before(tmp_path):
    engines = Counting(Engines.of("a", "b", "c"))
    c = make(tmp_path, engines, attention={"read_all_below": 64})
    for _ in range(3):
        assert reads_in_a_pass(c, engines) == {"a": 1, "b": 1, "c": 1}
    c.close()


def test_an_alert_on_a_quiet_engine_is_read_and_acted_on_in_the_pass_it_wakes(tmp_path):
    engines = Counting(Engines.of(*(f"e{i}" for i in range(20))))
    c = make(tmp_path, engines)
    c.reconcile()
    c.receive(parse(payload(alert("OomguardMemoryPressure", "e7"))))
    assert reads_in_a_pass(c, engines) == {"e7": 1}
    assert engines.engines["e7"].cap == 80
    assert all(e.cap == 100 for n, e in engines.engines.items() if n != "e7")
    c.close()


def test_an_alert_that_asks_for_nothing_does_not_cost_reads(tmp_path):
    engines = Counting(Engines.of("a", "b"))
    c = make(tmp_path, engines)
    c.reconcile()
    c.receive(parse(payload(alert("OomguardKVCacheUsageHigh", "a"))))  # KV near 100 %: normal
    assert reads_in_a_pass(c, engines) == {}
    c.close()


def test_recovery_is_read_every_pass_until_full_admission_then_goes_quiet(tmp_path):
    engines = Counting(Engines.of("a", "b"))
    c = make(tmp_path, engines, attention={**FLEET["attention"], "recent_action_seconds": 0})
    c.reconcile()
    fired = alert("OomguardMemoryPressure", "a")
    c.receive(parse(payload(fired)))
    c.reconcile()
    c.receive(parse(payload({**fired, "status": "resolved"})))
    caps = [engines.engines["a"].cap]
    while caps[-1] < 100 and len(caps) < 20:  # re-admission: read (and paced) every pass
        engines.serve("a", 1, seconds=1)
        assert "a" in reads_in_a_pass(c, engines)
        caps.append(engines.engines["a"].cap)
    assert caps[-1] == 100 and len(caps) > 3, caps  # it took passes, each one reading a
    assert reads_in_a_pass(c, engines) == {"a": 1}  # the pass after the last step confirms
    assert reads_in_a_pass(c, engines) == {}  # back at full admission: quiet again
    c.close()


def test_a_recent_action_keeps_the_engine_read(tmp_path):
    engines = Counting(Engines.of("a", "b"))
    c = make(tmp_path, engines)  # recent_action_seconds: 300 by default
    c.reconcile()
    fired = alert("OomguardMemoryPressure", "a")
    c.receive(parse(payload(fired)))
    c.reconcile()
    c.receive(parse(payload({**fired, "status": "resolved"})))
    engines.engines["a"].cap = 100  # someone put it back; the remediator still looks at it
    assert reads_in_a_pass(c, engines) == {"a": 1}
    assert reads_in_a_pass(c, engines) == {"a": 1}
    c.close()


def test_a_change_behind_the_remediators_back_is_found_by_the_resync(tmp_path):
    engines = Counting(Engines.of("a", "b"))
    c = make(
        tmp_path,
        engines,
        attention={"read_all_below": 0, "quiet_resync_seconds": 0.3, "recent_action_seconds": 0},
    )
    c.reconcile()
    engines.engines["a"].draining = True  # drained by hand, outside oomguard
    deadline = time.monotonic() + 5
    while engines.engines["a"].draining and time.monotonic() < deadline:
        c.reconcile()
        time.sleep(0.05)
    assert not engines.engines["a"].draining  # resumed after a resync read, within the period
    c.close()


def test_the_disruption_budget_still_sees_quiet_peers(tmp_path):
    # two engines of one model; b is quiet and not read. A drain of a is allowed (b serves),
    # a drain of b then is not (a is draining): the budget caps b instead.
    engines = Counting(Engines.of("a", "b"))
    c = make(tmp_path, engines)
    c.reconcile()
    c.receive(parse(payload(alert("OomguardMemoryCritical", "a"))))
    assert reads_in_a_pass(c, engines) == {"a": 1}
    assert engines.engines["a"].draining
    c.receive(parse(payload(alert("OomguardMemoryCritical", "b"))))
    c.reconcile()
    assert not engines.engines["b"].draining and engines.engines["b"].cap < 100
    c.close()


def test_the_last_ready_engine_is_not_drained_when_its_peer_is_quiet_and_unread(tmp_path):
    engines = Counting(Engines.of("a", "b"))
    engines.down.add("b")
    c = make(tmp_path, engines)
    c.reconcile()  # b unreadable: never quiet, read every pass, not ready
    c.receive(parse(payload(alert("OomguardMemoryCritical", "a"))))
    c.reconcile()
    assert not engines.engines["a"].draining  # a is the model's last ready engine
    c.close()


def test_resync_reads_spread_over_the_interval():
    att = Attention(AttentionConfig(read_all_below=0, quiet_resync_seconds=100), random.Random(1))
    names = [f"e{i}" for i in range(2000)]
    att.track({n: "m" for n in names})
    from oomguard.remediator.decision import Verdict
    from oomguard.remediator.policy import Desired, Observed

    o = Observed.from_state(Engines.of("x").state(type("T", (), {"name": "x", "url": ""})()))
    att.read({n: {} for n in names})
    for n in names:
        att.settle(Verdict(n, o, Desired(False, o.admission_cap, "serving", "")), 0.0)
    per_tenth = [len(att.due(names, {}, config_policy(), t + 10.0)) for t in range(0, 100, 10)]
    # cumulative due counts rise evenly: about a tenth of the fleet per tenth of the interval
    steps = [b - a for a, b in zip([0, *per_tenth], per_tenth, strict=False)]
    assert all(120 <= s <= 280 for s in steps), steps
    assert per_tenth[-1] == 2000


def paced_run(att: Attention, names: list[str], seconds: int, firing=None, loud=()):  # type: ignore[no-untyped-def]
    """One pass a second for `seconds` (simulated time), every engine read settled as it was
    (quiet, or `loud`: capped); the engines each pass read."""
    from oomguard.remediator.decision import Verdict
    from oomguard.remediator.policy import Desired

    quiet = observed()
    capped = observed(admission_cap=50)
    passes = []
    for t in range(seconds):
        due = att.due(names, firing or {}, config_policy(), float(t))
        att.read({n: {} for n in due})
        for n in due:
            o = capped if n in loud else quiet
            att.settle(Verdict(n, o, Desired(False, o.admission_cap, "serving", "")), float(t))
        passes.append(due)
    return passes


def observed(**changes):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from oomguard.remediator.policy import Observed

    o = Observed.from_state(Engines.of("x").state(type("T", (), {"name": "x", "url": ""})()))
    return replace(o, **changes)


def test_the_resync_keeps_to_its_read_budget_but_attention_is_never_paced():
    """2,000 engines, a 10 s resync and a budget of 50 reads/s: resynced every 40 s on average
    (not 9 s), never more than 50 a second over a window, each quiet engine still read within
    its period; the engine under an alert and the capped engine are read every pass."""
    names = [f"e{i}" for i in range(2000)]
    cfg = AttentionConfig(read_all_below=0, quiet_resync_seconds=10, resync_reads_per_second=50)
    att = Attention(cfg, random.Random(3))
    att.track({n: f"m{i // 100}" for i, n in enumerate(names)})
    assert att.resync_period() == pytest.approx(2000 / 50 / 0.9)  # jitter 0.2: mean 0.9 x
    fired = parse(payload(alert("OomguardMemoryPressure", "e7"))).alerts
    passes = paced_run(att, names, 200, firing={"e7": fired}, loud={"e9"})
    # the first passes read the engines never read (e7's alone first, then batches of 1000)
    assert all("e7" in due and "e9" in due for due in passes[3:])  # attention: every pass
    quiet = [[n for n in due if n not in ("e7", "e9")] for due in passes]
    after_first = quiet[3:]
    rate = sum(map(len, after_first[40:])) / len(after_first[40:])
    assert 40 <= rate <= 55, rate  # the budget, on average (about 2000 / 40 s)
    windows = [sum(map(len, after_first[i : i + 10])) for i in range(0, 190, 10)]
    assert max(windows) <= 10 * 50 * 1.3, windows
    last: dict[str, int] = {}
    gaps = []
    for t, due in enumerate(passes):
        for n in due:
            if n in last:
                gaps.append(t - last[n])
            last[n] = t
    assert max(gaps) <= att.resync_period() + 1  # no quiet engine waits past its period
    # no budget: the resync as configured, 10 s (about 2000 / 9 reads a second)
    free = Attention(cfg.model_copy(update={"resync_reads_per_second": 0}), random.Random(3))
    free.track({n: "m" for n in names})
    assert free.resync_period() == 10
    unpaced = [len(d) for d in paced_run(free, names, 60)[20:]]
    assert sum(unpaced) / len(unpaced) > 150


def test_a_paced_fleet_still_reads_and_acts_on_an_alert_at_once(tmp_path):
    engines = Counting(Engines.of(*(f"e{i}" for i in range(300))))
    c = make(
        tmp_path,
        engines,
        attention={"read_all_below": 0, "quiet_resync_seconds": 1, "resync_reads_per_second": 0.01},
    )
    assert len(reads_in_a_pass(c, engines)) == 300  # first reads: all (under the batch size)
    period = c.metrics.registry.get_sample_value("oomguard_remediator_resync_period_seconds")
    # not 1 s: the budget paces the resync (about nine hours: no quiet engine is read here)
    assert period == pytest.approx(300 / 0.01 / 0.9)
    c.receive(parse(payload(alert("OomguardMemoryPressure", "e7"))))
    assert reads_in_a_pass(c, engines) == {"e7": 1}
    assert engines.engines["e7"].cap == 80
    for _ in range(3):  # under its alert and just acted on: read every pass
        assert "e7" in reads_in_a_pass(c, engines)
    c.close()


def config_policy():
    from oomguard.remediator.policy import PolicyConfig

    return PolicyConfig()


# -- the property: attention changes which engines are read, never what is done ---------------
NAMES = ["OomguardMemoryPressure", "OomguardMemoryCritical", "OomguardPreemptionRateHigh"]
TARGETS = ["a", "b", "c", "d"]
events_st = st.lists(
    st.one_of(
        st.tuples(
            st.just("alert"),
            st.sampled_from(NAMES),
            st.sampled_from(TARGETS),
            st.booleans(),
            st.integers(0, 2),
        ),
        st.tuples(st.just("serve"), st.sampled_from(TARGETS), st.integers(0, 12)),
    ),
    max_size=25,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(events_st)
def test_any_sequence_acts_exactly_as_reading_every_engine_every_pass(tmp_path_factory, events):
    runs = []
    for attention in ({"read_all_below": 64}, {**FLEET["attention"], "recent_action_seconds": 0}):
        engines = Engines.of(*TARGETS)
        cfg = config(
            tmp_path_factory.mktemp("att"),
            *TARGETS,
            attention=attention,
            policy={"step_seconds": 0},
        )
        # two models over four engines: the fleet-wide limits are in play
        cfg = cfg.model_copy(
            update={
                "targets": [
                    t.model_copy(update={"model": "m1" if t.name in "ab" else "m2"})
                    for t in cfg.targets
                ]
            }
        )
        c = Controller(cfg, engines, AuditLog(cfg.audit_log), RemediatorMetrics())
        trace = []
        for ev in events:
            if ev[0] == "alert":
                _, name, target, firing, ep = ev
                a = alert(name, target, status="firing" if firing else "resolved", start=ep * 100)
                c.receive(parse(payload(a)))
            else:
                _, target, n = ev
                engines.serve(target, n, seconds=60)
            c.reconcile()
            trace.append(tuple((e.cap, e.draining) for e in (engines.engines[t] for t in TARGETS)))
        runs.append((trace, engines.calls))
        c.close()
    assert runs[0] == runs[1]


# -- focused passes: what a webhook changed, at once, when many engines need attention -----------
def test_a_webhook_pass_reads_only_what_it_changed_when_many_engines_need_attention(tmp_path):
    names = [f"e{i}" for i in range(60)]
    engines = Counting(Engines.of(*names))
    # one model per engine (no peers): 40 capped engines are read every pass
    c = make(tmp_path, engines, policy={"step_seconds": 3600})
    c = Controller(
        c.config.model_copy(
            update={"targets": [t.model_copy(update={"model": t.name}) for t in c.config.targets]}
        ),
        engines,
        AuditLog(c.config.audit_log),
        RemediatorMetrics(),
    )
    c.reconcile()
    c.receive(parse(payload(*(alert("OomguardMemoryPressure", f"e{i}") for i in range(40)))))
    assert len(reads_in_a_pass(c, engines)) == 40  # 40 > focus_above: but nothing was loud yet
    assert len(reads_in_a_pass(c, engines)) == 40  # capped and firing: read every pass
    c.receive(parse(payload(alert("OomguardMemoryPressure", "e50"))))
    assert reads_in_a_pass(c, engines) == {"e50": 1}  # focused: the new alert alone
    assert engines.engines["e50"].cap == 80
    assert len(reads_in_a_pass(c, engines)) == 41  # the next tick reads everyone again
    c.close()


def test_a_focused_pass_reads_the_models_engines_that_are_not_quiet(tmp_path):
    # a drains; a drain alert on b then comes in a focused pass (focus_above 0): a's last state
    # was read before its drain, so a is read again and the budget keeps b from draining too
    engines = Counting(Engines.of("a", "b", "c"))
    c = make(tmp_path, engines, attention={**FLEET["attention"], "focus_above": 0})
    c.reconcile()
    c.receive(parse(payload(alert("OomguardMemoryCritical", "a"))))
    c.reconcile()
    assert engines.engines["a"].draining
    c.receive(parse(payload(alert("OomguardMemoryCritical", "b"))))
    assert reads_in_a_pass(c, engines) == {"a": 1, "b": 1}  # not c: quiet, decided on its state
    assert not engines.engines["b"].draining and engines.engines["b"].cap < 100
    c.close()
