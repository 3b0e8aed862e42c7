"""The deploy-time gate: `oomguard budget CONFIG --deployment manifest.yaml` (or
`--serve-command "vllm serve ..."`) sizes each vLLM workload with its own flags on each GPU it
may be scheduled on, before anything reaches a GPU (docs/budget.md, "Deploy-time gate").

A workload's verdict, and the exit status a pipeline gates on:
- 0 `starts`: vLLM starts and one request of `max_model_len` fits its pool (and, with
  `--gate-prompt-logprobs`, a `max_model_len` prompt with `prompt_logprobs` fits too);
- 1 `will not start` (vLLM's own refusal: the weights, no pool, one request that does not fit,
  more ranks than the pod's GPUs) or `longest request does not fit` (the prompt_logprobs gate);
- 2 `cannot size`: a flag whose memory is not modelled, a GPU type nobody named, a config that
  cannot be sized. A gate never passes what it cannot size.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomguard.errors import BudgetError
from oomguard.gpus import lookup
from oomguard.sizing.capacity import kv_capacity
from oomguard.sizing.deploy import Workload, from_command_line, from_manifest


@dataclass
class GateResult:
    workload: Workload
    gpu: str  # the GPU table's key, or "" for --gpu-memory
    memory: int
    status: int  # 0 starts, 1 will not start / longest request does not fit, 2 cannot size
    verdict: str
    reason: str = ""
    budget: Any = None
    inputs: Any = None
    notes: list[str] = field(default_factory=list)

    def headline(self) -> str:
        gpus = f", {self.workload.gpus} GPU(s)" if self.workload.gpus else ""
        on = self.gpu or f"{self.memory / 1024**3:,.1f} GiB"
        why = f": {self.reason}" if self.reason else ""
        return f"{self.workload.source} ({self.workload.model}) on {on}{gpus}: {self.verdict}{why}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.workload.source,
            "model": self.workload.model,
            "serve_flags": self.workload.flags,
            "gpus": self.workload.gpus,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.memory,
            "status": self.status,
            "verdict": self.verdict,
            "reason": self.reason,
            "notes": [*self.workload.notes, *self.notes],
            "budget": self.budget.to_dict() if self.budget is not None else None,
        }


def _gpus(args: argparse.Namespace, work: Workload) -> list[tuple[str, int]]:
    """(GPU key, CUDA total) for every GPU the workload may run on."""
    from oomguard.gpus import GPUS
    from oomguard.units import parse_size

    if args.gpu:
        return [(args.gpu, GPUS[args.gpu].cuda_total_bytes)]
    if args.gpu_memory:
        try:
            return [("", parse_size(args.gpu_memory))]
        except ValueError as exc:
            raise BudgetError(str(exc)) from exc
    if not work.gpu_labels:
        raise BudgetError(
            f"{work.source}: no node label names the GPU (nvidia.com/gpu.product, "
            "cloud.google.com/gke-accelerator): pass --gpu NAME or --gpu-memory SIZE"
        )
    out = []
    for label in dict.fromkeys(work.gpu_labels):
        spec = lookup(label)
        if spec is None:
            raise BudgetError(
                f"{work.source}: GPU label {label[:60]!r} is not in the GPU table: pass --gpu "
                "NAME or --gpu-memory SIZE"
            )
        out.append((spec.key, spec.cuda_total_bytes))
    return out


def _auto_fit(shape: Any, budget: Any, inputs: Any) -> int:
    """The longest max_model_len one request fits in the pool (vLLM's `--max-model-len auto`
    fits it at start): a binary search over vLLM's per-request block count."""
    from oomguard.sizing.budget import kv_bytes_for

    def fits(tokens: int) -> bool:
        cap = kv_capacity(
            shape,
            budget.kv_pool_bytes_per_gpu,
            tokens,
            kv_bytes=kv_bytes_for(shape, inputs.kv_cache_dtype),
            block_size=inputs.block_size,
            tensor_parallel_size=inputs.tensor_parallel_size,
            max_num_batched_tokens=budget.max_num_batched_tokens,
            async_scheduling=inputs.async_scheduling,
        )
        return cap.max_concurrency >= 1

    low, high = 0, budget.max_model_len
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _judge(
    args: argparse.Namespace,
    work: Workload,
    gpu: str,
    memory: int,
    inputs_for: Callable[[int, str, dict[str, Any]], Any],
    size: Callable[[Any], Any],
    shape: Any,
) -> GateResult:
    def result(status: int, verdict: str, reason: str = "", **kw: Any) -> GateResult:
        return GateResult(work, gpu, memory, status, verdict, reason, **kw)

    if work.unsizable:
        return result(2, "cannot size", work.unsizable)
    inputs = inputs_for(memory, gpu, work.flags)
    ranks = inputs.tensor_parallel_size * inputs.pipeline_parallel_size * inputs.data_parallel_size
    if work.gpus is not None and ranks > work.gpus:
        return result(
            1,
            "will not start",
            f"TP {inputs.tensor_parallel_size} x PP {inputs.pipeline_parallel_size} x DP "
            f"{inputs.data_parallel_size} = {ranks} ranks on a pod with {work.gpus} GPU(s)",
            inputs=inputs,
        )
    try:
        budget = size(inputs)
    except BudgetError as exc:
        return result(2, "cannot size", str(exc), inputs=inputs)
    notes: list[str] = []
    if work.max_model_len_auto and budget.will_not_start.startswith("one request"):
        fitted = _auto_fit(shape, budget, inputs)
        notes.append(f"--max-model-len auto: vLLM fits it to the pool at start, about {fitted:,}")
        budget.will_not_start = ""
    if budget.will_not_start:
        return result(1, "will not start", budget.will_not_start, budget=budget, inputs=inputs)
    longest = budget.longest_prompt_logprobs_prompt
    if longest < budget.max_model_len:
        line = (
            f"a prompt with prompt_logprobs fits up to {longest:,} of the {budget.max_model_len:,} "
            "tokens max_model_len allows"
        )
        if args.gate_prompt_logprobs:
            return result(
                1, "longest request does not fit", line, budget=budget, inputs=inputs, notes=notes
            )
        notes.append(line + " (--gate-prompt-logprobs makes this fail the gate)")
    return result(0, "starts", budget=budget, inputs=inputs, notes=notes)


def evaluate(
    args: argparse.Namespace,
    config: dict[str, Any],
    quant: dict[str, Any] | None,
    *,
    inputs_for: Callable[[int, str, dict[str, Any]], Any],
    size: Callable[[Any], Any],
) -> list[GateResult]:
    """Every workload on every GPU it may land on."""
    from oomguard.sizing.model import shape_from_hf_config, with_hf_quant_config

    shape = shape_from_hf_config(with_hf_quant_config(config, quant))
    works = (
        from_manifest(args.deployment)
        if args.deployment
        else [from_command_line(args.serve_command)]
    )
    results = []
    for work in works:
        for gpu, memory in _gpus(args, work):
            results.append(_judge(args, work, gpu, memory, inputs_for, size, shape))
    return results
