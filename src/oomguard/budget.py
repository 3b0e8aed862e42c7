"""Memory budget for a vLLM 0.33 deployment, by vLLM's own accounting (docs/budget.md).

Three parts, each named after the vLLM code it follows:

1. **KV cache specs per layer** (`vllm/v1/kv_cache_interface.py`): every attention layer that
   owns a cache gets a page of `block_size x KV heads on this GPU x (K dim + V dim) x KV bytes`;
   sliding-window and chunked-local layers hold at most a window of tokens per request; MLA
   layers cache one latent of `kv_lora_rank + qk_rope_head_dim` per token, replicated on every
   tensor-parallel rank; layers that reuse another layer's cache own none.
2. **Capacity** (`vllm/v1/core/kv_cache_planning.py`, `kv_cache_utils.py`): layers are grouped
   as vLLM groups them, a block holds one page of each layer in the widest group, the pool
   holds `available // bytes_per_block` blocks, a request at `max_model_len` needs the sum of
   each group's blocks, and vLLM logs `int(blocks / blocks_per_request x max_model_len)` as
   "GPU KV cache size: N tokens".
3. **Available KV memory** (`vllm/v1/worker/gpu_worker.py`): `gpu_memory_utilization x total`
   minus weights (quantization-aware, per GPU), the profiled activation peak of a
   `max_num_batched_tokens` forward pass plus the sampler's dummy run, non-torch memory and
   the CUDA graph estimate. This part is an estimate (constants and their sources in
   docs/budget.md); vLLM's "Available KV cache memory" log line is authoritative and
   `--kv-pool-bytes` takes it.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from oomguard import units
from oomguard.digits import decimal
from oomguard.errors import BudgetError

GIB = 1024**3
MIB = 1024**2

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
    "fp8_inc": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

# Device memory as NVML reports it (MiB), for `--gpu NAME`, and NVML's "reserved" part that the
# CUDA runtime's total (what vLLM multiplies by gpu_memory_utilization) leaves out. Reserved
# figures as seen on typical drivers, the same table the GPU twin uses (src/oomguard/twin/gpu.py).
GPU_MEMORY_MIB: dict[str, int] = {
    "B200": 183359,
    "H200": 143771,
    "H100": 81559,
    "A100-80GB": 81920,
    "A100-40GB": 40960,
    "L40S": 46068,
    "RTX4090": 24564,
    "L4": 23034,
}
GPU_RESERVED_MIB: dict[str, int] = {
    "B200": 650,
    "H200": 600,
    "H100": 567,
    "A100-80GB": 543,
    "A100-40GB": 470,
    "L40S": 500,
    "RTX4090": 346,
    "L4": 430,
}


def cuda_total_bytes(gpu: str) -> int:
    """What `torch.cuda.mem_get_info` reports as total for a known GPU: NVML's total less the
    driver-reserved part (vllm/v1/worker/utils.py requests gmu x this)."""
    return (GPU_MEMORY_MIB[gpu] - GPU_RESERVED_MIB[gpu]) * MIB


# vLLM 0.33 defaults (vllm/config/cache.py, vllm/engine/arg_utils.py).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
MLA_BLOCK_SIZE = 64  # FlashMLA, the MLA backend on Hopper, needs 64-token blocks

# Non-KV memory, per GPU (docs/budget.md derives each one). Non-torch memory (cuBLAS/cuDNN
# workspaces, lazily loaded kernels, NCCL and custom all-reduce buffers) as vLLM logs it:
# the V1 engine 0.13-0.14 GiB on one H100 (five runs), 0.54-0.55 GiB per rank at TP 2 (two
# runs, vLLM 0.11.0) and 1.70 GiB at TP 4 (a recent vLLM); the V0 engine 0.35 GiB (RTX 3090,
# TP 1) and 0.32 GiB (A40, TP 2).
NON_TORCH_BYTES = int(0.13 * GIB)
NCCL_BYTES_PER_PEER = int(0.41 * GIB)  # per other rank of TP x PP (V1)
NON_TORCH_V0_BYTES = int(0.33 * GIB)  # V0, with or without TP
CUDA_GRAPH_BYTES = 512 * MIB  # the CUDA graph pool vLLM's profiler estimates
# The sampler's dummy run (gpu_model_runner._dummy_sampler_run) holds max_num_seqs x vocab
# logits on every rank (the logits processor all-gathers the vocabulary shards). vLLM 0.33:
# the model-dtype logits (2 B), their FP32 copy (4), the softmax (4) and the exponential noise
# of random_sample (4); top-k/top-p masking is in place (Triton or FlashInfer).
SAMPLER_BYTES_PER_LOGIT = 14
# Older vLLM (0.9-0.11 without VLLM_USE_FLASHINFER_SAMPLER=1) sorted every row in PyTorch:
# model-dtype logits 2 + FP32 copy 4 + int64 iota 8 + sorted values and indices 12 + the radix
# sort's double buffer 12 (docs/budget.md, "Sampler": a logged profile shows 38.6).
SORT_SAMPLER_BYTES_PER_LOGIT = 38
# Above this many parameters a MoE model's non-KV memory is least certain (Qwen3-235B-A22B-FP8
# at TP 4 on vLLM 0.9.2 logged 1.1 GiB more than this accounting, cause not found): the output
# says so.
LARGE_MOE_PARAMS = 100e9
# The Marlin GEMM of vLLM's V0 era (csrc/quantization/gptq_marlin/gptq_marlin.cu before the 2025
# rewrite) allocated an M x K copy of its input on every call (`a_tmp`, act-order or not) and an
# FP32 reduce buffer of up to 1,024 rows (`c_tmp`, marlin::determine_reduce_max_m, max_par 16).
MARLIN_METHODS = ("awq", "gptq", "awq_marlin", "gptq_marlin")
MARLIN_REDUCE_ROWS = 1024


# -- sizes: one parser for every flag and config (oomguard.units); re-exported for callers ----
parse_size = units.parse_size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


# -- the model --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerKV:
    """One decoder layer's attention cache, as vLLM's KV cache spec describes it."""

    kind: str  # "full", "sliding", "chunked" or "mla"
    kv_heads: int  # whole model (before tensor parallelism); 1 for MLA
    head_dim: int  # K width (MLA: kv_lora_rank + qk_rope_head_dim)
    head_dim_v: int  # V width (MLA: 0, the latent serves both)
    window: int | None = None  # sliding window or attention chunk, tokens
    owns_cache: bool = True  # False when the layer reads another layer's cache

    def bytes_per_token(self, kv_bytes: float, tp: int = 1) -> int:
        """Bytes this layer stores per cached token on one GPU."""
        if not self.owns_cache:
            return 0
        heads = self.kv_heads if self.kind == "mla" else max(1, self.kv_heads // tp)
        return int(heads * (self.head_dim + self.head_dim_v) * kv_bytes)


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint stores its linear weights (`quantization_config`)."""

    method: str = "none"  # none, fp8, mxfp4, awq, gptq, compressed-tensors, bitsandbytes, ...
    bytes_per_param: float = 0.0  # quantized linear layers, scales included; 0 = unquantized
    attention_excluded: bool = False  # attention projections kept in the model dtype
    experts_only: bool = False  # only MoE experts are quantized (mxfp4 on gpt-oss)


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
    experts_per_token: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in a MoE model (DeepSeek)
    layer_kv: tuple[LayerKV, ...] = ()  # one per layer; empty = uniform full attention
    quantization: Quantization = field(default_factory=Quantization)
    mla_dims: tuple[int, int, int, int] | None = None  # q_lora_rank, qk_nope, qk_rope, v_head
    notes: tuple[str, ...] = ()  # what the reader assumed, for the output
    vision_params: int = 0  # the vision tower and projector (config.json's vision_config)
    multimodal: bool = False  # a vision_config or a *ForConditionalGeneration wrapper
    # vLLM's Qwen2MLP (Qwen2, Qwen2.5, Qwen3 dense) names its gate/up output, so in eager
    # PyTorch it stays alive through down_proj; LlamaMLP rebinds `x` and frees it after the
    # activation (vllm/model_executor/models/qwen2.py, llama.py)
    mlp_keeps_gate_up: bool = False

    def layer_specs(self) -> tuple[LayerKV, ...]:
        if self.layer_kv:
            return self.layer_kv
        if self.mla_latent_dim is not None:
            return (LayerKV("mla", 1, self.mla_latent_dim, 0),) * self.layers
        return (LayerKV("full", self.kv_heads, self.head_dim, self.head_dim),) * self.layers

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> int:
        """Whole-model KV bytes per token of context, every layer's cache counted in full."""
        b = kv_dtype_bytes if kv_dtype_bytes is not None else self.dtype_bytes
        return sum(spec.bytes_per_token(b) for spec in self.layer_specs())

    # -- weights --------------------------------------------------------------------------
    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.mla_dims is not None and self.mla_latent_dim is not None:
            q_lora, nope, rope, v = self.mla_dims
            kv_lora = self.mla_latent_dim - rope
            heads = self.attention_heads
            q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
            kv = h * (kv_lora + rope) + kv_lora * heads * (nope + v)
            return q + kv + heads * v * h
        q = self.attention_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h

    def _param_groups(self) -> dict[str, int]:
        """Parameters by part: attention, dense MLP, routed experts, shared experts, embeddings."""
        h = self.hidden_size
        moe_layers = self.layers - self.dense_layers if self.experts else 0
        dense_layers = self.layers - moe_layers
        return {
            "attention": self.layers * self._attention_params(),
            "mlp": dense_layers * 3 * h * self.intermediate_size,
            "experts": moe_layers * 3 * h * self.expert_intermediate_size * self.experts,
            "shared_experts": moe_layers
            * 3
            * h
            * self.expert_intermediate_size
            * self.shared_experts,
            "router": moe_layers * h * self.experts,
            "embeddings": self.vocab_size * h * (1 if self.tied_embeddings else 2),
            "vision": self.vision_params,
        }

    def parameter_count(self) -> int:
        """An estimate from the shapes (attention, MLP or experts, embeddings); norms ignored."""
        return sum(self._param_groups().values())

    def weight_bytes(self) -> int:
        """Checkpoint weights in device memory, quantization applied (whole model)."""
        return int(sum(self.weight_bytes_by_part().values()))

    def weight_bytes_by_part(self) -> dict[str, float]:
        q = self.quantization
        groups = self._param_groups()
        out: dict[str, float] = {}
        for part, params in groups.items():
            # embeddings, the router and the vision tower stay in the model dtype
            quantized = q.bytes_per_param > 0 and part not in ("embeddings", "router", "vision")
            if q.experts_only and part != "experts":
                quantized = False
            if q.attention_excluded and part == "attention":
                quantized = False
            out[part] = params * (q.bytes_per_param if quantized else self.dtype_bytes)
        if q.method == "mxfp4" and self.experts:
            # vLLM pads MXFP4 expert weights to its kernels' tiles: hidden to a multiple of
            # 256, intermediate to 128 (Marlin on Hopper/Ampere, TRT-LLM on Blackwell:
            # mxfp4_round_up_hidden_size_and_intermediate_size in fused_moe/oracle/mxfp4.py).
            h, i = self.hidden_size, self.expert_intermediate_size
            padded = _round_up(h, 256) * _round_up(i, 128)
            out["experts"] *= padded / (h * i)
        return out


