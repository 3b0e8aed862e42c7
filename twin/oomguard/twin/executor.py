"""A model-free vLLM executor: the real vLLM server, scheduler and KV-cache manager, no model.

`vllm serve <folder with config.json> --distributed-executor-backend
oomguard.twin.executor.ModelFreeExecutor` runs vLLM's own API server, EngineCore, V1 scheduler
and KV cache manager on a machine without a GPU. This executor stands where the GPU workers
would: it reports a KV pool of a configured size and, each step, returns one token for every
scheduled request whose prefill is complete. vLLM decides everything else (admission, batching,
preemption), so what the tests and the twin observe is vLLM's real behaviour.

Settings come from `--additional-config '{"oomguard_twin": {...}}'` or environment variables:
  kv_blocks      OOMGUARD_TWIN_KV_BLOCKS      KV pool size in blocks (default 1024)
  step_seconds   OOMGUARD_TWIN_STEP_SECONDS   wall time of one step (default 0.005)
  token_id       OOMGUARD_TWIN_TOKEN_ID       the token every step "samples" (default 7)

With `gpu` set (OOMGUARD_TWIN_GPU: H100, A100-80GB, A100-40GB, RTX4090) the worker becomes a twin
of that GPU (twin/physics.py): the KV pool is sized from gpu_memory_utilization as vLLM sizes it,
each step takes its roofline time divided by `time_compression` (OOMGUARD_TWIN_TIME_COMPRESSION),
and a step whose memory peak exceeds the device raises torch.OutOfMemoryError: the engine dies
as a real one does. Also:
  model          OOMGUARD_TWIN_MODEL          simulated model (twin/models/<name> or a config.json)
  state_file     OOMGUARD_TWIN_STATE_FILE     the twin GPU's state file (twin/gpufile.py):
                                              neighbour_bytes, fragmentation_bytes (read every
                                              0.2 s); the worker publishes its own device
                                              memory beside it for the exporter's twin NVML
  allocator_dir  OOMGUARD_ALLOCATOR_DIR       where it publishes allocator stats (hand-off format)
  incident_dir   OOMGUARD_INCIDENT_DIR        OOM incident records (<allocator_dir>/incidents)
  target         OOMGUARD_TARGET              target name in those reports

Fault knobs, for inducing each type of incident on purpose (tests/test_incidents_induced.py);
every one is off by default:
  clock_rate                    OOMGUARD_TWIN_CLOCK_RATE       simulated seconds per wall second
                                once the engine serves (its first step): the worker's clock (OOM
                                record time, uptime, allocator history) and the growth below run
                                that fast, so hours pass in seconds (default 1: wall time)
  leak_bytes_per_hour           OOMGUARD_TWIN_LEAK_BYTES_PER_HOUR  allocated memory retained per
                                simulated hour of serving, a leak (default 0)
  fragmentation_bytes_per_hour  OOMGUARD_TWIN_FRAGMENTATION_BYTES_PER_HOUR  reserved-but-unusable
                                memory added per simulated hour, on top of the state file's
                                (default 0)
  reload_seconds                OOMGUARD_TWIN_RELOAD_SECONDS  a model load this long (wall s) on
                                every start after the first on this state file (a marker
                                beside it says an engine started there): the reload a restart
                                costs, crashed or requested alike; at most 270 s, inside vLLM's
                                5-minute engine handshake (default 0: none)
  cuda_error_at_step            OOMGUARD_TWIN_CUDA_ERROR_AT_STEP  that step raises a CUDA error
                                that is not out-of-memory ("an illegal memory access was
                                encountered", as PyTorch raises it), killing the engine (default 0:
                                never)

A simulated CUDA OOM goes through the plugin's out-of-memory observer
(`oomguard.vllm_plugin.oom.OomRecorder.observe`), as a real one does from PyTorch's allocator:
the hand-off file shows the OOM and an incident record names the step's batch before the
exception leaves the step.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from oomguard import vllm_seam as vllm
from oomguard.contract import ALLOCATOR_DIR_ENV, INCIDENT_DIR_ENV, TARGET_ENV
from oomguard.units import parse_size
from oomguard.vllm_plugin.oom import note_step

Executor = vllm.load(vllm.EXECUTOR)
FullAttentionSpec = vllm.load(vllm.FULL_ATTENTION_SPEC)
ModelRunnerOutput = vllm.load(vllm.MODEL_RUNNER_OUTPUT)

log = logging.getLogger("oomguard.twin.executor")


def _setting(config: dict[str, Any], key: str, env: str, default: float) -> float:
    if key in config:
        return float(config[key])
    return float(os.environ.get(env, default))


def _text(config: dict[str, Any], key: str, env: str, default: str = "") -> str:
    return str(config.get(key) or os.environ.get(env, default))


def _knob(
    config: dict[str, Any], key: str, env: str, default: float, low: float, whole: bool = False
) -> float:
    """A fault knob: a finite number >= `low` (`whole`: an integer), or a ValueError that names
    it (the engine refuses to start rather than run with a knob it misread)."""
    raw = config.get(key, os.environ.get(env))
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    bad = not math.isfinite(value) or value < low or (whole and value != int(value))
    if isinstance(raw, bool) or bad:
        what = "an integer" if whole else "a number"
        raise ValueError(f"twin setting {key} ({env}): expected {what} >= {low:g}, got {raw!r}")
    return value


# How stale the GPU state may be where a step's fit is decided (its start, its end, the step
# guard's look): the trace driver rewrites the state file every 0.1 s wall.
STATE_FRESH_S = 0.02

ILLEGAL_ADDRESS = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)


class GpuTwin:
    """The physics of one simulated GPU inside the worker: step time, memory, OOM, stats."""

    def __init__(self, vllm_config: Any, twin: dict[str, Any]) -> None:
        from oomguard.twin.physics import Physics

        sched = vllm_config.scheduler_config
        self.physics = Physics.for_model(
            _text(twin, "model", "OOMGUARD_TWIN_MODEL", "llama-3-8b"),
            gpu=_text(twin, "gpu", "OOMGUARD_TWIN_GPU"),
            gpu_memory_utilization=float(vllm_config.cache_config.gpu_memory_utilization),
            max_num_batched_tokens=int(sched.max_num_batched_tokens),
            block_size=int(vllm_config.cache_config.block_size or vllm.BLOCK_SIZE),
        )
        self.compression = _setting(twin, "time_compression", "OOMGUARD_TWIN_TIME_COMPRESSION", 1.0)
        self.state_file = _text(twin, "state_file", "OOMGUARD_TWIN_STATE_FILE")
        self.allocator_dir = _text(twin, "allocator_dir", ALLOCATOR_DIR_ENV)
        self.target = _text(twin, "target", TARGET_ENV)
        # fault knobs (module docstring), all off by default
        self.clock_rate = _knob(twin, "clock_rate", "OOMGUARD_TWIN_CLOCK_RATE", 1.0, 1.0)
        self.leak_per_hour = int(
            _knob(twin, "leak_bytes_per_hour", "OOMGUARD_TWIN_LEAK_BYTES_PER_HOUR", 0, 0)
        )
        self.fragmentation_per_hour = int(
            _knob(
                twin,
                "fragmentation_bytes_per_hour",
                "OOMGUARD_TWIN_FRAGMENTATION_BYTES_PER_HOUR",
                0,
                0,
            )
        )
        self.cuda_error_at_step = int(
            _knob(twin, "cuda_error_at_step", "OOMGUARD_TWIN_CUDA_ERROR_AT_STEP", 0, 0, whole=True)
        )
        self.steps = 0
        self._serving_since: float | None = None  # monotonic time of the first step
        from oomguard.vllm_plugin.oom import OomRecorder, note_flags

        note_flags(vllm_config)
        incident_dir = _text(twin, "incident_dir", INCIDENT_DIR_ENV) or (
            str(Path(self.allocator_dir) / "incidents") if self.allocator_dir else ""
        )
        self.oom = OomRecorder(
            self.allocator_dir,
            incident_dir,
            self.target,
            stats=self.memory_stats,
            identity=dict,
            extra=self.memory_details,
            clock=self.clock,
            monotonic=self.monotonic,
        )
        self.last_peak = 0
        self.neighbour = 0
        self.fragmentation = 0
        self.ooms = 0
        self.peak_seen = 0
        self._read_at = 0.0
        self._published_at = 0.0
        if self.state_file or self.allocator_dir:
            threading.Thread(
                target=self._publish_device_memory, name="twin-gpu-process", daemon=True
            ).start()

    def _read_state(self, every: float = 0.2) -> None:
        now = time.monotonic()
        if not self.state_file or now - self._read_at < every:
            return
        self._read_at = now
        try:
            data = json.loads(Path(self.state_file).read_text())
            self.neighbour = parse_size(data.get("neighbour_bytes", 0), plain=True)
            self.fragmentation = parse_size(data.get("fragmentation_bytes", 0), plain=True)
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # the driver rewrites it atomically; a missing file means no neighbour

    def device_bytes(self) -> int:
        """What this engine holds on the device, as NVML lists its process: weights, KV pool,
        CUDA graphs, non-torch memory and the profiled activation peak (gpu_memory_utilization
        x usable in all), plus fragmentation and leaks."""
        p = self.physics
        return p.resident + p.activation(p.max_num_batched_tokens) + self.fragmented + self.leaked

    def _publish_device_memory(self) -> None:
        """Every 0.5 s, busy or idle: this process's device memory beside the state file
        (twin/gpufile.py), which the exporter's twin NVML lists as NVML lists a GPU's
        processes, and the allocator report, as the plugin's publisher thread writes it on a
        GPU (steps publish too, but an idle engine takes none, and its fragments may change)."""
        from oomguard.twin.gpufile import publish_process

        while True:
            self._read_state()
            if self.state_file:
                try:
                    publish_process(self.state_file, os.getpid(), self.device_bytes())
                except OSError:
                    log.debug("twin: cannot publish the engine's device memory", exc_info=True)
            self.publish()
            time.sleep(0.5)

    # -- the twin's clock: wall time until the first step, then `clock_rate` times faster -------
    def _aged(self) -> float:
        """Wall seconds the clock has gained on wall time (0 with the default rate)."""
        if self._serving_since is None or self.clock_rate == 1.0:
            return 0.0
        return (time.monotonic() - self._serving_since) * (self.clock_rate - 1.0)

    def clock(self) -> float:
        return time.time() + self._aged()

    def monotonic(self) -> float:
        return time.monotonic() + self._aged()

    def _served_hours(self) -> float:
        if self._serving_since is None:
            return 0.0
        return (time.monotonic() - self._serving_since) * self.clock_rate / 3600.0

    @property
    def leaked(self) -> int:
        """Allocated memory retained so far by the leak knob."""
        return int(self.leak_per_hour * self._served_hours())

    @property
    def fragmented(self) -> int:
        """Reserved-but-unusable memory: the state file's plus what the knob grew."""
        return self.fragmentation + int(self.fragmentation_per_hour * self._served_hours())

    def memory_stats(self) -> dict[str, int]:
        """What `torch.cuda.memory_stats()` would say on this GPU (the keys the hand-off reads)."""
        p = self.physics
        fragmented = self.fragmented
        allocated = p.weights + p.kv_pool + p.graph_pool_bytes + self.leaked
        reserved = allocated + p.activation(p.max_num_batched_tokens) + fragmented
        peak = max(0, self.peak_seen - p.driver_reserved)
        return {
            "allocated_bytes.all.current": allocated,
            "reserved_bytes.all.current": reserved,
            "allocated_bytes.all.peak": max(allocated, peak),
            "reserved_bytes.all.peak": max(reserved, peak),
            "inactive_split_bytes.all.current": fragmented,
            "num_alloc_retries": 0,
            "num_ooms": self.ooms,
        }

    def memory_details(self) -> dict[str, int | bool]:
        """Incident details a real allocator snapshot cannot give: what the twin simulated."""
        return {
            "simulated": True,
            "step_peak_bytes": self.last_peak,
            "device_total_bytes": self.physics.total,
            "neighbour_bytes": self.neighbour,
            "fragmentation_bytes": self.fragmented,
            "leaked_bytes": self.leaked,
        }

    def publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.allocator_dir or (not force and now - self._published_at < 0.5):
            return
        self._published_at = now
        from oomguard.handoff import AllocatorReport, write_report
        from oomguard.vllm_plugin.step_guard import shrinks

        try:
            write_report(
                self.allocator_dir,
                AllocatorReport.from_memory_stats(
                    self.memory_stats(),
                    step_shrinks=shrinks() or None,
                    timestamp=time.time(),
                    pid=os.getpid(),
                    rank=0,
                    target=self.target,
                    engine="0",
                    device_index=0,
                    device_uuid="",
                ),
            )
        except OSError:
            log.debug("twin: cannot publish allocator stats", exc_info=True)

    def headroom(self) -> dict[str, int]:
        """Room for one request's extra transient memory (what the plugin's request guard reads):
        `idle` on this engine alone, `now` with the neighbour and fragmentation of the moment."""
        self._read_state()
        p = self.physics
        idle = p.total - p.driver_reserved - p.resident - p.activation(p.max_num_batched_tokens)
        return {"now": idle - self.neighbour - self.fragmented - self.leaked, "idle": idle}

    def step_room(self) -> dict[str, int]:
        """What the plugin's step guard reads before each step (a GPU worker reads the device
        and the allocator): `available`, the room for the step's transient memory now (what
        the device holds beside the engine's resident memory, the neighbour, fragmentation and
        leaks); `idle`, the same with nothing else on the GPU; `profiled`, a full step's
        activations (what vLLM's profile measured)."""
        self._read_state(every=STATE_FRESH_S)
        p = self.physics
        idle = p.total - p.driver_reserved - p.resident
        return {
            "available": idle - self.neighbour - self.fragmented - self.leaked,
            "idle": idle,
            "profiled": p.activation(p.max_num_batched_tokens),
        }

    def check_startup(self) -> None:
        """vLLM refuses to start when the device's free memory is below what it was told to take
        (another process holds the rest): the same check, against the twin's neighbour."""
        self._read_at = 0.0
        self._read_state()
        p = self.physics
        free = p.total - p.driver_reserved - self.neighbour
        wanted = p.gpu_memory_utilization * p.usable
        if free < wanted:
            raise ValueError(
                f"Free memory on device ({free / 2**30:.2f}/{p.total / 2**30:.2f} GiB) on startup "
                f"is less than desired GPU memory utilization ({p.gpu_memory_utilization}, "
                f"{wanted / 2**30:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory "
                "used by other processes."
            )

    def step(self, step: Any) -> float:
        """Check the step's memory (raise a CUDA OOM if it does not fit); return its seconds."""
        self._read_state()
        self.steps += 1
        if self._serving_since is None:
            self._serving_since = time.monotonic()
        if self.steps == self.cuda_error_at_step:
            # a fault of the GPU or a kernel, not of memory: PyTorch raises it as this
            raise torch.AcceleratorError(ILLEGAL_ADDRESS)
        self.check(step)
        self.publish()
        return self.physics.step_seconds(step) / self.compression

    def step_end(self, step: Any) -> None:
        """The step's activations are held until it ends: memory another process (or
        fragmentation) took while it ran meets them there, as on a GPU, where a neighbour
        that grows during a long prefill step kills it mid-way."""
        if step.tokens <= 0:
            return
        self._read_state(every=STATE_FRESH_S)
        self.check(step)

    def check(self, step: Any) -> None:
        """Raise a CUDA OOM (after PyTorch's OOM observers) when the step does not fit now."""
        p = self.physics
        fragmented, leaked = self.fragmented, self.leaked
        peak = p.peak(step, fragmented, self.neighbour) + leaked
        self.last_peak = peak
        self.peak_seen = max(self.peak_seen, peak - self.neighbour)
        if peak > p.total:
            self.ooms += 1
            need = peak - p.total
            # the step's transient allocation, and what was free when it was asked for
            transient = p.activation(step.tokens) + p.logits(step.logits)
            free = max(0, p.total - (peak - transient))
            # what PyTorch's allocator does before it raises: call the OOM observers
            self.oom.observe(0, transient, p.total, free)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {need / 2**30:.2f} GiB. GPU 0 has a total "
                f"capacity of {p.total / 2**30:.2f} GiB (twin {p.gpu}; step of {step.tokens} "
                f"tokens, {step.logits} prompt-logprob tokens, neighbour "
                f"{self.neighbour / 2**30:.2f} GiB, fragmentation "
                f"{fragmented / 2**30:.2f} GiB, leaked {leaked / 2**30:.2f} GiB)"
            )


