"""Standalone mode: exporters' pressure levels play the alerts, with `for` and hysteresis."""

from __future__ import annotations

import pytest

from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import StandaloneConfig
from oomguard.remediator.controller import Controller
from oomguard.remediator.standalone import PressureWatcher
from tests.remediator_helpers import Engines, config


def levels(**by_target: int) -> str:
    lines = ["# TYPE oomguard_engine_pressure_level gauge"]
    for target, level in by_target.items():
        lines.append(
            f'oomguard_engine_pressure_level{{target="{target}",engine="0",model_name="m",'
            f'reason="gpu_free"}} {level}'
        )
    return "\n".join(lines) + "\n"


def watch(url: str, now: list[float], **timings: float) -> PressureWatcher:
    """A watch of one exporter on the test's clock `now[0]`, with these StandaloneConfig timings."""
    return PressureWatcher(StandaloneConfig(exporters=[url], **timings), clock=lambda: now[0])


def test_levels_fire_after_their_hold_and_resolve_after_hysteresis(local_server, tmp_path):
    server = local_server(levels(a=0, b=0))
    now = [0.0]
    watcher = watch(
        server.url, now, pressure_for_seconds=10, critical_for_seconds=0, keep_firing_seconds=20
    )
    engines = Engines.of("a", "b")
    c = Controller(config(tmp_path, "a", "b"), engines, AuditLog(tmp_path / "audit.jsonl"))

    def tick(seconds: float) -> list[tuple[str, str]]:
        now[0] += seconds
        hook = watcher.poll()
        c.receive(hook, source="standalone")
        c.reconcile()
        return sorted((a.name, a.status) for a in hook.alerts)

    assert tick(1) == []
    server.serve_text(levels(a=2, b=0))
    assert tick(1) == []  # pending: level 2 must hold 10 s
    assert tick(5) == []
    assert tick(6) == [("OomguardMemoryPressure", "firing")]
    assert engines.engines["a"].cap == 80 and engines.engines["b"].cap == 100
    server.serve_text(levels(a=3, b=0))
    assert ("OomguardMemoryCritical", "firing") in tick(1)  # critical_for 0: at once
    assert engines.engines["a"].draining  # b is ready: the budget allows it
    server.serve_text(levels(a=0, b=0))
    assert len(tick(10)) == 2  # still firing: keep_firing 20 s
    assert engines.engines["a"].draining
    assert sorted(tick(15)) == [
        ("OomguardMemoryCritical", "resolved"),
        ("OomguardMemoryPressure", "resolved"),
    ]
    assert not engines.engines["a"].draining and engines.engines["a"].cap == 1  # re-admission


def test_an_exporter_that_cannot_be_read_holds_the_alerts(local_server):
    server = local_server(levels(a=3))
    now = [0.0]
    watcher = watch(server.url, now, keep_firing_seconds=0)
    assert [a.name for a in watcher.poll().alerts] == ["OomguardMemoryCritical"]
    server.responder = lambda _h: (500, b"boom", "text/plain")
    now[0] += 60
    assert watcher.poll().alerts == ()  # no resolve from missing data
    assert server.url in watcher.errors
    server.serve_text("garbage {{{\n" + levels(a=3))  # a bad line is dropped, not fatal
    critical = [a for a in watcher.poll().alerts if a.name == "OomguardMemoryCritical"]
    assert [a.status for a in critical] == ["firing"]
    server.serve_text(levels(a=0))
    assert {a.status for a in watcher.poll().alerts} == {"resolved"}


def test_a_blind_engine_is_held_at_once_and_let_go_at_once(local_server, tmp_path):
    server = local_server(levels(a=3, b=0))
    now = [0.0]
    watcher = watch(server.url, now, keep_firing_seconds=20)
    engines = Engines.of("a", "b")
    c = Controller(config(tmp_path, "a", "b"), engines, AuditLog(tmp_path / "audit.jsonl"))

    def tick(seconds: float) -> None:
        now[0] += seconds
        c.receive(watcher.poll(), source="standalone")
        c.reconcile()

    tick(1)
    assert engines.engines["a"].draining
    server.serve_text(levels(a=-1, b=0))  # the exporter lost sight of a: blind, not healthy
    tick(30)  # the critical alert resolves after its hysteresis, but a stays as it is
    assert engines.engines["a"].draining and c.status["a"].mode == "held"
    names = {a.name for a in c.book.firing()}
    assert names == {"OomguardPressureBlind"}
    server.serve_text(levels(a=0, b=0))  # it can see again: healthy, re-admission starts
    tick(1)
    assert not engines.engines["a"].draining and engines.engines["a"].cap == 1


