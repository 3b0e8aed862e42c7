"""Engine side of the oomguard plugin: admission cap, drain, resume and state inside EngineCore.

Registered as a `vllm.general_plugins` entry point, `register()` runs in every vLLM process
(API server, EngineCore, workers), possibly several times: it patches vLLM's classes once per
process and does nothing more.

What it adds:
- utility methods on EngineCore that the API server reaches through
  `engine_core.call_utility_async(name, *args)` (one call per engine with data parallelism):
  `oomguard_state`, `oomguard_set_admission_cap`, `oomguard_drain`, `oomguard_resume`;
- counters on the scheduler (admitted, finished, preempted, shed), kept by thin wrappers around
  `Scheduler.schedule` and `Scheduler._preempt_request`: a few integer additions per step;
- drain that moves queued work: requests waiting without KV blocks (no prefill yet, or preempted
  back to the queue) end at once with vLLM's retryable request error, which the API server
  answers 503, so a gateway re-sends them to a peer. Running requests finish. A thin wrapper
  around `Scheduler.update_from_output` sheds what a preemption puts back in the queue while
  draining (under `PAUSED_NEW` it would wait for good). `drained` means running 0 and waiting 0:
  a restart then drops nothing.

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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomguard import vllm_seam as vllm
from oomguard.contract import DRAINING, INITIAL_CAP_ENV
from oomguard.engine_state import EngineCoreState, SinceCapChange
from oomguard.vllm_plugin import oom

if TYPE_CHECKING:
    from oomguard.vllm_plugin.step_guard import StepGuard

log = logging.getLogger("oomguard.vllm_plugin")

_PATCHED = "_oomguard_patched"


@dataclass
class Counters:
    admitted: int = 0
    finished: int = 0
    preemptions: int = 0
    shed: int = 0  # queued requests ended with a retryable error by a drain
    prefilled: int = 0  # requests whose prompt was fully computed (a re-admission's clean count)
    cap_changed_at: float = field(default_factory=time.time)
    at_change: tuple[int, int, int, int] = (0, 0, 0, 0)  # admitted, finished, preempted, prefilled

    def mark_cap_change(self) -> None:
        self.cap_changed_at = time.time()
        self.at_change = (self.admitted, self.finished, self.preemptions, self.prefilled)


def counters(scheduler: Any) -> Counters:
    c = getattr(scheduler, "_oomguard_counters", None)
    if c is None:
        c = Counters()
        scheduler._oomguard_counters = c
        # the startup active limit, before anything lowers it: `--max-num-active-seqs` when set
        # (vLLM keeps it in max_num_active_reqs), else max_num_seqs
        scheduler._oomguard_ceiling = min(
            int(scheduler.max_num_active_reqs), int(scheduler.max_num_running_reqs)
        )
        _initial_cap(scheduler)
    return c


def ceiling(scheduler: Any) -> int:
    """The highest admission cap: the engine's startup active limit, never above it."""
    counters(scheduler)
    return int(scheduler._oomguard_ceiling)


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
    applied = max(1, min(cap, int(scheduler._oomguard_ceiling)))
    scheduler.max_num_active_reqs = applied
    log.info("oomguard: starting with admission cap %d (%s)", applied, INITIAL_CAP_ENV)


_NO_GUARD = object()


def step_guard_of(scheduler: Any) -> StepGuard | None:
    """The scheduler's step guard (vllm_plugin/step_guard.py), made at its first step; None
    when off, misconfigured, or without an in-process worker to read the memory from."""
    guard = scheduler.__dict__.get("_oomguard_step_guard", _NO_GUARD)
    if guard is _NO_GUARD:
        guard = scheduler._oomguard_step_guard = _make_step_guard(scheduler)
    return guard  # type: ignore[no-any-return]