def _get(cfg: dict[str, Any], *names: str) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return None


def _int(cfg: dict[str, Any], *names: str, default: int | None = None) -> int | None:
    value = _get(cfg, *names)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BudgetError(f"config.json field {names[0]} is not a number: {value!r}")
    if not math.isfinite(value) or not 0 <= value < 2**48:
        raise BudgetError(f"config.json field {names[0]} is out of range: {value!r}")
    return int(value)


_SLIDING_TYPES = {"sliding_attention", "sliding_window", "local", "local_attention"}
_FULL_TYPES = {"full_attention", "global", "global_attention", "attention"}
_CHUNKED_TYPES = {"chunked_attention"}


def _layer_kinds(cfg: dict[str, Any], layers: int) -> list[str]:
    """Full or sliding per layer, from `layer_types` or the older pattern fields."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) < layers:
            raise BudgetError(f"layer_types lists {len(types)} layers, the model has {layers}")
        kinds = []
        for t in types[:layers]:
            t = str(t)
            if t in _SLIDING_TYPES:
                kinds.append("sliding")
            elif t in _FULL_TYPES:
                kinds.append("full")
            elif t in _CHUNKED_TYPES:
                kinds.append("chunked")
            else:
                raise BudgetError(
                    f"layer type {t!r} is not an attention layer with a per-token KV cache "
                    "(hybrid or state-space model): size it from vLLM's startup log lines "
                    "'Available KV cache memory' and 'GPU KV cache size'"
                )
        return kinds
    hybrid = cfg.get("hybrid_layer_pattern")
    if isinstance(hybrid, list) and hybrid:  # MiMo-V2: 1 marks a sliding-window layer
        if len(hybrid) < layers:
            raise BudgetError(f"hybrid_layer_pattern lists {len(hybrid)} layers, not {layers}")
        return ["sliding" if p == 1 else "full" for p in hybrid[:layers]]
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or not window:
        return ["full"] * layers
    pattern = _int(cfg, "sliding_window_pattern")
    if pattern:  # Gemma 3 style: every pattern-th layer is global
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    if cfg.get("model_type") in ("gemma2",):  # Gemma 2 alternates, starting with local
        return ["sliding" if i % 2 == 0 else "full" for i in range(layers)]
    max_window_layers = _int(cfg, "max_window_layers")
    if max_window_layers is not None and cfg.get("use_sliding_window"):
        return ["full" if i < max_window_layers else "sliding" for i in range(layers)]
    return ["sliding"] * layers  # Mistral v0.1: every layer slides


def _quantization(cfg: dict[str, Any]) -> Quantization:
    """Bytes per quantized parameter, scales included (docs/budget.md, "Quantization")."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not isinstance(qc, dict):
        return Quantization()
    method = str(qc.get("quant_method") or qc.get("quant_type") or "").lower()
    excluded = [
        str(p)
        for key in ("modules_to_not_convert", "ignored_layers", "ignore", "llm_int8_skip_modules")
        if isinstance(qc.get(key), list)
        for p in qc[key]
    ]
    attention_excluded = any("attn" in p or "attention" in p for p in excluded) or any(
        fnmatch.fnmatch("model.layers.0.self_attn.q_proj", p) for p in excluded
    )
    if method in ("fp8", "fbgemm_fp8", "modelopt", "ptpc_fp8"):
        # 1 byte per weight; block-wise (128x128) or per-channel FP32 scales add < 0.1 %.
        return Quantization(method, 1.0 + 4 / (128 * 128), attention_excluded)
    if method == "mxfp4":
        # 4-bit E2M1 values, one E8M0 scale per 32 values: 4.25 bits; experts only.
        return Quantization(method, 4.25 / 8, True, experts_only=True)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "auto-round", "autoround"):
        bits = _int(qc, "bits", "w_bit", default=4) or 4
        group = _int(qc, "group_size", "q_group_size", default=128) or 128
        group = group if group > 0 else 4096  # -1: one scale per output channel
        # per group: one FP16 scale and one packed zero point of `bits` bits
        return Quantization(method, (bits + (16 + bits) / group) / 8, attention_excluded)
    if method == "bitsandbytes":
        if qc.get("load_in_8bit"):
            return Quantization(method, 1.0, attention_excluded)
        # NF4/FP4 with one FP32 absmax per 64 values (double quantization shrinks it further)
        return Quantization(method, 0.5 + 4 / 64, attention_excluded)
    if method == "compressed-tensors":
        bits, group = 8, 0
        groups = qc.get("config_groups")
        for grp in groups.values() if isinstance(groups, dict) else []:
            w = grp.get("weights") if isinstance(grp, dict) else None
            if isinstance(w, dict) and w.get("num_bits"):
                bits = _int(w, "num_bits", default=8) or 8
                group = _int(w, "group_size", default=0) or 0
                break
        scale = 16 / group if group else 0.0
        return Quantization(method, (bits + scale) / 8, attention_excluded)
    if method in ("", "none"):
        return Quantization()
    raise BudgetError(
        f"quantization method {method!r} is not modelled: pass --weights-bytes from vLLM's "
        "'Model loading took X GiB' log line"
    )


