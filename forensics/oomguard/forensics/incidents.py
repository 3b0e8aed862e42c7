"""OOM forensics: join the incident records and name the type of each incident.

Two writers put records into one directory (`OOMGUARD_INCIDENT_DIR`, by default
`<allocator dir>/incidents`), each building the record's model (`oomguard.incident_records`):
- the vLLM plugin's out-of-memory observer, `oom-<pid>-<n>.json` (schema
  `oomguard.oom_incident.v1`, vllm_plugin/oom.py), written by the dying worker before it dies:
  the failed allocation, the allocator summary, the step's batch, the flags, uptime, steps run and
  a short allocator history;
- the `oomguard serve` supervisor, `exit-<pid>-<generation>.json` (schema
  `oomguard.exit_incident.v1`, remediator/supervisor.py): why the child exited, its log's last
  lines, the OOM records written during its life and the cgroup's `oom_kill` count.

An exit record and the OOM records it names are one incident; OOM records that no exit record
names (no supervisor: Kubernetes restarts the pod) are incidents of their own, one per process.
`classify` gives each the type operators sort vLLM OOMs into (startup, runtime and chronic
OOMs: https://www.besthub.dev/articles/vllm-production-pitfalls-the-ultimate-fix-for-pagedattention-memory-fragmentation-and-oom-b3df5226dbf5;
host OOM, exit 137: https://www.kubenatives.com/p/production-runbook-vllm-oom-debugging; XIDs
that are not OOMs: https://docs.nvidia.com/deploy/xid-errors/):

  1 startup       OOM before the engine served a step: weights + KV pool do not fit
  2 long_prompt   the failing step had a long prefill or prompt_logprobs/large logprobs/n, and the
                  failed allocation is a transient peak
  3 under_load    a full batch, and a failed allocation small next to what is reserved
  4 after_hours   a long uptime, with a leak (allocated grew steadily) or fragmentation (reserved -
                  allocated large, no free block as large as the request)
  5 host_oom      SIGKILL without a traceback, the cgroup's oom_kill count grew
  6 not_oom       a CUDA error that is not out-of-memory, or an XID on the GPU and no allocator OOM

and `unknown` when the records do not say enough, with what was checked. Every decision keeps the
numbers that made it (`figures`) and a sentence per step (`evidence`). Thresholds live in
`Thresholds`, each with its reason.

Reading the directory is `oomguard.forensics.reader`; the records are `oomguard.incident_records`.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from oomguard.forensics.reader import Loaded
from oomguard.incident_records import ExitRecord, OomRecord
from oomguard.logits import LogitsShape

log = logging.getLogger("oomguard.incidents")

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class IncidentType:
    name: str  # label value and runbook anchor
    number: int  # the taxonomy's number (0: unknown)
    title: str
    fix: str


TYPES: dict[str, IncidentType] = {
    t.name: t
    for t in (
        IncidentType(
            "startup",
            1,
            "OOM at startup",
            "The weights and the KV pool do not fit: lower gpu_memory_utilization (or set "
            "--kv-cache-memory-bytes), lower max_model_len, quantize the weights, use tensor "
            "parallelism or a larger GPU; free the GPU of other processes.",
        ),
        IncidentType(
            "long_prompt",
            2,
            "activation spike of a long request",
            "One request's transient memory did not fit: enable chunked prefill, lower "
            "max_num_batched_tokens, cap prompt length and prompt_logprobs/logprobs/n at the "
            "gateway (400), or run the oomguard request guard in enforce mode.",
        ),
        IncidentType(
            "under_load",
            3,
            "OOM under load",
            "A full batch left no room: lower max_num_seqs (by 20 %), lower max_model_len, "
            "quantize the KV cache, lower gpu_memory_utilization by 0.03-0.05, or add capacity.",
        ),
        IncidentType(
            "after_hours",
            4,
            "OOM after hours",
            "Memory crept up over hours: for a leak, find the retained tensors (allocated grows "
            "at steady load); for fragmentation, set PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True; meanwhile restart the engine on a schedule.",
        ),
        IncidentType(
            "host_oom",
            5,
            "host OOM (killed by the kernel)",
            "The cgroup's memory limit, not the GPU: raise the pod or unit memory limit, load "
            "weights streaming, bound pinned host buffers; confirm with dmesg -T and "
            "memory.events oom_kill.",
        ),
        IncidentType(
            "not_oom",
            6,
            "not an out-of-memory",
            "Another fault: read the real error (the XID in dmesg or dcgm-exporter, the CUDA "
            "error in the log; CUBLAS_STATUS_ALLOC_FAILED can be a different fault); drain and "
            "check the GPU before restarting on it.",
        ),
        IncidentType(
            "unknown",
            0,
            "not classified",
            "The records do not say enough: read the evidence and the log tail; install the "
            "oomguard vLLM plugin so the next OOM is recorded by its observer.",
        ),
    )
}
TYPE_NAMES: tuple[str, ...] = tuple(TYPES)


@dataclass(frozen=True)
class Thresholds:
    """Every number the classifier decides with, and why it has its default."""

    # A prefill chunk of this many tokens makes a large transient: 8,192 tokens x a 128K
    # vocabulary of prompt_logprobs logits is 10.5 GB at the BF16 peak (oomguard.logits; vLLM's
    # prompt-logprobs path,
    # https://github.com/vllm-project/vllm/issues/5907); activations grow the same way.
    long_prefill_tokens: int = 4096
    # top-logprobs at OpenAI's maximum (20) or n/best_of of 4 multiply the sampler's memory.
    large_logprobs: int = 20
    large_n: int = 4
    # A failed allocation at least this large is a transient peak, not the step's usual churn.
    spike_min_bytes: int = 512 * MIB
    # Under load: the batch holds at least this share of max_num_seqs, or of
    # max_num_batched_tokens...
    busy_batch_ratio: float = 0.5
    busy_tokens_ratio: float = 0.9
    # ...and the failed allocation is small next to what the allocator holds.
    small_alloc_ratio: float = 0.05
    # After hours: the growth window of the leak and fragmentation alerts (thresholds.py).
    after_hours_seconds: float = 2 * 3600.0
    # Leak: allocated at step start rose by this much (the OomguardAllocatorLeak threshold)...
    leak_growth_bytes: int = 1 * GIB
    # ...in at least this share of the history's steps (steadily, not one jump).
    leak_steady_ratio: float = 0.8
    leak_min_samples: int = 4
    # Fragmentation: reserved - allocated at the OOM, after PyTorch released its free cached
    # blocks, is split-block waste (the OomguardAllocatorFragmentationGrowing threshold).
    fragmentation_bytes: int = 2 * GIB
    # An exit record alone: a child that lived this long is taken to have served (a 405B
    # model loads in about 20 minutes), unless its log says it did.
    startup_seconds: float = 1800.0
    # An XID this close to the incident (dcgm-exporter counts them per 5-minute window) counts.
    xid_window_seconds: float = 600.0
    # XID 45 is the driver cleaning up after a process that was killed: it follows any crash.
    ignored_xids: frozenset[int] = frozenset({45})


# -- XIDs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Xid:
    """XIDs a GPU reported (dcgm-exporter's DCGM_EXP_XID_ERRORS_COUNT for one window)."""

    timestamp: float  # when the count was read
    uuid: str  # the GPU's UUID ("" when the source does not say)
    code: int
    count: int = 1


# -- classification -----------------------------------------------------------------------------
@dataclass
class Incident:
    id: str
    timestamp: float
    target: str
    engine: str
    pid: int
    device_uuid: str
    type: str
    confidence: str  # confirmed | likely | "" (unknown)
    evidence: list[str]
    figures: dict[str, Any]
    records: list[str]

    @property
    def kind(self) -> IncidentType:
        return TYPES[self.type]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "timestamp": self.timestamp,
            "target": self.target,
            "engine": self.engine,
            "pid": self.pid,
            "device_uuid": self.device_uuid,
            "type": self.type,
            "type_number": self.kind.number,
            "title": self.kind.title,
            "confidence": self.confidence,
            "evidence": self.evidence,
            "figures": self.figures,
            "fix": self.kind.fix,
            "records": self.records,
        }