def _make_step_guard(scheduler: Any) -> StepGuard | None:
    from oomguard.vllm_plugin import step_guard

    mode = os.environ.get("OOMGUARD_STEP_GUARD_MODE", "observe").strip() or "observe"
    if mode == "off":
        return None
    probe = step_guard.registered_probe()
    if probe is None:
        log.info(
            "oomguard: step guard inactive: the workers run in other processes (tensor "
            "parallelism); it reads memory from an in-process worker"
        )
        return None
    try:
        model = scheduler.vllm_config.model_config
        hidden, vocab = int(model.get_hidden_size()), int(model.get_vocab_size())
        dtype_bytes = int(getattr(model.dtype, "itemsize", 2) or 2)
        full = int(scheduler.max_num_scheduled_tokens)

        def costs(profiled: int) -> step_guard.StepCosts:
            return step_guard.StepCosts.calibrated(profiled, full, hidden, vocab, dtype_bytes)

        guard = step_guard.StepGuard.from_env(probe, costs)
    except (AttributeError, TypeError, ValueError) as exc:
        log.error("oomguard: step guard off: %s", exc)
        return None
    log.info("oomguard: step guard in %s mode", guard.mode)
    return guard


def _guarded_schedule(schedule: Any, self: Any, args: Any, kwargs: Any) -> Any:
    """`schedule` with the step guard's budget, if it gives one, for this call only."""
    guard = step_guard_of(self)
    budget = None
    if guard is not None:
        try:
            budget = guard.budget(self)
        except Exception:  # the guard must never break a step: vLLM's own budget then
            log.warning("oomguard: step guard failed; step left as vLLM planned", exc_info=True)
    if budget is None:
        output = schedule(self, *args, **kwargs)
    else:
        # vLLM's own token budget (Scheduler.schedule reads it once, at the start), restored
        # whatever happens
        full = self.max_num_scheduled_tokens
        self.max_num_scheduled_tokens = budget
        try:
            output = schedule(self, *args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = full
    if guard is not None:
        tokens = int(getattr(output, "total_num_scheduled_tokens", 0) or 0)
        guard.after(tokens)
        if budget == 0 and tokens == 0 and guard.wait_seconds > 0:
            time.sleep(guard.wait_seconds)  # nothing fits: look again shortly
    return output


def _wrap_schedule(schedule: Any) -> Any:
    @functools.wraps(schedule)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = _guarded_schedule(schedule, self, args, kwargs)
        try:
            c = counters(self)
            c.admitted += len(output.scheduled_new_reqs)
            c.finished += len(output.finished_req_ids)
            # what an OOM in this step would lose: every request the scheduler holds
            oom.note_in_flight(len(self.requests))
        except Exception:  # counting must never break a step
            log.debug("oomguard: could not count a scheduler step", exc_info=True)
        return output

    wrapper._oomguard_wrapper = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_add_request(add: Any) -> Any:
    @functools.wraps(add)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = add(self, request, *args, **kwargs)
        try:  # the step guard counts what prompt and top logprobs add to a step
            guard = step_guard_of(self)
            if guard is not None:
                guard.track(request)
        except Exception:
            log.debug("oomguard: step guard could not track a request", exc_info=True)
        return result

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


SHED_CODE = "oomguard_draining"
SHED_MESSAGE = f"{DRAINING}; the request was not started: retry on another replica"


def _draining(scheduler: Any) -> bool:
    return bool(getattr(scheduler, "_oomguard_draining", False))


def shed_waiting(scheduler: Any) -> dict[int, list[str]]:
    """End every request that waits without KV blocks; return their ids by API-server client.

    Requests holding KV blocks (`kv_holding_waiting`) are not touched: PAUSED_NEW still runs
    them, so they finish here. Under PAUSED_NEW nothing else in the queue would ever run.
    """
    RequestStatus = vllm.load(vllm.REQUEST_STATUS)

    queued = [r.request_id for r in scheduler.waiting if not r.is_finished()]
    if not queued:
        return {}
    ended = scheduler.finish_requests(queued, RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[str]] = defaultdict(list)
    for request in ended:
        by_client[int(request.client_index)].append(request.request_id)
    counters(scheduler).shed += len(ended)
    log.info("oomguard: drain ended %d queued request(s) with a retryable error", len(ended))
    return by_client


def _shed_error() -> Any:
    RequestError = vllm.load(vllm.REQUEST_ERROR)

    # retryable: the API server answers 503 (RetryableRequestError), a gateway tries a peer
    return RequestError(code=SHED_CODE, message=SHED_MESSAGE, retryable=True)


def _shed_outputs(req_ids: list[str]) -> list[Any]:
    EngineCoreOutput = vllm.load(vllm.ENGINE_CORE_OUTPUT)
    FinishReason = vllm.load(vllm.FINISH_REASON)
    with_error = {"error": _shed_error()} if vllm.ENGINE_OUTPUT_ERROR else {}
    return [
        EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, **with_error)
        for req_id in req_ids
    ]


