"""The poller's lanes: collectors share one thread, and one that turns slow or hangs goes on on
its own thread without holding the others back for more than about an interval."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from oomguard.exporter.lanes import LANE
from oomguard.exporter.poller import Poller
from tests.test_poller import Scripted, value


def until(check: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def seq(poller: Poller, name: str) -> int:
    (state,) = [s for s in poller.states if s.collector.name == name]
    return state.seq


def collector_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("collector"))


def test_collectors_poll_on_one_thread():
    cs = [Scripted(f"c{i}") for i in range(6)]
    poller = Poller(cs, interval=0.05)
    poller.lanes.budget = 1.0  # none is slow, even on a loaded machine
    poller.start(first_results_within=2)
    try:
        assert until(lambda: all(seq(poller, c.name) >= 3 for c in cs))
        assert collector_threads() == [LANE]  # not one thread per collector
        assert poller.lanes.own() == []
    finally:
        poller.stop()
    assert collector_threads() == []


def test_a_collector_that_hangs_goes_on_its_own_thread_and_the_others_go_on():
    a, hung, b = Scripted("a"), Scripted("hung", timeout=0.3), Scripted("b")
    poller = Poller([a, hung, b], interval=0.05)
    poller.lanes.budget, poller.lanes.rejoin_after = 0.25, 5
    poller.start(first_results_within=2)
    try:
        assert until(lambda: seq(poller, "b") >= 2)
        hung.gate = threading.Event()  # its next poll hangs (a wedged driver)
        assert until(lambda: poller.lanes.own() == ["collector-hung-"])
        # the others carry on without it, on a new lane thread, while it still hangs
        got = seq(poller, "a"), seq(poller, "b")
        assert until(lambda: seq(poller, "a") >= got[0] + 5 and seq(poller, "b") >= got[1] + 5)
        assert [s.running_since is not None for s in poller.states] == [False, True, False]
        assert collector_threads() == sorted([LANE, LANE])  # the left one still holds it
        # its own timeout reports it stuck, the others stay up
        time.sleep(0.35)
        text = poller.render().text
        assert value(text, "oomguard_exporter_collector_up", collector="hung") == 0
        assert value(text, "oomguard_exporter_collector_up", collector="a") == 1
        assert value(text, "oomguard_exporter_collector_up", collector="b") == 1
        before = seq(poller, "hung")
        hung.gate.set()  # the driver answers again: its thread polls it from now on
        assert until(lambda: seq(poller, "hung") >= before + 3)
        # ... and, in time rejoin_after polls in a row, it gives it back to the lane
        assert until(lambda: poller.lanes.own() == [])
        assert until(lambda: collector_threads() == [LANE])
        got = seq(poller, "hung")
        assert until(lambda: seq(poller, "hung") >= got + 3)  # polled on the lane again
        assert poller.thread_restarts["collector-hung-"] == 0  # slow is not dead
        assert poller.problems() == []
    finally:
        if hung.gate is not None:
            hung.gate.set()
        poller.stop()
    assert collector_threads() == []


def test_the_others_are_held_back_once_by_about_an_interval():
    """How long a hang holds the rest of the lane: the render loop's watch runs each interval
    and the budget is a quarter of it at most, so the others' results never get stale."""
    ok, slow = Scripted("ok"), Scripted("slow", timeout=5.0)
    poller = Poller([slow, ok], interval=0.2)
    poller.start(first_results_within=2)
    try:
        assert until(lambda: seq(poller, "ok") >= 2)
        slow.gate = threading.Event()
        assert until(lambda: poller.lanes.own() == ["collector-slow-"])
        (state,) = [s for s in poller.states if s.collector.name == "ok"]
        # never stale: its last result is within stale_after of every render since
        for _ in range(10):
            time.sleep(0.1)
            assert state.result is not None
            assert time.time() - state.result.finished_at < poller.stale_after(ok)
    finally:
        slow.gate.set()
        poller.stop()


def test_a_poll_that_took_longer_than_the_budget_moves_its_collector_off_the_lane():
    """Slow but back before the watch looked (the render loop looks once an interval): a lane
    of such engines would take longer than an interval each pass."""

    class Slow(Scripted):
        def collect(self):
            time.sleep(0.3)
            return super().collect()

    slow, ok = Slow("slow"), Scripted("ok")
    poller = Poller([slow, ok], interval=1.0)  # one watch a second: it misses most polls
    poller.lanes.budget = 0.1
    poller.lanes.start()  # the lane alone, no watch
    try:
        assert until(lambda: poller.lanes.own() == ["collector-slow-"], within=5)
        assert until(lambda: seq(poller, "slow") >= 2, within=5)  # polled on its own thread
    finally:
        poller.stop()
    assert collector_threads() == []


def test_a_collector_that_keeps_failing_fast_stays_on_the_lane():
    broken = Scripted("broken")
    broken.error = ConnectionRefusedError("engine down")  # fails at once, every poll
    poller = Poller([broken, Scripted("ok")], interval=0.05)
    poller.lanes.budget = 1.0
    poller.start(first_results_within=2)
    try:
        assert until(lambda: seq(poller, "broken") >= 5 and seq(poller, "ok") >= 5)
        assert poller.lanes.own() == [] and collector_threads() == [LANE]
    finally:
        poller.stop()
