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

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from oomguard import vllm_seam
from oomguard.errors import BudgetError
from oomguard.logits import LogitsShape, longest_prompt_logprobs_prompt
from oomguard.sizing.capacity import Capacity, kv_capacity
from oomguard.sizing.model import DTYPE_BYTES, GIB, MIB, ModelShape, _cdiv

# `budget --json`'s layout; bumped when a field changes meaning or goes away.
SCHEMA_VERSION = 2

# vLLM's default (vllm_seam).
DEFAULT_GPU_MEMORY_UTILIZATION = vllm_seam.GPU_MEMORY_UTILIZATION


# Non-KV memory, per GPU (docs/budget.md derives each one). Non-torch memory (cuBLAS/cuDNN
# workspaces, lazily loaded kernels, NCCL and custom all-reduce buffers) as vLLM logs it:
# the V1 engine 0.13-0.14 GiB on one H100 (five runs), 0.54-0.55 GiB per rank at TP 2 (two
# runs, vLLM 0.11.0) and 1.70 GiB at TP 4 (a recent vLLM); the V0 engine 0.35 GiB (RTX 3090,
# TP 1) and 0.32 GiB (A40, TP 2).
NON_TORCH_BYTES = int(0.13 * GIB)
NCCL_BYTES_PER_PEER = int(0.41 * GIB)  # per other rank of TP x PP (V1)
NON_TORCH_V0_BYTES = int(0.33 * GIB)  # V0, with or without TP
CUDA_GRAPH_BYTES = 512 * MIB  # the CUDA graph pool vLLM's profiler estimates
# The sampler's dummy run: max_num_seqs rows of the full vocabulary on every rank, 14 B a logit in
# vLLM 0.33 and ~38 B with 0.9-0.11's sort sampler: the one formula in oomguard.logits.
# Above this many parameters a MoE model's non-KV memory is least certain (Qwen3-235B-A22B-FP8
# at TP 4 on vLLM 0.9.2 logged 1.1 GiB more than this accounting, cause not found): the output
# says so.
LARGE_MOE_PARAMS = 100e9
# The Marlin GEMM of vLLM's V0 era (csrc/quantization/gptq_marlin/gptq_marlin.cu before the 2025
# rewrite) allocated an M x K copy of its input on every call (`a_tmp`, act-order or not) and an
# FP32 reduce buffer of up to 1,024 rows (`c_tmp`, marlin::determine_reduce_max_m, max_par 16).
MARLIN_METHODS = ("awq", "gptq", "awq_marlin", "gptq_marlin")
MARLIN_REDUCE_ROWS = 1024


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
    # "estimate" (the pure reader), "vLLM log" (--weights-bytes) or "vLLM's parameter shapes"
    # (the model built by vLLM on the meta device: its parameters and buffers on one GPU)
    weights_source: str = "estimate"
    # Why this estimated pool cannot be trusted from config.json alone ("" when it can):
    # then only vLLM's own log lines size it (docs/budget.md, "What cannot be sized").
    unsizable: str = ""
    # Why vLLM would refuse to start with these flags ("" when it starts): the CLI exits 1.
    will_not_start: str = ""
    overhead_parts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # What the figures rest on that nobody stated (defaulted dtype, KV heads, block size, two
    # in-flight chunks, vLLM's defaults for this GPU...): in the text and the JSON.
    assumptions: list[str] = field(default_factory=list)
    # Logits (oomguard.logits): a max_num_batched_tokens chunk with prompt_logprobs, the room
    # outside vLLM's budget it has, and the longest prompt_logprobs prompt that fits there.
    prompt_logprobs_chunk_bytes: int = 0
    prompt_logprobs_room_bytes: int = 0
    longest_prompt_logprobs_prompt: int = 0
    sizing_path: str = "python"  # "vllm": specs and planning by vLLM's own code
    schema_version: int = SCHEMA_VERSION
    inputs: dict[str, Any] = field(default_factory=dict)

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
        # vLLM resolves auto from the checkpoint first (modelopt FP8 KV: 1 byte)
        return shape.kv_auto_dtype_bytes or shape.dtype_bytes
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
    sampler = LogitsShape(shape.vocab_size, int(shape.dtype_bytes)).sampler_peak(
        seqs, inp.sort_sampler
    )
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


def vision_weights_per_gpu(shape: ModelShape, inp: BudgetInputs) -> int:
    """The vision tower's share of `weights_per_gpu` (vLLM's path builds the language model
    alone and adds this)."""
    return int(shape.weight_bytes_by_part()["vision"] / inp.tensor_parallel_size)