def prefills_done(scheduler: Any, scheduler_output: Any) -> int:
    """How many requests' prompts this step finished computing (run after the step: the
    scheduler already counted its tokens as computed)."""
    done = 0
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        r = scheduler.requests.get(req_id)
        if (
            r is not None
            and r.num_computed_tokens - n < r.num_prompt_tokens <= r.num_computed_tokens
        ):
            done += 1
    return done


def _wrap_update_from_output(update: Any) -> Any:
    @functools.wraps(update)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:  # before the update: it frees the requests that finished
            scheduler_output = args[0] if args else kwargs["scheduler_output"]
            counters(self).prefilled += prefills_done(self, scheduler_output)
        except Exception:  # counting must never break a step
            log.debug("oomguard: could not count prefills", exc_info=True)
        outputs = update(self, *args, **kwargs)
        if not _draining(self):
            return outputs
        try:  # a preemption this step put requests back in the queue: send them on
            EngineCoreOutputs = vllm.load(vllm.ENGINE_CORE_OUTPUTS)

            for client, req_ids in shed_waiting(self).items():
                eco = outputs.get(client)
                if eco is None:
                    outputs[client] = eco = EngineCoreOutputs()
                eco.outputs = [*eco.outputs, *_shed_outputs(req_ids)]
        except Exception:  # shedding must never break a step
            log.warning("oomguard: could not shed queued requests", exc_info=True)
        return outputs

    wrapper._oomguard_wrapper = True  # type: ignore[attr-defined]
    return wrapper


# -- utility methods (run in the EngineCore process, `self` is the EngineCore) -------------------
def _paused(core: Any) -> bool:
    PauseState = vllm.load(vllm.PAUSE_STATE)

    return core.scheduler.pause_state != PauseState.UNPAUSED


def _gpu_memory_utilization(core: Any) -> float | None:
    try:
        return float(core.vllm_config.cache_config.gpu_memory_utilization)
    except (AttributeError, TypeError, ValueError):
        return None


def oomguard_state(self: Any) -> dict[str, Any]:
    """This engine core's state (oomguard.engine_state.EngineCoreState, sent as a dict: the
    utility call crosses a process boundary)."""
    s = self.scheduler
    _shed_if_due(self)  # a drain whose grace has passed sheds now, whoever asks first
    c = counters(s)
    running, waiting = s.get_request_counts()
    shedding = _draining(s) or bool(getattr(self, "reject_new_requests", False))
    draining = _paused(self) or shedding
    admitted0, finished0, preempted0, prefilled0 = c.at_change
    state = EngineCoreState(
        engine=int(getattr(self, "engine_index", 0) or 0),
        startup_max_num_seqs=ceiling(s),
        gpu_memory_utilization=_gpu_memory_utilization(self),
        admission_cap=int(s.max_num_active_reqs),
        mode="draining" if draining else "serving",
        shedding=shedding,
        # nothing left to lose: a restart now drops no request, running or queued
        drained=draining and running == 0 and waiting == 0,
        running=int(running),
        waiting=int(waiting),
        kv_cache_usage=float(s.get_kv_cache_usage()),
        admitted_total=c.admitted,
        finished_total=c.finished,
        preemptions_total=c.preemptions,
        shed_total=c.shed,
        since_cap_change=SinceCapChange(
            seconds=round(time.time() - c.cap_changed_at, 3),
            admitted=c.admitted - admitted0,
            finished=c.finished - finished0,
            preemptions=c.preemptions - preempted0,
            prefilled=c.prefilled - prefilled0,
        ),
    )
    return state.model_dump(mode="json")


