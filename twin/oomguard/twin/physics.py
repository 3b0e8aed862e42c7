"""The GPU twin's physics: how long a step takes and how much device memory it needs.

The twin decides only time and memory; vLLM's own scheduler decides admission, batching and
preemption. Everything here is a documented formula over documented parameters (docs/twin.md):

- **Step time**: a roofline. A step costs max(compute, memory traffic):
  compute = 2 x parameters x scheduled tokens + 4 x layers x attention width x (each scheduled
  token's context), at `mfu` of the GPU's dense BF16 peak; traffic = the weights once plus the KV
  cache of every scheduled request's context, at `mbu` of the memory bandwidth. Peaks are the
  vendors' data-sheet figures.
- **Memory**: the weights, the KV pool vLLM sizes at start (gpu_memory_utilization x total, minus
  weights, minus the activation peak of its profiling run at max_num_batched_tokens, minus the
  CUDA graph pool and non-torch memory), then per step the activations of the scheduled tokens,
  the logits of prompt tokens that asked for prompt_logprobs (FP32, every vocabulary entry),
  allocator fragmentation (reserved - allocated) and other processes on the GPU. A step whose peak
  exceeds the device raises a CUDA out-of-memory error, as the real one would.
- **Activations** are calibrated on a field report for Llama-3-8B (no public source found): an
  unchunked 30K-token prefill needed 11.2 GB, a 2,048-token chunk 2.1 GB; linear in tokens, the
  per-token part scaled by hidden size for other models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from oomguard.logits import LogitsShape
from oomguard.sizing.model import ModelShape, shape_from_hf_config
from oomguard.twin.gpu import GPU_MODELS, MIB

# Calibration (the field report above; Llama-3-8B, hidden 4096): 2,048 tok 2.1 GB, 30,000 11.2 GB
_CAL_HIDDEN = 4096
ACT_PER_TOKEN = (11.2e9 - 2.1e9) / (30_000 - 2_048)  # ~325.6 kB per token
ACT_BASE = 2.1e9 - 2_048 * ACT_PER_TOKEN  # ~1.43 GB of per-step workspace

SIM_MODELS = Path(__file__).resolve().parent / "models"


class TwinOutOfMemory(Exception):
    """A configuration that cannot even start (weights + profile do not fit): a type-1 OOM."""


@dataclass(frozen=True)
class Step:
    """What one engine step schedules, as the physics needs it."""

    tokens: int = 0  # every scheduled token (prefill chunks + one per decoding request)
    attention: int = 0  # sum over scheduled tokens of the context each one attends to
    context: int = 0  # sum over scheduled requests of their context (KV read this step)
    logits: int = 0  # prompt tokens whose logits are materialised (prompt_logprobs)


@dataclass(frozen=True)
class Physics:
    shape: ModelShape
    gpu: str = "H100"
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    graph_pool_bytes: int = 512 * MIB
    non_torch_bytes: int = 512 * MIB  # CUDA context, NCCL and other non-torch memory
    mfu: float = 0.5  # achievable share of peak compute
    mbu: float = 0.8  # achievable share of peak bandwidth

    @classmethod
    def for_model(cls, config: str | Path = "llama-3-8b", **kw: Any) -> Physics:
        path = SIM_MODELS / str(config) / "config.json"  # a twin model by name
        if not path.is_file():
            path = Path(config)
        return cls(shape_from_hf_config(json.loads(path.read_text())), **kw)

    # -- the device --------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return GPU_MODELS[self.gpu].total_mib * MIB

    @property
    def driver_reserved(self) -> int:
        return GPU_MODELS[self.gpu].reserved_mib * MIB

    @property
    def usable(self) -> int:
        """The CUDA runtime's total, which vLLM plans against: NVML's total less reserved."""
        return self.total - self.driver_reserved

    # The engine's fixed sizes are computed once per Physics (frozen: they never change). The
    # twin asks for them at every step, and the step guard before every step (step_room): the
    # model's parameter count walked its layers each time, ~3 % of a twin engine core's CPU,
    # which a GPU's engine does not spend.
    @cached_property
    def parameters(self) -> int:
        return self.shape.parameter_count()

    @cached_property
    def weights(self) -> int:
        return int(self.parameters * self.shape.dtype_bytes)

    @cached_property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token()

    # -- memory ------------------------------------------------------------------------------
    def activation(self, tokens: int) -> int:
        if tokens <= 0:
            return 0
        per_token = ACT_PER_TOKEN * self.shape.hidden_size / _CAL_HIDDEN
        return int(ACT_BASE + per_token * tokens)

    def logits(self, tokens: int) -> int:
        # prompt_logprobs of a chunk of `tokens`, as vLLM 0.33 holds them (oomguard.logits)
        shape = LogitsShape(self.shape.vocab_size, int(self.shape.dtype_bytes))
        return shape.prompt_logprobs_peak(tokens)

    @cached_property
    def kv_pool(self) -> int:
        """The pool vLLM allocates at start, after its profiling run: gmu x the CUDA runtime's
        total (vllm/v1/worker/utils.py request_memory) minus weights, the profiled activation
        peak, the CUDA graph estimate (profiled by default since vLLM 0.21) and non-torch."""
        budget = self.gpu_memory_utilization * self.usable
        pool = int(
            budget
            - self.weights
            - self.activation(self.max_num_batched_tokens)
            - self.graph_pool_bytes
            - self.non_torch_bytes
        )
        if pool <= 0:
            raise TwinOutOfMemory(
                f"weights {self.weights / 2**30:.1f} GiB + profile do not fit in "
                f"{self.gpu_memory_utilization} x {self.usable / 2**30:.1f} GiB"
            )
        return pool

    @cached_property
    def kv_blocks(self) -> int:
        return self.kv_pool // (self.block_size * self.kv_bytes_per_token)

    @cached_property
    def resident(self) -> int:
        """Held for the engine's life: weights, KV pool, CUDA graphs, non-torch memory."""
        return self.weights + self.kv_pool + self.graph_pool_bytes + self.non_torch_bytes

    def peak(self, step: Step, fragmentation: int = 0, neighbour: int = 0) -> int:
        """Device memory in use at the step's peak (everything on the GPU)."""
        return (
            self.driver_reserved
            + self.resident
            + self.activation(step.tokens)
            + self.logits(step.logits)
            + fragmentation
            + neighbour
        )

    def fits(self, step: Step, fragmentation: int = 0, neighbour: int = 0) -> bool:
        return self.peak(step, fragmentation, neighbour) <= self.total

    # -- time --------------------------------------------------------------------------------
    def step_seconds(self, step: Step) -> float:
        if step.tokens <= 0:
            return 0.0
        flops_peak, bandwidth = GPU_MODELS[self.gpu].flops, GPU_MODELS[self.gpu].bandwidth
        width = self.shape.attention_heads * self.shape.head_dim
        flops = 2 * self.parameters * step.tokens
        flops += 4 * self.shape.layers * width * step.attention
        traffic = self.weights + self.kv_bytes_per_token * step.context
        return max(flops / (flops_peak * self.mfu), traffic / (bandwidth * self.mbu))