STARTUP_MARKERS = (
    "less than desired GPU memory utilization",  # vllm/v1/worker/utils.py
    "No available memory for the cache blocks",  # vllm/v1/core/kv_cache_planning.py
    "larger than the available KV cache memory",  # the same file: max_model_len does not fit
)
# the API server's word that its EngineCore process died under it (vllm/v1/engine/core_client.py)
ENGINE_DIED_MARKERS = ("engine core exited unexpectedly", "EngineDeadError")
SERVED_MARKER = "Application startup complete."  # uvicorn, once vLLM's API serves
CUDA_ERROR_MARKERS = (
    "CUDA error:",
    "CUBLAS_STATUS_",
    "CUDNN_STATUS_",
    "NCCL error",
    "Xid",
    "illegal memory access",
)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _first_line(lines: Iterable[str], markers: Sequence[str]) -> str | None:
    for line in lines:
        if any(m in line for m in markers):
            return line.strip()[:300]
    return None


@dataclass
class _Case:
    """What one incident's records say, gathered before deciding."""

    oom: OomRecord | None
    exit: ExitRecord | None
    xids: list[Xid]
    evidence: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def note(self, text: str, **figures: Any) -> None:
        self.evidence.append(text)
        self.figures.update(figures)


def _served(c: _Case, t: Thresholds) -> bool | None:
    """Did the engine serve before it failed? None when nothing says."""
    if c.oom is not None:
        if c.oom.steps is not None:
            c.figures["steps"] = c.oom.steps
            return c.oom.steps > 0
        return c.oom.batch is not None  # older records: a step was noted, or none
    if c.exit is None:
        return None
    uptime = max(0.0, c.exit.timestamp - c.exit.started_at)
    c.figures["uptime_seconds"] = round(uptime, 1)
    if any(SERVED_MARKER in line for line in c.exit.log_tail):
        return True
    if _first_line(c.exit.lines, STARTUP_MARKERS):
        return False
    return uptime > t.startup_seconds


