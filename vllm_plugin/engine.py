"""Engine side of the oomguard plugin: admission cap, drain, resume and state inside EngineCore.

Registered as a `vllm.general_plugins` entry point, `register()` runs in every vLLM process
(API server, EngineCore, workers), possibly several times: it patches vLLM's classes once per
process and does nothing more.

What it adds:
- utility methods on EngineCore that the API server reaches through
  `engine_core.call_utility_async(name, *args)` (one call per engine with data parallelism):
  `oomguard_state`, `oomguard_set_admission_cap`, `oomguard_drain`, `oomguard_resume`;
- three counters on the scheduler (admitted, finished, preempted), kept by thin wrappers around
  `Scheduler.schedule` and `Scheduler._preempt_request`: a few integer additions per step.

The admission cap is `Scheduler.max_num_active_reqs`: lowering it stops new admissions until the
running count falls below it, without preempting or aborting anything. `max_num_running_reqs`
(the model runner's slot count) is never touched: vLLM asserts `running <= max_num_running_reqs`
every step, so lowering it below the running count would kill the engine.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from oomguard.engine_env import INITIAL_CAP_ENV

log = logging.getLogger("oomguard.vllm_plugin")

_PATCHED = "_oomguard_patched"


@dataclass
class Counters:
    admitted: int = 0
    finished: int = 0
    preemptions: int = 0
    cap_changed_at: float = field(default_factory=time.time)
    at_change: tuple[int, int, int] = (0, 0, 0)  # admitted, finished, preemptions

    def mark_cap_change(self) -> None:
        self.cap_changed_at = time.time()
        self.at_change = (self.admitted, self.finished, self.preemptions)


def counters(scheduler: Any) -> Counters:
    c = getattr(scheduler, "_oomguard_counters", None)
    if c is None:
        c = Counters()
        scheduler._oomguard_counters = c
        _initial_cap(scheduler)
    return c


def _initial_cap(scheduler: Any) -> None:
    """Start capped when the supervisor says so (after a crash or a restart for memory): the
    engine then comes back through staged re-admission, not at full admission."""
    raw = os.environ.get(INITIAL_CAP_ENV, "").strip()
    if not raw:
        return
    try:
        cap = int(raw)
    except ValueError:
        log.warning("oomguard: ignoring %s=%r (not an integer)", INITIAL_CAP_ENV, raw)
        return
    applied = max(1, min(cap, int(scheduler.max_num_running_reqs)))
    scheduler.max_num_active_reqs = applied
    log.info("oomguard: starting with admission cap %d (%s)", applied, INITIAL_CAP_ENV)


def _wrap_schedule(schedule: Any) -> Any:
    @functools.wraps(schedule)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = schedule(self, *args, **kwargs)
        try:
            c = counters(self)
            c.admitted += len(output.scheduled_new_reqs)
            c.finished += len(output.finished_req_ids)
        except Exception:  # counting must never break a step
            log.debug("oomguard: could not count a scheduler step", exc_info=True)
        return output

    wrapper._oomguard_wrapper = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_preempt(preempt: Any) -> Any:
    @functools.wraps(preempt)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = preempt(self, *args, **kwargs)
        counters(self).preemptions += 1
        return result

    wrapper._oomguard_wrapper = True  # type: ignore[attr-defined]
    return wrapper


# -- utility methods (run in the EngineCore process, `self` is the EngineCore) -------------------
def _paused(core: Any) -> bool:
    from vllm.v1.core.sched.interface import PauseState

    return core.scheduler.pause_state != PauseState.UNPAUSED


def _gpu_memory_utilization(core: Any) -> float | None:
    try:
        return float(core.vllm_config.cache_config.gpu_memory_utilization)
    except (AttributeError, TypeError, ValueError):
        return None


def oomguard_state(self: Any) -> dict[str, Any]:
    s = self.scheduler
    c = counters(s)
    running, waiting = s.get_request_counts()
    draining = _paused(self) or bool(getattr(self, "reject_new_requests", False))
    admitted0, finished0, preempted0 = c.at_change
    return {
        "engine": int(getattr(self, "engine_index", 0) or 0),
        "startup_max_num_seqs": int(s.max_num_running_reqs),
        "gpu_memory_utilization": _gpu_memory_utilization(self),
        "admission_cap": int(s.max_num_active_reqs),
        "mode": "draining" if draining else "serving",
        "drained": draining and running == 0,
        "running": int(running),
        "waiting": int(waiting),
        "kv_cache_usage": float(s.get_kv_cache_usage()),
        "admitted_total": c.admitted,
        "finished_total": c.finished,
        "preemptions_total": c.preemptions,
        "since_cap_change": {
            "seconds": round(time.time() - c.cap_changed_at, 3),
            "admitted": c.admitted - admitted0,
            "finished": c.finished - finished0,
            "preemptions": c.preemptions - preempted0,
        },
    }


def oomguard_set_admission_cap(self: Any, cap: int) -> dict[str, Any]:
    s = self.scheduler
    ceiling = int(s.max_num_running_reqs)
    applied = max(1, min(int(cap), ceiling))
    changed = applied != s.max_num_active_reqs
    if changed:
        s.max_num_active_reqs = applied
        counters(s).mark_cap_change()
        log.info(
            "oomguard: admission cap set to %d (requested %d, startup %d)", applied, cap, ceiling
        )
    return {
        "requested": int(cap),
        "admission_cap": applied,
        "clamped": applied != cap,
        "changed": changed,
        "state": oomguard_state(self),
    }


def oomguard_drain(self: Any) -> dict[str, Any]:
    from vllm.v1.core.sched.interface import PauseState

    if not _paused(self):
        log.info("oomguard: draining (queued requests wait, running ones finish)")
    # PAUSED_NEW: running requests and those holding KV blocks continue; queued ones wait.
    self.scheduler.set_pause_state(PauseState.PAUSED_NEW)
    if hasattr(self, "reject_new_requests"):
        # new requests that reach the engine finish with a retryable `engine_paused` error
        self.reject_new_requests = True
    return oomguard_state(self)


def oomguard_resume(self: Any) -> dict[str, Any]:
    from vllm.v1.core.sched.interface import PauseState

    if _paused(self):
        log.info("oomguard: resuming admissions")
    self.scheduler.set_pause_state(PauseState.UNPAUSED)
    if hasattr(self, "reject_new_requests"):
        self.reject_new_requests = False
    return oomguard_state(self)


UTILITIES = {
    "oomguard_state": oomguard_state,
    "oomguard_set_admission_cap": oomguard_set_admission_cap,
    "oomguard_drain": oomguard_drain,
    "oomguard_resume": oomguard_resume,
}


def register() -> None:
    """The `vllm.general_plugins` entry point. Idempotent: patches once per process."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # not a vLLM this plugin knows: stay out of the way
        log.warning("oomguard plugin: vLLM's V1 engine is not importable; plugin inactive")
        return
    if getattr(EngineCore, _PATCHED, False):
        return
    for name, fn in UTILITIES.items():
        setattr(EngineCore, name, fn)
    if not getattr(Scheduler.schedule, "_oomguard_wrapper", False):
        Scheduler.schedule = _wrap_schedule(Scheduler.schedule)  # type: ignore[method-assign]
    if not getattr(Scheduler._preempt_request, "_oomguard_wrapper", False):
        Scheduler._preempt_request = _wrap_preempt(Scheduler._preempt_request)  # type: ignore[method-assign]
    setattr(EngineCore, _PATCHED, True)
    from oomguard.vllm_plugin.allocator import install as install_allocator_publisher

    install_allocator_publisher()
    log.debug("oomguard plugin registered in this process")