RELOAD_MAX_S = 270.0  # under vLLM's engine handshake timeout (5 minutes)


def _emulate_reload(state_file: str, seconds: float) -> None:
    """A restarted engine loads its model again: on every start after the first on this GPU
    (a marker beside its state file), wait `seconds` (capped at RELOAD_MAX_S) before vLLM
    goes on. Whatever restarted it (an OOM crash or a requested restart) pays the same."""
    if not state_file or seconds <= 0:
        return
    marker = Path(state_file + ".started")
    if marker.exists():
        log.info("twin: emulating a model reload of %.1f s", min(seconds, RELOAD_MAX_S))
        time.sleep(min(seconds, RELOAD_MAX_S))
    try:
        marker.touch()
    except OSError as exc:  # the twin still runs; its next start just skips the reload
        log.warning("twin: cannot mark the engine started (%s)", exc)


class ModelFreeWorker:
    """What collective_rpc reaches: the worker methods vLLM calls, without a model."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        additional = vllm_config.additional_config or {}
        twin = additional.get("oomguard_twin", {}) if isinstance(additional, dict) else {}
        self.kv_blocks = int(_setting(twin, "kv_blocks", "OOMGUARD_TWIN_KV_BLOCKS", 1024))
        self.step_seconds = _setting(twin, "step_seconds", "OOMGUARD_TWIN_STEP_SECONDS", 0.005)
        self.token_id = int(_setting(twin, "token_id", "OOMGUARD_TWIN_TOKEN_ID", 7))
        self.gpu = GpuTwin(vllm_config, twin) if _text(twin, "gpu", "OOMGUARD_TWIN_GPU") else None
        _emulate_reload(
            _text(twin, "state_file", "OOMGUARD_TWIN_STATE_FILE"),
            _knob(twin, "reload_seconds", "OOMGUARD_TWIN_RELOAD_SECONDS", 0, 0),
        )
        if self.gpu is not None:
            self.kv_blocks = self.gpu.physics.kv_blocks
            log.info(
                "twin %s: KV pool %.1f GiB = %d blocks",
                self.gpu.physics.gpu,
                self.gpu.physics.kv_pool / 2**30,
                self.kv_blocks,
            )
        self._logprobs: set[str] = set()  # requests that asked for prompt_logprobs
        # prompt ids and top-k of those requests, until their prompt logprobs are returned
        self._prompt_logprobs: dict[str, tuple[list[int], int]] = {}
        # top-k of requests that asked for sampled-token `logprobs`, for their whole life
        self._sample_logprobs: dict[str, int] = {}
        model = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size or vllm.BLOCK_SIZE
        self.num_layers = model.get_num_layers(vllm_config.parallel_config)
        self.spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model.get_head_size(),
            dtype=model.dtype if isinstance(model.dtype, torch.dtype) else torch.float16,
        )
        # tokens that must be computed before a request samples: prompt (+ outputs if resumed)
        self._needed: dict[str, int] = {}
        self._pending: Any = None  # a ModelRunnerOutput
        if self.gpu is not None:
            from oomguard.vllm_plugin import step_guard

            # in the engine's process, as vLLM's single-GPU worker: the step guard reads it,
            # and a shrink rewrites the hand-off at once
            step_guard.register_probe(self.oomguard_step_memory)
            gpu = self.gpu
            step_guard.on_shrink(lambda: gpu.publish(force=True))

    # -- start-up ------------------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, Any]:  # KVCacheSpec by layer
        return {f"model.layers.{i}.self_attn.attn": self.spec for i in range(self.num_layers)}

    def determine_available_memory(self) -> int:
        if self.gpu is not None:
            self.gpu.check_startup()
        return self.kv_blocks * self.spec.page_size_bytes * self.num_layers

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC", "LBHNC"]  # vLLM's usual NHD / HND; nothing reads the (absent) cache

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        pass

    def oomguard_memory(self) -> dict[str, int] | None:
        """The request guard's headroom (a GPU worker computes it from the allocator)."""
        return self.gpu.headroom() if self.gpu is not None else None

    def oomguard_step_memory(self) -> dict[str, int] | None:
        """The step guard's reading before each step (vllm_plugin/step_guard.py)."""
        return self.gpu.step_room() if self.gpu is not None else None

    def check_health(self) -> None:
        pass

    # -- steps -------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> None:
        started = time.monotonic()
        note_step(scheduler_output)  # as the plugin does in a GPU worker: for OOM incidents
        for req_id in scheduler_output.finished_req_ids:
            self._needed.pop(req_id, None)
            self._logprobs.discard(req_id)
            self._prompt_logprobs.pop(req_id, None)
            self._sample_logprobs.pop(req_id, None)
        done_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            self._needed[new.req_id] = len(new.prefill_token_ids or prompt)
            done_before[new.req_id] = new.num_computed_tokens
            params = getattr(new, "sampling_params", None)
            if params is not None and getattr(params, "logprobs", None) is not None:
                self._sample_logprobs[new.req_id] = _top_k(int(params.logprobs))
            if params is not None and getattr(params, "prompt_logprobs", None) is not None:
                self._logprobs.add(new.req_id)
                top = int(params.prompt_logprobs)
                self._prompt_logprobs[new.req_id] = (list(prompt), _top_k(top))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            done_before[req_id] = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids or req_id not in self._needed:
                # resumed after preemption: prompt and outputs so far are recomputed
                tokens = cached.all_token_ids.get(req_id)
                if tokens is not None:
                    self._needed[req_id] = len(tokens)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        tokens = attention = context = logits = 0
        prompt_logprobs: dict[str, Any] = {}
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req_ids.append(req_id)
            before = done_before.get(req_id, 0)
            computed = before + n
            needed = self._needed.get(req_id, 0)
            ready = computed >= needed
            sampled.append([self.token_id] if ready else [])
            tokens += n
            context += computed
            attention += n * before + n * (n + 1) // 2  # each token attends to all before it
            if req_id in self._logprobs and before < needed:
                logits += min(n, needed - before)
            if ready and req_id in self._prompt_logprobs:
                prompt_logprobs[req_id] = self._prompt_logprob_tensors(req_id)
        step_seconds = self.step_seconds
        step = None
        if self.gpu is not None:
            from oomguard.twin.physics import Step

            step = Step(tokens, attention, context, logits)
            step_seconds = self.gpu.step(step)
        self._pending = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            prompt_logprobs_dict=prompt_logprobs,
            logprobs=self._sampled_logprobs(req_ids),
        )
        remaining = step_seconds - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)
        if self.gpu is not None and step is not None:
            self.gpu.step_end(step)

    def _sampled_logprobs(self, req_ids: list[str]) -> Any:
        """What a GPU runner's sampler returns when a request in the batch asked for `logprobs`
        (vllm/v1/sample/sampler.py): one row per scheduled request, in batch order, holding the
        sampled token then the top-k (the batch's largest k). No model: the sampled token is
        the top one (log-probability 0, rank 1) and the k - 1 others are the next token ids,
        each less likely. None when no request asked (as on a GPU)."""
        if not self._sample_logprobs or not any(r in self._sample_logprobs for r in req_ids):
            return None
        import numpy as np

        LogprobsLists = vllm.load(vllm.LOGPROBS_LISTS)

        k = max(self._sample_logprobs.get(r, 0) for r in req_ids)
        ids = np.array([self.token_id, *(self.token_id + j for j in range(k))], dtype=np.int32)
        values = np.array([0.0, *(-2.0 * j for j in range(k))], dtype=np.float32)
        rows = len(req_ids)
        return LogprobsLists(
            logprob_token_ids=np.tile(ids, (rows, 1)),
            logprobs=np.tile(values, (rows, 1)),
            sampled_token_ranks=np.ones(rows, dtype=np.int32),
        )

    def _prompt_logprob_tensors(self, req_id: str) -> Any:
        """What a GPU runner returns at the end of a prompt_logprobs prefill: for each prompt
        position after the first, the next prompt token and top-k entries (no model: every
        entry is that token, log-probability 0, rank 1)."""
        LogprobsTensors = vllm.load(vllm.LOGPROBS_TENSORS)

        prompt, top = self._prompt_logprobs.pop(req_id)
        targets = torch.tensor(prompt[1:], dtype=torch.int32)
        ids = targets.unsqueeze(1).repeat(1, top + 1)
        return LogprobsTensors(
            logprob_token_ids=ids,
            logprobs=torch.zeros(ids.shape, dtype=torch.float32),
            selected_token_ranks=torch.ones(len(targets), dtype=torch.int32),
        )

    def sample_tokens(self, grammar_output: Any) -> Any:  # a ModelRunnerOutput
        output, self._pending = self._pending, None
        return output or ModelRunnerOutput(req_ids=[], req_id_to_index={})

    def compile_or_warm_up_model(self) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        # Housekeeping RPCs a GPU worker implements (cache resets, profiling, LoRA, sleep) are
        # no-ops without a model.
        if name.startswith("_"):
            raise AttributeError(name)

        def noop(*args: Any, **kwargs: Any) -> None:
            log.debug("model-free worker: ignoring %s", name)

        return noop


