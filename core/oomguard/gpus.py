"""The one table of GPUs that `oomguard budget`, `oomguard preflight` and the GPU twin read.

Each row is one kind of GPU as NVML reports it, plus the two figures the roofline of the twin
needs, the names Kubernetes labels its nodes with, and whether the twin simulates it (`twin`:
the twin's catalogue and its fleet matrix are the rows marked so, `TWIN_GPUS`). A new GPU is one
row here: budget, preflight and the deploy-time gate know it at once, and the twin too when it is
marked `twin=True`. Memory figures mean one thing everywhere in oomguard:

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
    # Where the memory figures were read (an nvidia-smi capture, PyTorch's "total capacity", a
    # vLLM log), and whether the driver's reserved part is an estimate rather than a reading:
    # then budget and preflight say so beside the figure they use.
    source: str = ""
    reserved_estimated: bool = False
    # GKE's accelerator label values for this GPU (cloud.google.com/gke-accelerator); NVIDIA's
    # GPU feature discovery label (nvidia.com/gpu.product) is the NVML name with dashes
    gke_accelerators: tuple[str, ...] = ()
    # the GPU twin simulates it (twin/gpu.py's catalogue, the fleet matrix runs it)
    twin: bool = False

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
    def provenance(self) -> str:
        """What budget and preflight show beside a figure from this row."""
        if self.reserved_estimated:
            return (
                f"{self.key}: the driver's reserved {self.reserved_mib} MiB is an estimate, not a "
                "reading; give --gpu-memory with torch.cuda.mem_get_info()'s total to be exact"
            )
        return f"{self.key}: {self.source}" if self.source else ""

    @property
    def cuda_total_bytes(self) -> int:
        """NVML total less the driver's reserved part: what vLLM sizes from."""
        return (self.total_mib - self.reserved_mib) * MIB


_ROWS = (
    GpuSpec(
        "L4",
        "NVIDIA L4",
        23034,
        430,
        121e12,
        0.300e12,
        gke_accelerators=("nvidia-l4",),
        twin=True,
    ),
    GpuSpec(
        "A10",
        "NVIDIA A10",
        23028,
        440,
        125e12,
        0.600e12,
        note="reserved as the A10G's",
        source="total: nvidia-smi on an A10 (find_string index id 31200907773)",
        reserved_estimated=True,
    ),
    GpuSpec("A10G", "NVIDIA A10G", 23028, 440, 70e12, 0.600e12, twin=True),
    GpuSpec("RTX3090", "NVIDIA GeForce RTX 3090", 24576, 346, 71e12, 0.936e12),
    GpuSpec("RTX4090", "NVIDIA GeForce RTX 4090", 24564, 346, 165.2e12, 1.008e12, twin=True),
    GpuSpec(
        "RTX5090",
        "NVIDIA GeForce RTX 5090",
        32607,
        484,
        209.5e12,
        1.792e12,
        source="total: nvidia-smi, 32607MiB (find_string index id 34759949062); reserved: "
        "PyTorch's 'total capacity of 31.37 GiB' on a 5090 (Wan-Video/Wan2.1 issue 465)",
    ),
    GpuSpec(
        "A100-40GB",
        "NVIDIA A100-SXM4-40GB",
        40960,
        470,
        312e12,
        1.555e12,
        small_tier_by_name=True,
        gke_accelerators=("nvidia-tesla-a100",),
        twin=True,
    ),
    GpuSpec("L40S", "NVIDIA L40S", 46068, 500, 362e12, 0.864e12, twin=True),
    GpuSpec(
        "A100-80GB",
        "NVIDIA A100-SXM4-80GB",
        81920,
        543,
        312e12,
        2.039e12,
        small_tier_by_name=True,
        gke_accelerators=("nvidia-a100-80gb",),
        twin=True,
    ),
    GpuSpec(
        "H100",
        "NVIDIA H100 80GB HBM3",
        81559,
        567,
        989e12,
        3.35e12,
        gke_accelerators=("nvidia-h100-80gb", "nvidia-h100-mega-80gb"),
        twin=True,
    ),
    GpuSpec(
        "H100-NVL",
        "NVIDIA H100 NVL",
        95830,
        506,
        835e12,
        3.9e12,
        source="total: nvidia-smi, 95830MiB (find_string index id 12249344301); reserved: "
        "PyTorch's 'total capacity of 93.09 GiB' on an H100 NVL (index id 70792423305)",
    ),
    GpuSpec(
        "H20",
        "NVIDIA H20",
        97871,
        580,
        148e12,
        4.0e12,
        note="reserved as the H100 NVL's first estimate",
        source="total: nvidia-smi on H20s, 97871MiB (find_string index id 69782509629)",
        reserved_estimated=True,
    ),
    GpuSpec(
        "H200",
        "NVIDIA H200",
        143771,
        600,
        989e12,
        4.8e12,
        gke_accelerators=("nvidia-h200-141gb",),
        twin=True,
    ),
    GpuSpec("GH200", "NVIDIA GH200 480GB", 97871, 580, 989e12, 4.0e12, note="96 GB HBM3 variant"),
    GpuSpec(
        "GH200-144GB",
        "NVIDIA GH200 144G HBM3e",
        146831,
        911,
        989e12,
        4.9e12,
        source="total: nvidia-smi, 146831 MiB (find_string index id 57699609541); reserved: the "
        "device properties a public test pins for this board (total_memory 153,008,209,920 B, "
        "index id 71276350143), not a capture",
        reserved_estimated=True,
    ),
    GpuSpec(
        "B200",
        "NVIDIA B200",
        183359,
        650,
        2250e12,
        8.0e12,
        gke_accelerators=("nvidia-b200",),
        twin=True,
    ),
    GpuSpec(
        "B300",
        "NVIDIA B300 SXM6 AC",
        275040,
        700,
        2250e12,
        8.0e12,
        note="spec sheet only: total and reserved estimated",
        reserved_estimated=True,
    ),
    GpuSpec(
        "GB200",
        "NVIDIA GB200",
        189471,
        650,
        2500e12,
        8.0e12,
        note="spec sheet only: total estimated, reserved as the B200's",
        reserved_estimated=True,
        gke_accelerators=("nvidia-gb200",),
    ),
    GpuSpec(
        "RTX-PRO-6000",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        97887,
        597,
        500e12,
        1.6e12,
        source="total: 97,887 MiB in a home-lab vLLM log (find_string index id 61370435018); "
        "reserved: vLLM's 95.01 GiB total on four of them (tests/fixtures/hf-configs/"
        "logged.json, qwen3-235b-2507-fp8-tp4-rtx-pro-6000)",
        gke_accelerators=("nvidia-rtx-pro-6000",),
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
        twin=True,
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
        twin=True,
    ),
)

GPUS: dict[str, GpuSpec] = {row.key: row for row in _ROWS}
# The GPUs the twin simulates, in the table's order (the fleet matrix runs each one)
TWIN_GPUS: tuple[str, ...] = tuple(row.key for row in _ROWS if row.twin)


def lookup(name: str) -> GpuSpec | None:
    """A GPU by its key in any letter case, or by NVML's name or a Kubernetes node label value
    (`nvidia.com/gpu.product`: 'NVIDIA-H100-80GB-HBM3', dashes for spaces;
    `cloud.google.com/gke-accelerator`: 'nvidia-h100-80gb'); None if unknown."""
    text = name.strip().lower()
    for row in _ROWS:
        if text == row.key.lower():
            return row
    for row in _ROWS:
        label = row.nvml_name.replace(" ", "-").lower()
        if text in (row.nvml_name.lower(), label, *row.gke_accelerators):
            return row
    return None
