"""`oomguard serve -- vllm serve ...`: run vLLM as a child, restart it with adjusted flags.

The local backend of the restart actuator, for single boxes, the demo and the twin:
- starts `vllm serve` with the flags persisted in `<state-dir>/flags.json` (so a changed
  `--gpu-memory-utilization` / `--max-num-seqs` survives every restart, of vLLM and of this);
- restarts it on request (`POST /v1/restart`): stop gracefully (SIGTERM to its process group,
  SIGKILL after a deadline), start with the new flags and, when asked, an initial admission cap;
- records why the child exited (CUDA out-of-memory from its output, another CUDA error, killed
  by a signal, exit code) and writes an exit incident record next to the plugin's OOM records
  (`exit-<pid>-<generation>.json`, schema `oomguard.exit_incident.v1`: reason, code, signal,
  flags, the log's last lines, the OOM records the child wrote, the cgroup's `oom_kill` count
  at the child's start and exit: a host OOM, taxonomy type 5); a child that dies on its own
  comes back after `restart_delay`: after a CUDA OOM with flags one step lower and capped at
  the first re-admission stage, never at full admission;
- crashloop guard: after `max_crashes` within `crash_window_seconds` it stops restarting and
  reports `gave_up` until an operator (or the remediator) asks for a restart;
- restart rate limit: at most `max_restarts` requested restarts within `restart_window_seconds`
  (each one drops the KV cache and reloads the model); beyond it the API answers 429 with
  Retry-After. The restarts are recorded in `<state-dir>/restarts.json` before they happen, so
  the limit holds across restarts of `oomguard serve` itself;
- state that cannot be written (a full state directory) is never reported as in force: a
  requested restart whose record or new flags cannot be saved is refused (503, nothing
  restarted, the old flags reported and running); a state file whose content cannot be used is
  moved aside (`.bad`) and reported, never a reason not to start;
- vLLM gets SIGTERM when this process dies, however it dies (children.py): a vLLM left
  behind would hold the GPU and the port its successor needs;
- vLLM's output is read by a supervised thread (supervised.py) that never stops draining the
  pipe: a full disk drops log lines (counted), a death of the thread restarts it. Either makes
  /healthz answer 503 `degraded`, and GET /metrics counts it.

HTTP API (bearer token): GET /v1/status, POST /v1/restart; GET /healthz and GET /metrics (no
token).
POST /v1/restart body, checked strictly after authentication (400 names the field):
  {"flags": {"gpu_memory_utilization": <number>, "max_num_seqs": <integer>} | null,
   "initial_cap": <integer> | null, "reason": <string> | null}
No coercion: `true`, `2.9` or `"0.85"` where an integer or a number belongs is a 400. An
`initial_cap` outside 1..max_num_seqs is clamped (the answer says what was applied).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from oomguard import children
from oomguard.catalog import spec
from oomguard.digits import decimal
from oomguard.engine_env import INITIAL_CAP_ENV
from oomguard.errors import ConfigError
from oomguard.incident_records import (
    EXIT_SCHEMA,
    MAX_TEXT,
    CgroupKills,
    ExitRecord,
    exit_file_name,
)
from oomguard.remediator import clocks, httpserve, statefile
from oomguard.remediator.auth import Authenticator
from oomguard.remediator.config import AuthConfig
from oomguard.remediator.flags import (
    SEQS,
    FlagLimits,
    Flags,
    FlagState,
    FlagStore,
    apply,
    read,
)
from oomguard.remediator.logfile import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, RotatingLog
from oomguard.supervised import Supervised

log = logging.getLogger("oomguard.supervisor")

OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUDA error: out of memory")
# CUDA faults that are not out-of-memory (taxonomy type 6), some of them reported as if they were
CUDA_ERROR_MARKERS = (
    "CUDA error:",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "NCCL error",
    "Xid",
    "illegal memory access",
)
# "ValueError: ..." and "(EngineCore pid=7) ERROR ... [core.py:1584] ValueError: ...": the root
# cause vLLM logs scrolls out of the last 40 lines behind the API server's own traceback
EXCEPTION_LINE = re.compile(r"(?:^|\]\s)[\w.]*(?:Error|Exception): ")
MAX_BODY_BYTES = 16 * 1024


class RestartFlags(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu_memory_utilization: StrictFloat | StrictInt
    max_num_seqs: StrictInt

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return float(value)


class RestartRequest(BaseModel):
    """What POST /v1/restart accepts: strict types, nothing coerced, unknown fields refused."""

    model_config = ConfigDict(extra="forbid")
    flags: RestartFlags | None = None
    initial_cap: StrictInt | None = None
    reason: StrictStr | None = Field(None, max_length=500)


class RateLimited(Exception):
    def __init__(self, retry_after: float) -> None:
        super().__init__(f"restart rate limit reached; retry in {retry_after:.0f} s")
        self.retry_after = retry_after


class StateUnavailable(Exception):
    """The state directory cannot take a record the restart needs: nothing was restarted."""


class ChildStuck(Exception):
    """The old vLLM did not exit after SIGKILL (uninterruptible, most often in the GPU driver):
    no new one is started beside it, where it would find the GPU memory and the port taken."""


KILL_WAIT_SECONDS = 30.0  # after SIGKILL; a process in the GPU driver can take a while to go


class RestartBudget:
    """Requested restarts within the window, on the monotonic clock, recorded in a state file
    (restarts.json) before each restart, so the limit survives a restart of this process. A
    recorded restart whose age cannot be told (dated in the future: the clock stepped back)
    counts for the whole window: the limit errs on the side of fewer restarts."""

    def __init__(
        self,
        path: Path,
        max_restarts: int,
        window: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.max_restarts, self.window, self.clock = path, max_restarts, window, clock
        self.times: deque[float] = deque()
        self.problem: str | None = None
        data, self.problem = statefile.read(path)
        records = data.get("restarts") if isinstance(data, dict) else None
        if data is not None and not isinstance(records, list):
            self.problem = statefile.set_aside(path, f"{path}: no list of restarts")
            records = []
        now = clock()
        ages = []
        for record in records or []:
            age = clocks.age(record) if isinstance(record, dict) else 0.0
            ages.append(0.0 if age is None else age)  # unknown: as if it were now
        for age in sorted(a for a in ages if a < window)[: max_restarts * 2][::-1]:
            self.times.append(now - age)

    def admit(self) -> None:
        """Record one more restart (durably), or raise RateLimited when `max_restarts` happened
        within the window, or StateUnavailable when the record cannot be written."""
        now = self.clock()
        while self.times and now - self.times[0] >= self.window:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            raise RateLimited(self.window - (now - self.times[0]))
        self.times.append(now)
        stamp = statefile.now_stamp()
        records = []
        for t in self.times:
            age = now - t
            record = {**stamp, "time": stamp["time"] - age}
            if "uptime" in record:
                record["uptime"] = round(stamp["uptime"] - age, 6)
            records.append(record)
        try:
            statefile.write(self.path, {"restarts": records})
        except OSError as exc:
            self.times.pop()
            raise StateUnavailable(
                f"cannot record the restart in {self.path}: {exc.strerror or exc}"
            ) from exc


@dataclass
class _Generation:
    """One child and what its reader knows of it (kept across a restart of the reader)."""

    child: subprocess.Popen[bytes]
    generation: int
    log: RotatingLog
    oom_line_seen: bool = False
    exit_handled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Exit:
    time: float
    generation: int
    returncode: int
    reason: str  # cuda_oom | cuda_error | killed | exited | requested
    flags: dict[str, Any]


def classify(returncode: int, tail: list[str], *, oom_seen: bool = False) -> str:
    """Why the child exited. `oom_seen`: an OOM line anywhere in this generation's output or an
    OOM record from its observer; under load the failed requests' tracebacks that follow the
    OOM push its line out of the tail."""
    if oom_seen or any(marker in line for line in tail for marker in OOM_MARKERS):
        return "cuda_oom"
    if any(marker in line for line in tail for marker in CUDA_ERROR_MARKERS):
        return "cuda_error"
    if returncode < 0 or returncode in (137, 143):
        return "killed"  # SIGKILL with no traceback: the host OOM killer, most often
    return "exited"


def incident_dir(env: dict[str, str], state_dir: Path) -> str:
    """Where the child's OOM observer writes (its environment), else the state directory."""
    merged = {**os.environ, **env}
    if merged.get("OOMGUARD_INCIDENT_DIR"):
        return merged["OOMGUARD_INCIDENT_DIR"]
    if merged.get("OOMGUARD_ALLOCATOR_DIR"):
        return str(Path(merged["OOMGUARD_ALLOCATOR_DIR"]) / "incidents")
    return str(state_dir / "incidents")


