"""What a Hugging Face config.json says about a model's memory, read without vLLM.

The pure-Python reader: per-layer KV cache shapes (as vLLM's `get_kv_cache_spec` would build
them), weights by part (quantization-aware) and the fields the activation estimate needs. Where
vLLM is importable, `oomguard.sizing.vllm_path` builds the same specs with vLLM's own code and
this reader is the cross-check and the fallback (docs/budget.md). A config it cannot read exactly
raises `BudgetError` saying "cannot size this: <reason>", never a guess.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

from oomguard.digits import decimal
from oomguard.errors import BudgetError

GIB = 1024**3
MIB = 1024**2
# The deepest published language models have about 130 layers (Llama 3.1 405B: 126).
MAX_LAYERS = 10_000

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
    has_attention: bool = True  # False for a DeciLM layer whose attention is a no-op

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
    # `--kv-cache-dtype auto` as vLLM resolves it from the checkpoint (modelopt's
    # kv_cache_quant_algo, llm-compressor's kv_cache_scheme): 1 for FP8; None: the model dtype
    kv_auto_dtype_bytes: float | None = None
    vision_params: int = 0  # the vision tower and projector (config.json's vision_config)
    multimodal: bool = False  # a vision_config or a *ForConditionalGeneration wrapper
    # vLLM's Qwen2MLP (Qwen2, Qwen2.5, Qwen3 dense) names its gate/up output, so in eager
    # PyTorch it stays alive through down_proj; LlamaMLP rebinds `x` and frees it after the
    # activation (vllm/model_executor/models/qwen2.py, llama.py)
    mlp_keeps_gate_up: bool = False
    # Per-layer MLP widths where they differ (DeciLM's ffn_mult, Gemma 3n/4's double-wide MLP
    # on KV-sharing layers, Llama 4's dense layers between MoE ones): the intermediate size of
    # each dense MLP; empty = every non-MoE layer has `intermediate_size`.
    dense_intermediates: tuple[int, ...] = ()
    moe_layer_count: int | None = None  # None: every layer after `dense_layers` is MoE
    per_layer_input_params: int = 0  # Gemma 3n/4 per-layer embeddings and projections
    linear_block_params: int = 0  # DeciLM blocks replaced by one hidden x hidden linear

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
        """Attention projections of every layer (q, k, v, o), per layer where shapes differ."""
        h = self.hidden_size
        if self.mla_dims is not None and self.mla_latent_dim is not None:
            q_lora, nope, rope, v = self.mla_dims
            kv_lora = self.mla_latent_dim - rope
            heads = self.attention_heads
            q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
            kv = h * (kv_lora + rope) + kv_lora * heads * (nope + v)
            return (q + kv + heads * v * h) * self.layers
        total = 0
        for spec in self.layer_specs():
            if not spec.has_attention:
                continue
            q = self.attention_heads * spec.head_dim
            # a layer that reads another layer's cache has no K/V projection (Gemma 3n/4)
            kv = spec.kv_heads * (spec.head_dim + spec.head_dim_v) if spec.owns_cache else 0
            total += h * q + h * kv + self.attention_heads * spec.head_dim_v * h
        return total

    def _param_groups(self) -> dict[str, int]:
        """Parameters by part: attention, dense MLP, routed experts, shared experts, embeddings."""
        h = self.hidden_size
        if not self.experts:
            moe_layers = 0
        elif self.moe_layer_count is not None:
            moe_layers = self.moe_layer_count
        else:
            moe_layers = self.layers - self.dense_layers
        dense_layers = self.layers - moe_layers
        if self.dense_intermediates:
            mlp = sum(3 * h * i for i in self.dense_intermediates)
        else:
            mlp = dense_layers * 3 * h * self.intermediate_size
        mlp += self.linear_block_params
        return {
            "attention": self._attention_params(),
            "mlp": mlp,
            "experts": moe_layers * 3 * h * self.expert_intermediate_size * self.experts,
            "shared_experts": moe_layers
            * 3
            * h
            * self.expert_intermediate_size
            * self.shared_experts,
            "router": moe_layers * h * self.experts,
            "embeddings": self.vocab_size * h * (1 if self.tied_embeddings else 2)
            + self.per_layer_input_params,
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


def _signed(cfg: dict[str, Any], *names: str, default: int) -> int:
    """An integer field that may be negative (GPTQ's `group_size: -1`)."""
    value = _get(cfg, *names)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BudgetError(f"config.json field {names[0]} is not an integer: {value!r}")
    if not -(2**31) < value < 2**31:
        raise BudgetError(f"config.json field {names[0]} is out of range: {value!r}")
    return value


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
    if not method and qc:
        # vLLM refuses it too (its quantization config needs `quant_method`); sizing it as
        # unquantized would be a silent guess of 2-4x the weights
        raise BudgetError(
            "cannot size this: quantization_config has no quant_method (vLLM cannot load it "
            "either); add the checkpoint's quant_method"
        )
    excluded = [
        str(p)
        for key in ("modules_to_not_convert", "ignored_layers", "ignore", "llm_int8_skip_modules")
        if isinstance(qc.get(key), list)
        for p in qc[key]
    ]
    attention_excluded = any("attn" in p or "attention" in p for p in excluded) or any(
        fnmatch.fnmatch("model.layers.0.self_attn.q_proj", p) for p in excluded
    )
    algo = str(qc.get("quant_algo") or "").upper()
    if method in ("modelopt", "modelopt_fp4") and algo in ("NVFP4", "W4A16_NVFP4"):
        # E2M1 values with one FP8 (E4M3) scale per 16 (modelopt's group_size): 4.5 bits
        group = _int(qc, "group_size", default=16) or 16
        return Quantization("modelopt_fp4", (4 + 8 / group) / 8, attention_excluded)
    if method == "modelopt" and algo not in ("", "FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        raise BudgetError(
            f"quantization method modelopt {algo} is not modelled: pass --weights-bytes from "
            "vLLM's 'Model loading took X GiB' log line"
        )
    if method in ("fp8", "fbgemm_fp8", "modelopt", "ptpc_fp8"):
        # 1 byte per weight; block-wise (128x128) or per-channel FP32 scales add < 0.1 %.
        return Quantization(method, 1.0 + 4 / (128 * 128), attention_excluded)
    if method == "mxfp4":
        # 4-bit E2M1 values, one E8M0 scale per 32 values: 4.25 bits; experts only.
        return Quantization(method, 4.25 / 8, True, experts_only=True)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "auto-round", "autoround"):
        bits = _signed(qc, "bits", "w_bit", default=4)
        if bits not in (2, 3, 4, 8):
            # vLLM's GPTQ/AWQ configs take 2, 3, 4 or 8 bits and refuse anything else
            raise BudgetError(f"cannot size this: {method} with {bits} bits (vLLM takes 2-4 or 8)")
        group = _signed(qc, "group_size", "q_group_size", default=128)
        if group == 0 or group < -1:
            raise BudgetError(f"cannot size this: {method} group_size {group} (-1 or positive)")
        # -1: per-channel, one scale and zero point per output channel (amortised over the
        # input dimension, 4,096 here: under 0.1 % of the weights either way)
        group = group if group > 0 else 4096
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


