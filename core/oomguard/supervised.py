"""Background threads that cannot die silently.

A `Supervised` thread runs its body (a loop until its stop event is set). When the body raises,
whatever the exception, or returns while nobody asked it to stop, the death is logged with its
traceback, counted (`deaths`, and `on_death(name)` for the component's metric) and the body is
started again after a backoff (1 s, doubling to 30 s; back to 1 s after it ran `settle` seconds
without dying). While it is down, and for `settle` seconds after it died, `problem()` names it:
the component's /healthz answers degraded. A thread that keeps dying therefore keeps /healthz
degraded; one that died once and runs again recovers it after `settle` seconds, while the
restart counter (and its alert) keeps the record.

A thread can also hang rather than die (a call with no timeout on a connection whose peer
vanished): with `stall_after`, a body that calls `beat()` at least that often is alive, and one
that stops beating is named by `problem()` as stuck, so /healthz degrades (and a liveness probe
can restart the process: a hung thread cannot be killed from inside). The thread's own calls
still need timeouts; this catches the one nobody foresaw.

Used for every long-lived loop of the exporter (collectors, render), the remediator (leader
election, discovery watches, the standalone watch) and `oomguard serve` (the vLLM log reader).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("oomguard.threads")

BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
SETTLE_SECONDS = 15.0


class Supervised:
    def __init__(
        self,
        name: str,
        body: Callable[[], None],
        stop: threading.Event,
        on_death: Callable[[str], None] = lambda name: None,
        backoff: float = BACKOFF_SECONDS,
        max_backoff: float = MAX_BACKOFF_SECONDS,
        settle: float = SETTLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        stall_after: float | None = None,
    ) -> None:
        self.name = name
        self.body = body
        self.stop_event = stop
        self.on_death = on_death
        self.backoff, self.max_backoff, self.settle = backoff, max_backoff, settle
        self.clock = clock
        self.stall_after = stall_after
        self.last_beat = clock()
        self.deaths = 0
        self.last_error: str | None = None
        self.last_death: float | None = None
        self.running = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def beat(self) -> None:
        """The body made progress (see `stall_after`)."""
        self.last_beat = self.clock()

    def _loop(self) -> None:
        delay = self.backoff
        while not self.stop_event.is_set():
            started = self.last_beat = self.clock()
            self.running = True
            try:
                self.body()
                error = "returned without being stopped"
            except BaseException as exc:  # a thread must never die silently, whatever killed it
                error = f"{type(exc).__name__}: {exc}"[:300]
                if not self.stop_event.is_set():
                    log.error("thread %s died: %s", self.name, error, exc_info=exc)
            self.running = False
            if self.stop_event.is_set():
                return
            if self.clock() - started >= self.settle:
                delay = self.backoff  # it ran well for a while: a fresh death, a short wait
            self.deaths += 1
            self.last_error, self.last_death = error, self.clock()
            try:
                self.on_death(self.name)
            except Exception:  # the counter must not take the supervisor down with it
                log.exception("counting the death of thread %s failed", self.name)
            log.warning("restarting thread %s in %.0f s", self.name, delay)
            self.stop_event.wait(delay)
            delay = min(delay * 2, self.max_backoff)

    def problem(self) -> str | None:
        """Why this thread makes its component degraded now, or None."""
        if self._thread is None or self.stop_event.is_set():
            return None
        if not self._thread.is_alive():
            return f"thread {self.name} is gone"
        if self.running and self.stall_after is not None:
            quiet = self.clock() - self.last_beat
            if quiet > self.stall_after:
                return f"thread {self.name} has made no progress for {quiet:.0f} s (stuck)"
        if self.last_death is None:
            return None
        if not self.running:
            return f"thread {self.name} died ({self.last_error}); restarting"
        if self.clock() - self.last_death < self.settle:
            return (
                f"thread {self.name} restarted after dying {self.deaths} times ({self.last_error})"
            )
        return None


def problems(threads: Iterable[Supervised]) -> list[str]:
    return [p for t in threads if (p := t.problem()) is not None]
