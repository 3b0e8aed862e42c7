"""Memory budget math for a vLLM deployment: weights, KV bytes per token, pool, concurrency.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element; for
Llama-3-8B in FP16 that is 2 x 32 x 8 x 128 x 2 = 131,072 B (128 KiB). MLA models (DeepSeek-V2/V3)
cache one compressed latent per layer instead: layers x (kv_lora_rank + qk_rope_head_dim) x bytes.

The KV pool is what vLLM leaves after weights and its profiled activation peak inside
`gpu_memory_utilization x device memory`. The activation estimate is calibrated on two field
points for an 8B model (a 2,048-token chunk needed 2.1 GB, an unchunked 30K-token prefill 11.2 GB)
and scales with the hidden size; vLLM's own "Available KV cache memory" log line is authoritative,
and `--overhead-bytes` / `--kv-pool-bytes` override the estimate.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from oomguard.errors import BudgetError

GIB = 1024**3

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

# Device memory as NVML reports it (MiB), for `--gpu NAME`.
GPU_MEMORY_MIB: dict[str, int] = {
    "H200": 143771,
    "H100": 81559,
    "A100-80GB": 81920,
    "A100-40GB": 40960,
    "L40S": 46068,
    "RTX4090": 24564,
    "L4": 23034,
}

# Activation peak = fixed part + per prefill token x hidden size (bytes); see module docstring.
ACTIVATION_FIXED_BYTES = 1.45e9
ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 77.5
# CUDA graph pool, NCCL and cuBLAS workspaces: outside the torch allocator, inside the budget.
NON_TORCH_BYTES = 1.0 * GIB

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "KB": 1e3,
    "M": 1e6,
    "MB": 1e6,
    "G": 1e9,
    "GB": 1e9,
    "T": 1e12,
    "TB": 1e12,
    "KI": 2**10,
    "KIB": 2**10,
    "MI": 2**20,
    "MIB": 2**20,
    "GI": 2**30,
    "GIB": 2**30,
    "TI": 2**40,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'80GiB' -> 85899345920; '24GB' -> 24e9; '1024' -> 1024 bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 24GB, 81559MiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    dtype_bytes: float
    max_position_embeddings: int | None = None
    mla_latent_dim: int | None = None  # kv_lora_rank + qk_rope_head_dim for MLA models
    experts: int = 0
    expert_intermediate_size: int = 0
    shared_experts: int = 0

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> int:
        b = kv_dtype_bytes if kv_dtype_bytes is not None else self.dtype_bytes
        if self.mla_latent_dim is not None:
            return int(self.layers * self.mla_latent_dim * b)
        return int(2 * self.layers * self.kv_heads * self.head_dim * b)

    def parameter_count(self) -> int:
        """An estimate from the shapes (attention, MLP or experts, embeddings); norms ignored."""
        h = self.hidden_size
        q = self.attention_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.experts:
            mlp = 3 * h * self.expert_intermediate_size * (self.experts + self.shared_experts)
        else:
            mlp = 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.layers * (attention + mlp) + embeddings


def _get(cfg: dict[str, Any], *names: str) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return None


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """Read a Hugging Face `config.json`. Unsupported or incomplete configs raise BudgetError."""
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM inside
        cfg = {**cfg, **cfg["text_config"]}
    layer_types = cfg.get("layer_types") or []
    if any(isinstance(t, str) and ("mamba" in t or "linear" in t) for t in layer_types) or any(
        k.startswith(("mamba_", "ssm_")) for k in cfg
    ):
        raise BudgetError(
            "hybrid or state-space model (mamba/linear-attention layers): its cache is not "
            "a per-token KV cache and this budget would be wrong; size it from vLLM's startup log"
        )
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    heads = _get(cfg, "num_attention_heads", "n_head")
    missing = [
        n
        for n, v in (
            ("num_hidden_layers", layers),
            ("hidden_size", hidden),
            ("num_attention_heads", heads),
        )
        if v is None
    ]
    if missing:
        raise BudgetError(f"config.json lacks {', '.join(missing)}: cannot size the KV cache")
    kv_heads = _get(cfg, "num_key_value_heads", "num_kv_heads") or heads  # no GQA: MHA
    head_dim = _get(cfg, "head_dim") or hidden // heads
    dtype_name = str(_get(cfg, "torch_dtype", "dtype") or "float16").removeprefix("torch.")
    if dtype_name not in DTYPE_BYTES:
        raise BudgetError(f"unknown dtype {dtype_name!r} in config.json")
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
    experts = int(_get(cfg, "num_local_experts", "n_routed_experts", "num_experts") or 0)
    return ModelShape(
        layers=int(layers),
        hidden_size=int(hidden),
        attention_heads=int(heads),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        intermediate_size=int(_get(cfg, "intermediate_size", "n_inner") or 4 * hidden),
        vocab_size=int(_get(cfg, "vocab_size") or 0),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype_bytes=DTYPE_BYTES[dtype_name],
        max_position_embeddings=_get(cfg, "max_position_embeddings"),
        mla_latent_dim=mla,
        experts=experts,
        expert_intermediate_size=int(
            _get(cfg, "moe_intermediate_size") or _get(cfg, "intermediate_size") or 0
        ),
        shared_experts=int(_get(cfg, "n_shared_experts") or 0),
    )


@dataclass
class BudgetInputs:
    gpu_memory_bytes: int
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    context_len: int | None = None  # context for the concurrency figure; default max_model_len
    weights_bytes: int | None = None  # override the estimate (quantized checkpoints)
    overhead_bytes: int | None = None  # override activation + non-torch estimate
    kv_pool_bytes: int | None = None  # override the pool entirely (from vLLM's log)


@dataclass
class Budget:
    kv_bytes_per_token: int  # whole model
    kv_bytes_per_token_per_gpu: int
    weights_bytes_per_gpu: int
    overhead_bytes_per_gpu: int
    kv_pool_bytes_per_gpu: int
    kv_pool_tokens: int
    max_model_len: int
    context_len: int
    concurrency_at_context: float
    max_num_seqs: int
    recommended_max_num_seqs: int
    recommended_range: tuple[int, int]
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute(shape: ModelShape, inp: BudgetInputs) -> Budget:
    if not 0 < inp.gpu_memory_utilization <= 1:
        raise BudgetError("gpu_memory_utilization must be in (0, 1]")
    if inp.tensor_parallel_size < 1:
        raise BudgetError("tensor_parallel_size must be at least 1")
    tp = inp.tensor_parallel_size
    warnings: list[str] = []
    kv_dtype = None if inp.kv_cache_dtype == "auto" else DTYPE_BYTES.get(inp.kv_cache_dtype)
    if inp.kv_cache_dtype != "auto" and kv_dtype is None:
        raise BudgetError(f"unknown kv_cache_dtype {inp.kv_cache_dtype!r}")
    per_token = shape.kv_bytes_per_token(kv_dtype)
    if shape.mla_latent_dim is not None:
        per_token_gpu = per_token  # the latent is replicated on every TP rank
    else:
        if shape.kv_heads % tp and tp % shape.kv_heads:
            warnings.append(f"{shape.kv_heads} KV heads do not split evenly over TP={tp}")
        heads_per_gpu = max(1, math.ceil(shape.kv_heads / tp))
        per_token_gpu = per_token * heads_per_gpu // shape.kv_heads
    weights = inp.weights_bytes
    if weights is None:
        weights = int(shape.parameter_count() * shape.dtype_bytes)
    weights_gpu = weights // tp
    if inp.overhead_bytes is not None:
        overhead = inp.overhead_bytes
    else:
        activation = ACTIVATION_FIXED_BYTES + (
            inp.max_num_batched_tokens * ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN * shape.hidden_size
        )
        overhead = int(activation / tp + NON_TORCH_BYTES)
    budget = inp.gpu_memory_bytes * inp.gpu_memory_utilization
    if inp.kv_pool_bytes is not None:
        pool = inp.kv_pool_bytes
    else:
        pool = int(budget - weights_gpu - overhead)
    if inp.gpu_memory_utilization > 0.94:
        warnings.append(
            f"gpu_memory_utilization {inp.gpu_memory_utilization} leaves under 6 % for "
            "activation peaks, CUDA graphs and other processes; operators run 0.88-0.92"
        )
    if weights_gpu > budget:
        warnings.append("the weights alone exceed the memory budget: startup OOM (type 1)")
    pool = max(pool, 0)
    tokens = (pool // per_token_gpu) // inp.block_size * inp.block_size if per_token_gpu else 0
    max_len = inp.max_model_len or shape.max_position_embeddings or 0
    if not max_len:
        raise BudgetError("max_model_len is unknown: pass --max-model-len")
    context = inp.context_len or max_len
    concurrency = tokens / context if context else 0.0
    if tokens < max_len:
        warnings.append(
            f"one request at max_model_len={max_len} needs {max_len} KV tokens but the pool "
            f"holds {tokens}: vLLM will refuse to start; lower max_model_len or add memory"
        )
    if inp.max_num_seqs > concurrency:
        warnings.append(
            f"max_num_seqs={inp.max_num_seqs} but only {concurrency:.1f} requests of "
            f"{context} tokens fit: under long contexts vLLM will queue or preempt"
        )
    low, high = max(1, math.floor(0.7 * concurrency)), max(1, math.floor(0.8 * concurrency))
    return Budget(
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_token_gpu,
        weights_bytes_per_gpu=weights_gpu,
        overhead_bytes_per_gpu=overhead,
        kv_pool_bytes_per_gpu=pool,
        kv_pool_tokens=tokens,
        max_model_len=max_len,
        context_len=context,
        concurrency_at_context=concurrency,
        max_num_seqs=inp.max_num_seqs,
        recommended_max_num_seqs=max(1, math.floor(0.75 * concurrency)),
        recommended_range=(low, high),
        warnings=warnings,
    )