def with_hf_quant_config(config: dict[str, Any], quant: Any) -> dict[str, Any]:
    """config.json as vLLM reads a modelopt checkpoint: its `hf_quant_config.json` beside
    config.json becomes the `quantization_config` (vllm/transformers_utils/config.py,
    `maybe_override_with_speculators` / `get_config`'s modelopt branch); a config.json that has
    its own `quantization_config` keeps it."""
    if (
        not isinstance(quant, dict)
        or not isinstance(quant.get("quantization"), dict)
        or "quantization_config" in config
    ):
        return config
    return {**config, "quantization_config": {"quant_method": "modelopt", **quant["quantization"]}}


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


def _decilm_layers(blocks: list[Any], specs: list[LayerKV], heads: int) -> list[LayerKV]:
    """DeciLM / Nemotron-NAS `block_configs`: per layer, attention with `n_heads_in_group`
    query heads per KV head, or none (`no_op`, `replace_with_linear`: no KV cache), as vLLM's
    nemotron_nas.py builds it."""
    if len(blocks) != len(specs):
        raise BudgetError(f"block_configs lists {len(blocks)} layers, the model has {len(specs)}")
    out = []
    for spec, block in zip(specs, blocks, strict=True):
        attn = block.get("attention") if isinstance(block, dict) else None
        if not isinstance(attn, dict):
            raise BudgetError("cannot size this: a block_configs entry without attention")
        if attn.get("no_op") or attn.get("replace_with_linear"):
            out.append(
                LayerKV(
                    spec.kind, spec.kv_heads, spec.head_dim, spec.head_dim_v, None, False, False
                )
            )
            continue
        group = _int(attn, "n_heads_in_group")
        if not group or heads % group:
            raise BudgetError(f"cannot size this: n_heads_in_group {group} for {heads} heads")
        out.append(LayerKV(spec.kind, heads // group, spec.head_dim, spec.head_dim_v, spec.window))
    return out


def _decilm_ffn(blocks: list[Any], hidden: int) -> tuple[tuple[int, ...], int]:
    """DeciLM's per-layer MLP widths (`ffn_mult`: int(2 x mult x hidden / 3) rounded up to a
    multiple of 256, vLLM's nemotron_nas.py `_ffn_mult_to_intermediate_size`; a no-op FFN has
    none) and the h x h linears that stand in for replaced attention or FFN blocks."""
    widths: list[int] = []
    linears = 0
    for block in blocks:
        ffn = block.get("ffn") if isinstance(block, dict) else None
        attn = block.get("attention") if isinstance(block, dict) else None
        if isinstance(attn, dict) and attn.get("replace_with_linear"):
            linears += 1
        if not isinstance(ffn, dict) or ffn.get("no_op"):
            continue
        if ffn.get("replace_with_linear"):
            linears += 1
            continue
        mult = ffn.get("ffn_mult")
        if isinstance(mult, bool) or not isinstance(mult, (int, float)) or not 0 < mult < 1e4:
            raise BudgetError(f"cannot size this: block_configs ffn_mult {mult!r}")
        widths.append(_round_up(int(2 * mult * hidden / 3), 256))
    return tuple(widths), linears


# Model types whose config class ties the output projection to the embeddings when config.json
# says nothing (transformers' PretrainedConfig default; Llama, Mistral, Qwen... default to untied).
TIED_BY_DEFAULT = frozenset(
    {"falcon", "RefinedWeb", "RefinedWebModel", "gpt_bigcode", "gpt2", "starcoder2", "gemma"}
)

# MLPs of two matrices (up, down) with a plain activation; every other family here is gated
# (gate, up, down: three).
UNGATED_MLP_TYPES = frozenset(
    {"falcon", "RefinedWeb", "RefinedWebModel", "gpt_bigcode", "gpt2", "gpt_neox", "starcoder2"}
)


def _kv_auto_bytes(cfg: dict[str, Any]) -> float | None:
    """Bytes of `--kv-cache-dtype auto` as vLLM resolves it from the checkpoint
    (vllm/utils/torch_utils.py, resolve_kv_cache_dtype_string), or None: the model dtype."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    algo = qc.get("kv_cache_quant_algo")
    if isinstance(algo, str) and algo:
        if algo.upper() == "FP8":
            return 1.0
        raise BudgetError(
            f"cannot size this without vLLM: kv_cache_quant_algo {algo!r} (packed KV layout)"
        )
    scheme = qc.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        return 1.0  # llm-compressor's FP8 KV cache (Attention.__init__ sets fp8)
    return None


# Architectures whose configs the corpus checks against vLLM (tests/test_budget_vllm.py)
CHECKED_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
        "GptOssForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Llama4ForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
    }
)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa")


def _is_mla(cfg: dict[str, Any]) -> bool:
    """vLLM builds MLA attention for DeepSeek-V2/V3-family configs (ModelConfig.use_mla reads
    `kv_lora_rank` on those architectures); a stray kv_lora_rank elsewhere is not MLA."""
    model_type = str(cfg.get("model_type", ""))
    archs = cfg.get("architectures") or []
    named = any("Deepseek" in str(a) or "Kimi" in str(a) for a in archs)
    return bool(cfg.get("qk_rope_head_dim")) and (model_type in MLA_MODEL_TYPES or named)


# The fields vLLM derives the default max_model_len from: the smallest one set wins, and
# `model_max_length` overrides them all (model_arch_config_convertor.py,
# derive_max_model_len_and_key).
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def _max_len(cfg: dict[str, Any]) -> int | None:
    if _get(cfg, "model_max_length") is not None:
        return _int(cfg, "model_max_length")
    found = [_int(cfg, key) for key in _MAX_LEN_KEYS if _get(cfg, key) is not None]
    return min((v for v in found if v is not None), default=None)


def _kv_heads(cfg: dict[str, Any], heads: int) -> int:
    """KV heads as vLLM reads them (vllm/transformers_utils/model_arch_config_convertor.py,
    get_total_num_kv_heads): Falcon/GPTBigCode `multi_query` means one; ChatGLM's
    `multi_query_group_num`; else `num_key_value_heads` (or MHA: the attention heads)."""
    model_type = str(cfg.get("model_type", ""))
    if model_type == "falcon" and cfg.get("new_decoder_architecture"):
        kv = _int(cfg, "num_kv_heads", default=None)
    elif cfg.get("multi_query") is True and model_type in ("falcon", "gpt_bigcode", "RefinedWeb"):
        kv = 1
    elif cfg.get("multi_query_group_num") is not None:
        kv = _int(cfg, "multi_query_group_num")
    else:
        kv = _int(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=None)
    if kv is None:
        return heads
    if kv <= 0:
        raise BudgetError(f"cannot size this: {kv} KV heads (a model caches at least one)")
    if kv > heads or heads % kv:
        raise BudgetError(
            f"cannot size this: {kv} KV heads for {heads} attention heads (KV heads must "
            "divide the attention heads)"
        )
    return kv


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
    if cfg.get("compress_ratios") is not None or str(cfg.get("model_type", "")).startswith(
        "deepseek_v4"
    ):
        raise BudgetError(
            "cannot size this without vLLM: DeepSeek-V4 attention (compress_ratios) keeps "
            "compressed and sliding-window caches per layer whose pages vLLM sizes with its "
            "own kernels' layout; size it from vLLM's startup log lines 'Available KV cache "
            "memory' and 'GPU KV cache size'"
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
    kv_heads = _kv_heads(cfg, heads)
    head_dim = _int(cfg, "head_dim", "kv_channels", default=hidden // heads) or hidden // heads
    notes: list[str] = []
    if _get(cfg, "torch_dtype", "dtype") is None:
        notes.append("assumed: no torch_dtype in config.json, bfloat16 (vLLM's auto would read it)")
    if (
        not any(
            cfg.get(k) is not None
            for k in ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
        )
        and cfg.get("multi_query") is not True
    ):
        notes.append("assumed: no KV head field, multi-head attention (KV heads = heads)")
    archs = config.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else ""
    if arch not in CHECKED_ARCHITECTURES:
        notes.append(
            f"architecture {arch or '(none)'} is not one this reader was checked on against "
            "vLLM: its standard fields were read; where vLLM is installed its own code sizes it"
        )
    dtype_name = str(_get(cfg, "torch_dtype", "dtype") or "bfloat16").removeprefix("torch.")
    if dtype_name not in DTYPE_BYTES:
        raise BudgetError(f"unknown dtype {dtype_name!r} in config.json")
    # vLLM's dtype "auto" runs FP32 checkpoints in BF16/FP16 (vllm/config/model.py).
    dtype_bytes = min(DTYPE_BYTES[dtype_name], 2)

    mla = None
    mla_dims = None
    if cfg.get("kv_lora_rank"):
        if not _is_mla(cfg):
            raise BudgetError(
                "cannot size this: kv_lora_rank on a model that is not an MLA architecture "
                f"(model_type {cfg.get('model_type')!r}, no qk_rope_head_dim): vLLM would not "
                "build MLA attention for it"
            )
        if cfg.get("index_topk") or cfg.get("index_head_dim"):
            raise BudgetError(
                "cannot size this without vLLM: sparse MLA (DeepSeek-V3.2 / GLM-5 style, "
                "index_topk) adds an indexer cache per layer whose page vLLM sizes with its own "
                "kernels' layout; run `oomguard budget` where vLLM is installed"
            )
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
    no_rope = cfg.get("no_rope_layers")
    if not no_rope and chunk and str(cfg.get("model_type", "")).startswith("llama4"):
        # transformers' Llama4TextConfig default: every 4th layer is NoPE (global attention),
        # the others use RoPE and chunked local attention (no_rope_layer_interval 4)
        interval = _int(cfg, "no_rope_layer_interval", default=4) or 4
        no_rope = [int((i + 1) % interval != 0) for i in range(layers)]
        notes.append(
            f"no_rope_layers not set: transformers' default, every {interval}th layer global"
        )
    if no_rope and chunk and all(s.kind == "full" for s in specs):
        # Llama 4: three of four layers use chunked local attention (no_rope_layers marks them)
        flags = no_rope
        specs = [
            LayerKV("chunked", s.kv_heads, s.head_dim, s.head_dim_v, chunk, s.owns_cache)
            if i < len(flags) and flags[i]
            else s
            for i, s in enumerate(specs)
        ]
    blocks = cfg.get("block_configs")
    dense_intermediates: tuple[int, ...] = ()
    linear_blocks = 0
    if isinstance(blocks, list) and blocks:
        specs = _decilm_layers(blocks, specs, heads)
        dense_intermediates, linear_blocks = _decilm_ffn(blocks, hidden)
        notes.append("per-layer attention and MLP from block_configs (DeciLM / Nemotron-NAS)")
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
    model_type = str(cfg.get("model_type", ""))
    intermediate = (
        _int(cfg, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * hidden) or 0
    )
    expert_intermediate = _int(cfg, "moe_intermediate_size", "intermediate_size", default=0) or 0
    moe_layer_count: int | None = None
    if model_type.startswith("llama4") and experts:
        # Llama 4: every MoE layer has one shared expert as wide as the routed ones; MoE sits
        # on every `interleave_moe_layer_step`-th layer and the others are dense MLPs of
        # `intermediate_size_mlp` (transformers' Llama4TextConfig; vLLM's llama4.py)
        shared_experts = 1
        step = _int(cfg, "interleave_moe_layer_step", default=1) or 1
        moe_layer_count = layers // step
        if moe_layer_count < layers:
            dense_width = _int(cfg, "intermediate_size_mlp", default=intermediate) or 0
            dense_intermediates = (dense_width,) * (layers - moe_layer_count)
    if gemma4 and cfg.get("use_double_wide_mlp") and shared:
        # Gemma 3n/4: the layers that reuse another layer's KV cache have a twice-wide MLP
        dense_intermediates = (intermediate,) * (layers - shared) + (2 * intermediate,) * shared
    per_layer_inputs = 0
    per_layer_hidden = _int(cfg, "hidden_size_per_layer_input", default=0) or 0
    if per_layer_hidden:
        # Gemma 3n/4 per-layer inputs: an embedding of `vocab_size_per_layer_input` x (layers x
        # hidden_size_per_layer_input), the model-level projection to it, and each layer's gate
        # and projection (hidden x hidden_size_per_layer_input each)
        per_layer_vocab = _int(cfg, "vocab_size_per_layer_input", "vocab_size", default=0) or 0
        width = layers * per_layer_hidden
        per_layer_inputs = per_layer_vocab * width + hidden * width + 2 * hidden * width
    if model_type in UNGATED_MLP_TYPES:
        # two matrices, not three: expressed as the gated width that has the same parameters
        intermediate = 2 * intermediate // 3

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
        intermediate_size=intermediate,
        vocab_size=_int(cfg, "vocab_size", default=0) or 0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT)),
        dtype_bytes=dtype_bytes,
        max_position_embeddings=_max_len(cfg),
        mla_latent_dim=mla,
        experts=experts,
        expert_intermediate_size=expert_intermediate,
        shared_experts=shared_experts,
        experts_per_token=_int(
            cfg, "num_experts_per_tok", "experts_per_token", "moe_topk", default=0
        )
        or 0,
        dense_layers=min(first_dense, layers) if experts else 0,
        layer_kv=tuple(specs),
        quantization=_quantization(cfg),
        kv_auto_dtype_bytes=_kv_auto_bytes(cfg),
        mla_dims=mla_dims,
        notes=tuple(notes),
        vision_params=_vision_params(config, hidden),
        multimodal=wrapped or isinstance(config.get("vision_config"), dict),
        mlp_keeps_gate_up=model_type in ("qwen2", "qwen3"),
        dense_intermediates=dense_intermediates,
        moe_layer_count=moe_layer_count,
        per_layer_input_params=per_layer_inputs,
        linear_block_params=linear_blocks * hidden * hidden,
    )