def _top_k(requested: int) -> int:
    """The top-k a GPU runner returns for a `logprobs`/`prompt_logprobs` value (-1: the whole
    vocabulary, which vLLM bounds by `max_logprobs`, 20 by default)."""
    return min(requested if requested >= 0 else 20, 20)


def _run(call: Callable[[], Any], non_block: bool) -> Any:
    """The result, or with `non_block` a Future holding it (or the exception it raised)."""
    if not non_block:
        return call()
    future: Future[Any] = Future()
    try:
        future.set_result(call())
    except Exception as exc:
        future.set_exception(exc)
    return future


class ModelFreeExecutor(Executor):  # type: ignore[misc,valid-type]  # vLLM's, via vllm_seam
    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.worker = ModelFreeWorker(self.vllm_config)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        # One worker: the result list has one entry. A callable gets the worker as `self`.
        if isinstance(method, str):
            fn = getattr(self.worker, method)
        else:
            fn = functools.partial(method, self.worker)

        def call() -> list[Any]:
            return [fn(*args, **(kwargs or {}))]

        return _run(call, non_block)

    def _single(self, method: str, arg: Any, non_block: bool) -> Any:
        # vLLM expects one result (not a list) from execute_model / sample_tokens.
        return _run(lambda: getattr(self.worker, method)(arg), non_block)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        return self._single("execute_model", scheduler_output, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        return self._single("sample_tokens", grammar_output, non_block)

    def compile_or_warm_up_model(self) -> None:
        pass

    def determine_available_memory(self) -> list[int]:
        return [self.worker.determine_available_memory()]

    def check_health(self) -> None:
        self.worker.check_health()

    def shutdown(self) -> None:
        pass
