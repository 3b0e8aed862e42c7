"""OOM forensics (issue 16, item 3): incident records are classified into the field's six types,
each with the figures that decided it and the fix.

Records are written by the real writers: the plugin's out-of-memory observer
(`OomRecorder.observe`, as PyTorch calls it) with allocator figures of a real engine, and the
`oomguard serve` supervisor around a stand-in child that dies the way vLLM dies (the same
stand-ins as tests/test_supervisor_inputs.py). Figures, where they come from:
- Llama-3-8B has a 128,256-token vocabulary (twin/oomguard/twin/models/llama-3-8b/config.json);
  the prompt_logprobs logits of 8,192 prompt tokens peak at 10.5 GB at BF16 (oomguard.logits:
  vLLM computes prompt logprobs over the whole vocabulary, https://github.com/vllm-project/vllm/issues/5907).
- An H100 80GB has 79.11 GiB of capacity as PyTorch reports it ("GPU 0 has a total capacity of
  79.11 GiB" in vLLM's OOM reports); gpu_memory_utilization 0.92 is vLLM 0.33's default.
- PyTorch's OOM message names fragmentation as "reserved by PyTorch but unallocated" and points
  to expandable_segments (https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf);
  the leak and fragmentation thresholds
  are the OomguardAllocatorLeak / FragmentationGrowing ones (1 GiB and 2 GiB in 2 h).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard import incident_records as records
from oomguard.forensics import incidents as inc
from oomguard.forensics import reader
from oomguard.remediator.supervisor import Supervisor
from oomguard.vllm_plugin import oom
from tests.conftest import DCGM_MIG
from tests.twin_oom import GROUP

# the twin OOM child runs once for this file and tests/test_vllm_plugin_oom.py (tests/twin_oom.py)
pytestmark = pytest.mark.xdist_group(GROUP)

GIB = 2**30
MIB = 2**20
H100 = int(79.11 * GIB)
VOCAB = 128_256
NOW = 1_764_590_000.0


# -- the observer, driven as PyTorch drives it ----------
def engine_config(gmu: float = 0.92, seqs: int = 256, tokens: int = 8192, chunked: bool = True):
    return SimpleNamespace(
        cache_config=SimpleNamespace(gpu_memory_utilization=gmu, block_size=16),
        scheduler_config=SimpleNamespace(
            max_num_seqs=seqs, max_num_batched_tokens=tokens, enable_chunked_prefill=chunked
        ),
        model_config=SimpleNamespace(max_model_len=32768, get_vocab_size=lambda: VOCAB),
    )


def new_request(req_id: str, prompt: int, scheduled: int, **params: int) -> SimpleNamespace:
    sampling = SimpleNamespace(
        n=1, best_of=None, logprobs=None, prompt_logprobs=None, max_tokens=64
    )
    for key, value in params.items():
        setattr(sampling, key, value)
    return SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=list(range(prompt)),
        prefill_token_ids=None,
        num_computed_tokens=prompt - scheduled,
        sampling_params=sampling,
    )


def step(new: list[SimpleNamespace], decoding: int = 0) -> SimpleNamespace:
    scheduled = {r.req_id: len(r.prompt_token_ids) - r.num_computed_tokens for r in new}
    ids = [f"cmpl-d{i}" for i in range(decoding)]
    scheduled.update(dict.fromkeys(ids, 1))
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=[900] * decoding),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def stats(allocated: int, reserved: int, inactive: int = 0) -> dict[str, int]:
    return {
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": reserved,
        "reserved_bytes.all.peak": reserved,
        "inactive_split_bytes.all.current": inactive,
        "num_alloc_retries": 3,
        "num_ooms": 0,
    }


def observe(
    directory: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    allocated: int,
    reserved: int,
    requested: int,
    free: int,
    steps: list[SimpleNamespace] = (),  # type: ignore[assignment]
    uptime: float = 600.0,
    config: Any = None,
    history: list[tuple[int, int]] = (),  # type: ignore[assignment]
    inactive: int = 0,
    largest_free: int | None = None,
) -> dict[str, Any]:
    """Run the real observer path: flags noted, steps noted (with history samples), then an
    OOM observed. Returns the record it wrote."""
    monkeypatch.setattr(oom, "_step", None)
    monkeypatch.setattr(oom, "_steps", 0)
    monkeypatch.setattr(oom, "_flags", {})
    monkeypatch.setattr(oom, "_STARTED", NOW - uptime)
    current = {"stats": stats(allocated, reserved, inactive)}
    extra = {"segments": 412}
    if largest_free is not None:
        extra["largest_free_block_bytes"] = largest_free
    clock = {"t": NOW - uptime}
    rec = oom.OomRecorder(
        "",
        str(directory),
        "llama",
        stats=lambda: current["stats"],
        identity=lambda: {"device_uuid": "GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90"},
        extra=lambda: extra,
        clock=lambda: clock["t"],
    )
    oom.note_flags(config or engine_config())
    for i, (a, r) in enumerate(history):  # the history samples, as note_step takes them
        current["stats"] = stats(a, r, inactive)
        clock["t"] = NOW - uptime + (i + 1) * (uptime / (len(history) + 1))
        rec._next_sample = 0.0  # due now (in production: once a minute, thinned)
        oom.note_step(step([], decoding=1))
    for s in steps:
        oom.note_step(s)
    current["stats"] = stats(allocated, reserved, inactive)
    clock["t"] = NOW
    rec.observe(0, requested, H100, free)
    [path] = sorted(directory.glob(f"oom-{os.getpid()}-*.json"))[-1:]
    return json.loads(path.read_text())


def classify_dir(directory: Path, **kw: Any) -> list[inc.Incident]:
    loaded = reader.load(directory, missing_ok=False)
    assert not loaded.invalid, loaded.invalid
    return inc.incidents(loaded, **kw)


def the_incident(directory: Path, **kw: Any) -> inc.Incident:
    [found] = classify_dir(directory, **kw)
    return found


# -- type 1: startup ----------
def test_an_oom_before_the_first_step_is_a_startup_oom(tmp_path, monkeypatch):
    # Llama-3-70B in BF16 is about 131 GiB of weights: loading it on one 79.11 GiB H100 fails
    # with the device nearly full and no step ever run.
    record = observe(
        tmp_path,
        monkeypatch,
        allocated=int(78.6 * GIB),
        reserved=int(78.9 * GIB),
        requested=448 * MIB,
        free=3 * MIB,
        uptime=95.0,
        config=engine_config(gmu=0.92),
    )
    assert record["steps"] == 0 and record["batch"] is None
    found = the_incident(tmp_path)
    assert (found.type, found.confidence, found.kind.number) == ("startup", "confirmed", 1)
    assert found.figures["steps"] == 0
    assert found.figures["gpu_memory_utilization"] == 0.92
    assert "before the first step" in found.evidence[0]
    assert "gpu_memory_utilization" in found.kind.fix


# -- type 2: a long prompt asking for prompt_logprobs ----------
def test_a_prompt_logprobs_request_that_does_not_fit_is_a_long_prompt_spike(tmp_path, monkeypatch):
    logits = 8192 * VOCAB * 10  # 10.5 GB at the BF16 peak (oomguard.logits)
    record = observe(
        tmp_path,
        monkeypatch,
        allocated=int(71.2 * GIB),
        reserved=int(72.0 * GIB),
        requested=logits,
        free=int(1.9 * GIB),
        steps=[step([new_request("cmpl-long", 8192, 8192, prompt_logprobs=1)], decoding=12)],
        uptime=5400.0,
    )
    assert record["steps"] == 1 and record["flags"]["vocab_size"] == VOCAB
    found = the_incident(tmp_path)
    assert (found.type, found.kind.number) == ("long_prompt", 2)
    assert found.figures["logits_bytes"] == logits == found.figures["requested_bytes"]
    assert any("cmpl-long" in e and "prompt_logprobs=1" in e for e in found.evidence)
    assert "chunked prefill" in found.kind.fix


def test_a_small_allocation_beside_a_long_prompt_is_not_called_a_spike(tmp_path, monkeypatch):
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(71.2 * GIB),
        reserved=int(72.0 * GIB),
        requested=20 * MIB,  # the long prompt is in the batch, but this is not its peak
        free=2 * MIB,
        steps=[step([new_request("cmpl-long", 8192, 8192)], decoding=3)],
    )
    assert the_incident(tmp_path).type != "long_prompt"


# -- type 3: under load ----------
def test_a_full_batch_and_a_small_failed_allocation_is_an_oom_under_load(tmp_path, monkeypatch):
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(73.5 * GIB),
        reserved=int(73.9 * GIB),
        requested=40 * MIB,
        free=12 * MIB,
        steps=[step([new_request("cmpl-new", 900, 900)], decoding=199)],  # 200 of 256 seqs
        uptime=1800.0,
    )
    found = the_incident(tmp_path)
    assert (found.type, found.kind.number) == ("under_load", 3)
    assert found.figures["batch_requests"] == 200 and found.figures["max_num_seqs"] == 256
    assert "max_num_seqs" in found.kind.fix


def test_a_small_batch_is_not_called_under_load(tmp_path, monkeypatch):
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(73.5 * GIB),
        reserved=int(73.9 * GIB),
        requested=40 * MIB,
        free=12 * MIB,
        steps=[step([], decoding=20)],  # 20 of 256
    )
    assert the_incident(tmp_path).type == "unknown"


# -- type 4: after hours, leak or fragmentation ----------
def test_allocated_memory_growing_for_hours_is_a_leak(tmp_path, monkeypatch):
    base = int(66 * GIB)
    # nine hours, a sample every hour: +0.25 GiB an hour (2.25 GiB), one step back on the way
    growth = [0, 0.25, 0.5, 0.5, 0.8, 1.0, 1.2, 1.1, 1.6, 2.0, 2.25]
    history = [(base + int(g * GIB), base + int(g * GIB) + 2 * GIB) for g in growth]
    record = observe(
        tmp_path,
        monkeypatch,
        allocated=base + int(2.3 * GIB),
        reserved=base + int(4.2 * GIB),
        requested=260 * MIB,
        free=30 * MIB,
        steps=[step([], decoding=40)],
        uptime=9 * 3600.0,
        history=history,
    )
    assert len(record["history"]) == len(history)
    assert record["uptime_seconds"] == pytest.approx(9 * 3600.0)
    found = the_incident(tmp_path)
    assert (found.type, found.figures["after_hours"]) == ("after_hours", "leak")
    assert found.figures["allocated_growth_bytes"] == int(2.25 * GIB)
    assert "retained tensors" in found.kind.fix


def test_reserved_but_unused_memory_after_hours_is_fragmentation(tmp_path, monkeypatch):
    flat = [(int(62 * GIB), int(64 * GIB))] * 8  # allocated flat: no leak
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(62.4 * GIB),
        reserved=int(68.6 * GIB),  # 6.2 GiB reserved by PyTorch but unallocated
        inactive=int(6.1 * GIB),
        requested=1 * GIB,
        largest_free=300 * MIB,  # no single free block holds the 1 GiB asked for
        free=200 * MIB,
        steps=[step([], decoding=64)],
        uptime=30 * 3600.0,
        history=flat,
    )
    found = the_incident(tmp_path)
    assert (found.type, found.figures["after_hours"]) == ("after_hours", "fragmentation")
    assert found.figures["largest_free_block_bytes"] == 300 * MIB
    assert "expandable_segments" in found.kind.fix


def test_the_same_fragmentation_in_the_first_hour_is_not_after_hours(tmp_path, monkeypatch):
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(62.4 * GIB),
        reserved=int(68.6 * GIB),
        requested=1 * GIB,
        largest_free=300 * MIB,
        free=200 * MIB,
        steps=[step([], decoding=64)],
        uptime=1800.0,
    )
    assert the_incident(tmp_path).type != "after_hours"


def test_the_history_stays_bounded_over_a_long_life():
    values = iter(range(10**6))
    rec = oom.OomRecorder("", "", "t", stats=lambda: stats(next(values) * GIB, 0), identity=dict)
    for _ in range(1000):
        rec._next_sample = 0.0
        rec.sample()
    assert len(rec.history) < oom.HISTORY_LEN
    assert rec._interval > oom.HISTORY_FIRST_INTERVAL  # thinned: the rows span the whole life
    assert rec.history[0][1] == 0


# -- types 5 and 6: the supervisor's exit records ----------
def supervise(tmp_path: Path, script: str, cgroup: Path | None = None) -> Path:
    """A stand-in child under the real supervisor; returns the incident directory."""
    incidents = tmp_path / "incidents"
    sup = Supervisor(
        [sys.executable, "-c", f"import os, signal, sys, pathlib\n{script}", "--max-num-seqs", "8"],
        tmp_path / "state",
        max_crashes=1,  # no restart: one record to read
        env={"OOMGUARD_INCIDENT_DIR": str(incidents), "OOMGUARD_TARGET": "llama"},
        cgroup_dir=str(cgroup) if cgroup else None,
    )
    sup.start()
    deadline = time.monotonic() + 60
    while not list(incidents.glob("exit-*.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    sup.stop()
    return incidents


def test_sigkill_with_a_grown_cgroup_oom_kill_count_is_a_host_oom(tmp_path):
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    events = cgroup / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n")
    # what the kernel does: count the kill in memory.events, then SIGKILL the process
    script = (
        f"pathlib.Path({str(events)!r}).write_text('low 0\\nhigh 0\\nmax 40\\noom 2\\n"
        "oom_kill 2\\noom_group_kill 0\\n'); os.kill(os.getpid(), signal.SIGKILL)"
    )
    directory = supervise(tmp_path, script, cgroup)
    [record] = [json.loads(p.read_text()) for p in directory.glob("exit-*.json")]
    assert record["schema"] == records.EXIT_SCHEMA
    assert (
        record["cgroup"]["oom_kills_at_start"] == 1 and record["cgroup"]["oom_kills_at_exit"] == 2
    )
    found = the_incident(directory)
    assert (found.type, found.confidence, found.kind.number) == ("host_oom", "confirmed", 5)
    assert found.target == "llama"  # the engine's name, from the supervisor's environment
    assert found.figures["cgroup_oom_kills_delta"] == 1 and found.figures["returncode"] == -9


def test_a_counted_host_oom_outranks_the_xids_that_follow_a_killed_process():
    record = records.ExitRecord.model_validate_json(
        json.dumps({**valid_exit(), "cgroup": {"oom_kills_at_start": 0, "oom_kills_at_exit": 1}})
    )
    found = inc.classify(None, record, [inc.Xid(NOW + 10, "", 43)])
    assert (found.type, found.confidence) == ("host_oom", "confirmed")
    # without the kernel's count, the XID decides
    uncounted = record.model_copy(update={"cgroup": None})
    assert inc.classify(None, uncounted, [inc.Xid(NOW + 10, "", 43)]).type == "not_oom"


def test_sigkill_without_a_cgroup_count_is_a_likely_host_oom(tmp_path):
    directory = supervise(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)", tmp_path / "none")
    found = the_incident(directory)
    assert (found.type, found.confidence) == ("host_oom", "likely")
    assert any("dmesg" in e for e in found.evidence)


def test_sigkill_with_an_unchanged_oom_kill_count_is_not_a_host_oom(tmp_path):
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.events").write_text("oom 0\noom_kill 0\n")
    directory = supervise(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)", cgroup)
    assert the_incident(directory).type == "unknown"
    # the explanation names it as the table and the docs do: no "type 0"
    text = inc.render_text([the_incident(directory)], inc.Counter())
    assert "type 0" not in text and ": unknown, " in text


def test_a_startup_refusal_far_above_the_last_log_lines_is_still_found(tmp_path):
    # vLLM 0.33's shape: the engine core logs the root cause, then the API server's traceback
    # (about 55 lines here, 119 in all on the twin) ends in "Engine core initialization failed"
    script = (
        "print('(EngineCore pid=7) ERROR 12-01 12:33:43 [core.py:1584] ValueError: Free memory "
        "on device (69.09/79.65 GiB) on startup is less than desired GPU memory utilization "
        "(0.92, 72.77 GiB).', flush=True)\n"
        "for i in range(60): print(f'  File \"vllm/v1/engine/utils.py\", line {i}', flush=True)\n"
        "print('RuntimeError: Engine core initialization failed. See root cause above.', "
        "flush=True); sys.exit(1)"
    )
    directory = supervise(tmp_path, script)
    [record] = [json.loads(p.read_text()) for p in directory.glob("exit-*.json")]
    assert not any("less than desired" in line for line in record["log_tail"])
    assert len(record["exception_lines"]) == 2
    found = the_incident(directory)
    assert (found.type, found.confidence) == ("startup", "confirmed")
    assert any("less than desired GPU memory utilization" in e for e in found.evidence)


def test_a_cuda_error_that_is_not_out_of_memory_is_type_6(tmp_path):
    script = (
        "print('RuntimeError: CUDA error: an illegal memory access was encountered', flush=True)"
        "; sys.exit(1)"
    )
    found = the_incident(supervise(tmp_path, script))
    assert (found.type, found.kind.number) == ("not_oom", 6)
    assert "illegal memory access" in found.evidence[0]


def test_a_crash_with_an_xid_on_the_gpu_and_no_allocator_oom_is_type_6(tmp_path):
    from oomguard.exporter.collectors.dcgm import xids_from_text

    # the engine reported out-of-memory, but the allocator never ran out: XID 79 (fell off the
    # bus) in dcgm-exporter's window tells the real story
    script = "print('torch.OutOfMemoryError: CUDA out of memory.', flush=True); sys.exit(1)"
    directory = supervise(tmp_path, script)
    [exit_record] = [json.loads(p.read_text()) for p in directory.glob("exit-*.json")]
    assert exit_record["reason"] == "cuda_oom" and exit_record["oom_records"] == []
    text = DCGM_MIG.read_text()
    xids = xids_from_text(text, timestamp=exit_record["timestamp"] + 30)
    assert [(x.code, x.count) for x in xids] == [(79, 1)]
    found = the_incident(directory, xids=xids)
    assert (found.type, found.confidence) == ("not_oom", "confirmed")
    assert found.figures["xids"] == [79]
    assert any("no allocator OOM" in e for e in found.evidence)
    # without the XID the same records do not claim a type they cannot show
    assert the_incident(directory).type != "not_oom"


def test_an_old_xid_or_the_cleanup_xid_does_not_make_an_oom_type_6(tmp_path, monkeypatch):
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(71.2 * GIB),
        reserved=int(72.0 * GIB),
        requested=8192 * VOCAB * 4,
        free=int(1.9 * GIB),
        steps=[step([new_request("cmpl-long", 8192, 8192, prompt_logprobs=1)])],
    )
    xids = [
        inc.Xid(NOW - 3 * 3600, "", 79),  # hours before
        inc.Xid(NOW + 5, "", 45),  # the driver cleaning up after the dead process
    ]
    assert the_incident(tmp_path, xids=xids).type == "long_prompt"


# -- joining ----------
def test_an_exit_record_and_the_oom_records_it_names_are_one_incident(tmp_path, monkeypatch):
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(71.2 * GIB),
        reserved=int(72.0 * GIB),
        requested=8192 * VOCAB * 4,
        free=int(1.9 * GIB),
        steps=[step([new_request("cmpl-long", 8192, 8192, prompt_logprobs=1)])],
    )
    [oom_name] = [p.name for p in tmp_path.glob("oom-*.json")]
    exit_record = {
        "schema": records.EXIT_SCHEMA,
        "kind": "exit",
        "timestamp": NOW + 2,
        "started_at": NOW - 600,
        "pid": 777,
        "generation": 3,
        "returncode": 1,
        "signal": None,
        "reason": "cuda_oom",
        "flags": {"gpu_memory_utilization": 0.92, "max_num_seqs": 256},
        "oom_records": [oom_name],
        "log_tail": ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB."],
    }
    (tmp_path / "exit-777-3.json").write_text(json.dumps(exit_record))
    found = the_incident(tmp_path)
    assert found.id == "exit-777-3" and found.type == "long_prompt"
    assert found.records == ["exit-777-3.json", oom_name]


# -- the directory is untrusted ----------
def valid_exit(pid: int = 5) -> dict[str, Any]:
    return {
        "schema": records.EXIT_SCHEMA,
        "timestamp": NOW,
        "started_at": NOW - 60,
        "pid": pid,
        "generation": 1,
        "returncode": -9,
        "signal": 9,
        "reason": "killed",
    }


def test_hostile_files_are_counted_and_never_raise(tmp_path):
    d = tmp_path
    (d / "exit-5-1.json").write_text(json.dumps(valid_exit()))  # the one good record
    (d / "exit-6-1.json").write_text("{not json")
    (d / "exit-7-1.json").write_text("[1, 2]")
    (d / "exit-8-1.json").write_text(json.dumps({**valid_exit(8), "schema": "other"}))
    (d / "exit-9-1.json").write_text(json.dumps({**valid_exit(9), "returncode": "137"}))
    (d / "exit-10-1.json").write_text(json.dumps({**valid_exit(10), "timestamp": 10**400}))
    (d / "exit-11-1.json").write_text(json.dumps({**valid_exit(11), "signal": True}))
    (d / "exit-12-1.json").write_text(json.dumps(valid_exit(99)))  # poses as another process
    (d / "exit-13-1.json").write_text('{"schema": "oomguard.exit_incident.v1", "x": ' * 5000)
    (d / "exit-14-1.json").write_text(
        json.dumps({**valid_exit(14), "log_tail": ["x" * 100] * 3000})
    )  # 300 KB
    (d / "exit-15-1.json").write_text(
        json.dumps(valid_exit(15)).replace('"timestamp": ' + str(NOW), '"timestamp": NaN')
    )
    (d / "oom-16-1.json").write_text(
        json.dumps({"schema": records.OOM_SCHEMA, "timestamp": NOW, "pid": 16, "history": [[1, 2]]})
    )  # history rows are (time, allocated, reserved)
    (d / "exit-x-1.json").write_text("{}")
    os.symlink("/etc/passwd", d / "exit-20-1.json")
    os.mkfifo(d / "exit-21-1.json")  # would block a reader that opens it
    os.mkdir(d / "exit-22-1.json")
    (d / ".oom-123.tmp").write_text("{}")  # a writer's temp file: not a record, not counted
    loaded = reader.load(d)
    assert [r.pid for r in loaded.exits] == [5] and loaded.ooms == []
    assert loaded.invalid == {
        "not_json": 2,
        "too_deep": 1,  # exit-13
        "number_too_long": 1,  # exit-10
        "not_finite": 1,  # exit-15
        "schema": 1,
        "invalid_record": 3,
        "name_mismatch": 1,
        "too_large": 1,
        "bad_name": 1,
        "symlink": 1,
        "not_regular_file": 2,
    }


def huge_flag_record(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real observer record, then its max_num_seqs flag rewritten to 400 digits (defect 12:
    float(400 digits) raised OverflowError in the classifier)."""
    observe(
        directory,
        monkeypatch,
        allocated=int(73.5 * GIB),
        reserved=int(73.9 * GIB),
        requested=40 * MIB,
        free=12 * MIB,
        steps=[step([], decoding=200)],
    )
    [path] = directory.glob("oom-*.json")
    data = json.loads(path.read_text())
    data["flags"]["max_num_seqs"] = 0  # placeholder, replaced by the digits below
    text = json.dumps(data).replace('"max_num_seqs": 0', '"max_num_seqs": ' + "9" * 400)
    bad = directory / path.name.replace(f"-{data['pid']}-", f"-{data['pid'] + 1}-")
    bad.write_text(text.replace(f'"pid": {data["pid"]}', f'"pid": {data["pid"] + 1}'))


