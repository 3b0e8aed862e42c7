"""Who used the CPU during a benchmark run: every process of the run's tree, by role.

On the 2-CPU machine the lab's engines are CPU-bound (the twin's compressed step is shorter than
vLLM's own CPU time per step), so a configuration's goodput moves with the CPU its other
processes take from the engine cores. A census over the replay records that share per role, so a
goodput gap between two configurations can be read against the CPU each one's engines got.

A process is sampled every `every` seconds while the census runs (psutil, as vLLM itself uses):
its CPU time is kept from the last sample before it exits (a crashed engine's CPU counts up to
then), a process started during the window counts from zero, and its role is the one it had at
its last sample (a restarted engine core is a multiprocessing child until it renames itself).
Figures are percent of one core over the window (200 is both CPUs of the 2-CPU machine).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psutil


def cpu_seconds(proc: psutil.Process) -> float:
    """User plus system CPU seconds the process has used so far."""
    t = proc.cpu_times()
    return float(t.user + t.system)


def engine_cores(cpu: dict[str, Any] | None) -> float | None:
    """The engine cores' share (percent of one core) in a census result; None where a run
    recorded none (runs from before the census)."""
    return (cpu or {}).get("percent_of_one_core", {}).get("engine_core")


def _command(cmdline: list[str], program: str) -> str | None:
    """The subcommand after `program` (its path or module name) in a command line, if any."""
    for i, arg in enumerate(cmdline):
        if arg in (program, f"{program}.cli") or arg.endswith(f"/{program}"):
            return cmdline[i + 1] if i + 1 < len(cmdline) else ""
    return None


def role(name: str, cmdline: list[str], runner: bool) -> str:
    """The role of a process from its name (comm) and command line; `runner`: the benchmark's
    own process (the load generator, the gateway, the exporter and the watcher run in it)."""
    if runner:
        return "runner"
    if name.startswith("VLLM::Engine") or (cmdline and cmdline[0].startswith("VLLM::Engine")):
        return "engine_core"  # vLLM renames its engine core process (setproctitle)
    oomguard = _command(cmdline, "oomguard")  # first: a supervisor's command line names vllm
    if oomguard is not None:
        return {"serve": "supervisor", "remediator": "remediator"}.get(oomguard, "oomguard")
    if _command(cmdline, "vllm") == "serve":
        return "api_server"
    if name in ("vllm-router", "nginx") or _command(cmdline, "vllm-router") is not None:
        return "router"
    return "other"


class Census:
    """CPU per role over a window: `with Census() as c: ...; c.result()`."""

    def __init__(self, root: int | None = None, every: float = 2.0) -> None:
        self.root = psutil.Process(root if root is not None else os.getpid())
        self.every = every
        self._first: dict[int, float] = {}  # CPU seconds when first seen (0: born in window)
        self._last: dict[int, tuple[str, float]] = {}  # (role, CPU seconds) at the last sample
        self._started_at = 0.0
        self._ended_at = 0.0
        self._machine0: Any = None
        self._machine1: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self, initial: bool = False) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = [self.root]
        for p in procs:
            try:
                with p.oneshot():
                    cpu = cpu_seconds(p)
                    # named again at every sample: vLLM's engine core starts as a
                    # multiprocessing child and renames itself once it runs
                    who = role(p.name(), p.cmdline(), p.pid == self.root.pid)
                    if p.pid not in self._last:
                        self._first[p.pid] = cpu if initial else 0.0
            except psutil.Error:  # gone between listing and reading: its last sample stands
                continue
            self._last[p.pid] = (who, cpu)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> Census:
        self._machine0 = psutil.cpu_times()
        self._started_at = time.monotonic()
        self._sample(initial=True)
        self._thread = threading.Thread(target=self._run, name="cpu-census", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self._ended_at = time.monotonic()
        self._machine1 = psutil.cpu_times()

    def result(self) -> dict[str, Any]:
        """Percent of one core per role over the window, the run's total, and how busy the
        whole machine was (percent of all its CPUs; other work on the machine counts there)."""
        window = max(self._ended_at - self._started_at, 1e-9)
        roles: dict[str, float] = {}
        for pid, (who, cpu) in self._last.items():
            roles[who] = roles.get(who, 0.0) + max(0.0, cpu - self._first.get(pid, 0.0))
        percent = {k: round(v / window * 100, 1) for k, v in sorted(roles.items())}
        m0, m1 = self._machine0, self._machine1
        busy = None
        if m0 is not None and m1 is not None:
            total = sum(m1) - sum(m0)
            idle = (m1.idle + getattr(m1, "iowait", 0.0)) - (m0.idle + getattr(m0, "iowait", 0.0))
            busy = round((1 - idle / total) * 100, 1) if total > 0 else None
        return {
            "window_s": round(window, 1),
            "percent_of_one_core": percent,
            "run_total_percent": round(sum(roles.values()) / window * 100, 1),
            "machine_busy_percent_of_all_cpus": busy,
            "cpus": psutil.cpu_count(),
        }
