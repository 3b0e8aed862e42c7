"""One GPU table (oomguard.gpus) for budget, preflight, the deploy-time gate and the GPU twin: the
twin's catalogue and its fleet matrix are rows of it, so every twin GPU is a budget GPU by
construction."""

from __future__ import annotations

import pytest

from oomguard.gpus import GPUS, TWIN_GPUS, lookup
from oomguard.sizing.budget import BudgetInputs, compute, serve_defaults
from oomguard.sizing.model import shape_from_hf_config
from oomguard.twin.gpu import GPU_MODELS, MIB, TwinGpu, TwinNvml

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_the_twin_catalogue_is_the_rows_of_the_table_marked_twin() -> None:
    assert tuple(GPU_MODELS) == TWIN_GPUS == tuple(k for k, row in GPUS.items() if row.twin)
    assert all(GPU_MODELS[key] is GPUS[key] for key in TWIN_GPUS)
    assert {"L4", "A100-80GB", "H100", "H200", "B200", "H100-MIG-1g.10gb"} <= set(TWIN_GPUS)


@pytest.mark.parametrize("key", TWIN_GPUS)
def test_every_twin_gpu_is_a_budget_gpu_with_the_same_memory(key: str) -> None:
    """What the twin's NVML reports for a GPU is what budget sizes it from."""
    row = GPUS[key]
    nvml = TwinNvml([TwinGpu("GPU-0", model=key)])
    memory = nvml.nvmlDeviceGetMemoryInfo(("mig", 0) if row.mig_profile else 0, version=2)
    assert (memory.total, memory.reserved) == (row.total_mib * MIB, row.reserved_mib * MIB)
    assert memory.total - memory.reserved == row.cuda_total_bytes
    assert lookup(key.lower()) is row and lookup(row.nvml_name) is row
    budget = compute(
        shape_from_hf_config(LLAMA_8B),
        BudgetInputs(gpu_memory_bytes=row.cuda_total_bytes, gpu_name=key, max_model_len=2048),
    )
    assert budget.to_dict()  # sized: no unknown GPU anywhere on the way
    assert serve_defaults(row.cuda_total_bytes, key)


def test_the_table_is_consistent() -> None:
    keys = [k.lower() for k in GPUS]
    assert len(set(keys)) == len(keys)
    names = [row.nvml_name.lower() for row in GPUS.values()]
    assert len(set(names)) == len(names)
    labels = [label for row in GPUS.values() for label in row.gke_accelerators]
    assert len(set(labels)) == len(labels)
    for label in labels:
        assert label in lookup(label).gke_accelerators  # type: ignore[union-attr]
    for row in GPUS.values():
        assert 0 <= row.reserved_mib < row.total_mib and row.flops > 0 and row.bandwidth > 0
        if row.mig_profile:  # a MIG slice: carved from a whole GPU of the table, smaller than it
            parent = GPUS[row.parent]
            assert not parent.mig_profile and row.total_mib < parent.total_mib
            assert row.nvml_name == f"{parent.nvml_name} MIG {row.mig_profile}"
            assert not row.twin or parent.twin  # the twin shows a slice inside its parent
        else:
            assert not row.parent


def test_the_deploy_gate_reads_gke_labels_from_the_table() -> None:
    assert lookup("nvidia-h100-mega-80gb") is GPUS["H100"]
    assert lookup("nvidia-tesla-a100") is GPUS["A100-40GB"]
    assert lookup("NVIDIA-H100-80GB-HBM3") is GPUS["H100"]
    assert lookup("nvidia-no-such-gpu") is None