def test_a_400_digit_flag_is_counted_and_the_other_records_classified(tmp_path, monkeypatch):
    huge_flag_record(tmp_path, monkeypatch)
    r = cli(str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout)
    assert [i["type"] for i in data["incidents"]] == ["under_load"]
    assert data["invalid_files"] == {"number_too_long": 1}


def test_a_record_the_classifier_cannot_handle_is_counted_not_raised(tmp_path, monkeypatch):
    """Second line of defence: a value that passed validation but breaks the arithmetic (built
    in-process, past the reader) costs its own incident only."""
    huge_flag_record(tmp_path, monkeypatch)
    loaded = reader.load(tmp_path)
    [good] = loaded.ooms
    broken = good.model_copy(
        update={"name": "oom-9-1.json", "pid": 9, "flags": {**good.flags, "max_num_seqs": 10**400}}
    )
    loaded.ooms.append(broken)
    found = inc.incidents(loaded)
    assert [i.type for i in found] == ["under_load"]
    assert loaded.invalid == {"number_too_long": 1, "unclassifiable": 1}


def test_a_missing_directory_holds_no_incidents_unless_it_must_exist(tmp_path):
    assert reader.load(tmp_path / "nothing").ooms == []
    with pytest.raises(reader.IncidentDirError):
        reader.load(tmp_path / "nothing", missing_ok=False)


