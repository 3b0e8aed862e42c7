"""Which thread polls each collector: one shared thread for those that answer in time, an own
thread for one that does not.

A thread per collector (16 vLLM engines, NVML, the allocator hand-offs, cgroups: about 20 on a
GPU node) costs a wake-up each per interval, each on cold caches. At 10,000 series that was
1.1 % of a core at 1 s, over the exporter's 1 % budget (bench/exporter.py), while the same polls
one after another on one thread cost 0.1-0.3 points less. So collectors share one thread, the
lane, and keep the isolation that own threads gave them:

- A poll that has run past `budget` (an engine slow to answer, a hung NVML call) is left to the
  thread it runs on, which becomes that collector's own once the poll returns; the others go on
  at once on a new lane thread. `watch()` decides it, called by the render loop (each interval)
  and during start-up, so the others are held back once, by at most an interval plus `budget`:
  within their `stale_after` (three intervals), so none of them is reported stale for it. The
  left collector is reported stuck by its own `timeout`, as before. A poll that took longer
  than `budget` but returned before the watch looked moves its collector to an own thread too,
  so that the lane's pass stays short.
- A collector on its own thread whose last `rejoin_after` polls each took under `budget` goes
  back to the lane (an engine that was slow during a restart does not keep a thread for ever).
- A poll that raises what `Poller.poll` does not catch (a BaseException) is a death of the
  collector's thread: counted under its name (`collector-<name>-<target>`, as
  oomguard_exporter_thread_restarts_total always named it), and the collector goes on on its own
  supervised thread after the restart backoff, degraded in /healthz for `settle` seconds.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from oomguard import supervised
from oomguard.supervised import Supervised

log = logging.getLogger("oomguard.exporter")

LANE = "collectors"  # the shared thread's name
REJOIN_AFTER = 30  # polls in a row under budget before an own thread gives its collector back


class _Polled(Protocol):
    collector: Any


def thread_name(state: _Polled) -> str:
    """The name of a collector's own thread (and of its restarts' series)."""
    return f"collector-{state.collector.name}-{state.collector.target}"


class _Lane:
    """One lane thread's view: the poll it is in, and whether it has been left behind."""

    def __init__(self) -> None:
        self.stop = threading.Event()  # set when this thread no longer polls the lane
        self.current: _Polled | None = None
        self.since = 0.0  # monotonic start of `current`
        self.left: _Polled | None = None  # the collector whose poll outlived the budget


