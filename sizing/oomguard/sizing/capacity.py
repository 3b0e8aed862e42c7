"""vLLM 0.33's KV cache planning, in pure Python (`vllm/v1/core/kv_cache_planning.py`,
`kv_cache_utils.py`): groups, blocks, tokens and concurrency from per-layer specs. Checked against
vLLM's own functions in tests/test_budget.py."""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.errors import BudgetError
from oomguard.sizing.model import ModelShape, _cdiv

DEFAULT_BLOCK_SIZE = 16
MLA_BLOCK_SIZE = 64  # FlashMLA, the MLA backend on Hopper, needs 64-token blocks


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