def test_too_many_files_are_counted_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "MAX_FILES", 3)
    for pid in range(1, 6):
        (tmp_path / f"exit-{pid}-1.json").write_text(json.dumps(valid_exit(pid)))
    loaded = reader.load(tmp_path)
    assert len(loaded.exits) == 3 and loaded.invalid == {"too_many_files": 2}


def test_every_threshold_has_a_default_and_changes_the_decision(tmp_path, monkeypatch):
    observe(
        tmp_path,
        monkeypatch,
        allocated=int(73.5 * GIB),
        reserved=int(73.9 * GIB),
        requested=40 * MIB,
        free=12 * MIB,
        steps=[step([], decoding=100)],  # 100 of 256: 39 %
    )
    loaded = reader.load(tmp_path)
    assert inc.incidents(loaded)[0].type == "unknown"
    looser = inc.Thresholds(busy_batch_ratio=0.35)
    assert inc.incidents(loaded, thresholds=looser)[0].type == "under_load"


def test_since_takes_durations_and_zoned_times():
    assert inc.parse_since("2h", now=NOW) == NOW - 7200
    assert inc.parse_since("90s", now=NOW) == NOW - 90
    assert inc.parse_since("2026-12-01T10:00:00+00:00") == 1_796_119_200.0
    for bad in ("yesterday", "2026-12-01T10:00:00", "-5m", "5 m"):
        with pytest.raises(ValueError):
            inc.parse_since(bad, now=NOW)