def _triggers(oom: OomRecord, t: Thresholds) -> list[str]:
    """Requests of the failing step that make a large transient, described."""
    found: list[str] = []
    for r in (oom.batch.largest if oom.batch else [])[:64]:
        p = r.params
        why = []
        if p.get("prompt_logprobs") is not None and r.scheduled_tokens > 1:
            why.append(f"prompt_logprobs={p['prompt_logprobs']}")
        if r.scheduled_tokens >= t.long_prefill_tokens:
            why.append(f"{r.scheduled_tokens} prefill tokens")
        if (p.get("logprobs") or 0) >= t.large_logprobs:
            why.append(f"logprobs={p['logprobs']}")
        n = max(p.get("n") or 0, p.get("best_of") or 0)
        if n >= t.large_n:
            why.append(f"n={n}")
        if why:
            found.append(f"{r.id or '?'} ({r.prompt_tokens} prompt tokens: {', '.join(why)})")
    return found


def _logits_estimate(oom: OomRecord) -> int | None:
    """The prompt_logprobs logits of the step's tokens at vLLM 0.33's peak (oomguard.logits:
    model-dtype logits, their FP32 copy and the FP32 log-softmax), when the vocabulary is
    known; the model dtype from the record, else BF16."""
    vocab = oom.flags.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not oom.batch:
        return None
    dtype = oom.flags.get("dtype_bytes")
    dtype = dtype if dtype in (2, 4) and not isinstance(dtype, bool) else 2
    tokens = sum(
        r.scheduled_tokens for r in oom.batch.largest if r.params.get("prompt_logprobs") is not None
    )
    return LogitsShape(vocab, int(dtype)).prompt_logprobs_peak(tokens) if tokens else None


