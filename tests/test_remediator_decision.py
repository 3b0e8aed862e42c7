"""One decision for the loop and `explain`: generated alert sets, engine states and safety
states go through both; `explain`'s steps must be exactly what the loop does (recorded by the
in-memory fleet's actuator and a recording restart backend)."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import Controller
from oomguard.remediator.decision import Context, EngineInput, Unreadable, decide_fleet
from oomguard.remediator.flags import Flags
from oomguard.remediator.main import explain
from oomguard.remediator.policy import Observed
from oomguard.remediator.restart import FlagView
from oomguard.remediator.safety import EngineView, SafetyState, limit
from oomguard.remediator.targets import RestartConfig, SupervisorRef
from oomguard.remediator.webhook import parse
from tests.remediator_helpers import Engine, Engines, alert, config, payload

ALERTS = {  # name -> extra labels (the helper adds oomguard_action for the first three)
    "OomguardMemoryPressure": {},
    "OomguardMemoryCritical": {},
    "OomguardKVCacheUsageHigh": {},
    "OomguardCudaOomObserved": {"oomguard_action": "restart"},
    "OomguardExporterBlind": {"oomguard_action": "hold"},
}


class RecordingBackend:
    """A restart backend that records each restart; the engine comes back with the new flags."""

    def __init__(self, engines: Engines, name: str, view: FlagView) -> None:
        self.engines, self.name, self.view = engines, name, view
        self.lock = threading.Lock()

    def flags(self) -> FlagView:
        return self.view

    def restart(self, flags: Flags, initial_cap: int | None, reason: str) -> None:
        with self.lock:
            self.engines.calls.append((self.name, "restart", flags))
        e = self.engines.engines[self.name]
        e.startup, e.cap, e.draining = flags.max_num_seqs, initial_cap or 1, False
        e.changed()
        self.view = FlagView(self.view.original, flags, time.time())


engine_st = st.builds(
    Engine,
    startup=st.integers(1, 300),
    cap=st.integers(1, 300),
    draining=st.booleans(),
    since=st.sampled_from([0.5, 45.5, 1e9]),
    admitted=st.integers(0, 8),
    finished=st.integers(0, 8),
    preemptions=st.integers(0, 2),
    running=st.sampled_from([0, 0, 3]),
    waiting=st.sampled_from([0, 0, 2]),
)
target_st = st.fixed_dictionaries(
    {
        "engine": engine_st,
        "model": st.sampled_from(["llama", "qwen"]),
        "down": st.booleans(),
        "restartable": st.booleans(),
        "flags_changed_age": st.sampled_from([10.5, 7200.5]),
        "lowered": st.booleans(),
        "answered": st.booleans(),  # a restart already answered its alerts' episodes
        "past": st.lists(
            st.tuples(st.sampled_from([2.5, 20.5, 200.5]), st.sampled_from(["lower_cap", "drain"])),
            max_size=3,
        ),
    }
)
fleet_st = st.lists(target_st, min_size=1, max_size=4)
alerts_st = st.lists(
    st.tuples(st.sampled_from(sorted(ALERTS)), st.integers(0, 4), st.sampled_from([0, 100])),
    max_size=6,
    unique_by=lambda t: (t[0], t[1]),
)
safety_st = st.fixed_dictionaries(
    {
        "cooldown_seconds": st.sampled_from([0, 10, 60]),
        "max_actions": st.integers(1, 3),
        "max_draining_per_model": st.integers(1, 2),
        "allow_last_replica": st.booleans(),
    }
)


def expected_calls(entries: list[dict], name: str) -> list[tuple[str, object]]:
    """explain's steps for one target, as the actuator and backend calls they become."""
    (entry,) = [e for e in entries if e.get("target") == name]
    calls: list[tuple[str, object]] = []
    for step in entry.get("steps", []):
        kind, _, rest = step.partition(" ")
        if kind == "restart":
            values = dict(part.split("=") for part in rest.split())
            flags = Flags(float(values["gpu_memory_utilization"]), int(values["max_num_seqs"]))
            calls += [("drain", None), ("restart", flags)]
        elif kind in ("drain", "resume"):
            calls.append((kind, None))
        else:
            calls.append(("set_cap", int(rest)))
    return calls


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fleet_st, alerts_st, safety_st, st.booleans())
def test_explain_says_exactly_what_the_loop_does(fleet, raw_alerts, safety, paused):
    names = [f"t{i}" for i in range(len(fleet))]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engines = Engines({}, drains_finish=True)
        for name, t in zip(names, fleet, strict=True):
            e = t["engine"]
            e.cap = min(e.cap, e.startup)
            engines.engines[name] = e
            if t["down"]:
                engines.down.add(name)
        cfg = config(work, *names, safety={**safety, "window_seconds": 3600})
        cfg.targets = [
            t.model_copy(update={"model": f["model"]})
            for t, f in zip(cfg.targets, fleet, strict=True)
        ]
        now = time.time()
        alerts = [
            alert(n, names[i], start=s, **ALERTS[n]) for n, i, s in raw_alerts if i < len(names)
        ]
        alerts += [alert(n, "elsewhere", start=s) for n, i, s in raw_alerts if i >= len(names)]
        webhook = parse(payload(*alerts))
        # the safety state both sides rebuild from the audit log: past actions, answered
        # restart episodes, the pause switch
        audit = AuditLog(cfg.audit_log)
        backends = {}
        for name, t in zip(names, fleet, strict=True):
            for age, action in t["past"]:
                past = {"time": now - age, "event": "acted", "target": name, "action": action}
                with audit.path.open("a") as fh:
                    fh.write(json.dumps({**past, "result": "ok"}) + "\n")
            if t["restartable"]:
                e = t["engine"]
                original = Flags(0.9, e.startup)
                current = Flags(0.86, max(1, e.startup * 4 // 5)) if t["lowered"] else original
                view = FlagView(original, current, now - t["flags_changed_age"])
                backends[name] = RecordingBackend(engines, name, view)
                if t["answered"]:
                    mine = [a for a in webhook.alerts if a.labels.get("target") == name]
                    audit.record(
                        "acted",
                        target=name,
                        action="restart",
                        result="started",
                        after={"episodes": [a.episode for a in mine]},
                    )
        if paused:
            audit.record("paused", reason="test")
        restart = RestartConfig(
            supervisor=SupervisorRef(url="http://127.0.0.1:1"),
            drain_timeout_seconds=2,
            ready_timeout_seconds=2,
        )
        cfg.targets = [
            t.model_copy(update={"restart": restart}) if t.name in backends else t
            for t in cfg.targets
        ]

        said = explain(cfg, webhook, actuator=engines, backends=backends)
        assert engines.calls == []  # explain changes nothing

        c = Controller(cfg, engines, AuditLog(cfg.audit_log), backends=backends)
        try:
            c.receive(webhook)
            c._pass()  # one pass, as explain describes one
            for thread in list(c._restarting.values()):
                thread.join(10)
        finally:
            c.close()
        for name in names:
            done = [(kind, value) for n, kind, value in engines.calls if n == name]
            assert done == expected_calls(said, name), (name, said)


def _engine(name: str, alerts: list, cap: int = 256) -> EngineInput:
    o = Observed(256, cap, False, 1e9, 0, 0, 0)
    return EngineInput(name, "llama", tuple(alerts), o)


def test_a_critical_drain_is_not_withheld_by_the_cooldown_of_a_cap_step(tmp_path):
    """Memory goes from pressure (lower the cap) to critical (drain) within the cooldown of the
    cap step: the escalation must happen now, not one cooldown later (the OOM comes first)."""
    cfg = config(tmp_path, "a", "b", safety={"cooldown_seconds": 60})
    now = 1_000_000.0
    capped = SafetyState(history={"a": ((now - 5, "lower_cap"),)})
    ctx = Context(cfg.policy, cfg.safety, cfg.flags, capped, now)
    hook = parse(
        payload(
            alert("OomguardMemoryPressure", "a"),
            alert("OomguardMemoryCritical", "a", start=30),
        )
    )
    engines = [_engine("a", list(hook.alerts), cap=204), _engine("b", [])]
    verdict = decide_fleet(engines, ctx)[0]
    assert [s.describe() for s in verdict.steps] == ["drain"]
    # `explain` says the same, from the same audit log
    AuditLog(cfg.audit_log).record("acted", target="a", action="lower_cap", result="ok")
    fleet = Engines({"a": Engine(256, 204), "b": Engine(256, 256)})
    said = {e["target"]: e for e in explain(cfg, hook, actuator=fleet, backends={})}
    assert said["a"]["steps"] == ["drain"], said["a"]
    assert said["a"]["withheld"] == []
    # the other way round still waits: a milder step, or the same again, after the drain
    drained = capped.with_action("a", now, "drain")
    assert limit(cfg.safety, drained, now + 5, "a", "lower_cap", FLEET2) == "cooldown"
    assert limit(cfg.safety, drained, now + 5, "a", "drain", FLEET2) == "cooldown"


def test_escalation_still_counts_against_the_action_and_disruption_budgets(tmp_path):
    cfg = config(tmp_path, "a", "b", safety={"cooldown_seconds": 60, "max_actions": 1})
    now = 1_000_000.0
    hook = parse(payload(alert("OomguardMemoryCritical", "a")))
    spent = SafetyState(history={"a": ((now - 5, "drain"),)})
    ctx = Context(cfg.policy, cfg.safety, cfg.flags, spent, now)
    engines = [_engine("a", list(hook.alerts)), _engine("b", [])]
    # a drain 5 s ago: the drain's own cooldown holds the next drain
    assert decide_fleet(engines, ctx)[0].steps[0].withheld == "cooldown"
    # past the cooldown, the budget of one action per window holds it
    ctx = Context(cfg.policy, cfg.safety, cfg.flags, spent, now + 120)
    assert decide_fleet(engines, ctx)[0].steps[0].withheld == "rate_limit"
    # and a peer already draining holds it by the disruption budget, cap step or not
    capped = SafetyState(history={"a": ((now - 5, "lower_cap"),)})
    ctx = Context(cfg.policy, cfg.safety, cfg.flags, capped, now)
    peer_draining = EngineInput("b", "llama", (), Observed(256, 256, True, 1e9, 0, 0, 0))
    steps = decide_fleet([_engine("a", list(hook.alerts)), peer_draining], ctx)[0].steps
    assert steps[0].withheld == "disruption_budget"


FLEET2 = {
    "a": EngineView("llama", draining=False, reachable=True),
    "b": EngineView("llama", draining=False, reachable=True),
}


# -- allocator fragmentation: a restart at a quiet moment, not capping and waiting ------------
FRAG = {"reason": "allocator_fragmentation"}
VIEW = FlagView(Flags(0.9, 256), Flags(0.9, 256), 0.0)


def _frag_ctx(tmp_path, history=(), **safety):
    cfg = config(tmp_path, "a", "b", safety=safety)
    now = 1_000_000.0
    state = SafetyState(history={"a": tuple((now - age, kind) for age, kind in history)})
    return Context(cfg.policy, cfg.safety, cfg.flags, state, now)


SETTLED = 45.0  # PolicyConfig.fragmentation_settle_seconds


def _frag_engine(alerts, state, restartable=True, restarted=frozenset(), idle_for=None):
    if idle_for is None:  # drained and idle past the settle time, unless the test says
        idle_for = SETTLED if isinstance(state, Observed) and state.idle else 0.0
    return EngineInput(
        "a",
        "llama",
        tuple(alerts),
        state,
        restartable=restartable,
        flags=VIEW if restartable else None,
        restarted=restarted,
        idle_for=idle_for,
    )


SERVING = Observed(256, 256, False, 1e9, 0, 0, 0, running=60)
DRAINED_IDLE = Observed(256, 256, True, 20.0, 0, 0, 0)
DRAINED_BUSY = Observed(256, 256, True, 20.0, 0, 0, 0, running=12)


def test_fragmentation_pressure_drains_for_a_restart_instead_of_capping(tmp_path):
    ctx = _frag_ctx(tmp_path)
    frag = parse(payload(alert("OomguardMemoryPressure", "a", **FRAG))).alerts
    peer = _engine("b", [])
    (verdict, _) = decide_fleet([_frag_engine(frag, SERVING), peer], ctx)
    assert [s.describe() for s in verdict.steps] == ["drain"]
    assert "fragmentation" in verdict.steps[0].reason
    # pressure for another reason (a neighbour): capping, as before
    other = parse(payload(alert("OomguardMemoryPressure", "a", reason="headroom_low"))).alerts
    (verdict, _) = decide_fleet([_frag_engine(other, SERVING), peer], ctx)
    assert [s.describe() for s in verdict.steps] == ["lower_cap 204"]
    # no restart backend: nothing would answer the drain, so capping
    (verdict, _) = decide_fleet([_frag_engine(frag, SERVING, restartable=False), peer], ctx)
    assert [s.describe() for s in verdict.steps] == ["lower_cap 204"]
    # the model's only engine: the restart's own limit (single replica) keeps it capped
    (verdict,) = decide_fleet([_frag_engine(frag, SERVING)], ctx)
    assert [s.describe() for s in verdict.steps] == ["lower_cap 204"]
    # a peer already out of service: the disruption budget keeps it capped
    peer_draining = EngineInput("b", "llama", (), Observed(256, 256, True, 1e9, 0, 0, 0))
    (verdict, _) = decide_fleet([_frag_engine(frag, SERVING), peer_draining], ctx)
    assert [s.describe() for s in verdict.steps] == ["lower_cap 204"]


def test_fragmentation_restarts_at_once_when_drained_and_idle(tmp_path):
    """Not restart_after_drain_seconds (600 s) later: waiting never gives fragments back."""
    ctx = _frag_ctx(tmp_path, history=[(20.0, "drain")])
    peer = _engine("b", [])
    for name in ("OomguardMemoryPressure", "OomguardMemoryCritical"):
        frag = parse(payload(alert(name, "a", **FRAG))).alerts
        (verdict, _) = decide_fleet([_frag_engine(frag, DRAINED_IDLE), peer], ctx)
        (step,) = verdict.steps
        assert (step.kind, step.withheld, step.flags) == ("restart", None, Flags(0.9, 256))
        assert step.covers == (frag[0].episode,)
        assert not step.staged  # a new process has none of the fragments: full admission
        # still serving its last requests: not yet (the quiet moment is idle)
        (verdict, _) = decide_fleet([_frag_engine(frag, DRAINED_BUSY), peer], ctx)
        assert verdict.steps == () and verdict.desired is not None
        assert verdict.desired.draining
    # a drain for another reason waits restart_after_drain_seconds, as before
    critical = parse(payload(alert("OomguardMemoryCritical", "a", reason="headroom_exhausted")))
    (verdict, _) = decide_fleet([_frag_engine(critical.alerts, DRAINED_IDLE), peer], ctx)
    assert verdict.steps == ()


def test_fragmentation_restarts_only_when_it_stays_while_idle(tmp_path):
    """The fragments a burst's requests made coalesce once they finish: an engine that has just
    gone idle waits fragmentation_settle_seconds (its alert resolves meanwhile if the fragments
    went, and it resumes without a reload); what stays after that is restarted."""
    ctx = _frag_ctx(tmp_path, history=[(120.0, "drain")])
    assert ctx.policy.fragmentation_settle_seconds == SETTLED
    peer = _engine("b", [])
    frag = parse(payload(alert("OomguardMemoryCritical", "a", **FRAG))).alerts
    for idle_for in (0.0, 10.0, SETTLED - 1):
        (verdict, _) = decide_fleet(
            [_frag_engine(frag, DRAINED_IDLE, idle_for=idle_for), peer], ctx
        )
        assert verdict.steps == () and verdict.desired is not None and verdict.desired.draining
    (verdict, _) = decide_fleet([_frag_engine(frag, DRAINED_IDLE, idle_for=SETTLED), peer], ctx)
    assert [s.kind for s in verdict.steps] == ["restart"]
    # the alert resolved while it sat idle (the fragments coalesced): it resumes, no restart
    (verdict, _) = decide_fleet([_frag_engine([], DRAINED_IDLE, idle_for=10.0), peer], ctx)
    assert "resume" in [s.kind for s in verdict.steps]
    assert "restart" not in [s.kind for s in verdict.steps]


def test_a_fragmentation_restart_answers_its_episode_once(tmp_path):
    frag = parse(payload(alert("OomguardMemoryPressure", "a", **FRAG))).alerts
    done = frozenset({frag[0].episode})
    peer = _engine("b", [])
    ctx = _frag_ctx(tmp_path, history=[(20.0, "drain"), (10.0, "restart")])
    # back from the restart, capped at one, the alert still in its hysteresis: no second
    # drain or restart for the same episode
    back = Observed(256, 1, False, 5.0, 0, 0, 0)
    (verdict, _) = decide_fleet([_frag_engine(frag, back, restarted=done), peer], ctx)
    assert all(s.kind not in ("drain", "restart", "lower_cap") for s in verdict.steps)
    # nor a cap on the new process, which has none of the fragments (its alert only lags)
    full = Observed(256, 256, False, 5.0, 0, 0, 0, running=60)
    (verdict, _) = decide_fleet([_frag_engine(frag, full, restarted=done), peer], ctx)
    assert verdict.steps == ()
    # drained and idle again (someone drained it): still no second restart for that episode
    (verdict, _) = decide_fleet([_frag_engine(frag, DRAINED_IDLE, restarted=done), peer], ctx)
    assert all(s.kind != "restart" for s in verdict.steps)


def test_a_fragmentation_restart_answers_the_engine_wide_alerts_it_set_off(tmp_path):
    """As the rules fire it: the engine-wide level alerts (no reason) beside the fragmentation
    alert that carries it. The restart covers those, not a rate alert's cap; on the new process
    none of them asks for anything while the fragmentation alert lags with them. Once it has
    resolved, an alert still firing asks as usual: pressure on the new process is never ignored
    (a covered drain episode asks for a cap, as after any restart)."""
    fired = parse(
        payload(
            alert("OomguardMemoryPressure", "a"),
            alert("OomguardFragmentationPressure", "a", **FRAG),
            alert("OomguardMemoryCritical", "a"),
            alert("OomguardPreemptionRateHigh", "a"),
        )
    ).alerts
    by_name = {a.name: a for a in fired}
    frag = by_name["OomguardFragmentationPressure"]
    peer = _engine("b", [])
    ctx = _frag_ctx(tmp_path, history=[(20.0, "drain")])
    (verdict, _) = decide_fleet([_frag_engine(fired, SERVING), peer], ctx)
    assert [s.kind for s in verdict.steps] == ["drain"]  # not a cap: the quiet moment first
    (verdict, _) = decide_fleet([_frag_engine(fired, DRAINED_IDLE), peer], ctx)
    (step,) = verdict.steps
    assert (step.kind, step.episode, step.staged) == ("restart", frag.episode, False)
    level_alerts = ("OomguardMemoryPressure", "OomguardFragmentationPressure")
    assert set(step.covers) == {
        by_name[n].episode for n in (*level_alerts, "OomguardMemoryCritical")
    }
    done = frozenset(step.covers)
    ctx = _frag_ctx(tmp_path, history=[(20.0, "drain"), (10.0, "restart")])
    full = Observed(256, 256, False, 5.0, 0, 0, 0, running=60)
    lagging = [by_name[n] for n in (*level_alerts, "OomguardMemoryCritical")]
    (verdict, _) = decide_fleet([_frag_engine(lagging, full, restarted=done), peer], ctx)
    assert verdict.steps == ()
    # the rate alert was not answered by the restart: it caps the new process as usual
    (verdict, _) = decide_fleet([_frag_engine(fired, full, restarted=done), peer], ctx)
    assert [s.kind for s in verdict.steps] == ["lower_cap"]
    # the fragmentation alert resolved: what still fires asks again
    for name in ("OomguardMemoryPressure", "OomguardMemoryCritical"):
        still = [by_name[name]]
        (verdict, _) = decide_fleet([_frag_engine(still, full, restarted=done), peer], ctx)
        assert [s.kind for s in verdict.steps] == ["lower_cap"], name


def test_an_engine_drained_by_someone_else_is_theirs_to_restart(tmp_path):
    frag = parse(payload(alert("OomguardMemoryPressure", "a", **FRAG))).alerts
    (verdict, _) = decide_fleet(
        [_frag_engine(frag, DRAINED_IDLE), _engine("b", [])], _frag_ctx(tmp_path)
    )
    assert all(s.kind != "restart" for s in verdict.steps)


def test_fragmentation_never_acts_on_an_engine_without_alerts(tmp_path):
    ctx = _frag_ctx(tmp_path, history=[(20.0, "drain")])
    for state in (SERVING, DRAINED_IDLE):
        (verdict, _) = decide_fleet([_frag_engine([], state), _engine("b", [])], ctx)
        assert all(s.kind not in ("drain", "restart", "lower_cap") for s in verdict.steps)


def test_restart_on_fragmentation_false_answers_it_like_any_pressure(tmp_path):
    cfg = config(tmp_path, "a", "b", policy={"restart_on_fragmentation": False})
    now = 1_000_000.0
    peer = _engine("b", [])
    for history, state in (((), SERVING), (((now - 20.0, "drain"),), DRAINED_IDLE)):
        ctx = Context(cfg.policy, cfg.safety, cfg.flags, SafetyState(history={"a": history}), now)
        for name, expected in (
            ("OomguardMemoryPressure", "lower_cap"),
            ("OomguardMemoryCritical", "drain"),
        ):
            frag = parse(payload(alert(name, "a", **FRAG))).alerts
            (verdict, _) = decide_fleet([_frag_engine(frag, state), peer], ctx)
            assert all(s.kind != "restart" for s in verdict.steps), (name, verdict.steps)
            if state is SERVING:
                assert [s.kind for s in verdict.steps] == [expected]


# -- the flags' walk-back: a restart nothing needs --------------------------------------------
LOWERED = FlagView(Flags(0.9, 256), Flags(0.86, 204), 0.0)  # lowered long ago (wall time 0)


def _quiet(name: str, model: str = "llama") -> EngineInput:
    """An engine at full admission of its lowered flags, no alerts: the walk-back's case."""
    o = Observed(204, 204, False, 1e9, 0, 0, 0)
    return EngineInput(name, model, (), o, restartable=True, flags=LOWERED)


def test_a_walk_back_never_takes_the_models_last_ready_engine_nor_pages(tmp_path):
    # found: on a single box the walk-back was a restart withheld by single_replica, a limit
    # that pages (OomguardRemediationLimited) an hour after every OOM, for a healthy engine
    for allow in (False, True):  # the opt-in is for relieving memory, not for restoring flags
        cfg = config(tmp_path, "a", safety={"allow_last_replica": allow})
        ctx = Context(cfg.policy, cfg.safety, cfg.flags, SafetyState(), 1_000_000.0)
        (verdict,) = decide_fleet([_quiet("a")], ctx)
        assert verdict.steps == (), allow  # no withheld step: no limit counted, nothing pages
        assert verdict.waiting == "walk flags back: waits for the single_replica limit"
        assert verdict.desired is not None and verdict.desired.phase == "serving"
    # the model's other engine cannot be read: the last ready one waits too
    cfg = config(tmp_path, "a", "b", safety={"allow_last_replica": True})
    ctx = Context(cfg.policy, cfg.safety, cfg.flags, SafetyState(), 1_000_000.0)
    down = EngineInput("b", "llama", (), Unreadable("unreachable", "connection refused"))
    verdict = decide_fleet([_quiet("a"), down], ctx)[0]
    assert verdict.steps == () and verdict.waiting is not None
    assert "last_ready" in verdict.waiting


def test_a_walk_back_restarts_while_a_peer_serves_and_waits_out_the_other_limits(tmp_path):
    cfg = config(tmp_path, "a", "b", safety={"cooldown_seconds": 60})
    now = 1_000_000.0
    ctx = Context(cfg.policy, cfg.safety, cfg.flags, SafetyState(), now)
    first, second = decide_fleet([_quiet("a"), _quiet("b")], ctx)
    assert [s.describe() for s in first.steps] == [
        "restart gpu_memory_utilization=0.9 max_num_seqs=255"  # one step: 204 / 0.8
    ]
    assert first.steps[0].elective and first.waiting is None
    # `a` restarting is the model's one engine out of service: `b` waits for it, and says so
    assert second.steps == ()
    assert second.waiting == "walk flags back: waits for the disruption_budget limit"
    # within the cooldown of a restart it waits, and nothing is withheld
    recent = SafetyState(history={"a": ((now - 5, "restart"),)})
    ctx = Context(cfg.policy, cfg.safety, cfg.flags, recent, now)
    verdict = decide_fleet([_quiet("a"), _engine("b", [])], ctx)[0]
    assert (
        verdict.steps == () and verdict.waiting == "walk flags back: waits for the cooldown limit"
    )
    # a restart that memory needs is still withheld, and counted, by the same limits
    hook = parse(payload(alert("OomguardCudaOomObserved", "a", oomguard_action="restart")))
    needed = EngineInput(
        "a",
        "llama",
        tuple(hook.alerts),
        Observed(204, 204, False, 1e9, 0, 0, 0),
        restartable=True,
        flags=LOWERED,
    )
    (verdict,) = decide_fleet(
        [needed], Context(cfg.policy, config(tmp_path, "a").safety, cfg.flags, SafetyState(), now)
    )
    assert [s.withheld for s in verdict.steps][:1] == ["single_replica"] and verdict.waiting is None