# -- `oomguard incidents` ----------------------------------------------------------------------
def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oomguard", "incidents", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def two_incidents(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    observe(
        directory,
        monkeypatch,
        allocated=int(71.2 * GIB),
        reserved=int(72.0 * GIB),
        requested=8192 * VOCAB * 4,
        free=int(1.9 * GIB),
        steps=[step([new_request("cmpl-long", 8192, 8192, prompt_logprobs=1)])],
    )
    old = {**valid_exit(4242), "timestamp": NOW - 86400, "started_at": NOW - 86400 - 600}
    (directory / "exit-4242-1.json").write_text(json.dumps(old))
    (directory / "exit-1-1.json").write_text("{broken")


def test_the_cli_lists_and_explains_incidents(tmp_path, monkeypatch):
    two_incidents(tmp_path, monkeypatch)
    r = cli(str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["TIME", "(UTC)", "INCIDENT", "TARGET", "TYPE", "CONFIDENCE"]
    assert "5 host_oom" in lines[1] and "likely" in lines[1]  # oldest first
    assert "2 long_prompt" in lines[2] and "llama/0" in lines[2]
    assert "fix: One request's transient memory did not fit" in r.stdout
    assert "prompt_logprobs=1" in r.stdout
    assert "refused files: 1 not_json" in r.stdout


def test_the_cli_json_and_since(tmp_path, monkeypatch):
    two_incidents(tmp_path, monkeypatch)
    r = cli(str(tmp_path), "--json", "--since", "2025-11-01T00:00:00+00:00")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [i["type"] for i in data["incidents"]] == ["host_oom", "long_prompt"]
    spike = data["incidents"][1]
    assert spike["type_number"] == 2 and spike["figures"]["logits_bytes"] == 8192 * VOCAB * 10
    assert spike["fix"] and spike["evidence"] and data["invalid_files"] == {"not_json": 1}
    since = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(NOW - 3600))
    r = cli(str(tmp_path), "--json", "--since", since)
    assert [i["type"] for i in json.loads(r.stdout)["incidents"]] == ["long_prompt"]


