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
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import ModelRunnerOutput

log = logging.getLogger("oomguard.twin.executor")


def _setting(config: dict[str, Any], key: str, env: str, default: float) -> float:
    if key in config:
        return float(config[key])
    return float(os.environ.get(env, default))


class ModelFreeWorker:
    """What collective_rpc reaches: the worker methods vLLM calls, without a model."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        additional = vllm_config.additional_config or {}
        twin = additional.get("oomguard_twin", {}) if isinstance(additional, dict) else {}
        self.kv_blocks = int(_setting(twin, "kv_blocks", "OOMGUARD_TWIN_KV_BLOCKS", 1024))
        self.step_seconds = _setting(twin, "step_seconds", "OOMGUARD_TWIN_STEP_SECONDS", 0.005)
        self.token_id = int(_setting(twin, "token_id", "OOMGUARD_TWIN_TOKEN_ID", 7))
        model = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size or 16
        self.num_layers = model.get_num_layers(vllm_config.parallel_config)
        self.spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model.get_head_size(),
            dtype=model.dtype if isinstance(model.dtype, torch.dtype) else torch.float16,
        )
        # tokens that must be computed before a request samples: prompt (+ outputs if resumed)
        self._needed: dict[str, int] = {}
        self._pending: ModelRunnerOutput | None = None

    # -- start-up ------------------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {f"model.layers.{i}.self_attn.attn": self.spec for i in range(self.num_layers)}

    def determine_available_memory(self) -> int:
        return self.kv_blocks * self.spec.page_size_bytes * self.num_layers

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC", "LBHNC"]  # vLLM's usual NHD / HND; nothing reads the (absent) cache

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        pass

    def check_health(self) -> None:
        pass

    # -- steps -------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> None:
        started = time.monotonic()
        for req_id in scheduler_output.finished_req_ids:
            self._needed.pop(req_id, None)
        done_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            self._needed[new.req_id] = len(new.prefill_token_ids or prompt)
            done_before[new.req_id] = new.num_computed_tokens
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
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req_ids.append(req_id)
            computed = done_before.get(req_id, 0) + n
            ready = computed >= self._needed.get(req_id, 0)
            sampled.append([self.token_id] if ready else [])
        self._pending = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        remaining = self.step_seconds - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
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


class ModelFreeExecutor(Executor):
    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.worker = ModelFreeWorker(self.vllm_config)

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        # One worker: the result list has one entry. A callable gets the worker as `self`.
        fn = getattr(self.worker, method) if isinstance(method, str) else None

        def call() -> list[Any]:
            if fn is not None:
                return [fn(*args, **(kwargs or {}))]
            return [method(self.worker, *args, **(kwargs or {}))]  # type: ignore[operator]

        return _run(call, non_block)

    def _single(self, method: str, arg: Any, non_block: bool) -> Any:
        # vLLM expects one result (not a list) from execute_model / sample_tokens.
        return _run(lambda: getattr(self.worker, method)(arg), non_block)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
        return self._single("execute_model", scheduler_output, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
        return self._single("sample_tokens", grammar_output, non_block)

    def compile_or_warm_up_model(self) -> None:
        pass

    def determine_available_memory(self) -> list[int]:
        return [self.worker.determine_available_memory()]

    def check_health(self) -> None:
        self.worker.check_health()

    def shutdown(self) -> None:
        pass