class Lanes:
    def __init__(
        self,
        states: Sequence[_Polled],
        interval: float,
        poll: Callable[[Any], object],
        on_death: Callable[[str], None],
        budget: float | None = None,
        rejoin_after: int = REJOIN_AFTER,
        settle: float = supervised.SETTLE_SECONDS,
    ) -> None:
        self.states = list(states)
        self.interval = interval
        self.poll = poll  # Poller.poll: never raises an Exception
        self.on_death = on_death
        # a tenth of a second at the shipped 1 s; less at short intervals, where the whole lane
        # must fit in one
        self.budget = min(0.1, interval / 4) if budget is None else budget
        self.rejoin_after = rejoin_after
        self.settle = settle
        self._lock = threading.Lock()
        self._stopping = False
        self._members = [id(s) for s in self.states]  # in the lane now, in `states` order
        self._lane: _Lane | None = None
        self.threads: list[Supervised] = []  # live ones (lane and own), for /healthz and stop

    # -- the lane ----------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            self._start_lane()

    def _start_lane(self) -> None:
        """A new lane thread for the members (with the lock held)."""
        lane = _Lane()
        body = functools.partial(self._lane_loop, lane)
        t = Supervised(LANE, body, lane.stop, self.on_death, settle=self.settle)
        self._lane = lane
        self.threads.append(t)
        t.start()

    def _lane_loop(self, lane: _Lane) -> None:
        while not lane.stop.is_set():
            started = time.monotonic()
            with self._lock:
                members = set(self._members)
            for state in self.states:
                if id(state) not in members:
                    continue
                with self._lock:
                    if lane.stop.is_set():
                        break
                    lane.current, lane.since = state, time.monotonic()
                death: str | None = None
                try:
                    self.poll(state)
                except BaseException as exc:  # the collector's thread died, not the lane
                    death = f"{type(exc).__name__}: {exc}"[:300]
                    log.error("thread %s died: %s", thread_name(state), death, exc_info=exc)
                with self._lock:
                    lane.current = None
                    left = lane.left
                    # slow but back before the watch saw it: its own thread too, or a lane of
                    # slow engines would take longer than an interval each pass
                    slow = time.monotonic() - lane.since > self.budget
                    out = left is None and (death is not None or slow) and not self._stopping
                    if out:
                        self._members.remove(id(state))
                if death is not None:
                    self.on_death(thread_name(state))
                if left is not None:  # the lane went on without this thread: it is left's own
                    self._own(left, death)
                    return
                if out:
                    self._own(state, death)
            lane.stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def watch(self) -> None:
        """Leave a lane poll that has outlived the budget to its thread; the others go on."""
        with self._lock:
            # threads that ended (left lanes, own threads that gave their collector back)
            self.threads = [t for t in self.threads if t.is_alive() or not t.stop_event.is_set()]
            lane = self._lane
            if self._stopping or lane is None or lane.current is None:
                return
            took = time.monotonic() - lane.since
            if took <= self.budget:
                return
            state = lane.left = lane.current
            lane.stop.set()
            self._members.remove(id(state))
            self._start_lane()
        log.warning(
            "collector %s %s has polled for %.2f s (budget %.2f s): it goes on on its own "
            "thread once this poll returns, the others on a new lane thread",
            state.collector.name,
            state.collector.target,
            took,
            self.budget,
        )

    # -- own threads -------------------------------------------------------------------------
    def _own(self, state: _Polled, death: str | None = None) -> None:
        """Start `state`'s own thread, which polls it next an interval from now (after a
        death: the restart backoff); `death`: its poll died in the lane (counted already)."""
        stop = threading.Event()
        wait = self.interval if death is None else supervised.BACKOFF_SECONDS
        t = Supervised(
            thread_name(state),
            functools.partial(self._own_loop, state, stop, wait),
            stop,
            self.on_death,
            settle=self.settle,
        )
        if death is not None:  # degraded for `settle`, as a supervised thread that died is
            t.deaths, t.last_error, t.last_death = 1, death, t.clock()
        with self._lock:
            if self._stopping:
                return
            self.threads.append(t)
        t.start()

    def _own_loop(self, state: _Polled, stop: threading.Event, wait: float) -> None:
        stop.wait(wait)  # its last poll just ended (or died: as Supervised waits to restart)
        in_time = 0
        while not stop.is_set():
            started = time.monotonic()
            self.poll(state)  # a BaseException: Supervised counts the death and restarts this
            took = time.monotonic() - started
            in_time = in_time + 1 if took <= self.budget else 0
            if in_time >= self.rejoin_after:
                with self._lock:
                    if not self._stopping:
                        self._members = [
                            id(s) for s in self.states if id(s) in {*self._members, id(state)}
                        ]
                        stop.set()  # this thread ends quietly (Supervised: stopped)
                log.info(
                    "collector %s %s is back on the lane thread (%d polls in time)",
                    state.collector.name,
                    state.collector.target,
                    in_time,
                )
                return
            stop.wait(max(0.0, self.interval - took))

    def own(self) -> list[str]:
        """The collectors on their own thread now (thread names)."""
        with self._lock:
            members = set(self._members)
        return [thread_name(s) for s in self.states if id(s) not in members]

    def stop(self) -> list[Supervised]:
        """Stop every thread; returns them, to join."""
        with self._lock:
            self._stopping = True
            threads = list(self.threads)
        for t in threads:
            t.stop_event.set()
        return threads