def _leak(oom: OomRecord, t: Thresholds) -> tuple[bool, int]:
    """Allocated bytes at step start grew steadily over the history: (leak, growth)."""
    rows = oom.history
    if len(rows) < t.leak_min_samples:
        return False, 0
    growth = rows[-1][1] - rows[0][1]
    deltas = [b[1] - a[1] for a, b in itertools.pairwise(rows)]
    steady = sum(1 for d in deltas if d >= 0) / len(deltas)
    return growth >= t.leak_growth_bytes and steady >= t.leak_steady_ratio, growth


def _fragmented(oom: OomRecord, t: Thresholds) -> tuple[bool, int]:
    a = oom.allocator
    gap = max(a.reserved_bytes - a.allocated_bytes, a.inactive_split_bytes)
    largest = a.largest_free_block_bytes
    no_block = largest is None or largest < oom.requested_bytes
    return gap >= t.fragmentation_bytes and no_block, gap


def _cgroup_kills(ex: ExitRecord | None) -> int | None:
    """How many OOM kills the cgroup counted during the child's life; None: not measured."""
    g = ex.cgroup if ex is not None else None
    if g is None or g.oom_kills_at_start is None or g.oom_kills_at_exit is None:
        return None
    return g.oom_kills_at_exit - g.oom_kills_at_start