def own_cgroup_dir(proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's memory cgroup directory (the child inherits it), or None."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # cgroup v2
            return "/sys/fs/cgroup" + path.rstrip("/")
        if "memory" in controllers.split(","):  # cgroup v1 memory controller
            return "/sys/fs/cgroup/memory" + path.rstrip("/")
    return None


def cgroup_oom_kills(cgroup_dir: str | None) -> int | None:
    """The kernel's OOM-kill count of a cgroup (v2 memory.events, v1 memory.oom_control)."""
    if not cgroup_dir:
        return None
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (Path(cgroup_dir) / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split()
            count = decimal(parts[1]) if len(parts) == 2 and parts[0] == "oom_kill" else None
            if count is not None:
                return count
    return None


def _port(argv: list[str]) -> tuple[str, int]:
    host, port = "127.0.0.1", 8000
    for i, arg in enumerate(argv[:-1]):
        if arg == "--port":
            port = int(argv[i + 1])
        elif arg == "--host" and argv[i + 1] not in ("0.0.0.0", "::", ""):
            host = argv[i + 1]
    return host, port


class Supervisor:
    def __init__(
        self,
        argv: list[str],
        state_dir: Path,
        limits: FlagLimits | None = None,
        max_crashes: int = 5,
        crash_window_seconds: float = 600.0,
        restart_delay: float = 5.0,
        stop_timeout: float = 60.0,
        readmit_start: int = 1,
        env: dict[str, str] | None = None,
        adjust_on_crash: bool = True,
        max_restarts: int = 6,
        restart_window_seconds: float = 600.0,
        cgroup_dir: str | None = None,
        log_max_bytes: int = DEFAULT_MAX_BYTES,
        log_backups: int = DEFAULT_BACKUPS,
    ) -> None:
        if not argv:
            raise ConfigError("nothing to run: give the vLLM command after --")
        if not any(a == SEQS or a.startswith(SEQS + "=") for a in argv):
            raise ConfigError(f"the vLLM command line must set {SEQS} (oomguard steps it)")
        self.argv = argv
        self.limits = limits or FlagLimits()
        self.store = FlagStore(state_dir / "flags.json")
        self.flags = self.store.load(read(argv, 0))
        self.budget = RestartBudget(
            state_dir / "restarts.json", max_restarts, restart_window_seconds
        )
        # what could not be read or written (a full state directory): /healthz degrades on it
        self.state_problems = [p for p in (self.store.problem, self.budget.problem) if p]
        self.flags_persisted = True
        self.thread_restarts: Counter[str] = Counter({"log-reader": 0})
        self._reader: Supervised | None = None
        self._log: RotatingLog | None = None
        self.log_dropped = 0  # lines of earlier generations' logs lost to failed writes
        self.state_write_errors = 0
        self.log_path = state_dir / "vllm.log"  # rotated by size (logfile.py)
        self.log_max_bytes, self.log_backups = log_max_bytes, log_backups
        self.max_crashes, self.window = max_crashes, crash_window_seconds
        self.restart_delay, self.stop_timeout = restart_delay, stop_timeout
        self.readmit_start = readmit_start
        self.adjust_on_crash = adjust_on_crash  # False: a plain restart policy (baselines)
        self.max_restarts, self.restart_window = max_restarts, restart_window_seconds
        self.env = env or {}
        self.host, self.port = _port(argv)
        self.exits: deque[Exit] = deque(maxlen=50)
        self.generation = 0
        self.gave_up = False
        self.child: subprocess.Popen[bytes] | None = None
        self.initial_cap: int | None = None
        self._tail: deque[str] = deque(maxlen=200)
        self._started_at = 0.0
        self.incident_dir = incident_dir(self.env, state_dir)
        self.cgroup_dir = cgroup_dir or own_cgroup_dir()
        self._oom_kills_at_start: int | None = None
        self._lock = threading.RLock()
        self._stopping = False
        # One client for vLLM's /health, read at every /v1/status: building a client (its SSL
        # context) costs ~20 ms of CPU, and the remediator, `oomguard status` or a dashboard may
        # read the status several times a second. vLLM is this process's own child on its own
        # host: no proxy from the environment applies.
        self._http = httpx.Client(timeout=2, trust_env=False)

    # -- the child -----------------------------------------------------------------------------
    def command(self) -> list[str]:
        return apply(self.argv, self.flags.current)

    def start(self, initial_cap: int | None = None) -> None:
        with self._lock:
            self.generation += 1
            self.initial_cap = initial_cap
            env = {**os.environ, **self.env}
            env.pop(INITIAL_CAP_ENV, None)
            if initial_cap is not None:
                env[INITIAL_CAP_ENV] = str(initial_cap)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._tail.clear()
            self._started_at = time.time()
            self._oom_kills_at_start = cgroup_oom_kills(self.cgroup_dir)
            # SIGTERM when this supervisor dies, even by SIGKILL (children.py): a vLLM left
            # behind holds the GPU and the port the next supervisor's vLLM needs
            self.child = children.popen(
                self.command(),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.info(
                "started vLLM (generation %d, pid %d): %s",
                self.generation,
                self.child.pid,
                " ".join(self.command()),
            )
            if self._log is not None:
                self.log_dropped += self._log.dropped
            self._log = RotatingLog(self.log_path, self.log_max_bytes, self.log_backups)
            gen = _Generation(self.child, self.generation, self._log)
            # the reader of this generation's output: supervised, so that vLLM's pipe is
            # drained whatever happens to one line (supervised.py); done when the exit is handled
            self._reader = Supervised(
                "log-reader", functools.partial(self._watch, gen), gen.done, self._died
            )
            self._reader.start()

    def _died(self, thread: str) -> None:
        self.thread_restarts[thread] += 1

    def _watch(self, gen: _Generation) -> None:
        """Copy the child's output to the log until it ends, then handle its exit. Entered
        again after a death (supervised): reading goes on where it stopped, an exit already
        handled is not handled twice."""
        child = gen.child
        assert child.stdout is not None
        for line in child.stdout:
            gen.log.write(line)  # never raises: a full disk drops the line (logfile.py)
            text = line.decode(errors="replace")
            self._tail.append(text)
            gen.oom_line_seen = gen.oom_line_seen or any(m in text for m in OOM_MARKERS)
        gen.log.close()
        if not gen.exit_handled:
            gen.exit_handled = True
            self._exited(gen)
        gen.done.set()

    def _exited(self, gen: _Generation) -> None:
        child, generation = gen.child, gen.generation
        code = child.wait()
        with self._lock:
            # a child we stopped: restart() started the next generation under this lock, or
            # stop() is shutting everything down
            if generation != self.generation or self._stopping:
                return
            oom_seen = gen.oom_line_seen or bool(self._oom_records_since_start())
            reason = classify(code, list(self._tail), oom_seen=oom_seen)
            self._record(code, reason)
            self._write_exit_incident(child.pid, code, reason)
            log.error("vLLM exited (code %d, %s)", code, reason)
            crashes = [e for e in self.exits if e.reason != "requested"]
            recent = [e for e in crashes if time.time() - e.time < self.window]
            if len(recent) >= self.max_crashes:
                self.gave_up = True
                log.error(
                    "crashloop guard: %d crashes in %.0f s; not restarting until asked",
                    len(recent),
                    self.window,
                )
                return
            if reason == "cuda_oom" and self.adjust_on_crash:
                lowered = self._with(
                    self.flags.current.lower(self.limits), "crashed with a CUDA out-of-memory error"
                )
                # in force at the next start either way: it comes back lower, saved or not
                self.flags = lowered
                self._save_flags(lowered)
        time.sleep(self.restart_delay)  # a model reload in real life; never a tight loop
        with self._lock:
            if generation == self.generation and not self._stopping:
                # after a crash, come back through staged re-admission
                try:
                    self.start(initial_cap=self.readmit_start if self.adjust_on_crash else None)
                except OSError as exc:  # cannot even start it: an operator has to look
                    self.gave_up = True
                    self.state_problems.append(f"cannot start vLLM: {exc}")
                    log.error("cannot start vLLM again: %s; not restarting until asked", exc)

    def _with(self, flags: Flags, reason: str) -> FlagState:
        """The flag state with `flags` in force (a copy: the current one is kept until the new
        one is saved, or deliberately put in force)."""
        state = replace(self.flags, history=list(self.flags.history))
        state.set(flags, reason)
        return state

    def _save_flags(self, state: FlagState) -> bool:
        try:
            self.store.save(state)
        except OSError as exc:
            self.state_write_errors += 1
            self.flags_persisted = False
            log.error("cannot save the flags to %s: %s", self.store.path, exc)
            return False
        self.flags_persisted = True
        return True

    def _record(self, code: int, reason: str) -> None:
        self.exits.append(
            Exit(time.time(), self.generation, code, reason, asdict(self.flags.current))
        )

    def _oom_records_since_start(self) -> list[str]:
        """The OOM observer's records written since this generation started (never raises)."""
        try:
            return sorted(
                p.name
                for p in Path(self.incident_dir).glob("oom-*.json")
                if p.is_file() and p.stat().st_mtime >= self._started_at - 1
            )
        except OSError:
            return []

    def _write_exit_incident(self, pid: int, code: int, reason: str) -> None:
        """An exit record beside the OOM records the child's observer wrote (never raises)."""
        try:
            since = self._started_at
            directory = Path(self.incident_dir)
            oom_records = self._oom_records_since_start()
            record = ExitRecord(
                schema=EXIT_SCHEMA,
                timestamp=time.time(),
                started_at=since,
                pid=pid,
                target={**os.environ, **self.env}.get("OOMGUARD_TARGET", "")[:MAX_TEXT],
                generation=self.generation,
                returncode=code,
                signal=-code if code < 0 else (code - 128 if code > 128 else None),
                reason=reason,
                flags=asdict(self.flags.current),
                oom_records=oom_records[-256:],  # the model holds at most 256
                cgroup=CgroupKills(
                    dir=self.cgroup_dir,
                    oom_kills_at_start=self._oom_kills_at_start,
                    oom_kills_at_exit=cgroup_oom_kills(self.cgroup_dir),
                ),
                log_tail=[line.rstrip()[:500] for line in list(self._tail)[-40:]],
                exception_lines=[
                    line.rstrip()[:500] for line in self._tail if EXCEPTION_LINE.search(line)
                ][-20:],
            )
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / exit_file_name(pid, self.generation)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(record.dump())
            os.replace(tmp, path)
        except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
            log.warning("could not write the exit incident record", exc_info=True)

    def _stop_child(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        children.signal_group(child.pid, signal.SIGTERM)
        try:
            child.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            log.warning("vLLM did not stop in %.0f s: SIGKILL", self.stop_timeout)
            children.signal_group(child.pid, signal.SIGKILL)
            try:
                child.wait(KILL_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                raise ChildStuck(
                    f"vLLM (pid {child.pid}) still runs {KILL_WAIT_SECONDS:.0f} s after SIGKILL "
                    "(uninterruptible: the GPU driver?); nothing new started"
                ) from None

    def clamp_cap(self, initial_cap: int | None, flags: Flags | None) -> int | None:
        """An initial cap within 1..max_num_seqs of the flags the child will start with."""
        if initial_cap is None:
            return None
        ceiling = (flags or self.flags.current).max_num_seqs
        return max(1, min(initial_cap, ceiling))

    def restart(self, flags: Flags | None, initial_cap: int | None, reason: str) -> int:
        """Stop the child and start it with `flags`. The restart is recorded (the rate limit)
        and the flags saved first; only then is anything changed. Returns the generation.

        Raises ValueError for flags outside the limits, RateLimited beyond the restart budget,
        ChildStuck when the old vLLM outlives SIGKILL (nothing new started; the monitor takes
        its exit as any other once it goes),
        StateUnavailable when the state directory cannot take the records (nothing restarted,
        the old flags in force and reported).
        """
        with self._lock:
            if flags is not None:
                self._check(flags)
            try:
                self.budget.admit()
            except StateUnavailable:
                self.state_write_errors += 1
                raise
            initial_cap = self.clamp_cap(initial_cap, flags)
            if flags is not None and flags != self.flags.current:
                state = self._with(flags, reason)
                if not self._save_flags(state):
                    raise StateUnavailable(
                        f"cannot save the new flags to {self.store.path}: nothing restarted"
                    )
                self.flags = state
            self._stop_child()
            if self.child is not None:
                self._record(self.child.returncode or 0, "requested")
            self.gave_up = False
            self.start(initial_cap)
            return self.generation

    def _check(self, flags: Flags) -> None:
        o, lim = self.flags.original, self.limits
        if not lim.gmu_floor <= flags.gpu_memory_utilization <= o.gpu_memory_utilization:
            raise ValueError(
                f"gpu_memory_utilization {flags.gpu_memory_utilization} outside "
                f"[{lim.gmu_floor}, {o.gpu_memory_utilization}]"
            )
        if not lim.seqs_floor <= flags.max_num_seqs <= o.max_num_seqs:
            raise ValueError(
                f"max_num_seqs {flags.max_num_seqs} outside [{lim.seqs_floor}, {o.max_num_seqs}]"
            )

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            try:
                self._stop_child()
            except ChildStuck as exc:  # shutting down all the same: say what is left behind
                log.error("%s", exc)
            finally:
                self._http.close()

    def ready(self) -> bool:
        child = self.child
        if child is None or child.poll() is not None:
            return False
        try:
            r = self._http.get(f"http://{self.host}:{self.port}/health")
        except (httpx.HTTPError, RuntimeError):  # RuntimeError: the client closed at stop()
            return False
        return r.status_code == 200

    def status(self) -> dict[str, Any]:
        child = self.child
        running = child is not None and child.poll() is None
        return {
            "generation": self.generation,
            "running": running,
            "pid": child.pid if running and child else None,
            "ready": self.ready(),
            "initial_cap": self.initial_cap,
            "gave_up": self.gave_up,
            "flags": {
                "original": asdict(self.flags.original),
                "current": asdict(self.flags.current),
                "changed_at": self.flags.changed_at,
                "history": self.flags.history[-10:],
                "persisted": self.flags_persisted,
            },
            "exits": [asdict(e) for e in self.exits],
            "command": self.command(),
            "log": {"path": str(self.log_path), "dropped_lines": self.dropped_lines()},
            "problems": self.problems(),
        }

    def dropped_lines(self) -> int:
        return self.log_dropped + (self._log.dropped if self._log is not None else 0)

    def problems(self) -> list[str]:
        """What makes `oomguard serve` degraded now (/healthz): its reader, its files."""
        out = list(self.state_problems)
        if not self.flags_persisted:
            out.append(f"the flags in force are not saved in {self.store.path}")
        if self._reader is not None and (problem := self._reader.problem()):
            out.append(problem)
        current = self._log
        if current is not None and current.failing:
            out.append(f"vLLM's log {self.log_path} cannot be written: lines are dropped")
        return out


class BadBody(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


async def read_restart_request(request: Request) -> RestartRequest:
    """The restart body, bounded in size and depth, validated strictly (BadBody names why)."""
    raw = b""
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise BadBody(f"body larger than {MAX_BODY_BYTES} bytes", 413)
    except ClientDisconnect:  # gone, or cut for sending too slowly (httpserve.py)
        raise BadBody("the client went away before its body arrived") from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BadBody("body is nested too deeply") from None
    except ValueError as exc:  # not JSON, bad UTF-8, an integer beyond the digit limit
        raise BadBody(f"not valid JSON: {exc}") from None
    try:
        return RestartRequest.model_validate(data)
    except ValidationError as exc:
        raise BadBody(
            "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
            )
        ) from None


def create_app(sup: Supervisor, auth: AuthConfig) -> Starlette:
    authn = Authenticator(auth)

    def allowed(request: Request) -> bool:
        return authn.allows(request.headers.get("authorization", ""))

    def denied() -> JSONResponse:
        return JSONResponse(
            {"error": "missing or wrong bearer token"}, 401, headers={"WWW-Authenticate": "Bearer"}
        )

    async def status(request: Request) -> Response:
        if not allowed(request):
            return denied()
        # in a thread: its health check waits up to 2 s on a busy vLLM, and meanwhile the
        # event loop must answer /healthz and a restart
        return JSONResponse(await run_in_threadpool(sup.status))

    async def restart(request: Request) -> Response:
        if not allowed(request):  # before the body: strangers learn nothing of its schema
            return denied()
        try:
            body = await read_restart_request(request)
        except BadBody as exc:
            return JSONResponse({"error": f"bad restart request: {exc}"}, exc.status)
        flags = (
            Flags(body.flags.gpu_memory_utilization, body.flags.max_num_seqs)
            if body.flags is not None
            else None
        )
        reason = body.reason or "requested over the API"
        try:
            generation = await run_in_threadpool(sup.restart, flags, body.initial_cap, reason)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, 400)
        except RateLimited as exc:
            return JSONResponse(
                {"error": str(exc)}, 429, headers={"Retry-After": str(math.ceil(exc.retry_after))}
            )
        except StateUnavailable as exc:
            return JSONResponse(
                {"error": f"state directory unavailable, nothing restarted: {exc}"},
                503,
                headers={"Retry-After": "30"},
            )
        except ChildStuck as exc:
            return JSONResponse({"error": str(exc)}, 503, headers={"Retry-After": "30"})
        return JSONResponse(
            {
                "generation": generation,
                "initial_cap": sup.initial_cap,
                "flags": asdict(sup.flags.current),
            },
            202,
        )

    async def healthz(_: Request) -> Response:
        problems = sup.problems()
        if problems:
            return JSONResponse({"status": "degraded", "problems": problems}, 503)
        return JSONResponse({"status": "ok", "problems": []})

    async def metrics(_: Request) -> Response:
        return Response(metrics_text(sup), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(
        routes=[
            Route("/v1/status", status, methods=["GET"]),
            Route("/v1/restart", restart, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


def metrics_text(sup: Supervisor) -> bytes:
    """The supervisor's own series (catalog names, component `supervisor`)."""
    lines: list[str] = []

    def family(name: str, kind: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {spec(name).help}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    family(
        "oomguard_supervisor_thread_restarts_total",
        "counter",
        [(f'{{thread="{t}"}}', n) for t, n in sorted(sup.thread_restarts.items())],
    )
    family("oomguard_supervisor_log_dropped_lines_total", "counter", [("", sup.dropped_lines())])
    family(
        "oomguard_supervisor_state_write_errors_total", "counter", [("", sup.state_write_errors)]
    )
    return ("\n".join(lines) + "\n").encode()


def serve(sup: Supervisor, listen: str, auth: AuthConfig) -> int:
    host, _, port = listen.rpartition(":")
    sup.start()
    try:
        httpserve.run(create_app(sup, auth), host or "127.0.0.1", int(port))
    finally:
        sup.stop()  # vLLM runs in its own session: stop it, or it outlives us
    return 0
