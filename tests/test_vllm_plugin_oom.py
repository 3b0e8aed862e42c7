"""The out-of-memory observer: a fatal CUDA OOM is on disk before the process dies (issue 11,
item 4), with an incident record that names the step's batch (issue 16, item 3).

Without a GPU the observer is driven by the GPU twin's simulated OOM (the same `observe` PyTorch
would call); the process is then ended with `os._exit`, as a dying worker ends, so nothing after
the observer (atexit handlers, the publisher thread, finally blocks) can write anything. The real
vLLM server path is in tests/test_restart.py; the real CUDA path runs where a GPU exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.twin_oom import GROUP

# the twin OOM child runs once for this file and tests/test_incidents.py (tests/twin_oom.py)
pytestmark = pytest.mark.xdist_group(GROUP)


def test_a_fatal_oom_is_on_disk_before_the_process_dies(twin_oom_dir):
    # the child ran the twin's 6,000-token prompt-logprobs step, which did not fit, and died
    # with exit code 1 (tests/twin_oom.py, checked there); its periodic report, read before the
    # OOM, landed after the observer's: the count stays
    reports = [json.loads(p.read_text()) for p in twin_oom_dir.glob("pid-*.json")]
    assert len(reports) == 1 and reports[0]["ooms"] == 1, reports
    assert reports[0]["target"] == "llama" and reports[0]["schema"] == "oomguard.allocator.v1"

    [path] = (twin_oom_dir / "incidents").glob("oom-*.json")
    record = json.loads(path.read_text())
    assert record["schema"] == "oomguard.oom_incident.v1" and record["kind"] == "cuda_oom"
    assert record["pid"] == reports[0]["pid"]
    # FP32 logits of 6,000 prompt tokens x 128,256 vocabulary are in the failed allocation
    assert record["requested_bytes"] >= 6000 * 128_256 * 4
    assert record["requested_bytes"] > record["device_free_bytes"]
    assert record["allocator"]["ooms"] == 1 and record["allocator"]["simulated"] is True
    assert record["allocator"]["neighbour_bytes"] == 6 * 2**30
    batch = record["batch"]
    assert batch["requests"] == 2 and batch["scheduled_tokens"] == 6001
    big = batch["largest"][0]
    assert big["id"] == "cmpl-big" and big["prompt_tokens"] == 6000
    assert big["params"]["prompt_logprobs"] == 5
    assert record["flags"]["gpu_memory_utilization"] == 0.9
    assert record["flags"]["max_num_batched_tokens"] == 8192
    # no scheduler in this process: what the engine held is the step's batch
    assert (record["in_flight"], record["in_flight_source"]) == (2, "step")


def test_the_record_counts_every_request_the_scheduler_held(tmp_path, monkeypatch):
    """The requests lost with the engine: all the scheduler held (running and queued), noted
    after each schedule(), with the served model name vLLM labels its metrics with; the
    record parses as the exporter reads it."""
    from types import SimpleNamespace

    from oomguard.forensics import reader
    from oomguard.incident_records import OomRecord
    from oomguard.vllm_plugin import oom

    for name, value in (("_in_flight", None), ("_step", None), ("_model_name", "")):
        monkeypatch.setattr(oom, name, value)
    monkeypatch.setattr(oom, "_flags", {})
    oom.note_flags(
        SimpleNamespace(model_config=SimpleNamespace(served_model_name=["llama-3", "alias"]))
    )
    oom.note_in_flight(37)
    rec = oom.OomRecorder("", str(tmp_path), "llama", dict, lambda: {"engine": "1"})
    rec.observe(0, 1, 2, 3)
    [path] = tmp_path.glob("oom-*.json")
    record = json.loads(path.read_text())
    assert (record["in_flight"], record["in_flight_source"]) == (37, "scheduler")
    assert record["model_name"] == "llama-3"
    parsed = reader._parse(path.name, path.read_bytes())
    assert isinstance(parsed, OomRecord)
    assert (parsed.in_flight, parsed.model_name, parsed.engine) == (37, "llama-3", "1")


def test_the_observer_never_raises(tmp_path):
    from oomguard.vllm_plugin.oom import OomRecorder

    def broken() -> dict:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    (tmp_path / "file").write_text("")
    rec = OomRecorder(str(tmp_path / "file" / "x"), str(tmp_path), "t", broken, dict)
    rec.observe(0, 1, 2, 3)  # unwritable directory and failing stats: logged, not raised
    assert rec.ooms == 1


def test_no_cuda_observer_hook_on_a_cpu_torch():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from oomguard.vllm_plugin.oom import attach_to_torch

    assert attach_to_torch() is False


CUDA_CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["OOMGUARD_ALLOCATOR_DIR"] = sys.argv[1]
    import torch
    from oomguard.vllm_plugin.oom import attach_to_torch
    assert attach_to_torch()
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    try:
        torch.empty(total * 2, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        os._exit(1)
    os._exit(0)
    """
)


def test_a_real_cuda_oom_is_counted_before_the_process_dies(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    code = subprocess.run(
        [sys.executable, "-c", CUDA_CHILD, str(tmp_path)], timeout=120, check=False
    ).returncode
    assert code == 1
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("pid-*.json")]
    assert report["ooms"] >= 1
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "incidents").glob("*.json")]
    assert record["requested_bytes"] >= torch.cuda.mem_get_info()[1]
    assert record["allocator"]["segments"] >= 1