def _decide(c: _Case, t: Thresholds) -> tuple[str, str]:
    """(type, confidence), noting the evidence on the way."""
    oom, ex = c.oom, c.exit
    if c.xids:
        codes = sorted({x.code for x in c.xids})
        c.note(
            f"XID {', '.join(map(str, codes))} on the GPU within "
            f"{t.xid_window_seconds:.0f} s of the incident",
            xids=codes,
        )
    # SIGKILL without an allocator OOM: the exit record of the killed child
    killed = ex if oom is None and ex is not None and ex.reason == "killed" else None
    killed = killed if killed is not None and killed.signal == 9 else None
    kills = _cgroup_kills(killed)
    # 5, counted by the kernel: that outranks an XID (XID 43/45 follow a killed process)
    if killed is not None and kills is not None and kills > 0:
        c.note(
            f"exit code {killed.returncode}: SIGKILL, no traceback; the cgroup's oom_kill count "
            f"rose by {kills} during the child's life",
            returncode=killed.returncode,
            cgroup_oom_kills_delta=kills,
        )
        return "host_oom", "confirmed"
    # 5, counted by the kernel, one process of the child killed: without a group kill the OOM
    # killer takes the largest process, vLLM's EngineCore, and the API server then exits on its
    # own (its watchdog), so the child's own exit carries no signal
    lost = ex if oom is None and ex is not None and ex.reason == "exited" else None
    lost_kills = _cgroup_kills(lost)
    if lost is not None and lost_kills is not None and lost_kills > 0:
        c.note(
            f"the child exited (code {lost.returncode}) with no CUDA error and no allocator OOM, "
            f"and the cgroup's oom_kill count rose by {lost_kills} during its life: the kernel "
            "killed one of its processes",
            returncode=lost.returncode,
            cgroup_oom_kills_delta=lost_kills,
        )
        died = _first_line(lost.lines, ENGINE_DIED_MARKERS)
        if died:
            c.note(f"vLLM lost its engine: {died}")
        return "host_oom", "confirmed"
    # 6: a CUDA fault that is not an allocator OOM
    if oom is None and ex is not None and ex.reason == "cuda_error":
        line = _first_line(ex.lines, CUDA_ERROR_MARKERS)
        c.note(f"the process died of a CUDA error, not out-of-memory: {line}", reason=ex.reason)
        return "not_oom", "confirmed"
    if oom is None and c.xids:
        if ex is not None and ex.reason == "cuda_oom":
            c.note("the log reports out-of-memory but no allocator OOM was recorded")
        return "not_oom", "confirmed" if ex is not None else "likely"
    # 5, not counted
    if killed is not None:
        c.note(
            f"exit code {killed.returncode}: SIGKILL, no traceback", returncode=killed.returncode
        )
        if kills is not None:
            c.figures["cgroup_oom_kills_delta"] = kills
            c.note("the cgroup's oom_kill count did not change: killed by something else")
            return "unknown", ""
        c.note("no cgroup oom_kill count to confirm it: check dmesg -T")
        return "host_oom", "likely"
    # 1: never served
    served = _served(c, t)
    startup_line = _first_line(ex.lines, STARTUP_MARKERS) if ex else None
    if served is False and (oom is not None or startup_line or (ex and ex.reason == "cuda_oom")):
        if oom is not None:
            c.note(
                f"out of memory before the first step (steps {oom.steps}); "
                f"allocated {gib(oom.allocator.allocated_bytes)} of "
                f"{gib(oom.device_limit_bytes)}",
                allocated_bytes=oom.allocator.allocated_bytes,
                device_limit_bytes=oom.device_limit_bytes,
            )
        if startup_line:
            c.note(f"vLLM refused to start: {startup_line}")
        elif ex is not None and oom is None:
            c.note(f"out of memory after {c.figures.get('uptime_seconds')} s, before serving")
        gmu = (oom.flags if oom else ex.flags if ex else {}).get("gpu_memory_utilization")
        if gmu is not None:
            c.figures["gpu_memory_utilization"] = gmu
        return "startup", "confirmed"
    if oom is None:
        if ex is not None:
            c.note(
                f"the child exited ({ex.reason}, code {ex.returncode}) and no OOM record "
                "names the failing step",
                reason=ex.reason,
                returncode=ex.returncode,
            )
        return "unknown", ""
    # the engine served: which kind of step failed
    a = oom.allocator
    c.figures.update(
        requested_bytes=oom.requested_bytes,
        device_free_bytes=oom.device_free_bytes,
        allocated_bytes=a.allocated_bytes,
        reserved_bytes=a.reserved_bytes,
    )
    if oom.uptime_seconds is not None:
        c.figures["uptime_seconds"] = round(oom.uptime_seconds, 1)
    c.note(
        f"asked for {gib(oom.requested_bytes)} with {gib(oom.device_free_bytes)} free; "
        f"allocated {gib(a.allocated_bytes)}, reserved {gib(a.reserved_bytes)}"
    )
    triggers = _triggers(oom, t)
    if triggers and oom.requested_bytes >= t.spike_min_bytes:
        c.note(f"the step carried {'; '.join(triggers[:3])}", trigger_requests=len(triggers))
        logits = _logits_estimate(oom)
        if logits:
            c.note(
                f"the prompt_logprobs logits of its tokens alone are {gib(logits)} "
                "(logits, their FP32 copy and log-softmax: oomguard.logits)",
                logits_bytes=logits,
            )
        return "long_prompt", "confirmed"
    uptime = oom.uptime_seconds or 0.0
    if uptime >= t.after_hours_seconds:
        leak, growth = _leak(oom, t)
        frag, gap = _fragmented(oom, t)
        c.figures.update(allocated_growth_bytes=growth, reserved_minus_allocated_bytes=gap)
        if leak:
            c.note(
                f"after {uptime / 3600:.1f} h allocated memory grew steadily by {gib(growth)} "
                f"over {len(oom.history)} samples: a leak",
                after_hours="leak",
            )
            return "after_hours", "confirmed"
        if frag:
            largest = a.largest_free_block_bytes
            c.note(
                f"after {uptime / 3600:.1f} h {gib(gap)} was reserved but unused, and "
                + (
                    f"the largest free block ({gib(largest)}) was smaller than the request"
                    if largest is not None
                    else "no block could serve the request"
                )
                + ": fragmentation",
                after_hours="fragmentation",
                largest_free_block_bytes=largest,
            )
            return "after_hours", "confirmed"
    batch = oom.batch
    seqs = oom.flags.get("max_num_seqs")
    tokens = oom.flags.get("max_num_batched_tokens")
    if batch is not None:
        c.figures.update(batch_requests=batch.requests, batch_tokens=batch.scheduled_tokens)
        busy = (
            isinstance(seqs, int) and seqs > 0 and batch.requests >= t.busy_batch_ratio * seqs
        ) or (
            isinstance(tokens, int)
            and tokens > 0
            and batch.scheduled_tokens >= t.busy_tokens_ratio * tokens
        )
        small = oom.requested_bytes < t.small_alloc_ratio * max(a.reserved_bytes, 1)
        if busy and small:
            c.note(
                f"the step ran {batch.requests} requests (max_num_seqs {seqs}), "
                f"{batch.scheduled_tokens} tokens (max_num_batched_tokens {tokens}); the failed "
                f"allocation is {oom.requested_bytes / max(a.reserved_bytes, 1):.1%} of reserved",
                max_num_seqs=seqs,
            )
            return "under_load", "confirmed"
    c.note(
        "no long request, no full batch, no leak or fragmentation after hours: "
        f"uptime {uptime:.0f} s, batch {batch.requests if batch else 0} requests"
    )
    return "unknown", ""