def test_the_cli_default_directory_comes_from_the_environment(tmp_path, monkeypatch):
    two_incidents(tmp_path, monkeypatch)
    r = cli("--json", env={"OOMGUARD_INCIDENT_DIR": str(tmp_path)})
    assert len(json.loads(r.stdout)["incidents"]) == 2


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["/nonexistent/incidents"], ["no such directory"]),
        (["--since", "yesterday", "."], ["--since", "duration"]),
        (["--since", "2026-12-01T10:00:00", "."], ["time zone"]),
        (["--bogus", "."], ["unrecognized arguments: --bogus"]),
        ([".", "extra"], ["unrecognized arguments: extra"]),
        (["--dcgm-file", "/nonexistent.prom", "."], ["--dcgm-file"]),
    ],
)
def test_cli_mistakes_are_one_line_and_exit_2(args, words, tmp_path):
    r = cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("oomguard incidents: ")
    for word in words:
        assert word in line


def test_a_fifo_in_the_directory_does_not_hang_the_cli(tmp_path):
    os.mkfifo(tmp_path / "oom-12-1.json")
    r = cli(str(tmp_path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["invalid_files"] == {"not_regular_file": 1}


# -- the exporter's collector ---------------------------------------------------------------------
def test_the_collector_counts_incidents_by_type(tmp_path, monkeypatch):
    from oomguard.exporter.collectors.incidents import IncidentCollector
    from oomguard.exporter.render import FamilyBuilder

    two_incidents(tmp_path, monkeypatch)
    xids: list[inc.Xid] = []
    collector = IncidentCollector(str(tmp_path), "gpu-node-01", xid_source=lambda: xids)
    reading = collector.collect()
    assert reading.invalid == {"not_json": 1}
    assert dict(reading.by_type) == {
        ("llama", "0", "long_prompt"): 1,
        ("", "", "host_oom"): 1,
    }
    out = FamilyBuilder()
    collector.families(reading, out)
    # beside it, the requests the engine held as it died (tests/test_crash_losses.py)
    [family] = [f for f in out.families() if f.spec.name == "oomguard_incidents_total"]
    assert family.spec.type == "counter"
    assert sorted(family.samples) == [
        (("gpu-node-01", "", "", "host_oom"), 1.0),
        (("gpu-node-01", "llama", "0", "long_prompt"), 1.0),
    ]
    assert collector.collect() is reading  # nothing changed: not re-read
    # an XID on the node now turns the SIGKILL without an OOM record into type 6
    xids.append(inc.Xid(NOW - 86400 + 20, "", 79))
    assert dict(collector.collect().by_type)[("", "", "not_oom")] == 1
    (tmp_path / "exit-1-1.json").unlink()
    assert not collector.collect().invalid


def test_a_bad_record_leaves_the_collectors_family_whole(tmp_path, monkeypatch):
    """Defect 12: one record with a 400-digit flag made the collector raise, and the whole
    oomguard_incidents_total family vanished, valid records included."""
    from oomguard.exporter.collectors.incidents import IncidentCollector
    from oomguard.exporter.render import FamilyBuilder

    huge_flag_record(tmp_path, monkeypatch)
    collector = IncidentCollector(str(tmp_path), "gpu-node-01")
    reading = collector.collect()
    assert reading.invalid == {"number_too_long": 1}
    out = FamilyBuilder()
    collector.families(reading, out)
    [family] = [f for f in out.families() if f.spec.name == "oomguard_incidents_total"]
    assert family.samples == [(("gpu-node-01", "llama", "0", "under_load"), 1.0)]


def test_the_collector_parses_each_file_once_while_it_does_not_change(tmp_path, monkeypatch):
    from oomguard.exporter.collectors.incidents import IncidentCollector

    two_incidents(tmp_path, monkeypatch)
    parsed: list[str] = []
    real = reader._parse
    counted = lambda name, data: parsed.append(name) or real(name, data)  # noqa: E731
    monkeypatch.setattr(reader, "_parse", counted)
    xids: list[inc.Xid] = []
    collector = IncidentCollector(str(tmp_path), "n", xid_source=lambda: xids)
    collector.collect()
    assert len(parsed) == 3  # two records and the broken file
    xids.append(inc.Xid(NOW, "", 79))  # re-classified, not re-read
    assert collector.collect().invalid == {"not_json": 1} and len(parsed) == 3
    (tmp_path / "exit-1-1.json").write_text(json.dumps(valid_exit(1)))  # changed: read again
    assert not collector.collect().invalid and parsed[3:] == ["exit-1-1.json"]


def test_the_collector_reports_a_missing_directory_as_empty_and_an_unreadable_one_as_failed(
    tmp_path,
):
    from oomguard.errors import CollectorError
    from oomguard.exporter.collectors.incidents import IncidentCollector

    assert not IncidentCollector(str(tmp_path / "none"), "n").collect().by_type
    (tmp_path / "file").write_text("")
    with pytest.raises(CollectorError):
        IncidentCollector(str(tmp_path / "file"), "n").collect()


def test_dcgm_xid_counts_are_served_per_code(tmp_path):
    from oomguard.exporter.collectors.dcgm import DcgmCollector

    collector = DcgmCollector("gpu-node-07", file=str(DCGM_MIG), clock=lambda: NOW)
    reading = collector.collect()
    [(identity, code, count)] = reading.xid_counts
    assert (identity.uuid, code, count) == ("GPU-5d1f0c3a-7e2b-4a91-b6c4-0e8f2a7d3b61", 79, 1)
    assert collector.recent_xids == (inc.Xid(NOW, identity.uuid, 79, 1),)
    hostile = tmp_path / "dcgm.prom"
    hostile.write_text(
        DCGM_MIG.read_text().replace('xid="79"} 1', 'xid="../../x"} 1')
        + 'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",xid="13"} 9223372036854775794\n'
    )
    reading = DcgmCollector("n", file=str(hostile)).collect()
    assert reading.xid_counts == [] and reading.invalid["bad_xid"] == 1
    assert reading.invalid["blank_sentinel"] >= 1


# -- on the GPU twin ----------------------------------------------------------------------------
def test_the_twins_prompt_logprobs_oom_is_classified_as_a_long_prompt_spike(twin_oom_dir):
    """The twin's simulated CUDA OOM (a 6,000-token prompt asking for prompt_logprobs on an H100
    with a 6 GiB neighbour, tests/twin_oom.py) goes through the real observer in a process that
    dies at once (exit code 1, checked there); its record is classified as type 2."""
    found = the_incident(twin_oom_dir / "incidents")
    assert (found.type, found.confidence) == ("long_prompt", "confirmed")
    assert found.target == "llama" and found.figures["steps"] == 1
    assert found.figures["requested_bytes"] >= 6000 * VOCAB * 4
    assert any("cmpl-big" in e and "prompt_logprobs=5" in e for e in found.evidence)


def test_a_twin_engine_that_cannot_start_is_classified_as_a_startup_oom(tmp_path):
    """The real vLLM server on a twin H100 where another process holds 10 GiB: at the default
    gpu_memory_utilization 0.92 vLLM refuses to start (its own free-memory check, which the twin
    runs against its neighbour). The supervisor's exit record is classified as type 1."""
    from oomguard.lab.processes import TINY_MODEL, free_port, vllm_command, vllm_env
    from tests.vllm_server import require_vllm

    require_vllm()
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"neighbour_bytes": 10 * GIB}))
    incidents = tmp_path / "incidents"
    args = ("--max-num-seqs", "16", "--gpu-memory-utilization", "0.92")
    sup = Supervisor(
        vllm_command(free_port(), TINY_MODEL, args),
        tmp_path / "state",
        max_crashes=1,
        env={
            **vllm_env("t", None),
            "OOMGUARD_TWIN_GPU": "H100",
            "OOMGUARD_TWIN_STATE_FILE": str(gpu),
            "OOMGUARD_ALLOCATOR_DIR": str(tmp_path / "allocator"),
            "OOMGUARD_INCIDENT_DIR": str(incidents),
        },
    )
    sup.start()
    try:
        deadline = time.monotonic() + 240
        while not list(incidents.glob("exit-*.json")) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        sup.stop()
    found = the_incident(incidents)
    assert (found.type, found.confidence, found.kind.number) == ("startup", "confirmed", 1)
    assert any("less than desired GPU memory utilization" in e for e in found.evidence)
    assert found.figures["gpu_memory_utilization"] == 0.92