def test_one_malformed_exporter_page_does_not_stop_the_watch_of_the_others(local_server):
    """Defect 10: a page the text parser rejects raised CollectorError out of poll(), which
    caught only HTTP and value errors: no exporter was watched any more."""
    broken = local_server('oomguard_engine_pressure_level{target="b" 3\n')  # torn labels
    good = local_server(levels(a=3))
    watcher = PressureWatcher(
        StandaloneConfig(exporters=[broken.url, good.url], critical_for_seconds=0),
        clock=lambda: 0.0,
    )
    hook = watcher.poll()
    assert ("OomguardMemoryCritical", "firing") in [(a.name, a.status) for a in hook.alerts]
    assert {a.labels["target"] for a in hook.alerts} == {"a"}
    assert "CollectorError" in watcher.errors[broken.url]


class Killed(BaseException):
    """What no loop catches: the injected death of a thread."""


@pytest.mark.slow  # waits out a restart backoff (seconds)
def test_a_dead_standalone_watch_is_restarted_counted_and_degrades_healthz(
    local_server, tmp_path, monkeypatch
):
    import time

    from starlette.testclient import TestClient

    from oomguard.remediator.main import Remediator

    server = local_server(levels(a=3))
    cfg = config(
        tmp_path,
        "a",
        "b",
        mode="standalone",
        standalone={"exporters": [server.url], "interval_seconds": 0.1, "critical_for_seconds": 0},
    )
    engines = Engines.of("a", "b")
    r = Remediator(cfg, engines)
    watch = r.threads[0]
    watch.settle = 2.0
    real, calls = r.watcher.poll, []

    def dies_once():
        calls.append(1)
        if len(calls) == 1:
            raise Killed("injected")
        return real()

    monkeypatch.setattr(r.watcher, "poll", dies_once)
    sample = r.controller.metrics.registry.get_sample_value
    r.start()
    try:
        with TestClient(r.app) as client:
            deadline = time.monotonic() + 10
            while not r.problems() and time.monotonic() < deadline:
                time.sleep(0.02)
            health = client.get("/healthz")
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            assert "standalone-watch" in " ".join(health.json()["problems"])
            deadline = time.monotonic() + 15
            while not engines.engines["a"].draining and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engines.engines["a"].draining  # restarted: level 3 drains a
            labels = {"thread": "standalone-watch"}
            assert sample("oomguard_remediator_thread_restarts_total", labels) == 1
            deadline = time.monotonic() + 10
            while client.get("/healthz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.get("/healthz").status_code == 200
    finally:
        r.stop()


def page(target: str, level: int, reason: str) -> str:
    return levels(**{target: level}).replace('reason="gpu_free"', f'reason="{reason}"')


def test_an_engine_is_one_alert_whatever_its_reason_as_in_the_rules(local_server):
    """As the rules (`max without (reason)`): a new reason at the same level is the same alert,
    key and episode, not a new one pending for its `for`; only OomguardFragmentationPressure
    looks at one reason, carries it, and resolves after keep_firing once the reason is gone."""
    server = local_server(page("a", 3, "allocator_fragmentation"))
    now = [0.0]
    watcher = watch(server.url, now, keep_firing_seconds=5, pressure_for_seconds=2)

    def alerts() -> dict:
        return {a.name: a for a in watcher.poll().alerts}

    first = alerts()
    crit = first["OomguardMemoryCritical"]
    assert "reason" not in crit.labels
    assert "OomguardFragmentationPressure" not in first  # pending: its `for` is 2 s
    now[0] += 3
    second = alerts()
    frag, pressure = second["OomguardFragmentationPressure"], second["OomguardMemoryPressure"]
    assert (frag.status, frag.labels["reason"]) == ("firing", "allocator_fragmentation")
    assert pressure.status == "firing" and "reason" not in pressure.labels
    server.serve_text(page("a", 3, "headroom_exhausted"))  # the reason changes, the level stays
    now[0] += 1
    third = alerts()
    for before in (crit, pressure):
        after = third[before.name]
        assert (after.status, after.key, after.episode) == ("firing", before.key, before.episode)
    assert third["OomguardFragmentationPressure"].status == "firing"  # keep_firing 5 s
    now[0] += 5
    fourth = alerts()
    assert (fourth["OomguardFragmentationPressure"].status, fourth[crit.name].episode) == (
        "resolved",
        crit.episode,
    )
    server.serve_text(page("a", 0, "ok"))
    now[0] += 10
    assert {a.status for a in alerts().values()} == {"resolved"}
    now[0] += 1
    assert alerts() == {}
    # nothing pending or firing is remembered past the series an alert judges
    assert {k[3] for k in watcher._rules} == {
        "OomguardMemoryPressure",
        "OomguardPressureBlind",
        "OomguardMemoryCritical",
    }


def test_a_reason_that_flaps_at_level_2_still_fires_after_its_for(local_server):
    """Stop 39's gap: a reason alternating every second at level 2 (a step-guard shrink's hold,
    then headroom_low) held the alert pending per reason forever; the engine's alert fires."""
    server = local_server(page("a", 2, "headroom_low"))
    now = [0.0]
    watcher = watch(server.url, now, pressure_for_seconds=3)
    fired = []
    for k in range(6):
        server.serve_text(page("a", 2, ("headroom_low", "step_guard_shrink")[k % 2]))
        fired.append(
            [a.status for a in watcher.poll().alerts if a.name == "OomguardMemoryPressure"]
        )
        now[0] += 1
    assert fired == [[], [], [], ["firing"], ["firing"], ["firing"]]


def test_a_drained_engine_whose_fragments_coalesced_is_not_restarted_for_another_reason(
    local_server, tmp_path
):
    """long-context-burst (issue 30): fragmentation drained the engine; once idle its fragments
    coalesced, but a step-guard shrink held the level at 2 with reason step_guard_shrink. The
    watch kept the episode's first reason on the pressure alert, so the remediator restarted
    the engine for fragmentation it no longer had. OomguardFragmentationPressure resolves after
    keep_firing once its reason is gone, and the engine is not restarted."""
    import time

    from oomguard.remediator.flags import Flags
    from tests.test_remediator_controller import FakeBackend, restartable, settle

    server = local_server(page("a", 3, "allocator_fragmentation"))
    now = [time.time()]
    watcher = watch(
        server.url, now, pressure_for_seconds=0, critical_for_seconds=0, keep_firing_seconds=15
    )
    engines = Engines.of("a", "b", startup=64)
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.9, 64), time.time())
    c = restartable(tmp_path, engines, backend, "a", clock=lambda: now[0])

    def tick(seconds: float) -> None:
        now[0] += seconds
        c.receive(watcher.poll(), source="standalone")
        c.reconcile()
        settle(c)

    engines.engines["a"].running = 2
    tick(1)
    assert engines.engines["a"].draining and backend.restarts == []
    engines.engines["a"].running = 0  # idle: its fragments coalesce
    server.serve_text(page("a", 2, "step_guard_shrink"))  # a shrink's hold keeps it at 2
    for _ in range(60):  # a minute, past fragmentation_settle_seconds (45)
        tick(1)
    assert backend.restarts == []
    firing = {(a.name, a.labels.get("reason")) for a in c.book.firing()}
    assert firing == {("OomguardMemoryPressure", None)}  # the engine's pressure, any reason
    c.close()

    # the control: fragmentation that stays is still restarted once the engine is idle
    server.serve_text(page("a", 3, "allocator_fragmentation"))
    engines = Engines.of("a", "b", startup=64)
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.9, 64), time.time())
    watcher = PressureWatcher(watcher.config, clock=lambda: now[0])
    c = restartable(tmp_path / "control", engines, backend, "a", clock=lambda: now[0])
    for _ in range(60):
        tick(1)
    assert [f for f, _, _ in backend.restarts] == [Flags(0.9, 64)]
    c.close()
