"""Child processes that die with their parent.

Every long-lived process oomguard starts (vLLM under `oomguard serve`; vLLM, Prometheus,
Alertmanager, the remediator and `oomguard serve` under `oomguard demo` and the tests) runs in a
session of its own, so that it can be stopped as a group and a terminal's Ctrl-C does not reach
it twice. A session of its own also means nothing stops it when its parent is killed: a demo or a
test run ended with SIGKILL (a CI timeout, the OOM killer) left five `oomguard serve` and their
vLLMs running per run, 2.5 GB each, and a supervisor killed that way left a vLLM holding the GPU
and the port its successor needs.

`popen` starts the child with Linux's parent-death signal (prctl PR_SET_PDEATHSIG): when the
parent dies, however it dies, the kernel sends the child `death_signal`. SIGTERM by default, not
SIGKILL: vLLM stops its EngineCore process on SIGTERM, while a vLLM API server killed with
SIGKILL leaves its EngineCore running forever (measured on vLLM 0.33: reparented to init, 560 MB).

The kernel sends the signal when the *thread* that forked the child ends, not the process. A
child started from a short-lived thread (the demo starts its vLLMs in parallel threads; the
supervisor starts the next vLLM from the log reader of the one that crashed) would be killed the
moment that thread returns. Every child is therefore forked by one long-lived daemon thread of
this module, which ends only with the process.

Elsewhere than Linux, `popen` is `subprocess.Popen` (no parent-death signal).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl  # type: ignore[no-any-return]


_PRCTL = _load_prctl()
SUPPORTED = _PRCTL is not None


def _in_child(parent: int, death_signal: int, then: Callable[[], Any] | None) -> Callable[[], None]:
    """What runs in the child between fork and exec: ask for `death_signal` when the parent
    dies, and take it at once if the parent died before the request took effect."""

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
            if os.getppid() != parent:  # orphaned already: the signal will never come
                os._exit(128 + death_signal)
        if then is not None:
            then()

    return preexec


class _Spawner:
    """The one thread that forks every child (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def _run(self) -> None:
        while True:
            job, done = self._jobs.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(job())
            except BaseException as exc:  # handed to the caller, in its own thread
                done.set_exception(exc)

    def submit(self, job: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None or self._pid != os.getpid():  # first use, or after a fork
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._run, name="oomguard-children", daemon=True
                )
                self._thread.start()
                self._pid = os.getpid()
        done: Future[Any] = Future()
        self._jobs.put((job, done))
        return done.result()


_SPAWNER = _Spawner()


def popen(
    argv: list[str], *, death_signal: int = signal.SIGTERM, **kwargs: Any
) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, **kwargs)` whose child gets `death_signal` when this process
    dies (Linux). A `preexec_fn` in `kwargs` still runs, after the request."""
    if _PRCTL is None:
        return subprocess.Popen(argv, **kwargs)
    then = kwargs.pop("preexec_fn", None)

    def start() -> subprocess.Popen[Any]:
        preexec = _in_child(os.getpid(), int(death_signal), then)
        return subprocess.Popen(argv, preexec_fn=preexec, **kwargs)

    proc: subprocess.Popen[Any] = _SPAWNER.submit(start)
    return proc


def signal_group(leader_pid: int, sig: int) -> bool:
    """Send `sig` to the process group a child started with `start_new_session=True` leads
    (its id is the child's pid). False when the group is gone. The group id is taken from the
    pid, not from `os.getpgid`: the leader may be reaped by another thread between a `poll()`
    and the signal (getpgid then raises), while its own children, vLLM's EngineCore among
    them, still hold the group and must still get the signal."""
    try:
        os.killpg(leader_pid, sig)
    except ProcessLookupError:
        return False
    return True
