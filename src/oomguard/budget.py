"""`oomguard budget`'s names where they always were: the code lives in `oomguard.sizing`
(model reading, capacity planning, the budget, vLLM's own path) and the GPU table in
`oomguard.gpus`. Imported by the twin's physics and by older callers."""

from __future__ import annotations

from oomguard.gpus import GPUS
from oomguard.sizing.budget import (
    CUDA_GRAPH_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    Budget,
    BudgetInputs,
    compute,
    kv_bytes_for,
    overhead_per_gpu,
    serve_defaults,
    weights_per_gpu,
)
from oomguard.sizing.capacity import (
    DEFAULT_BLOCK_SIZE,
    MLA_BLOCK_SIZE,
    Capacity,
    kv_capacity,
    request_kv_bytes,
)
from oomguard.sizing.model import (
    DTYPE_BYTES,
    GIB,
    MIB,
    LayerKV,
    ModelShape,
    Quantization,
    shape_from_hf_config,
)
from oomguard.units import parse_size


def cuda_total_bytes(gpu: str) -> int:
    """What `torch.cuda.mem_get_info` reports as total for a known GPU (oomguard.gpus)."""
    return GPUS[gpu].cuda_total_bytes


__all__ = [
    "CUDA_GRAPH_BYTES",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DTYPE_BYTES",
    "GIB",
    "MIB",
    "MLA_BLOCK_SIZE",
    "Budget",
    "BudgetInputs",
    "Capacity",
    "LayerKV",
    "ModelShape",
    "Quantization",
    "compute",
    "cuda_total_bytes",
    "kv_bytes_for",
    "kv_capacity",
    "overhead_per_gpu",
    "parse_size",
    "request_kv_bytes",
    "serve_defaults",
    "shape_from_hf_config",
    "weights_per_gpu",
]