def test_the_exporter_process_serves_incidents_by_type_and_xid_counts(tmp_path, monkeypatch):
    """The real exporter process: incident records under <allocator dir>/incidents and a
    dcgm-exporter file with an XID window count, read through /metrics by Prometheus' parser."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.stack import start_exporter, stop

    two_incidents(tmp_path / "alloc" / "incidents", monkeypatch)
    proc, addr = start_exporter(
        "--interval",
        "0.2",
        "--dcgm-file",
        str(DCGM_MIG),
        "--allocator-dir",
        str(tmp_path / "alloc"),
    )
    try:
        got: dict[str, list] = {}
        deadline = time.monotonic() + 20
        while "oomguard_incidents" not in got and time.monotonic() < deadline:
            time.sleep(0.3)
            text = httpx.get(f"http://{addr}/metrics", timeout=2).text
            got = {f.name: f.samples for f in text_string_to_metric_families(text)}
    finally:
        stop(proc)
    incidents = {s.labels["type"]: s.value for s in got["oomguard_incidents"]}
    # the old SIGKILL has no XID near it; the long-prompt OOM has its own type
    assert incidents == {"long_prompt": 1.0, "host_oom": 1.0}
    [xid] = got["oomguard_gpu_xid_errors"]
    assert (xid.labels["xid"], xid.value) == ("79", 1.0)
    up = {s.labels["collector"]: s.value for s in got["oomguard_exporter_collector_up"]}
    assert up["incidents"] == 1


def test_a_dcgm_file_without_the_xid_count_says_xids_were_not_checked(tmp_path):
    """dcgm-exporter's shipped counters CSV leaves DCGM_EXP_XID_ERRORS_COUNT commented out, so a
    plain scrape (this one is real, a T4) holds only the last-XID gauge: --dcgm-file then cannot
    count XIDs, and the on-call must be told rather than left to read 'no type 6' as checked."""
    plain = Path(__file__).parent / "fixtures" / "dcgm" / "t4-whole-gpu-pod.real.prom"
    r = cli(str(tmp_path), "--dcgm-file", str(plain), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["incidents"] == []
    [line] = r.stderr.strip().splitlines()
    assert "DCGM_EXP_XID_ERRORS_COUNT" in line and "not checked" in line
    r = cli(str(tmp_path), "--dcgm-file", str(DCGM_MIG), "--json")  # holds the XID counts
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_missing_default_directory_is_nothing_recorded_yet(tmp_path):
    """The directory appears with the first OOM record: on a healthy box the runbook's bare
    `oomguard incidents` says there is nothing yet and exits 0 (a cron job or a script must not
    fail for it); the note says where it looked and how to point it elsewhere (the wrong node,
    another layout). A DIR given and missing is a typo: exit 2."""
    env = {"OOMGUARD_INCIDENT_DIR": "", "OOMGUARD_ALLOCATOR_DIR": str(tmp_path / "nowhere")}
    r = cli("--since", "1h", env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.strip() == "no incidents"
    [line] = r.stderr.strip().splitlines()
    assert "nothing recorded yet" in line and str(tmp_path / "nowhere" / "incidents") in line
    assert "OOMGUARD_INCIDENT_DIR" in line and "first OOM record" in line
    r = cli("--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout) == {"incidents": [], "invalid_files": {}}
    r = cli(str(tmp_path / "typo"), env=env)
    assert r.returncode == 2 and "no such directory" in r.stderr, (r.stdout, r.stderr)
