"""GPU acceptance: the parts of oomguard that read a real GPU, checked against the GPU itself.

Run by `scripts/gpu-check` (docs/benchmarks.md, "GPU acceptance"). Five checks, each compared
with an independent reading of the same GPU:

1. `nvml`: the exporter's NVML collector against `nvidia-smi --query-gpu` and
   `--query-compute-apps` (total, used, free per GPU; memory per process);
2. `allocator`: the allocator publisher's hand-off file, and the exporter's series read from
   it, against `torch.cuda.memory_stats()` of the real caching allocator after a fragmenting
   workload (the workload must leave split blocks, or the check says it did not);
3. `oom`: a real `torch.cuda.OutOfMemoryError`, caught by the plugin's OOM observer as PyTorch
   calls it, written as an incident record, read back and classified (a long-prompt step was
   noted before it, so the expected type is `long_prompt`);
4. `headroom`: the request guard's worker headroom (`worker_memory`) against
   `torch.cuda.mem_get_info` and the allocator's counters, then proven by allocating it;
5. `pressure`: the GPU's pressure level (the exporter's evaluator over the NVML collector and
   the hand-off) as a second process allocates in stages toward each threshold: 0, 1, 2, 3.

Without a GPU (`--dry-run`) the same check code runs against a simulated device (the GPU twin's
NVML and a small simulated caching allocator), so CI catches a broken check; every check then
says `not_checked` with the reason, and the outcome of its simulated run is kept apart under
`dry_run`. A dry run measures nothing about any GPU.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from oomguard import children, vllm_seam

SCHEMA = "oomguard.gpu_check.v1"
MIB = 2**20
GIB = 2**30
# Polls timed for the NVML collector's cost on this GPU (issue 30: the exporter polls every
# second, under 1 % of a core): a few hundred milliseconds on a real GPU.
POLL_SAMPLES = 1000
CHECKS = ("nvml", "allocator", "oom", "headroom", "pressure")
TITLES = {
    "nvml": "NVML collector against nvidia-smi --query-gpu/--query-compute-apps",
    "allocator": "allocator publisher against the CUDA caching allocator (fragmenting workload)",
    "oom": "a real torch.cuda.OutOfMemoryError through the OOM observer, recorded and classified",
    "headroom": "the guard's headroom against torch.cuda.mem_get_info, then allocated",
    "pressure": "the pressure level as a second process allocates",
}


class CheckFailed(Exception):
    """A comparison that did not hold; the message says which figures and by how much."""


# -- the device under test ---------------------------------------------------------------------
class Device:
    """What the checks read and do: a real GPU (CudaDevice) or a simulated one (SimDevice)."""

    simulated: bool
    cuda: Any  # torch.cuda, or the simulated allocator
    nvml: Any  # the pynvml module, or the twin's NVML
    oom_error: type[BaseException]

    def nvidia_smi(self, args: list[str]) -> str:
        raise NotImplementedError

    def allocate(self, nbytes: int) -> Any:
        raise NotImplementedError

    def free(self, block: Any) -> None:
        raise NotImplementedError

    def uuid(self) -> str:
        raise NotImplementedError

    def attach_oom_observer(self, handoff: str, incidents: str) -> bool:
        raise NotImplementedError

    @contextlib.contextmanager
    def torch_for_plugin(self) -> Iterator[None]:
        """`import torch` inside plugin functions sees this device's CUDA."""
        yield

    def neighbour(self) -> Neighbour:
        raise NotImplementedError


class Neighbour:
    """A second process on the GPU that allocates on request."""

    def allocate(self, nbytes: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class CudaDevice(Device):
    simulated = False

    def __init__(self) -> None:
        import pynvml
        import torch

        self.torch = torch
        self.cuda = torch.cuda
        self.nvml = pynvml
        self.oom_error = torch.cuda.OutOfMemoryError
        torch.cuda.init()
        self.cuda.set_device(0)

    def nvidia_smi(self, args: list[str]) -> str:
        r = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False
        )
        if r.returncode != 0:
            raise CheckFailed(f"nvidia-smi {' '.join(args)}: {(r.stdout + r.stderr).strip()}")
        return r.stdout

    def allocate(self, nbytes: int) -> Any:
        block = self.torch.empty(int(nbytes), dtype=self.torch.uint8, device="cuda")
        self.cuda.synchronize()
        return block

    def free(self, block: Any) -> None:
        del block

    def uuid(self) -> str:
        raw = str(getattr(self.cuda.get_device_properties(0), "uuid", ""))
        return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"

    def attach_oom_observer(self, handoff: str, incidents: str) -> bool:
        from oomguard.vllm_plugin import oom

        os.environ["OOMGUARD_ALLOCATOR_DIR"] = handoff
        os.environ["OOMGUARD_INCIDENT_DIR"] = incidents
        os.environ["OOMGUARD_TARGET"] = "gpu-check"
        return oom.attach_to_torch()  # the plugin's own path: recorder() on torch.cuda

    def neighbour(self) -> Neighbour:
        return _CudaNeighbour()


