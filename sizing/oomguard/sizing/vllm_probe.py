"""Run in a child process by `oomguard.sizing.vllm_path`: build a model with vLLM's own code on
the meta device (no weights, no GPU) and size its KV cache with vLLM's own planner.

`python -m oomguard.sizing.vllm_probe` reads a JSON list of jobs on stdin and writes one JSON
result per job on stdout (a list). The steps are vLLM 0.33's own, in the engine's order:

1. `EngineArgs(...).create_engine_config()`: vLLM reads config.json (and a modelopt
   `hf_quant_config.json` beside it) with its config classes, resolves `--kv-cache-dtype auto`
   from the checkpoint (`resolve_kv_cache_dtype_string`: modelopt's `kv_cache_quant_algo`,
   llm-compressor's `kv_cache_scheme`) and checks `max_model_len` against the model.
2. `initialize_model` under `torch.device("meta")`: every layer is constructed as on a GPU rank,
   parameters without storage. Tensor parallelism is rank 0's view: the model-parallel group of
   this one process reports `tensor_parallel_size` ranks while the model is built, so every layer
   shards its heads as rank 0 of a real TP group does.
3. `Attention.get_kv_cache_spec(vllm_config)` for every attention layer in the static forward
   context, skipping layers that share another layer's cache (`GPUModelRunner.get_kv_cache_spec`).
4. `get_global_kv_cache_groups` -> `get_kv_cache_configs` (which refuses as the engine does:
   "To serve at least one request ...") -> `generate_scheduler_kv_cache_config` ->
   `get_kv_cache_capacity` ("GPU KV cache size" tokens and "Maximum concurrency"), for each pool
   size asked.

What runs on the CPU platform and is set back to what a CUDA engine does (and reported as an
assumption): the block size (16, or 64 for MLA models, FlashMLA's; or the one given), async
scheduling (0.33's default with one pipeline stage; the CPU platform turns it off), and the
attention backend a layer's spec asks for its kernel block sizes: FlashAttention's (multiples of
16, CUDA's default backend) instead of the CPU backend's multiples of 32, from which a
sliding-window layer picks its block size (with the CPU's, gpt-oss, Gemma 2/3, Mistral v0.1 and
Phi-3.5 planned up to half the blocks a GPU plans). Where the CPU
platform cannot construct a checkpoint's quantized linear layers (FP8 block kernels), the model is
rebuilt with unquantized linear layers: linear kernels do not change a KV cache spec, the KV cache
dtype was already resolved from the checkpoint in step 1, and the parameter bytes are then not
reported.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from oomguard import vllm_seam as vllm

# A multimodal checkpoint's language model, built alone: its attention layers are the ones the
# wrapper builds (the vision encoder has no KV cache). The wrappers' own modules import image
# processors (torchvision) that a CPU environment may lack.
TEXT_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),
    "Gemma4ForConditionalGeneration": ("Gemma4ForCausalLM", "gemma4_text"),
    "Llama4ForConditionalGeneration": ("Llama4ForCausalLM", "llama4_text"),
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", None),
    "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", "qwen3"),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}


# Checkpoints whose config.json names no model_type (their own configuration code declares it):
# the model type of vLLM's in-tree config class for them (vllm/transformers_utils/configs).
REMOTE_MODEL_TYPES = {
    "ChatGLMModel": "chatglm",
    "ChatGLMForConditionalGeneration": "chatglm",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def text_model_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The config vLLM is given: a known multimodal wrapper's `text_config` with the text
    architecture (and the wrapper's quantization), else the config itself. Also a note."""
    archs = config.get("architectures") or []
    arch = str(archs[0]) if isinstance(archs, list) and archs else ""
    text = config.get("text_config")
    if arch in TEXT_ARCHITECTURES and isinstance(text, dict):
        text_arch, model_type = TEXT_ARCHITECTURES[arch]
        out = {**text, "architectures": [text_arch]}
        if model_type:
            out["model_type"] = model_type
        for key in ("quantization_config", "torch_dtype", "dtype", "tie_word_embeddings"):
            if key in config and key not in out:
                out[key] = config[key]
        return out, f"{arch}: its language model built alone as {text_arch}"
    if "auto_map" in config:
        # The checkpoint's own Python (trust_remote_code) is never run here: the folder holds
        # config.json only, and vLLM's in-tree classes for the model type read it.
        out = {k: v for k, v in config.items() if k != "auto_map"}
        if "model_type" not in out and arch in REMOTE_MODEL_TYPES:
            out["model_type"] = REMOTE_MODEL_TYPES[arch]
        return out, "auto_map ignored: vLLM's in-tree config and model classes, no checkpoint code"
    return config, ""


# Quantization methods whose parameters vLLM's CPU platform creates in another layout than its
# CUDA kernels do: vLLM's MXFP4 MoE pads experts to Marlin/TRT-LLM tiles on a GPU only.
CPU_LAYOUT_METHODS = frozenset({"mxfp4", "gpt_oss_mxfp4"})


