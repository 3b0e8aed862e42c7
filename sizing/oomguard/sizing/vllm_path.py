"""vLLM's own code first: where vLLM is importable, the KV cache specs and the planning come from
vLLM itself (`oomguard.sizing.vllm_probe`, run in a child process so vLLM's global state, its
logging and a hang stay out of the caller; bounded by a timeout).

The pure-Python reader (`oomguard.sizing.model`, `capacity`) stays for machines without vLLM and
is checked against this path on a corpus of real configs (tests/test_budget_vllm.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

PROBE_TIMEOUT_S = 600.0  # importing vLLM and building a model: seconds on an idle CPU


def vllm_importable() -> bool:
    """True where `import vllm` would find a package (without importing it: seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


@dataclass
class VllmPlan:
    """vLLM's planner on one pool size: its blocks, groups, tokens and concurrency, or its
    refusal ("To serve at least one request ...")."""

    available: int
    num_blocks: int = 0
    groups: int = 0
    tokens: int = 0
    max_concurrency: float = 0.0
    error: str = ""


@dataclass
class VllmSizing:
    ok: bool
    error: str = ""
    architecture: str = ""
    layers: list[dict[str, Any]] = field(default_factory=list)
    kv_cache_dtype: str = ""
    block_size: int = 0
    max_model_len: int = 0
    weights_bytes_per_gpu: int | None = None  # parameters and buffers, CUDA's layout
    parameter_bytes_per_gpu: int | None = None  # parameters alone
    quant_method: str = ""
    plans: list[VllmPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """Bytes one cached token takes on one GPU over every layer that owns a cache."""
        return sum(layer["page_size_bytes"] // layer["block_size"] for layer in self.layers)


def job(
    config: dict[str, Any],
    *,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    async_scheduling: bool = True,
    available: list[int] | None = None,
    hf_quant_config: dict[str, Any] | None = None,
    pool_before_weights: int | None = None,
    fallback_weights: int | None = None,
    extra_weights: int = 0,
) -> dict[str, Any]:
    """One model to size. `available`: KV pool sizes to plan. Or `pool_before_weights`
    (gpu_memory_utilization x total less the profiled non-KV memory): the pool is that less
    vLLM's own parameter bytes plus `extra_weights` (what the child does not build: a vision
    tower), or less `fallback_weights` where vLLM's bytes are not CUDA's."""
    return {
        "pool_before_weights": pool_before_weights,
        "fallback_weights": fallback_weights,
        "extra_weights": extra_weights,
        "config": config,
        "hf_quant_config": hf_quant_config,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens,
        "tensor_parallel_size": tensor_parallel_size,
        "kv_cache_dtype": kv_cache_dtype,
        "block_size": block_size,
        "async_scheduling": async_scheduling,
        "available": available or [],
    }


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _parse(raw: dict[str, Any]) -> VllmSizing:
    if not raw.get("ok"):
        return VllmSizing(False, error=str(raw.get("error", "unknown failure")))
    plans = [
        VllmPlan(
            int(p["available"]),
            int(p.get("num_blocks", 0)),
            int(p.get("groups", 0)),
            int(p.get("tokens", 0)),
            float(p.get("max_concurrency", 0.0)),
            str(p.get("error", "")),
        )
        for p in raw.get("plans", [])
    ]
    return VllmSizing(
        True,
        architecture=str(raw.get("architecture", "")),
        layers=list(raw.get("layers", [])),
        kv_cache_dtype=str(raw.get("kv_cache_dtype", "")),
        block_size=int(raw.get("block_size", 0)),
        max_model_len=int(raw.get("max_model_len", 0)),
        weights_bytes_per_gpu=_optional_int(raw.get("weights_bytes_per_gpu")),
        parameter_bytes_per_gpu=_optional_int(raw.get("parameter_bytes_per_gpu")),
        quant_method=str(raw.get("quant_method", "")),
        plans=plans,
        notes=[str(n) for n in raw.get("notes", [])],
    )


def run(jobs: list[dict[str, Any]], timeout: float = PROBE_TIMEOUT_S) -> list[VllmSizing]:
    """vLLM's sizing of each job, in one child process. A child that fails as a whole (vLLM
    not importable, a crash, the timeout) answers every job with the reason."""
    env = dict(os.environ)
    # Nothing here touches a GPU: vLLM's CPU platform builds the model on the meta device.
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # config.json and nothing else: no Hub look-ups (a model name never leaves this machine)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "oomguard.sizing.vllm_probe"],
            input=json.dumps(jobs),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return [VllmSizing(False, error=f"vLLM's sizing took over {timeout:.0f} s")] * len(jobs)
    except OSError as exc:
        return [VllmSizing(False, error=f"cannot run vLLM's sizing: {exc}")] * len(jobs)
    try:
        answers = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = " ".join(done.stderr.strip().splitlines()[-3:])[:300]
        reason = f"vLLM's sizing failed (exit {done.returncode}): {tail}"
        return [VllmSizing(False, error=reason)] * len(jobs)
    if not isinstance(answers, list) or len(answers) != len(jobs):
        return [VllmSizing(False, error="vLLM's sizing answered out of shape")] * len(jobs)
    return [
        _parse(a) if isinstance(a, dict) else VllmSizing(False, error="bad answer") for a in answers
    ]


def apply(budget: Any, sizing: VllmSizing) -> None:
    """Put vLLM's own figures into a `Budget` sized by the pure path for the same inputs: the
    specs' bytes per token, the planner's blocks, groups, tokens and concurrency, and its refusal
    as the verdict. Where the two disagree the output says so (a fallback that is wrong must
    never be silent: tests/test_budget_vllm.py keeps them equal on the corpus)."""
    if not sizing.ok or not sizing.plans:
        budget.notes.append(
            f"vLLM's own sizing was not available ({sizing.error or 'no plan'}): the "
            "pure-Python reader sized this"
        )
        return
    plan = sizing.plans[0]
    budget.sizing_path = "vllm"
    budget.notes.extend(f"vLLM path: {n}" for n in sizing.notes)
    budget.assumptions.append(
        "vLLM path: CUDA's FlashAttention kernel block sizes (a sliding-window layer takes its "
        "block size from them), built on the CPU platform with the meta device"
    )
    per_token = sizing.kv_bytes_per_token_per_gpu
    differs = per_token != budget.kv_bytes_per_token_per_gpu or plan.tokens != budget.kv_pool_tokens
    if differs and not plan.error:
        budget.notes.append(
            f"the pure-Python reader differs from vLLM's code here ({budget.kv_pool_tokens:,} "
            f"tokens, {budget.kv_bytes_per_token_per_gpu:,} B a token): vLLM's are shown"
        )
    budget.kv_bytes_per_token_per_gpu = per_token
    if plan.error:
        budget.will_not_start = budget.will_not_start or f"vLLM refuses: {plan.error[:300]}"
        budget.recommended_max_num_seqs = 0
        budget.recommended_range = (0, 0)
        return
    budget.num_blocks = plan.num_blocks
    budget.kv_cache_groups = plan.groups
    budget.kv_pool_tokens = plan.tokens
    budget.max_concurrency = plan.max_concurrency
    if budget.context_len == budget.max_model_len:
        budget.concurrency_at_context = plan.max_concurrency