def _matching_xids(xids: Sequence[Xid], when: float, uuid: str, t: Thresholds) -> list[Xid]:
    return [
        x
        for x in xids
        if x.code not in t.ignored_xids
        and x.count > 0
        and abs(x.timestamp - when) <= t.xid_window_seconds
        and (not x.uuid or not uuid or x.uuid == uuid)
    ]


def classify(
    oom: OomRecord | None,
    exit: ExitRecord | None = None,
    xids: Sequence[Xid] = (),
    thresholds: Thresholds | None = None,
) -> Incident:
    """One incident from its records: the type, the evidence, the figures that decided it."""
    t = thresholds or Thresholds()
    if exit is not None:
        when = exit.timestamp
    elif oom is not None:
        when = oom.timestamp
    else:
        raise ValueError("an incident needs an OOM record or an exit record")
    uuid = oom.device_uuid if oom is not None else ""
    case = _Case(oom, exit, _matching_xids(xids, when, uuid, t))
    kind, confidence = _decide(case, t)
    records = [r.name for r in (exit, oom) if r is not None and r.name]
    if exit is not None:
        ident, pid = f"exit-{exit.pid}-{exit.generation}", exit.pid
    else:
        assert oom is not None  # one of the two records is there (checked above)
        ident, pid = oom.name.removesuffix(".json") or f"oom-{oom.pid}", oom.pid
    return Incident(
        id=ident,
        timestamp=when,
        target=oom.target if oom is not None else exit.target if exit is not None else "",
        engine=oom.engine if oom is not None else "",
        pid=pid,
        device_uuid=uuid,
        type=kind,
        confidence=confidence,
        evidence=case.evidence,
        figures=case.figures,
        records=records,
    )


def incidents(
    loaded: Loaded, xids: Sequence[Xid] = (), thresholds: Thresholds | None = None
) -> list[Incident]:
    """Join exit records with the OOM records they name; each incident classified, oldest first.

    Several OOM records for one exit (tensor-parallel ranks, retried steps): the earliest is
    the one that failed first, and it decides; the others are listed.
    """
    by_name = {r.name: r for r in loaded.ooms}
    used: set[str] = set()
    out: list[Incident] = []
    for ex in loaded.exits:
        named = sorted(
            (by_name[n] for n in ex.oom_records if n in by_name), key=lambda r: r.timestamp
        )
        used.update(r.name for r in named)
        inc = _classified(loaded, named[0] if named else None, ex, xids, thresholds)
        if inc is not None:
            inc.records += [r.name for r in named[1:]]
            out.append(inc)
    first: dict[int, OomRecord] = {}
    rest: dict[int, list[str]] = {}
    for r in sorted(loaded.ooms, key=lambda r: r.timestamp):
        if r.name in used:
            continue
        if r.pid in first:
            rest.setdefault(r.pid, []).append(r.name)
        else:
            first[r.pid] = r
    for pid, r in first.items():
        inc = _classified(loaded, r, None, xids, thresholds)
        if inc is not None:
            inc.records += rest.get(pid, [])
            out.append(inc)
    out.sort(key=lambda i: i.timestamp)
    return out


