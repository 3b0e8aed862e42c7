"""vLLM 0.33 as oomguard sees it: every patch point, route, metric name and default that depends
on vLLM's version, in one module (docs/architecture.md: a new vLLM version is a new module beside
this one, plus the build files).

The rest of oomguard imports these names from `oomguard.vllm_seam`, which picks the module for
the installed vLLM (or the newest where vLLM is absent: the exporter and remediator images).
`tests/test_vllm_seam.py` fails when a vLLM metric name or a `vllm.*` import appears elsewhere.
"""

from __future__ import annotations

import importlib
from typing import Any

# the vLLM releases this module describes (pyproject.toml's `vllm` extra holds the same range)
VERSIONS = ">=0.33,<0.34"
VERSION = "0.33.0"  # the release the tests, the demo and the images run
MINOR = "0.33"

# -- patch points: "module:attribute" inside vLLM, loaded by `load` -------------------------------
# the engine side (vllm_plugin/engine.py): the V1 scheduler and engine core are patched in place
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
ENGINE_CORE = "vllm.v1.engine.core:EngineCore"
GPU_WORKER = "vllm.v1.worker.gpu_worker:Worker"
PAUSE_STATE = "vllm.v1.core.sched.interface:PauseState"
REQUEST_STATUS = "vllm.v1.request:RequestStatus"
REQUEST_ERROR = "vllm.outputs:RequestError"
ENGINE_CORE_OUTPUT = "vllm.v1.engine:EngineCoreOutput"
ENGINE_CORE_OUTPUTS = "vllm.v1.engine:EngineCoreOutputs"
FINISH_REASON = "vllm.v1.engine:FinishReason"
# the API server side (vllm_plugin/admission.py): the request guard's hooks and vLLM's errors
INPUT_PROCESSOR = "vllm.v1.engine.input_processor:InputProcessor"
OUTPUT_PROCESSOR = "vllm.v1.engine.output_processor:OutputProcessor"
ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
VALIDATION_ERROR = "vllm.exceptions:VLLMValidationError"
GRACEFUL_HTTP_ERROR = "vllm.exceptions:GracefulHTTPError"
# distributed groups (vllm_plugin/allocator.py, sizing/vllm_probe.py)
PARALLEL_STATE = "vllm.distributed:parallel_state"
DISTRIBUTED = "vllm.distributed"
# the model-free executor (twin/executor.py)
EXECUTOR = "vllm.v1.executor.abstract:Executor"
FULL_ATTENTION_SPEC = "vllm.v1.kv_cache_interface:FullAttentionSpec"
KV_CACHE_SPEC = "vllm.v1.kv_cache_interface:KVCacheSpec"
MODEL_RUNNER_OUTPUT = "vllm.v1.outputs:ModelRunnerOutput"
LOGPROBS_LISTS = "vllm.v1.outputs:LogprobsLists"
LOGPROBS_TENSORS = "vllm.v1.outputs:LogprobsTensors"
# vLLM's own KV planning, run by `oomguard budget --vllm` (sizing/vllm_probe.py)
CONFIG = "vllm.config"
ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"
ATTENTION_LAYER_BASE = "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase"
INITIALIZE_MODEL = "vllm.model_executor.model_loader.utils:initialize_model"
KV_CACHE_PLANNING = "vllm.v1.core.kv_cache_planning"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
FLASH_ATTENTION_BACKEND = "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend"
SET_DEFAULT_TORCH_DTYPE = "vllm.utils.torch_utils:set_default_torch_dtype"
# `python -m vllm.entrypoints...`: how a command line runs vLLM's server (sizing/deploy.py)
ENTRYPOINTS = "vllm.entrypoints"

# whether EngineCoreOutput carries a RequestError (`error=`): 0.33 answers a request ended with
# FinishReason.ERROR by that error (retryable: 503); without it the API server answers 500
ENGINE_OUTPUT_ERROR = True


def load(point: str) -> Any:
    """The object at `point` ("module:attribute", or a module); ImportError if absent."""
    module, _, attr = point.partition(":")
    mod = importlib.import_module(module)
    if not attr:
        return mod
    try:
        return getattr(mod, attr)
    except AttributeError:
        try:  # a submodule not yet imported (`vllm.distributed:parallel_state`)
            return importlib.import_module(f"{module}.{attr}")
        except ImportError:
            raise ImportError(f"{point} is not in this vLLM") from None


# -- the HTTP routes of vLLM's API server --------------------------------------------------------
HEALTH = "/health"
METRICS_PATH = "/metrics"
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
MODELS = "/v1/models"
# Every route that puts work on the engine. While draining, a POST to one of these is answered
# 503 + Retry-After at the door (vllm_plugin/api.py). tests/test_vllm_plugin.py checks that each
# POST route the real server registers is in exactly one of GATED_PATHS and the plugin's
# CONTROL_PATHS, so a vLLM upgrade that adds an inference route fails the tests instead of
# slipping past the drain.
GATED_PATHS = frozenset(
    {
        COMPLETIONS,
        CHAT_COMPLETIONS,
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/v1/decisions",
        "/v1/systemone",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/v1/classify",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v2/embed",
        "/v2/rerank",
        "/cohere/v2/chat",
        "/generate",
        "/generative_scoring",
        "/inference/v1/generate",
        "/invocations",  # SageMaker: dispatches to completions, chat, embeddings, ...
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
    }
)

# POST routes that never start inference: tokenizer work, aborts and cancels (they must keep
# working while draining), and operator controls
CONTROL_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/v1/messages/count_tokens",
        "/v1/completions/render",
        "/v1/completions/derender",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/messages/render",
        "/v1/responses/render",
        "/cohere/v2/chat/render",
        "/v1/responses/{response_id}/cancel",
        "/abort_requests",
        "/inference/v1/abort_requests",
        "/ping",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/pause",
        "/resume",
        "/sleep",
        "/wake_up",
        "/release_kv_cache_memory",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/collective_rpc",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/fault_tolerance/apply",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/shutdown_weight_transfer_engine",
        "/weight_checker",
    }
)

# -- metric names on vLLM's /metrics (vllm/v1/metrics/loggers.py) ---------------------------------
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # removed upstream; some routers still emit it
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
PREEMPTIONS = "vllm:num_preemptions_total"
FINISHED = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
CACHE_CONFIG = "vllm:cache_config_info"
PROMPT_HIST = "vllm:request_prompt_tokens"
GENERATION_HIST = "vllm:request_generation_tokens"
TTFT = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
SLEEP_STATE = "vllm:engine_sleep_state"
METRIC_PREFIX = "vllm:"
# time_to_first_token_seconds' buckets: an SLO threshold must be one of them, since PromQL reads
# the bucket whose `le` label equals it (thresholds.py)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)

# -- defaults (vllm/config/cache.py, vllm/engine/arg_utils.py) ------------------------------------
GPU_MEMORY_UTILIZATION = 0.92
BLOCK_SIZE = 16  # the KV block size when the config leaves it unset

# -- images ---------------------------------------------------------------------------------------
IMAGE = f"ghcr.io/oomguard/vllm-oomguard:{VERSION}"  # vLLM + `pip install oomguard`
