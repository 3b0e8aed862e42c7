"""The one table of GPUs that `oomguard budget`, `oomguard preflight` and the GPU twin read.

Each row is one kind of GPU as NVML reports it, plus the two figures the roofline of the twin
needs. Memory figures mean one thing everywhere in oomguard:

- `total_mib`: NVML's total (`nvidia-smi -q`, FB Memory Usage, Total).
- `reserved_mib`: NVML's "Reserved" (memory v2): the driver's share, never usable by CUDA.
- `cuda_total_bytes` = total - reserved: what `torch.cuda.mem_get_info()` reports as total, the
  figure vLLM multiplies by `gpu_memory_utilization` (vllm/v1/worker/utils.py,
  `request_memory`). `--gpu-memory` on both `budget` and `preflight` is this CUDA total.

Totals are NVML's as seen on typical drivers for each board (MiB, rounded the way the driver
prints them); reserved figures are typical driver reservations, rounded. `flops` is the dense BF16
tensor peak and `bandwidth` the memory bandwidth, from the vendors' data sheets (a MIG slice gets
its share of both). Where a figure was not read from a real `nvidia-smi` the row says how it was
derived in `note`.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024**2


@dataclass(frozen=True)
class GpuSpec:
    key: str  # the name `--gpu` takes (any letter case)
    nvml_name: str  # what NVML's nvmlDeviceGetName returns
    total_mib: int
    reserved_mib: int
    flops: float
    bandwidth: float
    mig_profile: str = ""  # "1g.10gb" for a MIG slice; "" for a whole GPU
    parent: str = ""  # the key of the GPU a MIG slice is carved from
    # vLLM's by-name defaults: `vllm serve` gives an A100 the small batch tier whatever its
    # memory (vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args)
    small_tier_by_name: bool = False
    note: str = ""

    @property
    def name(self) -> str:
        """NVML's name (what the twin's nvmlDeviceGetName answers)."""
        return self.nvml_name

    @property
    def total_bytes(self) -> int:
        return self.total_mib * MIB

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_mib * MIB

    @property
    def cuda_total_bytes(self) -> int:
        """NVML total less the driver's reserved part: what vLLM sizes from."""
        return (self.total_mib - self.reserved_mib) * MIB


_ROWS = (
    GpuSpec("L4", "NVIDIA L4", 23034, 430, 121e12, 0.300e12),
    GpuSpec("A10", "NVIDIA A10", 23028, 440, 125e12, 0.600e12, note="reserved as the A10G's"),
    GpuSpec("A10G", "NVIDIA A10G", 23028, 440, 70e12, 0.600e12),
    GpuSpec("RTX3090", "NVIDIA GeForce RTX 3090", 24576, 346, 71e12, 0.936e12),
    GpuSpec("RTX4090", "NVIDIA GeForce RTX 4090", 24564, 346, 165.2e12, 1.008e12),
    GpuSpec(
        "RTX5090",
        "NVIDIA GeForce RTX 5090",
        32607,
        400,
        209.5e12,
        1.792e12,
        note="reserved estimated from the 4090's share",
    ),
    GpuSpec(
        "A100-40GB", "NVIDIA A100-SXM4-40GB", 40960, 470, 312e12, 1.555e12, small_tier_by_name=True
    ),
    GpuSpec("L40S", "NVIDIA L40S", 46068, 500, 362e12, 0.864e12),
    GpuSpec(
        "A100-80GB", "NVIDIA A100-SXM4-80GB", 81920, 543, 312e12, 2.039e12, small_tier_by_name=True
    ),
    GpuSpec("H100", "NVIDIA H100 80GB HBM3", 81559, 567, 989e12, 3.35e12),
    GpuSpec("H100-NVL", "NVIDIA H100 NVL", 95830, 580, 835e12, 3.9e12),
    GpuSpec("H20", "NVIDIA H20", 97871, 580, 148e12, 4.0e12, note="reserved as the H100 NVL's"),
    GpuSpec("H200", "NVIDIA H200", 143771, 600, 989e12, 4.8e12),
    GpuSpec("GH200", "NVIDIA GH200 480GB", 97871, 580, 989e12, 4.0e12, note="96 GB HBM3 variant"),
    GpuSpec("GH200-144GB", "NVIDIA GH200 144G HBM3e", 146831, 600, 989e12, 4.9e12),
    GpuSpec("B200", "NVIDIA B200", 183359, 650, 2250e12, 8.0e12),
    GpuSpec("B300", "NVIDIA B300 SXM6 AC", 275040, 700, 2250e12, 8.0e12, note="reserved estimated"),
    GpuSpec("GB200", "NVIDIA GB200", 189471, 650, 2500e12, 8.0e12, note="reserved as the B200's"),
    GpuSpec(
        "RTX-PRO-6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, 500, 500e12, 1.6e12
    ),
    # MIG slices of an H100 80GB: 1/7 or 3/7 of the compute, 1/8 or 4/8 of the memory system.
    GpuSpec(
        "H100-MIG-1g.10gb",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        9984,
        0,
        989e12 / 7,
        3.35e12 / 8,
        mig_profile="1g.10gb",
        parent="H100",
    ),
    GpuSpec(
        "H100-MIG-3g.40gb",
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        40192,
        0,
        989e12 * 3 / 7,
        3.35e12 / 2,
        mig_profile="3g.40gb",
        parent="H100",
    ),
)

GPUS: dict[str, GpuSpec] = {row.key: row for row in _ROWS}


def lookup(name: str) -> GpuSpec | None:
    """A GPU by its key in any letter case, or by NVML's name or a Kubernetes node label value
    (`nvidia.com/gpu.product`: 'NVIDIA-H100-80GB-HBM3', dashes for spaces); None if unknown."""
    text = name.strip().lower()
    for row in _ROWS:
        if text == row.key.lower():
            return row
    for row in _ROWS:
        label = row.nvml_name.replace(" ", "-").lower()
        if text in (row.nvml_name.lower(), label):
            return row
    return None