_NEIGHBOUR = """
import sys, torch
torch.cuda.init(); torch.cuda.set_device(0)
held = [torch.empty(1, dtype=torch.uint8, device="cuda")]
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    if n <= 0:
        break
    held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    print("ok", flush=True)
"""


class _CudaNeighbour(Neighbour):
    def __init__(self) -> None:
        # it holds GPU memory: SIGTERM should this check die (children.py)
        self.proc = children.popen(
            [sys.executable, "-c", _NEIGHBOUR],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._expect("ready", 120)

    def _expect(self, word: str, timeout: float) -> None:
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise CheckFailed(f"the second process did not answer '{word}' in {timeout:.0f} s")
        line = self.proc.stdout.readline().strip()
        if line != word:
            raise CheckFailed(f"the second process answered {line!r}, expected {word!r}")

    def allocate(self, nbytes: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{int(nbytes)}\n")
        self.proc.stdin.flush()
        self._expect("ok", 60)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("0\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- a simulated device, for the dry run ---------------------------------------------------------
class SimOutOfMemoryError(RuntimeError):
    """The simulated allocator's torch.cuda.OutOfMemoryError."""


@dataclass
class _Segment:
    size: int
    blocks: list[list[int]] = field(default_factory=list)  # [size, active 0/1]


class SimCuda:
    """A small model of PyTorch's caching allocator over one twin GPU: large allocations
    rounded to 2 MiB, best-fit reuse of free blocks with splitting (what leaves
    `inactive_split_bytes`), release of whole free segments and one retry before an OOM, and
    the out-of-memory observers called before the error is raised. It exists so the dry run
    drives the checks' code; it measures nothing."""

    CONTEXT = 512 * MIB  # a CUDA context's own device memory

    def __init__(self, nvml: Any, gpu_index: int = 0) -> None:
        self.nvml, self.index, self.pid = nvml, gpu_index, os.getpid()
        self.segments: list[_Segment] = []
        self.peak_allocated = self.peak_reserved = 0
        self.retries = self.ooms = 0
        self.observers: list[Callable[[int, int, int, int], None]] = []
        self._update()

    # torch.cuda's interface, as far as the plugin uses it
    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: int = 0) -> Any:
        gpu = self.nvml.gpus[self.index]
        return SimpleNamespace(uuid=gpu.uuid.removeprefix("GPU-"), total_memory=self._total())

    def _total(self) -> int:
        gpu = self.nvml.gpus[self.index]
        return int(gpu.total - gpu.reserved)

    def mem_get_info(self, device: int = 0) -> tuple[int, int]:
        return int(self.nvml.gpus[self.index].free), self._total()

    def memory_stats(self, device: int = 0) -> dict[str, int]:
        allocated, reserved, split = self._figures()
        return {
            "allocated_bytes.all.current": allocated,
            "reserved_bytes.all.current": reserved,
            "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.peak": self.peak_reserved,
            "inactive_split_bytes.all.current": split,
            "num_alloc_retries": self.retries,
            "num_ooms": self.ooms,
        }

    def memory_snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "total_size": s.size,
                "blocks": [
                    {"size": b[0], "state": "active_allocated" if b[1] else "inactive"}
                    for b in s.blocks
                ],
            }
            for s in self.segments
        ]

    def empty_cache(self) -> None:
        self.segments = [s for s in self.segments if any(b[1] for b in s.blocks)]
        self._update()

    def synchronize(self) -> None:
        pass

    # the allocator
    def _figures(self) -> tuple[int, int, int]:
        allocated = sum(b[0] for s in self.segments for b in s.blocks if b[1])
        reserved = sum(s.size for s in self.segments)
        split = sum(
            b[0] for s in self.segments if any(x[1] for x in s.blocks) for b in s.blocks if not b[1]
        )
        return allocated, reserved, split

    def _update(self) -> None:
        allocated, reserved, _ = self._figures()
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)
        self.nvml.set_process(self.index, self.pid, self.CONTEXT + reserved)

    def allocate(self, nbytes: int) -> tuple[_Segment, list[int]]:
        grain = 2 * MIB if nbytes >= MIB else 512  # PyTorch's large and small rounding
        size = max(grain, -(-int(nbytes) // grain) * grain)
        best: tuple[_Segment, list[int]] | None = None
        for seg in self.segments:
            for b in seg.blocks:
                if not b[1] and b[0] >= size and (best is None or b[0] < best[1][0]):
                    best = (seg, b)
        if best is not None:
            seg, b = best
            if b[0] > size:  # split: the rest stays free inside a segment in use
                seg.blocks.insert(seg.blocks.index(b) + 1, [b[0] - size, 0])
                b[0] = size
            b[1] = 1
            self._update()
            return seg, b
        seg_size = max(size, 2 * MIB)
        if self.nvml.gpus[self.index].free < seg_size:
            self.retries += 1
            self.empty_cache()
            if self.nvml.gpus[self.index].free < seg_size:
                self.ooms += 1
                free, total = self.mem_get_info()
                for observer in self.observers:
                    observer(0, seg_size, total, free)
                raise SimOutOfMemoryError(f"CUDA out of memory. Tried to allocate {seg_size}")
        seg = _Segment(seg_size, [[size, 1]] + ([[seg_size - size, 0]] if seg_size > size else []))
        self.segments.append(seg)
        self._update()
        return seg, seg.blocks[0]

    def release(self, handle: tuple[_Segment, list[int]]) -> None:
        seg, b = handle
        b[1] = 0
        merged: list[list[int]] = []  # neighbouring free blocks coalesce
        for x in seg.blocks:
            if merged and not merged[-1][1] and not x[1]:
                merged[-1][0] += x[0]
            else:
                merged.append(x)
        seg.blocks = merged
        self._update()


class _SimNeighbour(Neighbour):
    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml, self.index, self.used = nvml, index, SimCuda.CONTEXT
        self.pid = os.getpid() + 1
        nvml.set_process(index, self.pid, self.used)

    def allocate(self, nbytes: int) -> None:
        self.used += int(nbytes)
        self.nvml.set_process(self.index, self.pid, self.used)

    def close(self) -> None:
        self.nvml.set_process(self.index, self.pid, None)


class SimDevice(Device):
    """The GPU twin's NVML (one simulated H100) with SimCuda on it, and an nvidia-smi that
    reads the same twin. `smi_skew_bytes` makes that nvidia-smi disagree (tests of the checks)."""

    simulated = True
    oom_error = SimOutOfMemoryError

    def __init__(self, model: str = "H100", smi_skew_bytes: int = 0) -> None:
        from oomguard.twin.gpu import TwinGpu, TwinNvml

        self.gpu = TwinGpu("GPU-00000000-0000-4000-8000-0000000000a1", model=model)
        self.nvml = TwinNvml([self.gpu])
        self.cuda = SimCuda(self.nvml)
        self.smi_skew = smi_skew_bytes

    def nvidia_smi(self, args: list[str]) -> str:
        g = self.gpu
        mib = lambda n: str(int(n) // MIB)  # noqa: E731
        if any(a.startswith("--query-gpu") for a in args):
            fields = next(a for a in args if a.startswith("--query-gpu")).split("=", 1)[1]
            row = {
                "uuid": g.uuid,
                "memory.total": mib(g.total),
                "memory.used": mib(g.used + self.smi_skew),
                "memory.free": mib(g.free - self.smi_skew),
                "memory.reserved": mib(g.reserved),
            }
            return ", ".join(row[f] for f in fields.split(",")) + "\n"
        return "".join(f"{pid}, {g.uuid}, {mib(used)}\n" for pid, used in g.processes.items())

    def allocate(self, nbytes: int) -> Any:
        return self.cuda.allocate(nbytes)

    def free(self, block: Any) -> None:
        self.cuda.release(block)

    def uuid(self) -> str:
        return self.gpu.uuid

    def attach_oom_observer(self, handoff: str, incidents: str) -> bool:
        from oomguard.vllm_plugin import oom

        recorder = oom.OomRecorder(
            handoff,
            incidents,
            "gpu-check",
            stats=self.cuda.memory_stats,
            identity=lambda: {"device_index": 0, "device_uuid": self.gpu.uuid},
            extra=lambda: _largest_free(self.cuda.memory_snapshot()),
        )
        self.cuda.observers.append(recorder.observe)
        return True

    @contextlib.contextmanager
    def torch_for_plugin(self) -> Iterator[None]:
        saved = sys.modules.get("torch")
        sys.modules["torch"] = SimpleNamespace(cuda=self.cuda)  # type: ignore[assignment]
        try:
            yield
        finally:
            if saved is None:
                sys.modules.pop("torch", None)
            else:
                sys.modules["torch"] = saved

    def neighbour(self) -> Neighbour:
        return _SimNeighbour(self.nvml, 0)


def _largest_free(snapshot: list[dict[str, Any]]) -> dict[str, Any]:
    largest = max(
        (int(b["size"]) for s in snapshot for b in s["blocks"] if b["state"] == "inactive"),
        default=0,
    )
    return {"segments": len(snapshot), "largest_free_block_bytes": largest}


# -- helpers -------------------------------------------------------------------------------------
def _near(name: str, ours: float, theirs: float, tolerance: float) -> dict[str, float]:
    if abs(ours - theirs) > tolerance:
        raise CheckFailed(
            f"{name}: oomguard {ours / MIB:,.1f} MiB, reference {theirs / MIB:,.1f} MiB "
            f"(off by {abs(ours - theirs) / MIB:,.1f} MiB, tolerance {tolerance / MIB:,.1f} MiB)"
        )
    return {f"{name}_ours_bytes": ours, f"{name}_reference_bytes": theirs}


def _csv(text: str) -> list[list[str]]:
    return [[c.strip() for c in row] for row in csv.reader(io.StringIO(text)) if row]


def fragment(device: Device, seed: int = 7, count: int = 240) -> list[Any]:
    """Allocate blocks of mixed sizes, free every other one, then allocate slightly smaller
    blocks into the holes: the allocator splits free blocks and keeps the remainders
    (inactive_split_bytes), as a long-running engine's does. Returns what stays allocated."""
    rng = random.Random(seed)
    blocks = [device.allocate(rng.randint(3, 40) * MIB + rng.randint(0, MIB)) for _ in range(count)]
    kept = blocks[1::2]
    for b in blocks[0::2]:
        device.free(b)
    del blocks
    kept += [device.allocate(rng.randint(1, 20) * MIB + 4096) for _ in range(count // 2)]
    return kept


# -- the checks ------------------------------------------------------------------------------------
def check_nvml(device: Device, held: list[Any]) -> dict[str, Any]:
    from oomguard.exporter.collectors.nvml import NvmlCollector

    held.append(device.allocate(1 * GIB))  # this process shows as a compute app
    reading = NvmlCollector(platform.node(), device.nvml, process_metrics=True).collect()
    fields = "uuid,memory.total,memory.used,memory.free,memory.reserved"
    try:
        rows = _csv(device.nvidia_smi([f"--query-gpu={fields}", "--format=csv,noheader,nounits"]))
    except CheckFailed:  # drivers before memory.reserved
        fields = "uuid,memory.total,memory.used,memory.free"
        rows = _csv(device.nvidia_smi([f"--query-gpu={fields}", "--format=csv,noheader,nounits"]))
    names = fields.split(",")
    smi = {r[0]: dict(zip(names, r, strict=True)) for r in rows}
    ours = {g.identity.uuid: g for g in reading.gpus if not g.identity.gpu_instance_id}
    if set(ours) != set(smi):
        raise CheckFailed(f"GPUs: NVML collector {sorted(ours)}, nvidia-smi {sorted(smi)}")
    measured: dict[str, Any] = {"gpus": len(ours)}
    drift = 64 * MIB  # memory moves between the two reads (other processes); MiB rounding
    for uuid, g in ours.items():
        row = smi[uuid]
        assert g.total is not None and g.free is not None and g.used is not None
        one = _near("total", g.total, int(row["memory.total"]) * MIB, 1 * MIB)
        one |= _near("free", g.free, int(row["memory.free"]) * MIB, drift)
        # nvidia-smi's used leaves reserved out on drivers that report it (NVML memory v2)
        smi_used = int(row["memory.used"]) * MIB
        one |= _near("used", g.used, smi_used, drift + (g.reserved or 0))
        measured[uuid] = one
    apps = _csv(
        device.nvidia_smi(
            ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]
        )
    )
    smi_procs = {(int(p), u): int(m) * MIB for p, u, m in apps if m.isdigit()}
    our_procs = {(pid, ident.uuid): used for ident, pid, used in reading.processes}
    missing = sorted(set(smi_procs) - set(our_procs))
    if missing:
        raise CheckFailed(f"processes nvidia-smi lists and the collector does not: {missing}")
    for key, used in smi_procs.items():
        _near(f"process {key[0]}", our_procs[key], used, 2 * MIB)
    me = [k for k in our_procs if k[0] == os.getpid()]
    measured |= {"processes": len(smi_procs), "this_process_listed": bool(me)}
    measured["poll_cpu_us_per_gpu"] = poll_cost(
        NvmlCollector(platform.node(), device.nvml), len(ours)
    )
    return measured


def poll_cost(collector: Any, gpus: int, samples: int = POLL_SAMPLES) -> dict[str, float]:
    """CPU time of one exporter poll of NVML on this machine's driver, per GPU (microseconds):
    the collector kept between polls as the exporter keeps it (its caches warm)."""
    collector.collect()
    cpu = []
    for _ in range(samples):
        start = time.process_time()
        collector.collect()
        cpu.append(time.process_time() - start)
    cpu.sort()
    per = 1e6 / max(gpus, 1)
    return {
        "polls": samples,
        "mean": round(sum(cpu) / samples * per, 1),
        "p50": round(cpu[samples // 2] * per, 1),
        "p99": round(cpu[min(samples - 1, int(samples * 0.99))] * per, 1),
    }


def check_allocator(device: Device, held: list[Any], tmp: Path) -> dict[str, Any]:
    from oomguard.exporter.collectors.allocator import AllocatorCollector
    from oomguard.exporter.render import FamilyBuilder
    from oomguard.handoff import TORCH_STATS_KEYS, read_reports
    from oomguard.vllm_plugin.allocator import AllocatorPublisher

    held += fragment(device)
    handoff = tmp / "allocator"
    publisher = AllocatorPublisher(device.cuda, str(handoff), target="gpu-check")
    if publisher.publish_once() is None:
        raise CheckFailed("the publisher wrote no report (see its warning above)")
    stats = device.cuda.memory_stats(0)  # nothing allocated since: the same figures
    reports, problems = read_reports(handoff, time.time(), stale_after=60.0)
    if problems or len(reports) != 1:
        raise CheckFailed(f"hand-off read back {len(reports)} reports, refused {dict(problems)}")
    r = reports[0]
    for name, key in TORCH_STATS_KEYS.items():
        if getattr(r, name) != int(stats.get(key, 0)):
            raise CheckFailed(f"{name}: report {getattr(r, name)}, memory_stats {stats.get(key)}")
    if r.pid != os.getpid() or r.device_uuid != device.uuid():
        raise CheckFailed(f"identity: pid {r.pid}, device {r.device_uuid!r} ({device.uuid()!r})")
    # the exporter joins a rank to its GPU by this UUID: NVML must list the same string
    from oomguard.exporter.collectors.nvml import NvmlCollector

    listed = {g.identity.uuid for g in NvmlCollector("", device.nvml).collect().gpus}
    if r.device_uuid not in listed:
        raise CheckFailed(f"the report's device {r.device_uuid!r} is not among NVML's {listed}")
    if r.inactive_split_bytes <= 0 or r.reserved_bytes <= r.allocated_bytes:
        raise CheckFailed(
            f"the workload did not fragment the allocator (inactive split "
            f"{r.inactive_split_bytes}, reserved {r.reserved_bytes}, allocated {r.allocated_bytes})"
        )
    collector = AllocatorCollector(str(handoff), platform.node(), stale_after=60.0)
    out = FamilyBuilder()
    collector.families(collector.collect(), out)
    served = {f.spec.name: s[1] for f in out.families() for s in f.samples}
    for metric, value in (
        ("oomguard_allocator_allocated_bytes", r.allocated_bytes),
        ("oomguard_allocator_reserved_bytes", r.reserved_bytes),
        ("oomguard_allocator_inactive_split_bytes", r.inactive_split_bytes),
    ):
        if served.get(metric) != value:
            raise CheckFailed(f"{metric}: served {served.get(metric)}, report {value}")
    return {
        "allocated_bytes": r.allocated_bytes,
        "reserved_bytes": r.reserved_bytes,
        "inactive_split_bytes": r.inactive_split_bytes,
        "allocated_peak_bytes": r.allocated_peak_bytes,
        "reserved_peak_bytes": r.reserved_peak_bytes,
        "alloc_retries": r.alloc_retries,
    }


def _step_with_long_prompt(tokens: int) -> Any:
    """A scheduler output as vLLM's worker sees it: one new request, `tokens` prompt tokens
    scheduled at once, with prompt_logprobs (the heaviest transient a prompt asks for)."""
    sampling = SimpleNamespace(n=1, best_of=None, logprobs=None, prompt_logprobs=1, max_tokens=16)
    req = SimpleNamespace(
        req_id="gpu-check-long",
        prompt_token_ids=list(range(tokens)),
        prefill_token_ids=None,
        num_computed_tokens=0,
        sampling_params=sampling,
    )
    return SimpleNamespace(
        scheduled_new_reqs=[req],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.req_id: tokens},
        total_num_scheduled_tokens=tokens,
    )


def _engine_config() -> Any:
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            gpu_memory_utilization=vllm_seam.GPU_MEMORY_UTILIZATION, block_size=vllm_seam.BLOCK_SIZE
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=256, max_num_batched_tokens=8192, enable_chunked_prefill=True
        ),
        model_config=SimpleNamespace(
            max_model_len=32768, get_vocab_size=lambda: 128_256, get_hidden_size=lambda: 4096
        ),
    )


def check_oom(device: Device, tmp: Path) -> dict[str, Any]:
    from oomguard.forensics import incidents, reader
    from oomguard.vllm_plugin import oom

    handoff, recorded = tmp / "oom-handoff", tmp / "incidents"
    recorded.mkdir(parents=True, exist_ok=True)
    if not device.attach_oom_observer(str(handoff), str(recorded)):
        raise CheckFailed("the OOM observer could not be attached to this torch")
    oom.note_flags(_engine_config())
    oom.note_step(_step_with_long_prompt(8192))  # the step that "fails": the classifier's input
    free, total = device.cuda.mem_get_info(0)
    stats = device.cuda.memory_stats(0)
    cached = int(stats["reserved_bytes.all.current"]) - int(stats["allocated_bytes.all.current"])
    ooms_before = int(stats.get("num_ooms", 0))
    ask = free + cached + 4 * GIB  # more than the device can give, cache released or not
    try:
        block = device.allocate(ask)
    except device.oom_error:
        pass
    else:
        device.free(block)
        raise CheckFailed(f"allocating {ask / GIB:.1f} GiB with {free / GIB:.1f} GiB free worked")
    loaded = reader.load(recorded, missing_ok=False)
    if loaded.invalid or len(loaded.ooms) != 1:
        raise CheckFailed(f"{len(loaded.ooms)} OOM records read back, refused {loaded.invalid}")
    rec = loaded.ooms[0]
    if not ask <= rec.requested_bytes <= ask + 2 * MIB:  # the allocator rounds up to 2 MiB
        raise CheckFailed(f"requested_bytes {rec.requested_bytes}, asked {ask}")
    if rec.allocator.ooms < 1 or rec.steps != 1:
        raise CheckFailed(f"record: ooms {rec.allocator.ooms}, steps {rec.steps}")
    after = int(device.cuda.memory_stats(0).get("num_ooms", 0))
    if after != ooms_before + 1:
        raise CheckFailed(f"torch counted {after - ooms_before} OOMs for one failed allocation")
    [found] = incidents.incidents(loaded)
    if found.type != "long_prompt" or found.confidence != "confirmed":
        raise CheckFailed(f"classified {found.type} ({found.confidence}): {found.evidence}")
    return {
        "requested_bytes": rec.requested_bytes,
        "device_limit_bytes": rec.device_limit_bytes,
        "device_free_bytes": rec.device_free_bytes,
        "mem_get_info_total_bytes": total,
        "type": found.type,
        "confidence": found.confidence,
        "evidence": found.evidence,
    }


def check_headroom(device: Device) -> dict[str, Any]:
    from oomguard.vllm_plugin.engine import _expandable_segments, worker_memory
    from oomguard.vllm_plugin.guard import ModelMemory, activation_bytes

    worker = SimpleNamespace(vllm_config=_engine_config())
    with device.torch_for_plugin():
        got = worker_memory(worker)
    free, total = device.cuda.mem_get_info(0)
    stats = device.cuda.memory_stats(0)
    reserved = int(stats["reserved_bytes.all.current"])
    allocated = int(stats["allocated_bytes.all.current"])
    split = 0 if _expandable_segments() else int(stats["inactive_split_bytes.all.current"])
    step = activation_bytes(8192, ModelMemory(128_256, 4096))
    expected = free + max(0, reserved - allocated - split) - step
    measured = _near("now", got["now"], expected, 64 * MIB)
    room = got["now"] + step  # what one allocation can take right now, by the guard's account
    if room <= 0:
        raise CheckFailed(f"no headroom to test: now {got['now']}, step {step}")
    try:
        block = device.allocate(int(room * 0.95))
    except device.oom_error:
        raise CheckFailed(
            f"95 % of the guard's headroom ({room * 0.95 / GIB:.2f} GiB) "
            "could not be allocated: the guard overestimates"
        ) from None
    device.free(block)
    return measured | {
        "idle_bytes": got["idle"],
        "step_bytes": step,
        "allocated_95_percent_bytes": int(room * 0.95),
        "mem_get_info_free_bytes": free,
        "mem_get_info_total_bytes": total,
    }


def check_pressure(device: Device, tmp: Path) -> dict[str, Any]:
    from oomguard.exporter.collectors.nvml import NvmlCollector
    from oomguard.exporter.collectors.vllm import EngineReading
    from oomguard.exporter.pressure import EngineSource, PressureEvaluator
    from oomguard.handoff import read_reports
    from oomguard.thresholds import PressureThresholds
    from oomguard.vllm_plugin.allocator import AllocatorPublisher

    t = PressureThresholds()
    handoff = tmp / "pressure-handoff"
    publisher = AllocatorPublisher(device.cuda, str(handoff), target="gpu-check")
    collector = NvmlCollector(platform.node(), device.nvml, process_metrics=True)
    evaluator = PressureEvaluator(t)
    uuid = device.uuid()
    gmu_box: dict[str, float] = {}

    def level() -> tuple[int, str, float, float]:
        publisher.publish_once()
        reading = collector.collect()
        [gpu] = [g for g in reading.gpus if g.identity.uuid == uuid]
        reports, _ = read_reports(handoff, time.time(), stale_after=60.0)
        engine = EngineReading("gpu-check", "0", gpu_memory_utilization=gmu_box.get("gmu"))
        src = EngineSource("gpu-check", engine, gpus=[uuid])
        ev = evaluator.evaluate([gpu], [src], reports, time.time(), reading.processes)
        [gp] = [p for p in ev.gpus if p.identity.uuid == uuid]
        assert gpu.total is not None
        usable = gpu.total - (gpu.reserved or 0.0)
        return gp.level.level, gp.level.reason, gp.headroom_bytes or 0.0, usable

    neighbour = device.neighbour()
    fill: Any = None
    try:
        # The engine (this process) fills the GPU to 4 % of usable memory left, and its plan
        # is exactly what it holds (gmu = its use / usable): the headroom starts above the
        # caution line whatever this GPU's size, and every byte the neighbour takes comes off
        # it, whether or not NVML lists this process (per-engine use known or not).
        reading = collector.collect()
        [gpu] = [g for g in reading.gpus if g.identity.uuid == uuid]
        assert gpu.total is not None and gpu.free is not None
        usable = gpu.total - (gpu.reserved or 0.0)
        fill = device.allocate(int(gpu.free - 0.04 * usable))
        reading = collector.collect()
        [gpu] = [g for g in reading.gpus if g.identity.uuid == uuid]
        own = sum(b for _, pid, b in reading.processes if pid == os.getpid())
        gmu = (own or gpu.used or 0.0) / usable
        if not 0 < gmu <= 1:
            raise CheckFailed(f"cannot plan an engine on this GPU (gmu {gmu:.3f})")
        gmu_box["gmu"] = gmu
        stages = [
            ("start", None, 0),
            ("below caution", (t.headroom_caution_ratio + t.headroom_pressure_ratio) / 2, 1),
            ("below pressure", (t.headroom_pressure_ratio + t.headroom_critical_ratio) / 2, 2),
            ("below critical", t.headroom_critical_ratio / 2, 3),
        ]
        seen = []
        for name, target, expected in stages:
            lvl, reason, headroom, usable = level()
            if target is not None:
                neighbour.allocate(int(headroom - target * usable))
                lvl, reason, headroom, usable = level()
            seen.append({"stage": name, "level": lvl, "reason": reason, "headroom_bytes": headroom})
            if lvl != expected:
                raise CheckFailed(
                    f"{name}: level {lvl} ({reason}), expected {expected}, headroom "
                    f"{headroom / usable:.2%} of usable; stages so far {seen}"
                )
    finally:
        neighbour.close()
        if fill is not None:
            device.free(fill)
    return {"gpu_memory_utilization": round(gmu, 4), "stages": seen}


# -- running them ----------------------------------------------------------------------------------
def _run(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        measured = fn()
        outcome, detail = "pass", ""
    except CheckFailed as exc:
        measured, outcome, detail = {}, "fail", str(exc)
    except Exception as exc:  # a check that breaks is reported, the others still run
        measured, outcome, detail = {}, "error", f"{type(exc).__name__}: {exc}"
    return {
        "outcome": outcome,
        "detail": detail,
        "measured": measured,
        "seconds": round(time.monotonic() - started, 2),
    }


def run_checks(device: Device, only: tuple[str, ...] = CHECKS) -> dict[str, dict[str, Any]]:
    """Each check's outcome on `device`, in order (the allocator's fragmenting workload stays
    allocated for the headroom check, which needs a fragmented allocator)."""
    held: list[Any] = []
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="oomguard-gpu-check-") as d:
        tmp = Path(d)
        table: dict[str, Callable[[], dict[str, Any]]] = {
            "nvml": lambda: check_nvml(device, held),
            "allocator": lambda: check_allocator(device, held, tmp),
            "headroom": lambda: check_headroom(device),
            "oom": lambda: check_oom(device, tmp),
            "pressure": lambda: check_pressure(device, tmp),
        }
        for name in ("nvml", "allocator", "headroom", "oom", "pressure"):
            if name in only:
                out[name] = _run(name, table[name])
    for block in held:
        device.free(block)
    return {name: out[name] for name in CHECKS if name in out}


def gpu_facts() -> dict[str, Any]:
    """What this machine offers, and why a real run cannot happen when it cannot."""
    facts: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    missing = []
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
        facts["cuda_available"] = bool(torch.cuda.is_available())
        if facts["cuda_available"]:
            facts["devices"] = [
                torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
            ]
    except ImportError:
        missing.append("PyTorch")
        facts["cuda_available"] = False
    try:
        import pynvml

        pynvml.nvmlInit()
        facts["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except ImportError:
        missing.append("nvidia-ml-py")
    except Exception as exc:  # NVMLError_LibraryNotFound and friends: no driver here
        facts["nvml"] = f"{type(exc).__name__}"
    facts["nvidia_smi"] = bool(_which("nvidia-smi"))
    facts["missing_packages"] = missing
    return facts


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def why_no_gpu(facts: dict[str, Any]) -> str:
    if facts["missing_packages"]:
        return f"{' and '.join(facts['missing_packages'])} not installed"
    if not facts.get("cuda_available"):
        return f"no CUDA device (torch {facts.get('torch')}, CUDA {facts.get('torch_cuda')})"
    if not facts.get("nvidia_smi"):
        return "nvidia-smi not found"
    return ""


def report(
    dry_run: bool, facts: dict[str, Any], outcomes: dict[str, dict[str, Any]], seconds: float
) -> dict[str, Any]:
    checks = []
    reason = why_no_gpu(facts) if dry_run else ""
    for name in CHECKS:
        o = outcomes.get(name)
        entry: dict[str, Any] = {"name": name, "title": TITLES[name]}
        if dry_run:
            entry |= {
                "status": "not_checked",
                "reason": f"dry run: {reason or 'asked for'}; nothing about a GPU was measured",
                "dry_run": o,
            }
        elif o is None:
            entry |= {"status": "not_checked", "reason": "not selected (--only)"}
        else:
            entry |= {
                "status": o["outcome"],
                "detail": o["detail"],
                "measured": o["measured"],
                "seconds": o["seconds"],
            }
        checks.append(entry)
    counts: dict[str, int] = {}
    for c in checks:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    out = {
        "schema": SCHEMA,
        "dry_run": dry_run,
        "gpu": facts,
        "checks": checks,
        "summary": counts,
        "seconds": round(seconds, 1),
    }
    if dry_run:
        out["not_checked"] = [
            f"{c['name']}: {c['title']}" for c in checks if c["status"] == "not_checked"
        ]
        out["note"] = (
            "A dry run drives every check's code against a simulated GPU (the twin's NVML and a "
            "simulated caching allocator) so that a broken check shows in CI; `dry_run.outcome` "
            "is that simulation's. Run scripts/gpu-check on a GPU machine for the real checks."
        )
    return out


def main_run(dry_run: bool, only: tuple[str, ...] = CHECKS) -> tuple[dict[str, Any], int]:
    """(the result document, exit status): 0 every check passed (a dry run: every simulated
    check passed), 1 a check failed or broke, 2 no GPU for a real run."""
    started = time.monotonic()
    facts = gpu_facts()
    if dry_run:
        outcomes = run_checks(SimDevice(), only)
        failed = [n for n, o in outcomes.items() if o["outcome"] != "pass"]
        return report(True, facts, outcomes, time.monotonic() - started), 1 if failed else 0
    reason = why_no_gpu(facts)
    if reason:
        return report(False, facts, {}, 0.0) | {"error": reason}, 2
    outcomes = run_checks(CudaDevice(), only)
    failed = [n for n, o in outcomes.items() if o["outcome"] != "pass"]
    return report(False, facts, outcomes, time.monotonic() - started), 1 if failed else 0


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, default=str) + "\n"