def _classified(
    loaded: Loaded,
    oom: OomRecord | None,
    ex: ExitRecord | None,
    xids: Sequence[Xid],
    thresholds: Thresholds | None,
) -> Incident | None:
    """One incident classified; a record the classifier cannot handle (a value the validation
    let through and the arithmetic cannot use) is counted as `unclassifiable` and skipped, so
    one bad record never takes the others (or the exporter's whole family) with it."""
    try:
        return classify(oom, ex, xids, thresholds)
    except Exception as exc:  # any record content: counted, never raised out of a poll
        names = [r.name for r in (ex, oom) if r is not None]
        log.warning("incident records %s cannot be classified: %r", ", ".join(names), exc)
        loaded.invalid["unclassifiable"] += 1
        return None


# -- reading it ---------------------------------------------------------------------------------
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(s|m|h|d)")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_SINCE_DAYS = 36_500  # a century: any incident record is younger
MAX_SINCE_SECONDS = MAX_SINCE_DAYS * 86400.0


def parse_since(text: str, now: float | None = None) -> float:
    """`--since`: a duration back from now (90s, 30m, 2h, 7d) or an ISO-8601 time; unix time."""
    from datetime import datetime

    now = time.time() if now is None else now
    match = _DURATION.fullmatch(text.strip())
    if match:
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        if not seconds <= MAX_SINCE_SECONDS:  # 5,000 digits: inf
            raise ValueError(f"--since {text[:40]!r}: more than {MAX_SINCE_DAYS:,} days back")
        return now - seconds
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text[:40]!r}: expected a duration (90s, 30m, 2h, 7d) or an ISO-8601 time"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"--since {text[:40]!r}: give the time zone (e.g. 2026-12-01T10:00Z)")
    return when.timestamp()


def _when(ts: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def render_text(found: Sequence[Incident], invalid: Counter[str]) -> str:
    """A table, then one explanation per incident: the evidence and the fix."""
    lines = []
    if not found:
        lines.append("no incidents")
    else:
        header = ("TIME (UTC)", "INCIDENT", "TARGET", "TYPE", "CONFIDENCE")
        rows = [
            (
                _when(i.timestamp),
                i.id,
                (i.target or "-") + (f"/{i.engine}" if i.engine else ""),
                f"{i.kind.number} {i.type}" if i.kind.number else i.type,
                i.confidence or "-",
            )
            for i in found
        ]
        widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
        for r in [header, *rows]:
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
        for i in found:
            kind = f"type {i.kind.number} {i.type}" if i.kind.number else i.type
            lines += ["", f"{i.id}: {kind}, {i.kind.title}"]
            lines += [f"  - {e}" for e in i.evidence]
            lines.append(f"  fix: {i.kind.fix}")
            lines.append(f"  records: {', '.join(i.records) or '-'}")
    if invalid:
        refused = ", ".join(f"{n} {reason}" for reason, n in sorted(invalid.items()))
        lines += ["", f"refused files: {refused}"]
    return "\n".join(lines) + "\n"


def to_json(found: Sequence[Incident], invalid: Counter[str]) -> str:
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return json.dumps(
        {
            "incidents": [
                {**i.to_dict(), "figures": {k: clean(v) for k, v in i.figures.items()}}
                for i in found
            ],
            "invalid_files": dict(sorted(invalid.items())),
        },
        indent=2,
    )