def oomguard_set_admission_cap(self: Any, cap: int) -> dict[str, Any]:
    s = self.scheduler
    highest = ceiling(s)
    applied = max(1, min(int(cap), highest))
    changed = applied != s.max_num_active_reqs
    if changed:
        s.max_num_active_reqs = applied
        counters(s).mark_cap_change()
        log.info(
            "oomguard: admission cap set to %d (requested %d, startup %d)", applied, cap, highest
        )
    return {
        "requested": int(cap),
        "admission_cap": applied,
        "clamped": applied != cap,
        "changed": changed,
        "state": oomguard_state(self),
    }


def oomguard_drain(self: Any, grace_seconds: float = 0.0) -> dict[str, Any]:
    """Drain: nothing new starts at once; queued and new requests are sent elsewhere (shed)
    `grace_seconds` later, once routers have taken this replica out of rotation (its readiness
    fails from now on). Repeated calls keep the earliest shedding time."""
    PauseState = vllm.load(vllm.PAUSE_STATE)

    s = self.scheduler
    if not _paused(self):
        log.info(
            "oomguard: draining (running requests finish, queued ones go elsewhere in %.1f s)",
            grace_seconds,
        )
    # PAUSED_NEW: running requests and those holding KV blocks continue; nothing new starts.
    s.set_pause_state(PauseState.PAUSED_NEW)
    due = time.monotonic() + max(0.0, float(grace_seconds))
    s._oomguard_shed_at = min(due, getattr(s, "_oomguard_shed_at", None) or due)
    _shed_if_due(self)
    return oomguard_state(self)


def _shed_if_due(self: Any) -> None:
    """Once a drain's grace has passed: refuse new requests and end the queued ones with a
    retryable error (a router retries them on a peer)."""
    FinishReason = vllm.load(vllm.FINISH_REASON)

    s = self.scheduler
    due = getattr(s, "_oomguard_shed_at", None)
    if due is None or time.monotonic() < due or not _paused(self):
        return
    s._oomguard_draining = True
    if hasattr(self, "reject_new_requests"):
        # new requests that reach the engine finish with a retryable `engine_paused` error
        self.reject_new_requests = True
    send = getattr(self, "_send_finish_outputs_to_client", None)
    if send is not None:  # EngineCoreProc: the API server is on the other end of a queue
        for client, req_ids in shed_waiting(s).items():
            with_error = (_shed_error(),) if vllm.ENGINE_OUTPUT_ERROR else ()
            send(req_ids, client, FinishReason.ERROR, *with_error)


def oomguard_resume(self: Any) -> dict[str, Any]:
    PauseState = vllm.load(vllm.PAUSE_STATE)

    if _paused(self):
        log.info("oomguard: resuming admissions")
    self.scheduler.set_pause_state(PauseState.UNPAUSED)
    self.scheduler._oomguard_draining = False
    self.scheduler._oomguard_shed_at = None
    if hasattr(self, "reject_new_requests"):
        self.reject_new_requests = False
    return oomguard_state(self)


def _memory_from_workers(core: Any) -> dict[str, int] | None:
    """Each worker's transient headroom (the twin's or a GPU worker's `oomguard_memory`); the
    tightest rank counts (tensor parallel ranks step together)."""
    try:
        results = core.model_executor.collective_rpc("oomguard_memory", timeout=2.0)
    except Exception:
        log.debug("oomguard: workers did not report memory", exc_info=True)
        return None
    reports = [r for r in results or [] if isinstance(r, dict) and "now" in r and "idle" in r]
    if not reports:
        return None
    return {
        "now": min(int(r["now"]) for r in reports),
        "idle": min(int(r["idle"]) for r in reports),
    }


