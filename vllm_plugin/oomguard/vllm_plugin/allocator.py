"""Publishes PyTorch caching-allocator statistics from each vLLM worker for the exporter.

Only a process that owns a CUDA context can read `torch.cuda.memory_stats()`. A daemon thread in
every vLLM process waits until CUDA is initialised in that process (that makes it a worker;
checking does not create a context), then writes one hand-off file per process every
`OOMGUARD_ALLOCATOR_INTERVAL` seconds (format: core/oomguard/handoff.py).

Never in the serving path: the thread only reads counters, catches every error (logged once),
and does nothing at all in a process without CUDA. The optional periodic `empty_cache()`
(`OOMGUARD_ALLOCATOR_GC_INTERVAL`, off by default) measures free memory after returning cached
blocks; it takes the allocator's lock briefly, so enable it only where that is acceptable.

Environment:
  OOMGUARD_ALLOCATOR_DIR          hand-off directory (default /run/oomguard/allocator)
  OOMGUARD_ALLOCATOR_INTERVAL     seconds between reports (default 1)
  OOMGUARD_ALLOCATOR_GC_INTERVAL  seconds between empty_cache() measurements (default 0: off)
  OOMGUARD_TARGET                 the vLLM target name the exporter and remediator use
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from oomguard import vllm_seam as vllm
from oomguard.contract import ALLOCATOR_DIR_ENV, HANDOFF_DIR, TARGET_ENV
from oomguard.handoff import AllocatorReport, report_path, write_report
from oomguard.vllm_plugin import step_guard

log = logging.getLogger("oomguard.vllm_plugin.allocator")

_started = False
_lock = threading.Lock()


def rank_and_engine() -> tuple[int, str]:
    rank, engine = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)) or 0), "0"
    with contextlib.suppress(Exception):  # vLLM's groups exist only after distributed init
        parallel_state = vllm.load(vllm.PARALLEL_STATE)

        rank = parallel_state.get_world_group().rank
        engine = str(parallel_state.get_dp_group().rank_in_group)
    return rank, os.environ.get("VLLM_DP_RANK", engine)


class AllocatorPublisher:
    def __init__(
        self,
        cuda: Any,
        directory: str,
        interval: float = 1.0,
        gc_interval: float = 0.0,
        target: str = "",
        clock: Any = time.time,
    ) -> None:
        self.cuda = cuda
        self.directory = directory
        self.interval = interval
        self.gc_interval = gc_interval
        self.target = target
        self.clock = clock
        self._last_gc = 0.0
        self._free_after_gc: int | None = None
        self._gc_at: float | None = None
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ready(self) -> bool:
        """True once this process has a CUDA context (it is a worker)."""
        return bool(self.cuda.is_initialized())

    def publish_once(self) -> Path | None:
        """Read the allocator and write the report. Never raises."""
        try:
            if not self.ready():
                return None
            device = self.cuda.current_device()
            now = self.clock()
            if self.gc_interval > 0 and now - self._last_gc >= self.gc_interval:
                self.cuda.empty_cache()
                self._free_after_gc = int(self.cuda.mem_get_info(device)[0])
                self._gc_at = now
                self._last_gc = now
            props = self.cuda.get_device_properties(device)
            uuid = str(getattr(props, "uuid", ""))
            rank, engine = rank_and_engine()
            report = AllocatorReport.from_memory_stats(
                self.cuda.memory_stats(device),
                timestamp=now,
                pid=os.getpid(),
                rank=rank,
                target=self.target,
                engine=engine,
                device_index=int(device),
                device_uuid=uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}",
                free_after_gc_bytes=self._free_after_gc,
                gc_timestamp=self._gc_at,
                step_shrinks=step_guard.shrinks() or None,
            )
            return write_report(self.directory, report)
        except Exception:
            if not self._failed:  # say it once, not every second
                log.warning("oomguard: cannot publish allocator stats", exc_info=True)
                self._failed = True
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish_once()
        with contextlib.suppress(OSError):
            report_path(self.directory, os.getpid()).unlink(missing_ok=True)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="oomguard-allocator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def install() -> AllocatorPublisher | None:
    """Start the publisher in this process if it can ever use CUDA; once per process."""
    global _started
    with _lock:
        if _started:
            return None
        _started = True
    try:
        import torch

        if not torch.cuda.is_available():
            return None  # no CUDA: nothing to publish, no thread
        publisher = AllocatorPublisher(
            torch.cuda,
            os.environ.get(ALLOCATOR_DIR_ENV, HANDOFF_DIR),
            float(os.environ.get("OOMGUARD_ALLOCATOR_INTERVAL", "1")),
            float(os.environ.get("OOMGUARD_ALLOCATOR_GC_INTERVAL", "0")),
            os.environ.get(TARGET_ENV, ""),
        )
        publisher.start()
        # a step guard's shrink reaches the exporter at once, not at the next tick
        step_guard.on_shrink(publisher.publish_once)
        return publisher
    except Exception:
        log.warning("oomguard: allocator publisher not started", exc_info=True)
        return None
