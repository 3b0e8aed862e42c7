"""Records a CUDA out-of-memory from inside the dying process, before it dies.

A fatal CUDA OOM kills vLLM's worker within milliseconds; the allocator publisher's 1 s thread
dies with it, so its last hand-off file predates the OOM and the exporter never counts it. PyTorch
calls out-of-memory observers synchronously, in the thread that failed to allocate, after the
caching allocator released its lock and before the `OutOfMemoryError` is raised
(`torch._C._cuda_attach_out_of_memory_observer`). `OomRecorder.observe` is such an observer. It
writes, before returning:

1. the allocator hand-off file (format: core/oomguard/handoff.py, unchanged) with the OOM counted,
   so the exporter sees the count even if nothing else in the process runs again;
2. an incident record, `<incident dir>/oom-<pid>-<n>.json` (`oomguard.incident_records.OomRecord`,
   schema `oomguard.oom_incident.v1`, the model the forensics read back):
   the allocation that failed, the allocator summary (allocated, reserved, inactive split,
   segments, largest free block), the step's batch (requests, prompt and computed tokens,
   sampling parameters that set transient memory), the engine's memory flags, and what the
   classifier (forensics/oomguard/forensics/) needs to name the type: the process's uptime, how many
   steps it ran (0: it never served, so the OOM was at start-up), and a short history of the
   allocator's allocated/reserved bytes (a leak grows the first, fragmentation the gap).

The GPU twin's simulated CUDA OOM (twin/executor.py) calls the same `observe`, with its own
allocator statistics, so this path runs on the real vLLM server in the tests.

The step's batch comes from `note_step(scheduler_output)`: the worker's `execute_model` keeps a
reference to the current step's scheduler output (one attribute store per step); it is read only
when an OOM happens.

The requests the engine held when it died (`in_flight`): every request EngineCore's scheduler
had, running or queued, noted by the plugin's scheduler wrapper after each `schedule()` (one
`len` per step, `note_in_flight`); where the worker runs in another process than the scheduler
(tensor-parallel workers), the step's batch. The API server answers each of them with an error
when EngineCore dies, and vLLM's own request counters die with the process: the exporter counts
them from these records (`oomguard_requests_lost_total`) for the error-budget SLO.

Environment: OOMGUARD_ALLOCATOR_DIR (hand-off directory), OOMGUARD_INCIDENT_DIR (default
`<allocator dir>/incidents`), OOMGUARD_TARGET.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomguard.contract import ALLOCATOR_DIR_ENV, HANDOFF_DIR, INCIDENT_DIR_ENV, TARGET_ENV
from oomguard.handoff import AllocatorReport, write_report

log = logging.getLogger("oomguard.vllm_plugin.oom")

MAX_BATCH_REQUESTS = 512  # an incident file stays small even for a huge batch
HISTORY_LEN = 64  # allocator samples kept; when full every other one is dropped
HISTORY_FIRST_INTERVAL = 60.0  # seconds between samples, doubled at each thinning
_STARTED = time.time()  # the plugin is imported as the worker starts: uptime counts from here

_step: Any = None  # the scheduler output of the step running in this process
_flags: dict[str, Any] = {}
_recorder: OomRecorder | None = None
_lock = threading.Lock()
_steps = 0  # steps this process executed (0 at an OOM: it never served)
_in_flight: int | None = None  # requests EngineCore's scheduler held at its last step, if here
_model_name = ""  # the served model name, as vLLM's metrics label it
_active: OomRecorder | None = None  # the recorder whose stats the history samples


def note_step(scheduler_output: Any) -> None:
    """Remember the step being executed (a reference; summarised only on an OOM)."""
    global _step, _steps
    _step = scheduler_output
    _steps += 1
    if _active is not None:
        _active.sample()  # one clock read per step; the allocator is read once a minute


def note_in_flight(requests: int) -> None:
    """Remember how many requests the scheduler in this process holds (after each schedule)."""
    global _in_flight
    _in_flight = requests


def note_flags(vllm_config: Any) -> None:
    """Remember the engine's memory flags for incident records (once, at worker start)."""
    cache = getattr(vllm_config, "cache_config", None)
    sched = getattr(vllm_config, "scheduler_config", None)
    model = getattr(vllm_config, "model_config", None)
    values = {
        "gpu_memory_utilization": getattr(cache, "gpu_memory_utilization", None),
        "max_num_seqs": getattr(sched, "max_num_seqs", None),
        "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
        "enable_chunked_prefill": getattr(sched, "enable_chunked_prefill", None),
        "max_model_len": getattr(model, "max_model_len", None),
        "block_size": getattr(cache, "block_size", None),
    }
    with contextlib.suppress(Exception):  # sizes the logits estimate in the classifier
        values["vocab_size"] = int(model.get_vocab_size())  # type: ignore[union-attr]
    with contextlib.suppress(Exception):  # the logits' dtype (oomguard.logits)
        values["dtype_bytes"] = int(model.dtype.itemsize)  # type: ignore[union-attr]
    _flags.clear()
    _flags.update({k: v for k, v in values.items() if isinstance(v, bool | int | float)})
    global _model_name
    name = getattr(model, "served_model_name", None)  # vLLM's `model_name` metric label
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    _model_name = name[:256] if isinstance(name, str) else ""