def compute(shape: ModelShape, inp: BudgetInputs, *, vllm_weights: int | None = None) -> Budget:
    """The budget for `shape` under `inp`. `vllm_weights`: the weights per GPU from vLLM's own
    parameter shapes (oomguard.sizing.vllm_path), used unless --weights-bytes gave the logged
    figure."""
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

    if inp.weights_bytes is not None:
        weights_gpu, weights_source = inp.weights_bytes, "vLLM log"
    elif vllm_weights is not None:
        weights_gpu, weights_source = vllm_weights, "vLLM's parameter shapes"
    else:
        weights_gpu, weights_source = weights_per_gpu(shape, inp), "estimate"
    if inp.overhead_bytes is not None:
        parts = {"given": inp.overhead_bytes}
    else:
        parts = overhead_per_gpu(shape, inp, batched, seqs)
    overhead = sum(parts.values())
    budget = int(inp.gpu_memory_bytes * inp.gpu_memory_utilization)
    if inp.kv_pool_bytes is not None:
        pool = inp.kv_pool_bytes
        source = "vLLM log"
        if pool <= 0:
            warnings.append(
                "the logged pool is empty: vLLM fails at start ('No available memory for the "
                "cache blocks')"
            )
            will_not_start = will_not_start or "no memory is left for the KV cache"
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

    def capacity(length: int) -> Capacity:
        return kv_capacity(
            shape,
            pool,
            length,
            kv_bytes=kv_b,
            block_size=inp.block_size,
            tensor_parallel_size=tp,
            pipeline_parallel_size=inp.pipeline_parallel_size,
            max_num_batched_tokens=batched,
            async_scheduling=inp.async_scheduling,
        )

    cap = capacity(max_len)
    tokens = cap.tokens
    context = inp.context_len or max_len
    concurrency = cap.max_concurrency if context == max_len else capacity(context).max_concurrency
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
    logits = LogitsShape(shape.vocab_size, int(shape.dtype_bytes))
    chunk_bytes = logits.prompt_logprobs_peak(batched)
    # Room for the logits when prompt logprobs are computed (after the forward pass and the
    # sampler): what vLLM leaves outside gmu x total, plus the profiled activation/sampler peak
    # the allocator holds cached by then (gpu_model_runner: forward, sample, prompt logprobs).
    room = int(inp.gpu_memory_bytes * (1 - inp.gpu_memory_utilization))
    room += parts.get("activation_or_sampler_peak", 0)
    longest = longest_prompt_logprobs_prompt(room, logits, batched, True, max_len)
    if longest < max_len:
        notes.append(
            f"prompt_logprobs: a {batched:,}-token chunk holds {chunk_bytes / GIB:.2f} GiB of "
            f"logits (oomguard.logits); about {room / GIB:.2f} GiB is outside vLLM's budget "
            f"then: prompts with prompt_logprobs fit up to {longest:,} tokens (cap them at the "
            "gateway, or lower --max-num-batched-tokens)"
        )
    assumptions = _assumptions(shape, inp, batched, seqs, max_len, kv_b)
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
        weights_source=weights_source,
        unsizable=unsizable,
        will_not_start=will_not_start,
        overhead_parts=parts,
        notes=notes,
        warnings=warnings,
        assumptions=assumptions,
        prompt_logprobs_chunk_bytes=chunk_bytes,
        prompt_logprobs_room_bytes=room,
        longest_prompt_logprobs_prompt=longest,
        inputs=asdict(inp),
    )


def _assumptions(
    shape: ModelShape, inp: BudgetInputs, batched: int, seqs: int, max_len: int, kv_b: float
) -> list[str]:
    out = [n.removeprefix("assumed: ") for n in shape.notes if n.startswith("assumed: ")]
    if inp.max_model_len is None:
        out.append(f"max_model_len {max_len:,}: the model's max_position_embeddings")
    if inp.max_num_batched_tokens is None:
        out.append(f"max_num_batched_tokens {batched:,}: what vllm serve picks for this GPU")
    if inp.max_num_seqs is None:
        out.append(f"max_num_seqs {seqs}: what vllm serve picks for this GPU")
    if inp.block_size is None:
        mla = any(s.kind == "mla" for s in shape.layer_specs())
        out.append(
            f"block size {64 if mla else 16}: the CUDA backend's (FlashMLA 64 for MLA; "
            "Blackwell's CUTLASS MLA uses 128: pass --block-size)"
            if mla
            else "block size 16: FlashAttention's default on CUDA"
        )
    if inp.kv_cache_dtype == "auto":
        resolved = (
            "fp8 (the checkpoint's KV quantization)"
            if shape.kv_auto_dtype_bytes
            else ("the model dtype")
        )
        out.append(f"KV cache dtype auto: {resolved}, {kv_b:g} B per element")
    if inp.async_scheduling and inp.pipeline_parallel_size == 1:
        out.append(
            "two in-flight chunks of max_num_batched_tokens (async scheduling, "
            f"vLLM {vllm_seam.MINOR}'s "
            "default) for sliding-window and chunked layers"
        )
    if inp.gpu_name:
        from oomguard.gpus import lookup

        row = lookup(inp.gpu_name)
        where = f" ({row.provenance})" if row is not None and row.provenance else ""
        out.append(f"GPU memory: {inp.gpu_name}'s CUDA total from oomguard's GPU table{where}")
    out.append("chunked prefill on (vLLM V1's default): prompt_logprobs logits per chunk")
    return out