def oomguard_headroom(self: Any) -> dict[str, Any]:
    """What the request guard needs from this engine: its shape and its live headroom."""
    s = self.scheduler
    config = self.vllm_config
    sched, cache, model = config.scheduler_config, config.cache_config, config.model_config
    pool = s.kv_cache_manager.block_pool
    return {
        "engine": int(getattr(self, "engine_index", 0) or 0),
        "vocab_size": int(model.get_vocab_size()),
        "hidden_size": int(model.get_hidden_size()),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "chunked_prefill": bool(sched.enable_chunked_prefill),
        "block_size": int(cache.block_size or vllm.BLOCK_SIZE),
        "total_kv_blocks": int(s.kv_cache_config.num_blocks),
        "free_kv_blocks": int(pool.get_num_free_blocks()),
        "memory": _memory_from_workers(self),
    }


def oomguard_step_guard(self: Any) -> dict[str, Any]:
    """The step guard of this engine (vllm_plugin/step_guard.py), for GET /step-guard."""
    from oomguard.vllm_plugin import step_guard

    guard = step_guard_of(self.scheduler)
    out: dict[str, Any] = {
        "engine": int(getattr(self, "engine_index", 0) or 0),
        "mode": guard.mode if guard is not None else "inactive",
        "shrinks": step_guard.shrinks(),
    }
    if guard is not None:
        out.update(guard.stats())
    return out


UTILITIES = {
    "oomguard_step_guard": oomguard_step_guard,
    "oomguard_state": oomguard_state,
    "oomguard_headroom": oomguard_headroom,
    "oomguard_set_admission_cap": oomguard_set_admission_cap,
    "oomguard_drain": oomguard_drain,
    "oomguard_resume": oomguard_resume,
}


def _wrap_worker_execute(execute: Any) -> Any:
    @functools.wraps(execute)
    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_oomguard_flags_noted", False):
            oom.note_flags(getattr(self, "vllm_config", None))
            self._oomguard_flags_noted = True
        oom.note_step(scheduler_output)  # read only if this step runs out of memory
        return execute(self, scheduler_output, *args, **kwargs)

    wrapper._oomguard_wrapper = True  # type: ignore[attr-defined]
    return wrapper


def _expandable_segments() -> bool:
    """PyTorch's allocator maps and unmaps pages of one growing segment: no stranded splits."""
    conf = (
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        + ","
        + os.environ.get("PYTORCH_ALLOC_CONF", "")
    )
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _room(self: Any) -> tuple[int, int]:
    """(available, idle) of this worker's GPU: one `cudaMemGetInfo` and one read of the caching
    allocator's counters (tens of microseconds); what each means: worker_memory below."""
    import torch

    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    fragments = (
        0 if _expandable_segments() else int(stats.get("inactive_split_bytes.all.current", 0))
    )
    if not hasattr(self, "_oomguard_non_torch"):  # the non-torch memory at the first reading
        self._oomguard_non_torch = max(0, total - free - reserved)
    available = free + max(0, reserved - allocated - fragments)
    return int(available), int(total - allocated - self._oomguard_non_torch)


def worker_memory(self: Any) -> dict[str, int]:
    """A GPU worker's transient headroom, from the caching allocator and the device.

    now  = device free + reserved-but-free allocator cache that is not split into fragments
           - the profiled step's activations
    idle = device total - allocated - non-torch memory at the first reading - the profiled step
    Fragments (`inactive_split_bytes`: free blocks inside segments still in use, which PyTorch
    calls non-releasable) hold only allocations that fit in them, not a step's activations, so
    they do not count (the twin's fragmentation is the same bytes); with expandable segments
    PyTorch can unmap and reuse them, so they do. `idle` cannot tell a neighbour that started
    before the engine from the engine's own non-torch memory; such a neighbour counts as the
    engine's.
    """
    from oomguard.vllm_plugin.guard import ModelMemory, activation_bytes

    available, idle = _room(self)
    config = self.vllm_config
    step = activation_bytes(
        int(config.scheduler_config.max_num_batched_tokens),
        ModelMemory(config.model_config.get_vocab_size(), config.model_config.get_hidden_size()),
    )
    return {"now": available - step, "idle": idle - step}