def _params(sampling: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("n", "best_of", "logprobs", "prompt_logprobs", "max_tokens"):
        value = getattr(sampling, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
    return out


def batch_summary(step: Any) -> dict[str, Any] | None:
    """What the step scheduled: one entry per request (new ones with their prompt and params)."""
    if step is None:
        return None
    from oomguard.incident_records import MAX_TEXT  # loaded by the recorder already

    scheduled: dict[str, int] = dict(getattr(step, "num_scheduled_tokens", {}) or {})
    requests: list[dict[str, Any]] = []
    for new in getattr(step, "scheduled_new_reqs", []) or []:
        prompt = new.prompt_token_ids or new.prefill_token_ids or []
        requests.append(
            {
                "id": str(new.req_id)[:MAX_TEXT],
                "new": True,
                "prompt_tokens": len(prompt),
                "computed_tokens": int(new.num_computed_tokens),
                "scheduled_tokens": int(scheduled.get(new.req_id, 0)),
                "params": _params(new.sampling_params),
            }
        )
    cached = getattr(step, "scheduled_cached_reqs", None)
    if cached is not None:
        for i, req_id in enumerate(cached.req_ids):
            requests.append(
                {
                    "id": str(req_id)[:MAX_TEXT],
                    "new": False,
                    "computed_tokens": int(cached.num_computed_tokens[i]),
                    "scheduled_tokens": int(scheduled.get(req_id, 0)),
                }
            )
    requests.sort(key=lambda r: -r["scheduled_tokens"])  # the big ones first
    return {
        "requests": len(requests),
        "scheduled_tokens": int(getattr(step, "total_num_scheduled_tokens", 0) or 0),
        "largest": requests[:MAX_BATCH_REQUESTS],
    }


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".oom-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())  # the process may be gone a moment later
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class OomRecorder:
    """An out-of-memory observer that writes the hand-off file and an incident record.

    `stats` returns `torch.cuda.memory_stats()`-shaped counters; `identity` returns the hand-off
    identity fields (rank, engine, device_index, device_uuid); `extra` returns allocator details
    for the incident (segments, largest free block), or {}.
    """

    def __init__(
        self,
        directory: str,
        incident_dir: str,
        target: str,
        stats: Callable[[], dict[str, Any]],
        identity: Callable[[], dict[str, Any]],
        extra: Callable[[], dict[str, Any]] = dict,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory, self.incident_dir, self.target = directory, incident_dir, target
        self.stats, self.identity, self.extra, self.clock = stats, identity, extra, clock
        self.monotonic = monotonic  # paces the history (the GPU twin's runs faster)
        # The record's models, imported here (once per recording process, at its start) so that
        # the OOM path finds them loaded and other processes never load them.
        import oomguard.incident_records  # noqa: F401

        self.ooms = 0
        # (unix time, allocated, reserved): thinned to cover the whole life in HISTORY_LEN rows
        self.history: list[tuple[float, int, int]] = []
        self._interval = HISTORY_FIRST_INTERVAL
        self._next_sample = 0.0
        global _active
        _active = self

    def sample(self) -> None:
        """Add an allocator sample when one is due (called from note_step; never raises)."""
        now = self.monotonic()
        if now < self._next_sample:
            return
        self._next_sample = now + self._interval
        try:
            stats = self.stats()
            row = (
                float(self.clock()),
                int(stats.get("allocated_bytes.all.current", 0)),
                int(stats.get("reserved_bytes.all.current", 0)),
            )
        except Exception:
            return
        self.history.append(row)
        if len(self.history) >= HISTORY_LEN:
            self.history = self.history[::2]
            self._interval *= 2
            self._next_sample = now + self._interval

    def observe(self, device: int, requested: int, device_limit: int, device_free: int) -> None:
        """PyTorch's observer signature. Never raises: the process is failing already."""
        self.ooms += 1
        now = self.clock()
        try:
            stats = dict(self.stats())
            stats["num_ooms"] = max(int(stats.get("num_ooms", 0)), self.ooms)
            identity = {
                "rank": 0,
                "engine": "0",
                "device_index": int(device),
                "device_uuid": "",
                **self.identity(),
            }
            from oomguard.vllm_plugin.step_guard import shrinks

            report = AllocatorReport.from_memory_stats(
                stats,
                timestamp=now,
                pid=os.getpid(),
                target=self.target,
                step_shrinks=shrinks() or None,  # the counts go on in the same file
                **identity,
            )
            if self.directory:
                write_report(self.directory, report)
        except Exception:
            log.warning("oomguard: could not write the allocator report on OOM", exc_info=True)
            return
        try:
            self._write_incident(now, report, requested, device_limit, device_free)
        except Exception:
            log.warning("oomguard: could not write the OOM incident record", exc_info=True)

    def _write_incident(
        self,
        now: float,
        report: AllocatorReport,
        requested: int,
        device_limit: int,
        device_free: int,
    ) -> None:
        if not self.incident_dir:
            return
        extra: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            extra = dict(self.extra())
        from oomguard.incident_records import (
            MAX_TEXT,
            OOM_SCHEMA,
            Allocator,
            Batch,
            OomRecord,
            oom_file_name,
        )

        batch = batch_summary(_step)
        record = OomRecord(
            schema=OOM_SCHEMA,
            timestamp=now,
            pid=report.pid,
            rank=report.rank,
            target=report.target[:MAX_TEXT],
            engine=report.engine[:MAX_TEXT],
            device_index=report.device_index,
            device_uuid=report.device_uuid[:MAX_TEXT],
            requested_bytes=int(requested),
            device_limit_bytes=int(device_limit),
            device_free_bytes=int(device_free),
            allocator=Allocator.model_validate(
                {
                    "allocated_bytes": report.allocated_bytes,
                    "reserved_bytes": report.reserved_bytes,
                    "allocated_peak_bytes": report.allocated_peak_bytes,
                    "reserved_peak_bytes": report.reserved_peak_bytes,
                    "inactive_split_bytes": report.inactive_split_bytes,
                    "alloc_retries": report.alloc_retries,
                    "ooms": report.ooms,
                    **extra,
                }
            ),
            batch=Batch.model_validate(batch) if batch is not None else None,
            **in_flight(batch),
            model_name=_model_name,
            flags=dict(_flags),
            process_started_at=_STARTED,
            # rounded: a sub-millisecond float has more digits than the reader takes (20)
            uptime_seconds=round(max(0.0, now - _STARTED), 6),
            steps=_steps,
            history=list(self.history),
        )
        _write_text(Path(self.incident_dir) / oom_file_name(report.pid, self.ooms), record.dump())


def in_flight(batch: dict[str, Any] | None) -> dict[str, Any]:
    """The requests the engine held as it died, and where the number comes from."""
    if _in_flight is not None:
        return {"in_flight": int(_in_flight), "in_flight_source": "scheduler"}
    if batch is not None:
        return {"in_flight": int(batch["requests"]), "in_flight_source": "step"}
    return {}


# -- real CUDA ---------------------------------------------------------------------------------
def _cuda_identity() -> dict[str, Any]:
    import torch

    from oomguard.vllm_plugin.allocator import rank_and_engine

    device = torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    rank, engine = rank_and_engine()
    return {
        "rank": rank,
        "engine": engine,
        "device_index": int(device),
        "device_uuid": uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}",
    }


def _cuda_details() -> dict[str, Any]:
    """Segments and the largest free block, from the allocator's snapshot (OOM time only)."""
    import torch

    segments = torch.cuda.memory_snapshot()
    largest = 0
    for segment in segments:
        for block in segment.get("blocks", []):
            if block.get("state") == "inactive":
                largest = max(largest, int(block.get("size", 0)))
    return {"segments": len(segments), "largest_free_block_bytes": largest}


def directories() -> tuple[str, str]:
    handoff = os.environ.get(ALLOCATOR_DIR_ENV, HANDOFF_DIR)
    incidents = os.environ.get(INCIDENT_DIR_ENV) or str(Path(handoff) / "incidents")
    return handoff, incidents


def recorder(
    stats: Callable[[], dict[str, Any]] | None = None,
    identity: Callable[[], dict[str, Any]] | None = None,
    extra: Callable[[], dict[str, Any]] | None = None,
) -> OomRecorder:
    """This process's recorder (created once). Without providers it reads torch.cuda."""
    global _recorder
    with _lock:
        if _recorder is None:
            handoff, incidents = directories()
            if stats is None:
                import torch

                stats = torch.cuda.memory_stats
            _recorder = OomRecorder(
                handoff,
                incidents,
                os.environ.get(TARGET_ENV, ""),
                stats,
                identity or _cuda_identity,
                extra or _cuda_details,
            )
        return _recorder


def attach_to_torch() -> bool:
    """Register the recorder with PyTorch's CUDA allocator once CUDA is initialised.

    PyTorch keeps OOM observers per device allocator, which exist only after CUDA's lazy init;
    `torch.cuda._lazy_call` runs the registration then (or at once if CUDA is up already).
    Returns False where this torch has no CUDA observer hook (CPU builds).
    """
    try:
        import torch

        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if attach is None or lazy_call is None or not torch.cuda.is_available():
            return False
        observer = recorder().observe
        lazy_call(lambda: attach(observer))
        return True
    except Exception:
        log.warning("oomguard: CUDA OOM observer not attached", exc_info=True)
        return False