def _device_bytes(tensors: Any) -> int:
    """Bytes of parameters or buffers (modules shared between layers are listed once)."""
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _torch_bytes(dtype: Any) -> int:
    import torch

    return int(torch.empty((), dtype=dtype).element_size())


def _layer(name: str, spec: Any) -> dict[str, Any]:
    kind = type(spec).__name__
    out: dict[str, Any] = {
        "name": name,
        "spec": kind,
        "block_size": int(spec.block_size),
        "page_size_bytes": int(spec.page_size_bytes),
    }
    for field in ("num_kv_heads", "head_size", "head_size_v", "sliding_window"):
        value = getattr(spec, field, None)
        if value is not None:
            out[field] = int(value)
    chunk = getattr(spec, "attention_chunk_size", None)
    if chunk is not None:
        out["attention_chunk_size"] = int(chunk)
    dtype = getattr(spec, "dtype", None)
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
        out["dtype_bytes"] = _torch_bytes(dtype)
    return out


class Probe:
    """vLLM's imports and its one-process distributed setup, done once per child process."""

    def __init__(self) -> None:
        import torch

        config = vllm.load(vllm.CONFIG)
        planning = vllm.load(vllm.KV_CACHE_PLANNING)
        utils = vllm.load(vllm.KV_CACHE_UTILS)
        self.torch = torch
        self.ps = vllm.load(vllm.PARALLEL_STATE)
        self.set_config = config.set_current_vllm_config
        self.layers_of = config.get_layers_from_vllm_config
        self.attention_base: Any = vllm.load(vllm.ATTENTION_LAYER_BASE)
        self.engine_args: Any = vllm.load(vllm.ENGINE_ARGS)
        self.initialize_model = vllm.load(vllm.INITIALIZE_MODEL)
        self.global_groups = planning.get_global_kv_cache_groups
        self.configs = planning.get_kv_cache_configs
        self.scheduler_config = utils.generate_scheduler_kv_cache_config
        self.capacity = utils.get_kv_cache_capacity
        self.distributed = False

    def _distributed(self, vllm_config: Any) -> None:
        """One process, world size 1; the model-parallel groups are made anew for each model
        (vLLM creates the expert-parallel group only for a MoE model's config)."""
        distributed = vllm.load(vllm.DISTRIBUTED)
        ensure_model_parallel_initialized = distributed.ensure_model_parallel_initialized
        init_distributed_environment = distributed.init_distributed_environment

        with self.set_config(vllm_config):
            if not self.distributed:
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                    local_rank=0,
                    backend="gloo",
                )
                self.distributed = True
            else:
                self.ps.destroy_model_parallel()
            ensure_model_parallel_initialized(1, 1)

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        # The checkpoint folder lives until the model is built: some models read more of it
        # while they are constructed (Llama 4 its generation config).
        with tempfile.TemporaryDirectory(prefix="oomguard-sizing-") as folder:
            return self._run(job, Path(folder))

    def _run(self, job: dict[str, Any], folder: Path) -> dict[str, Any]:
        config, note = text_model_config(job["config"])
        notes = [note] if note else []
        (folder / "config.json").write_text(json.dumps(config))
        if job.get("hf_quant_config"):
            (folder / "hf_quant_config.json").write_text(json.dumps(job["hf_quant_config"]))
        args: Any = self.engine_args(
            model=str(folder),
            skip_tokenizer_init=True,
            load_format="dummy",
            enforce_eager=True,
            max_model_len=job.get("max_model_len"),
            kv_cache_dtype=job.get("kv_cache_dtype") or "auto",
            max_num_batched_tokens=job.get("max_num_batched_tokens"),
        )
        vllm_config = args.create_engine_config()
        tp = int(job.get("tensor_parallel_size") or 1)
        mla = bool(vllm_config.model_config.use_mla)
        block = job.get("block_size") or (64 if mla else 16)
        vllm_config.cache_config.block_size = int(block)
        if hasattr(vllm_config.cache_config, "kv_cache_layout"):
            # FlashAttention's layout on CUDA: layers outermost, no block-outermost packing
            vllm_config.cache_config.kv_cache_layout = "LBNHC"
        vllm_config.scheduler_config.async_scheduling = bool(job.get("async_scheduling", True))
        vllm_config.parallel_config.tensor_parallel_size = tp
        self._distributed(vllm_config)
        tp_group = self.ps.get_tp_group()
        saved = (tp_group.world_size, tp_group.rank_in_group)
        # parameters and buffers (rotary caches) on one GPU: what "Model loading took" counts
        weights: int | None = None
        parameters: int | None = None
        quant = vllm_config.quant_config
        quant_method = str(quant.get_name()) if quant is not None else ""
        try:
            tp_group.world_size, tp_group.rank_in_group = tp, 0
            try:
                model = self._build(vllm_config)
                parameters = _device_bytes(model.parameters())
                weights = parameters + _device_bytes(model.buffers())
                if quant_method in CPU_LAYOUT_METHODS:
                    notes.append(
                        f"{quant_method} parameters are laid out for the CPU's kernels here, not "
                        "CUDA's (padded expert tiles): the weights are the pure reader's"
                    )
                    weights = parameters = None
            except Exception as exc:
                if vllm_config.quant_config is None:
                    raise
                notes.append(
                    f"linear layers built unquantized ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:160]}); the KV cache spec does not depend "
                    "on them"
                )
                scheme = getattr(vllm_config.quant_config, "kv_cache_scheme", None)
                if scheme is not None and vllm_config.cache_config.cache_dtype == "auto":
                    vllm_config.cache_config.cache_dtype = "fp8"  # as Attention.__init__ does
                vllm_config.quant_config = None
                vllm_config.compilation_config.static_forward_context.clear()
                self._build(vllm_config)
        finally:
            tp_group.world_size, tp_group.rank_in_group = saved
        specs: dict[str, Any] = {}
        cuda_backend = self._cuda_backend()
        for name, layer in self.layers_of(vllm_config, self.attention_base).items():
            if getattr(layer, "kv_sharing_target_layer_name", None):
                continue  # reads another layer's cache (GPUModelRunner.get_kv_cache_spec)
            with self._as_on_cuda(layer, cuda_backend), self.set_config(vllm_config):
                spec = layer.get_kv_cache_spec(vllm_config)
            if spec:
                specs[name] = spec
        available = [int(a) for a in job.get("available", [])]
        before = job.get("pool_before_weights")
        if before is not None:
            # gpu_memory_utilization x total less the profile, then less the weights: vLLM's
            # parameter bytes where they are CUDA's, else the reader's
            if weights is not None:
                used = weights + int(job.get("extra_weights") or 0)
            else:
                used = int(job.get("fallback_weights") or 0)
            available = [int(before) - used]
        plans = [self._plan(vllm_config, specs, a) for a in available]
        return {
            "ok": True,
            "architecture": (config.get("architectures") or [""])[0],
            "layers": [_layer(n, s) for n, s in specs.items()],
            "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
            "block_size": int(vllm_config.cache_config.block_size),
            "max_model_len": int(vllm_config.model_config.max_model_len),
            "use_mla": mla,
            "weights_bytes_per_gpu": weights,
            "parameter_bytes_per_gpu": parameters,
            "quant_method": quant_method,
            "plans": plans,
            "notes": notes,
        }

    @staticmethod
    def _cuda_backend() -> Any:
        """FlashAttention's backend class, the default on a CUDA GPU (Ampere, Ada, Hopper): a
        sliding-window layer picks its block size from the backend's kernel block sizes
        (`Attention.get_kv_cache_spec`, `_largest_kernel_block_within`), and the CPU backend
        this process built the layers with takes multiples of 32 where CUDA's take 16. None if
        it cannot be imported (the spec is then the CPU backend's, and the output says so)."""
        try:
            return vllm.load(vllm.FLASH_ATTENTION_BACKEND)
        except Exception:
            return None

    @staticmethod
    @contextlib.contextmanager
    def _as_on_cuda(layer: Any, backend: Any) -> Any:
        """The layer's spec with the CUDA backend in place of the CPU one (MLA layers keep
        theirs: their block size is the cache config's)."""
        current = getattr(layer, "attn_backend", None)
        swap = (
            backend is not None
            and current is not None
            and not current.is_mla()
            and current.get_name() == "CPU_ATTN"
        )
        if swap:
            layer.attn_backend = backend
        try:
            yield
        finally:
            if swap:
                layer.attn_backend = current

    def _build(self, vllm_config: Any) -> Any:
        set_default_torch_dtype = vllm.load(vllm.SET_DEFAULT_TORCH_DTYPE)

        # as vLLM's loaders do: parameters are made in the model dtype
        dtype = vllm_config.model_config.dtype
        with (
            self.set_config(vllm_config),
            set_default_torch_dtype(dtype),
            self.torch.device("meta"),
        ):
            return self.initialize_model(vllm_config=vllm_config)

    def _plan(self, vllm_config: Any, specs: dict[str, Any], available: int) -> dict[str, Any]:
        mine = copy.deepcopy(specs)  # grouping may unify page sizes in place
        out: dict[str, Any] = {"available": available}
        try:
            groups = self.global_groups(vllm_config, [mine])
            configs = self.configs(vllm_config, [mine], [available], groups)
        except ValueError as exc:  # the engine's own refusal
            out["error"] = " ".join(str(exc).split())
            return out
        sched = self.scheduler_config(configs)
        tokens, concurrency = self.capacity(vllm_config, sched)
        out.update(
            num_blocks=int(configs[0].num_blocks),
            groups=len(sched.kv_cache_groups),
            tokens=int(tokens),
            max_concurrency=float(concurrency),
        )
        return out


def main() -> int:
    jobs = json.load(sys.stdin)
    results: list[dict[str, Any]] = []
    # vLLM prints to stdout as it imports and builds: keep stdout for the one JSON answer.
    with contextlib.redirect_stdout(io.StringIO()):
        probe = Probe()
        for job in jobs:
            try:
                results.append(probe.run(job))
            except Exception as exc:
                first = " ".join(str(exc).split())[:400]
                results.append({"ok": False, "error": f"{type(exc).__name__}: {first}"})
    sys.stdout.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.exit(main())
