"""Fault injection for the write-ahead tests: die by SIGKILL at a named point of an action.

`OOMGUARD_CRASH_AT=<point>[:<n>]` in the remediator's environment kills the process with a real
SIGKILL (as kill -9 or the OOM killer would) the n-th time (default: the first) it reaches
<point>. The points of one action, in order:

  before_intent   decided, nothing recorded yet
  after_intent    the intent is durable; the engine has not been called
  after_engine    the engine answered; the commit is not recorded yet
  after_commit    the commit is durable

A restart calls the engine from its own thread (restarting.py): at its after_engine and
after_commit the sequence has started, and may or may not have reached the engine yet.

Unset (always, in production) a point costs one comparison.
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = ("before_intent", "after_intent", "after_engine", "after_commit")

_spec = os.environ.get("OOMGUARD_CRASH_AT", "")
_point, _, _nth = _spec.partition(":")
_left = int(_nth) if _nth.isdigit() and int(_nth) > 0 else 1
_lock = threading.Lock()


def reach(point: str) -> None:
    """Called at each crash point; kills the process here when told to."""
    global _left
    if point != _point:
        return
    with _lock:
        _left -= 1
        if _left > 0:
            return
    os.kill(os.getpid(), signal.SIGKILL)