def _vision_params(config: dict[str, Any], text_hidden: int) -> int:
    """Parameters of a vision tower and its projector, from `vision_config` (vLLM loads them in
    the model dtype with the language model: Mistral-Small-3.2's 0.44 B are 0.82 GiB of the
    44.76 GiB vLLM 0.11 logged). Pixtral-style towers: a patch convolution, `num_hidden_layers`
    blocks of attention (`num_attention_heads` x `head_dim` wide) and a gated SiLU MLP (three
    matrices; GELU MLPs of CLIP/SigLIP towers have two), then the projector: the patch merger
    (`spatial_merge_size`^2 x hidden -> hidden) and two linears to the text hidden size."""
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        return 0
    vh = _int(vc, "hidden_size", "embed_dim", default=0) or 0
    layers = _int(vc, "num_hidden_layers", "depth", default=0) or 0
    if not vh or not layers:
        return 0
    heads = _int(vc, "num_attention_heads", "num_heads", default=0) or 0
    head_dim = _int(vc, "head_dim", default=0) or (vh // heads if heads else vh)
    width = heads * head_dim if heads else vh
    inter = _int(vc, "intermediate_size", default=4 * vh) or 4 * vh
    matrices = 3 if vc.get("hidden_act") == "silu" else 2
    patch = _int(vc, "patch_size", default=14) or 14
    channels = _int(vc, "num_channels", default=3) or 3
    merge = _int(config, "spatial_merge_size", default=1) or 1
    per_layer = 4 * vh * width + matrices * vh * inter + 2 * vh  # + two norms
    merger = merge * merge * vh * vh if merge > 1 else 0
    projector = merger + vh * text_hidden + text_hidden * text_hidden
    return channels * patch * patch * vh + layers * per_layer + projector


# The deepest published language models have about 130 layers (Llama 3.1 405B: 126).
MAX_LAYERS = 10_000


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """Read a Hugging Face `config.json`. Unsupported or incomplete configs raise BudgetError."""
    if not isinstance(config, dict):
        raise BudgetError("config.json is not a JSON object")
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM inside
        outer_q = cfg.get("quantization_config")
        cfg = {**cfg, **cfg["text_config"]}
        if outer_q is not None and "quantization_config" not in config["text_config"]:
            cfg["quantization_config"] = outer_q
    if any(
        k.startswith(("mamba_", "ssm_", "linear_", "conv_")) or k == "hybrid_override_pattern"
        for k in cfg
    ):
        raise BudgetError(
            "hybrid or state-space model (mamba/linear-attention layers): its cache is not "
            "a per-token KV cache and this budget would be wrong; size it from vLLM's startup "
            "log lines 'Available KV cache memory' and 'GPU KV cache size'"
        )
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _int(cfg, "num_attention_heads", "n_head")
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
    assert layers is not None and hidden is not None and heads is not None
    if layers <= 0 or hidden <= 0 or heads <= 0:
        raise BudgetError("config.json has a non-positive layer, hidden or head count")
    if layers > MAX_LAYERS:  # sizing walks the layers: 10**8 of them took minutes and GBs
        raise BudgetError(
            f"config.json field num_hidden_layers is {layers:,}: over {MAX_LAYERS:,}, not a model"
        )
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", default=heads) or heads
    head_dim = _int(cfg, "head_dim", default=hidden // heads) or hidden // heads
    dtype_name = str(_get(cfg, "torch_dtype", "dtype") or "bfloat16").removeprefix("torch.")
    if dtype_name not in DTYPE_BYTES:
        raise BudgetError(f"unknown dtype {dtype_name!r} in config.json")
    # vLLM's dtype "auto" runs FP32 checkpoints in BF16/FP16 (vllm/config/model.py).
    dtype_bytes = min(DTYPE_BYTES[dtype_name], 2)
    notes: list[str] = []

    mla = None
    mla_dims = None
    if cfg.get("kv_lora_rank"):
        rope = _int(cfg, "qk_rope_head_dim", default=0) or 0
        mla = (_int(cfg, "kv_lora_rank", default=0) or 0) + rope
        mla_dims = (
            _int(cfg, "q_lora_rank", default=0) or 0,
            _int(cfg, "qk_nope_head_dim", default=0) or 0,
            rope,
            _int(cfg, "v_head_dim", default=head_dim) or head_dim,
        )

    kinds = ["mla"] * layers if mla is not None else _layer_kinds(cfg, layers)
    window = _int(cfg, "sliding_window", "sliding_window_size")
    chunk = _int(cfg, "attention_chunk_size")
    # Per-layer shapes. Gemma 4's global layers: `global_head_dim` (512 unless set) and, when
    # `attention_k_eq_v`, `num_global_key_value_heads` (transformers' Gemma4TextConfig builds
    # `per_layer_config` from them). MiMo-V2's sliding layers: `swa_num_key_value_heads`,
    # `swa_head_dim`, `swa_v_head_dim` (vllm/model_executor/models/mimo_v2.py).
    gemma4 = str(cfg.get("model_type", "")).startswith("gemma4")
    full_heads, full_dim = kv_heads, head_dim
    if gemma4:
        full_dim = _int(cfg, "global_head_dim", default=512) or 512
        if cfg.get("attention_k_eq_v"):
            full_heads = _int(cfg, "num_global_key_value_heads", default=kv_heads) or kv_heads
    swa_heads = _int(cfg, "swa_num_key_value_heads", default=kv_heads) or kv_heads
    swa_dim = _int(cfg, "swa_head_dim", default=head_dim) or head_dim
    v_dim = _int(cfg, "v_head_dim", default=None) if mla is None else None
    # Cross-layer KV sharing: the last N layers read earlier layers' caches (Gemma 3n/4).
    shared = _int(cfg, "num_kv_shared_layers", default=0) or 0
    specs: list[LayerKV] = []
    for i, kind in enumerate(kinds):
        owns = i < layers - shared
        if kind == "mla":
            assert mla is not None
            specs.append(LayerKV("mla", 1, mla, 0, None, owns))
        elif kind == "sliding":
            if not window:
                raise BudgetError("layer_types has sliding layers but sliding_window is unset")
            swa_v = _int(cfg, "swa_v_head_dim", default=swa_dim) or swa_dim
            specs.append(LayerKV("sliding", swa_heads, swa_dim, swa_v, window, owns))
        elif kind == "chunked":
            if not chunk:
                raise BudgetError("chunked attention layers need attention_chunk_size")
            specs.append(LayerKV("chunked", kv_heads, head_dim, v_dim or head_dim, chunk, owns))
        else:
            specs.append(LayerKV("full", full_heads, full_dim, v_dim or full_dim, None, owns))
    if cfg.get("no_rope_layers") and chunk and all(s.kind == "full" for s in specs):
        # Llama 4: three of four layers use chunked local attention (no_rope_layers marks them)
        flags = cfg["no_rope_layers"]
        specs = [
            LayerKV("chunked", s.kv_heads, s.head_dim, s.head_dim_v, chunk, s.owns_cache)
            if i < len(flags) and flags[i]
            else s
            for i, s in enumerate(specs)
        ]
    overrides = cfg.get("per_layer_config")
    if isinstance(overrides, dict):  # explicit per-layer shapes win
        for key, o in overrides.items():
            layer = decimal(str(key))
            i = -1 if layer is None else layer
            if 0 <= i < len(specs) and isinstance(o, dict) and specs[i].kind != "mla":
                sp = specs[i]
                heads = _int(o, "num_key_value_heads", default=sp.kv_heads) or sp.kv_heads
                dim = _int(o, "head_dim", default=sp.head_dim) or sp.head_dim
                specs[i] = LayerKV(sp.kind, heads, dim, dim, sp.window, sp.owns_cache)
    if shared:
        notes.append(f"the last {shared} layers reuse earlier layers' KV cache")

    experts = _int(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=0) or 0
    first_dense = _int(cfg, "first_k_dense_replace", default=0) or 0
    shared_experts = _int(cfg, "n_shared_experts", default=0) or 0
    if experts and cfg.get("shared_expert_intermediate_size"):
        shared_experts = max(shared_experts, 1)
    architectures = config.get("architectures")
    wrapped = isinstance(architectures, list) and any(
        str(a).endswith("ForConditionalGeneration") for a in architectures
    )
    return ModelShape(
        layers=layers,
        hidden_size=hidden,
        attention_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int(cfg, "intermediate_size", "n_inner", default=4 * hidden) or 0,
        vocab_size=_int(cfg, "vocab_size", default=0) or 0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype_bytes=dtype_bytes,
        max_position_embeddings=_int(cfg, "max_position_embeddings"),
        mla_latent_dim=mla,
        experts=experts,
        expert_intermediate_size=_int(cfg, "moe_intermediate_size", "intermediate_size", default=0)
        or 0,
        shared_experts=shared_experts,
        experts_per_token=_int(
            cfg, "num_experts_per_tok", "experts_per_token", "moe_topk", default=0
        )
        or 0,
        dense_layers=min(first_dense, layers) if experts else 0,
        layer_kv=tuple(specs),
        quantization=_quantization(cfg),
        mla_dims=mla_dims,
        notes=tuple(notes),
        vision_params=_vision_params(config, hidden),
        multimodal=wrapped or isinstance(config.get("vision_config"), dict),
        mlp_keeps_gate_up=str(cfg.get("model_type", "")) in ("qwen2", "qwen3"),
    )


# -- capacity (vLLM's KV cache planning) ------------------------------------------------------
@dataclass(frozen=True)
class _Spec:
    """A layer's spec on one GPU, the fields vLLM's grouping compares."""

    kind: str
    block_size: int
    page_bytes: int
    window: int | None


@dataclass(frozen=True)
class Capacity:
    num_blocks: int
    bytes_per_block: int
    blocks_per_request: int
    max_concurrency: float  # requests of max_model_len tokens
    tokens: int  # what vLLM logs as "GPU KV cache size: N tokens"
    groups: int


def _max_blocks_per_request(spec: _Spec, max_model_len: int, in_flight: int) -> int:
    """`max_memory_usage_bytes / page_size_bytes` of vLLM's spec classes."""
    if spec.kind == "sliding":
        assert spec.window is not None
        tokens = min(spec.window - 1 + in_flight, max_model_len)
        return _cdiv(tokens, spec.block_size) + 1
    if spec.kind == "chunked":
        assert spec.window is not None
        return _cdiv(min(spec.window + in_flight, max_model_len), spec.block_size)
    return _cdiv(max_model_len, spec.block_size)


def _groups(specs: list[_Spec]) -> list[tuple[_Spec, int]]:
    """(spec, layers) per KV cache group, as `get_kv_cache_groups` forms them."""
    if len(set(specs)) == 1:
        return [(specs[0], len(specs))]
    kinds = {s.kind for s in specs}
    windows = {s.window for s in specs}
    if len(kinds) == 1 and len(windows) == 1:
        # UniformTypeKVCacheSpecs: one group, every layer's page in each block
        return [
            (
                _Spec(
                    specs[0].kind,
                    specs[0].block_size,
                    sum(s.page_bytes for s in specs),
                    specs[0].window,
                ),
                1,
            )
        ]
    # Hybrid: unify page sizes by growing the block size of smaller pages, then group.
    largest = max(s.page_bytes for s in specs)
    unified = []
    for s in specs:
        if s.page_bytes == largest:
            unified.append(s)
        elif largest % s.page_bytes == 0:
            ratio = largest // s.page_bytes
            unified.append(_Spec(s.kind, s.block_size * ratio, largest, s.window))
        else:  # padded to the largest page
            unified.append(_Spec(s.kind, s.block_size, largest, s.window))
    buckets: dict[_Spec, int] = {}
    for s in unified:
        buckets[s] = buckets.get(s, 0) + 1
    smallest, biggest = min(buckets.values()), max(buckets.values())
    group_size = biggest if biggest < smallest * 1.5 else smallest
    groups = []
    for spec, count in buckets.items():
        for _ in range(_cdiv(count, group_size)):
            groups.append((spec, group_size))
    return groups


def request_kv_bytes(
    shape: ModelShape,
    max_model_len: int,
    *,
    kv_bytes: float | None = None,
    block_size: int | None = None,
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int = 8192,
    async_scheduling: bool = True,
) -> int:
    """KV memory one request of `max_model_len` tokens needs on one GPU: the figure in vLLM's
    "To serve at least one request ... X GiB KV cache is needed" start-up error."""
    b = kv_bytes if kv_bytes is not None else shape.dtype_bytes
    layer_specs = shape.layer_specs()
    if block_size is None:
        block_size = MLA_BLOCK_SIZE if layer_specs[0].kind == "mla" else DEFAULT_BLOCK_SIZE
    in_flight = (2 if async_scheduling else 1) * max_num_batched_tokens
    total = 0
    for s in layer_specs:
        if not s.owns_cache:
            continue
        spec = _Spec(
            s.kind, block_size, block_size * s.bytes_per_token(b, tensor_parallel_size), s.window
        )
        total += _max_blocks_per_request(spec, max_model_len, in_flight) * spec.page_bytes
    return total


def kv_capacity(
    shape: ModelShape,
    available_bytes: int,
    max_model_len: int,
    *,
    kv_bytes: float | None = None,
    block_size: int | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_num_batched_tokens: int = 8192,
    async_scheduling: bool = True,
) -> Capacity:
    """Blocks and tokens vLLM 0.33 makes of `available_bytes` of KV memory on one GPU."""
    b = kv_bytes if kv_bytes is not None else shape.dtype_bytes
    layer_specs = shape.layer_specs()
    if block_size is None:
        block_size = MLA_BLOCK_SIZE if layer_specs[0].kind == "mla" else DEFAULT_BLOCK_SIZE
    # With pipeline parallelism each stage caches its own layers; the first stage is the
    # widest (ceil), and vLLM sizes every stage's blocks to the smallest pool.
    per_stage = _cdiv(len(layer_specs), pipeline_parallel_size)
    stage = layer_specs[:per_stage]
    specs = [
        _Spec(s.kind, block_size, block_size * s.bytes_per_token(b, tensor_parallel_size), s.window)
        for s in stage
        if s.owns_cache
    ]
    if not specs or any(spec.page_bytes <= 0 for spec in specs):
        raise BudgetError("a layer of this model caches 0 bytes a token: check its head counts")
    if max_model_len <= 0 or block_size <= 0 or max_num_batched_tokens <= 0:
        raise BudgetError("max_model_len, block size and max_num_batched_tokens must be positive")
    groups = _groups(specs)
    bytes_per_block = max(spec.page_bytes * layers for spec, layers in groups)
    concurrent_batches = (
        2 if async_scheduling and pipeline_parallel_size == 1 else (pipeline_parallel_size)
    )
    in_flight = concurrent_batches * max_num_batched_tokens
    per_request = sum(_max_blocks_per_request(spec, max_model_len, in_flight) for spec, _ in groups)
    blocks = max(0, available_bytes // bytes_per_block)
    concurrency = blocks / per_request
    return Capacity(
        num_blocks=blocks,
        bytes_per_block=bytes_per_block,
        blocks_per_request=per_request,
        max_concurrency=concurrency,
        tokens=int(concurrency * max_model_len),
        groups=len(groups),
    )


# -- the budget -------------------------------------------------------------------------------
@dataclass
class BudgetInputs:
    gpu_memory_bytes: int  # the CUDA runtime's total for one GPU (NVML total less reserved)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    gpu_name: str = ""  # for vLLM's by-name defaults (an A100 gets the small tier)
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: vLLM's default for this GPU
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    max_num_batched_tokens: int | None = None  # None: vLLM's default for this GPU
    enforce_eager: bool = False
    async_scheduling: bool = True
    # vLLM >= 0.21 subtracts its CUDA graph estimate from the pool; older versions captured
    # the graphs after sizing it (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 does the same).
    profile_cuda_graphs: bool = True
    sort_sampler: bool = False  # PyTorch sort-based top-k/top-p (vLLM 0.9/0.10 default)
    # vLLM's V0 engine (the default before 0.8): the model runs in eager PyTorch, its Marlin
    # kernels copied each GEMM input, and its non-torch memory was logged higher at TP 1.
    v0_engine: bool = False
    context_len: int | None = None  # context for the concurrency figure; default max_model_len
    weights_bytes: int | None = None  # per GPU, from "Model loading took X GiB"
    overhead_bytes: int | None = None  # override activation + non-torch + graphs estimate
    kv_pool_bytes: int | None = None  # from vLLM's "Available KV cache memory" log line


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
    max_num_batched_tokens: int = 0
    num_blocks: int = 0
    kv_cache_groups: int = 1
    max_concurrency: float = 0.0  # at max_model_len, as vLLM logs it
    pool_source: str = "estimate"  # "estimate" or "vLLM log"
    # Why this estimated pool cannot be trusted from config.json alone ("" when it can):
    # then only vLLM's own log lines size it (docs/budget.md, "What cannot be sized").
    unsizable: str = ""
    # Why vLLM would refuse to start with these flags ("" when it starts): the CLI exits 1.
    will_not_start: str = ""
    overhead_parts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def serve_defaults(gpu_memory_bytes: int, gpu_name: str = "") -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) `vllm serve` picks for this GPU
    (vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args: by memory,
    and an A100 gets the small tier by name)."""
    if gpu_memory_bytes >= 160 * GIB:
        return 16384, 1024
    if gpu_memory_bytes >= 70 * GIB and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


def kv_bytes_for(shape: ModelShape, kv_cache_dtype: str) -> float:
    if kv_cache_dtype == "auto":
        return shape.dtype_bytes
    if kv_cache_dtype not in DTYPE_BYTES:
        raise BudgetError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return DTYPE_BYTES[kv_cache_dtype]


def weights_per_gpu(shape: ModelShape, inp: BudgetInputs) -> int:
    """Weights on the busiest GPU: TP shards every linear layer and the vocabulary, PP splits
    layers (the first stage also holds the embeddings), EP spreads experts over TP x DP."""
    parts = shape.weight_bytes_by_part()
    tp, pp = inp.tensor_parallel_size, inp.pipeline_parallel_size
    ep = tp * inp.data_parallel_size if inp.enable_expert_parallel else tp
    layer_share = _cdiv(shape.layers, pp) / shape.layers
    embeddings = parts["embeddings"]
    if pp > 1 and not shape.tied_embeddings:
        embeddings /= 2  # input embeddings on the first stage, lm_head on the last
    per_gpu = (
        (parts["attention"] + parts["mlp"] + parts["shared_experts"]) / tp * layer_share
        + parts["experts"] / ep * layer_share
        + parts["router"] * layer_share
        + embeddings / tp
        + parts["vision"] / tp  # the vision tower sits with the first stage
    )
    return int(per_gpu)


def overhead_per_gpu(
    shape: ModelShape, inp: BudgetInputs, batched: int, seqs: int
) -> dict[str, int]:
    """Non-KV memory vLLM's profiling run measures, per GPU (docs/budget.md)."""
    tp = inp.tensor_parallel_size
    h = shape.hidden_size
    act_dtype = shape.dtype_bytes
    if shape.experts:
        # The fused-MoE kernel's two workspaces, each tokens x top-k x max(N, K) in the
        # activation dtype, where K is the hidden size (never sharded) and N the expert's
        # gate/up width on this GPU (vllm/model_executor/layers/fused_moe/experts/triton_moe.py
        # workspace_shapes; modular_kernel.py _allocate_buffers: no chunking).
        expert_tp = 1 if inp.enable_expert_parallel else tp
        n = 2 * shape.expert_intermediate_size / expert_tp
        topk = max(shape.experts_per_token, 1)
        per_token = topk * (max(n / 2, h) + max(n, h))
        per_token += 3 * shape.expert_intermediate_size * shape.shared_experts / tp
        per_token += 2 * h
        if shape.dense_layers:  # leading dense layers run the plain MLP
            per_token = max(per_token, 3 * shape.intermediate_size / tp + 2 * h)
    elif inp.v0_engine or inp.enforce_eager:
        per_token = _eager_mlp_peak(shape, inp)
    else:
        # Compiled (torch.compile, V1's default): the graph frees each buffer once dead, so
        # the peak is the MLP's gate/up output and activation (3 x intermediate per token,
        # TP-sharded) beside two hidden-size buffers.
        per_token = 3 * shape.intermediate_size / tp + 2 * h
    activation = batched * act_dtype * per_token
    if inp.v0_engine and shape.quantization.method in MARLIN_METHODS and not shape.experts:
        activation += MARLIN_REDUCE_ROWS * h * 4  # down_proj's FP32 reduce buffer
    # The sampler's dummy run: max_num_seqs rows of the full vocabulary on every rank.
    per_logit = SORT_SAMPLER_BYTES_PER_LOGIT if inp.sort_sampler else SAMPLER_BYTES_PER_LOGIT
    sampler = seqs * shape.vocab_size * per_logit
    graphs = inp.profile_cuda_graphs and not inp.enforce_eager
    # The profile's peak is the larger of the two: the forward pass's activations are freed
    # before the sampler's dummy run (gpu_model_runner.profile_run).
    parts = {
        "activation_or_sampler_peak": int(max(activation, sampler)),
        "non_torch": _non_torch(inp),
        "cuda_graphs": CUDA_GRAPH_BYTES if graphs else 0,
    }
    return parts


def _eager_mlp_peak(shape: ModelShape, inp: BudgetInputs) -> float:
    """Elements per token alive at a dense MLP's peak when the model runs in eager PyTorch (V0,
    or --enforce-eager): Python's references decide what is freed. Always alive: the layer's
    input (the model's loop still holds it), the MLP's input and the residual (three hidden
    sizes). LlamaMLP rebinds `x`, so its gate/up output (2 I) dies after the activation (I):
    peak 3h + 3I at the activation. Qwen2MLP keeps `gate_up` through down_proj, whose output
    (h) joins: 4h + 3I. A V0-era Marlin GEMM adds its input copy (I at down_proj); with TP the
    all-reduce after down_proj is out of place (one more h). I is the per-GPU intermediate
    size. Logged: Llama-3.1-8B V0, 20,000 tokens: 2.07 GiB (3h + 3I: 2.06); Qwen2.5-72B-AWQ V0
    TP 2, 32,768 tokens: 5.66 GiB (4h + 4I + Marlin's reduce buffer: 5.64)."""
    h = shape.hidden_size
    i = shape.intermediate_size / inp.tensor_parallel_size
    marlin = inp.v0_engine and shape.quantization.method in MARLIN_METHODS
    copy = i if marlin else 0.0
    reduce = h if inp.tensor_parallel_size > 1 else 0.0  # out-of-place all-reduce output
    if shape.mlp_keeps_gate_up:
        return max(4 * h + 3 * i + copy, 4 * h + 3 * i + reduce)
    return max(3 * h + 3 * i, 4 * h + i + copy, 4 * h + i + reduce)


def _non_torch(inp: BudgetInputs) -> int:
    """Non-torch memory as vLLM's profile logs it (constants at the top of this module)."""
    if inp.v0_engine:
        return NON_TORCH_V0_BYTES
    peers = inp.tensor_parallel_size * inp.pipeline_parallel_size - 1
    return NON_TORCH_BYTES + NCCL_BYTES_PER_PEER * peers


def _unsizable(shape: ModelShape) -> str:
    """Why config.json alone cannot size this model's KV pool, or "" (docs/budget.md)."""
    if shape.multimodal:
        return (
            "a multimodal model, whose profile vLLM also runs through the vision encoder; the "
            "one measured (Mistral-Small-3.2, vLLM 0.11) peaked 2.6 GiB below the text-model "
            "accounting"
        )
    if shape.experts and shape.parameter_count() > LARGE_MOE_PARAMS:
        return (
            "a MoE model over 100B parameters, whose profile is the least certain part; "
            "Qwen3-235B-A22B-FP8 at TP 4 logged 1.1 GiB more non-KV memory than this "
            "accounting, cause not found"
        )
    return ""


def compute(shape: ModelShape, inp: BudgetInputs) -> Budget:
    if not 0 < inp.gpu_memory_utilization <= 1:
        raise BudgetError("gpu_memory_utilization must be in (0, 1]")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(inp, name) < 1:
            raise BudgetError(f"{name} must be at least 1")
    if inp.gpu_memory_bytes <= 0:
        raise BudgetError("GPU memory must be positive")
    for name in ("max_model_len", "max_num_seqs", "block_size", "max_num_batched_tokens"):
        value = getattr(inp, name)
        if value is not None and value < 1:
            raise BudgetError(f"{name} must be at least 1")
    if inp.context_len is not None and inp.context_len < 1:
        raise BudgetError("context_len must be at least 1")
    tp = inp.tensor_parallel_size
    warnings: list[str] = []
    notes: list[str] = list(shape.notes)
    kv_b = kv_bytes_for(shape, inp.kv_cache_dtype)
    per_token = shape.kv_bytes_per_token(kv_b)
    specs = shape.layer_specs()
    stage_layers = specs[: _cdiv(len(specs), inp.pipeline_parallel_size)]
    per_token_gpu = sum(s.bytes_per_token(kv_b, tp) for s in stage_layers)
    will_not_start = ""
    if shape.attention_heads % tp:
        # vLLM's ModelConfig.verify_with_parallel_config refuses this before loading anything.
        will_not_start = (
            f"{shape.attention_heads} attention heads are not divisible by TP={tp}: vLLM "
            "refuses to start ('Total number of attention heads ... must be divisible by "
            "tensor parallel size')"
        )
        warnings.append(will_not_start)
    elif any(s.kind != "mla" and s.kv_heads % tp and tp % s.kv_heads for s in specs):
        warnings.append(f"{shape.kv_heads} KV heads do not split evenly over TP={tp}")
    if any(s.kind != "mla" and s.kv_heads < tp for s in specs):
        notes.append(f"KV heads are replicated: fewer KV heads than TP={tp} ranks")

    default_batched, default_seqs = serve_defaults(inp.gpu_memory_bytes, inp.gpu_name)
    batched = inp.max_num_batched_tokens or default_batched
    seqs = inp.max_num_seqs or default_seqs
    max_len = inp.max_model_len or shape.max_position_embeddings or 0
    if not max_len:
        raise BudgetError("max_model_len is unknown: pass --max-model-len")

    weights_gpu = (
        inp.weights_bytes if inp.weights_bytes is not None else weights_per_gpu(shape, inp)
    )
    if inp.overhead_bytes is not None:
        parts = {"given": inp.overhead_bytes}
    else:
        parts = overhead_per_gpu(shape, inp, batched, seqs)
    overhead = sum(parts.values())
    budget = int(inp.gpu_memory_bytes * inp.gpu_memory_utilization)
    if inp.kv_pool_bytes is not None:
        pool = inp.kv_pool_bytes
        source = "vLLM log"
    else:
        pool = budget - weights_gpu - overhead
        source = "estimate"
        if weights_gpu > budget:
            warnings.append(
                f"the weights alone ({weights_gpu / GIB:.1f} GiB per GPU) exceed the memory "
                f"budget ({budget / GIB:.1f} GiB): startup OOM (type 1); quantize, add tensor "
                "parallelism or use a larger GPU"
            )
            will_not_start = will_not_start or "the weights alone exceed the memory budget"
        elif pool <= 0:
            warnings.append(
                "weights plus the profiled activation peak leave no KV cache memory: vLLM "
                "fails at start ('No available memory for the cache blocks')"
            )
            will_not_start = will_not_start or "no memory is left for the KV cache"
    if inp.gpu_memory_utilization > 0.94:
        warnings.append(
            f"gpu_memory_utilization {inp.gpu_memory_utilization} leaves under 6 % for "
            "activation peaks, CUDA graphs and other processes; operators run 0.88-0.92"
        )
    pool = max(pool, 0)
    cap = kv_capacity(
        shape,
        pool,
        max_len,
        kv_bytes=kv_b,
        block_size=inp.block_size,
        tensor_parallel_size=tp,
        pipeline_parallel_size=inp.pipeline_parallel_size,
        max_num_batched_tokens=batched,
        async_scheduling=inp.async_scheduling,
    )
    tokens = cap.tokens
    context = inp.context_len or max_len
    if context == max_len:
        concurrency = cap.max_concurrency
    else:
        concurrency = kv_capacity(
            shape,
            pool,
            context,
            kv_bytes=kv_b,
            block_size=inp.block_size,
            tensor_parallel_size=tp,
            pipeline_parallel_size=inp.pipeline_parallel_size,
            max_num_batched_tokens=batched,
            async_scheduling=inp.async_scheduling,
        ).max_concurrency
    if cap.max_concurrency < 1 and pool > 0:
        warnings.append(
            f"one request at max_model_len={max_len:,} does not fit the KV pool "
            f"({cap.max_concurrency:.2f}x): vLLM will refuse to start; lower max_model_len, "
            "quantize the KV cache or add memory"
        )
        will_not_start = will_not_start or (
            f"one request at max_model_len={max_len:,} does not fit the KV pool"
        )
    if seqs > concurrency and cap.max_concurrency >= 1:
        notes.append(
            f"max_num_seqs={seqs} but only {concurrency:.1f} requests of {context:,} tokens "
            "fit: under long contexts vLLM queues or preempts (normal, not an OOM)"
        )
    unsizable = _unsizable(shape) if source == "estimate" else ""
    if unsizable:
        notes.append(
            f"the KV pool cannot be sized from config.json alone: {unsizable}. Read 'Available "
            "KV cache memory' and 'GPU KV cache size' from vLLM's startup log and pass the first "
            "as --kv-pool-bytes"
        )
    elif source == "estimate":
        notes.append(
            "the KV pool is an estimate: vLLM's 'Available KV cache memory' log line is "
            "authoritative (pass it as --kv-pool-bytes)"
        )
    low, high = max(1, math.floor(0.7 * concurrency)), max(1, math.floor(0.8 * concurrency))
    recommended = max(1, math.floor(0.75 * concurrency))
    if will_not_start:  # nothing to recommend: 0, not a floor of 1 that reads as advice
        low = high = recommended = 0
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
        max_num_seqs=seqs,
        recommended_max_num_seqs=recommended,
        recommended_range=(low, high),
        max_num_batched_tokens=batched,
        num_blocks=cap.num_blocks,
        kv_cache_groups=cap.groups,
        max_concurrency=cap.max_concurrency,
        pool_source=source,
        unsizable=unsizable,
        will_not_start=will_not_start,
        overhead_parts=parts,
        notes=notes,
        warnings=warnings,
    )