def worker_step_memory(self: Any) -> dict[str, int]:
    """What the step guard reads before each step (a GPU worker in the engine's process).

    available = device free + reserved-but-free allocator cache not split into fragments
    idle      = device total - allocated - non-torch memory at the first reading (the same with
                nothing else on the GPU)
    profiled  = the transient peak vLLM's profile measured for a full step
                (`Worker.peak_activation_memory`; 0 when the worker has none)
    One `cudaMemGetInfo` and one read of the allocator's counters: tens of microseconds.
    """
    available, idle = _room(self)
    return {
        "available": available,
        "idle": idle,
        "profiled": int(getattr(self, "peak_activation_memory", 0) or 0),
    }


def _wrap_worker_init(init: Any) -> Any:
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        from oomguard.vllm_plugin import step_guard

        # a worker in the engine's own process (vLLM's single-GPU executor) lets the step
        # guard read its memory; one in another process registers in that process only
        step_guard.register_probe(self.oomguard_step_memory)

    wrapper._oomguard_wrapper = True  # type: ignore[attr-defined]
    return wrapper


def _patch_worker() -> None:
    """The GPU worker notes each step for OOM incident records (no GPU worker: nothing to do)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return  # no CUDA in this install: no GPU worker to patch, no import cost
        Worker = vllm.load(vllm.GPU_WORKER)
    except Exception:  # an install whose GPU worker does not import
        return
    if not getattr(Worker.execute_model, "_oomguard_wrapper", False):
        Worker.execute_model = _wrap_worker_execute(Worker.execute_model)  # type: ignore[method-assign]
    Worker.oomguard_memory = worker_memory  # type: ignore[attr-defined]
    Worker.oomguard_step_memory = worker_step_memory  # type: ignore[attr-defined]
    if not getattr(Worker.__init__, "_oomguard_wrapper", False):
        Worker.__init__ = _wrap_worker_init(Worker.__init__)  # type: ignore[method-assign]


def register() -> None:
    """The `vllm.general_plugins` entry point. Idempotent: patches once per process."""
    try:
        Scheduler = vllm.load(vllm.SCHEDULER)
        EngineCore = vllm.load(vllm.ENGINE_CORE)
    except ImportError:  # not a vLLM this plugin knows: stay out of the way
        log.warning("oomguard plugin: vLLM's V1 engine is not importable; plugin inactive")
        return
    if getattr(EngineCore, _PATCHED, False):
        return
    for name, fn in UTILITIES.items():
        setattr(EngineCore, name, fn)
    if not getattr(Scheduler.schedule, "_oomguard_wrapper", False):
        Scheduler.schedule = _wrap_schedule(Scheduler.schedule)  # type: ignore[method-assign]
    if not getattr(Scheduler.update_from_output, "_oomguard_wrapper", False):
        Scheduler.update_from_output = _wrap_update_from_output(Scheduler.update_from_output)  # type: ignore[method-assign]
    if not getattr(Scheduler._preempt_request, "_oomguard_wrapper", False):
        Scheduler._preempt_request = _wrap_preempt(Scheduler._preempt_request)  # type: ignore[method-assign]
    if not getattr(Scheduler.add_request, "_oomguard_wrapper", False):
        Scheduler.add_request = _wrap_add_request(Scheduler.add_request)  # type: ignore[method-assign]
    setattr(EngineCore, _PATCHED, True)
    _patch_worker()
    from oomguard.vllm_plugin.allocator import install as install_allocator_publisher
    from oomguard.vllm_plugin.oom import attach_to_torch

    install_allocator_publisher()
    attach_to_torch()
    log.debug("oomguard plugin registered in this process")
