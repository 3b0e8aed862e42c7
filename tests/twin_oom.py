"""The twin's simulated CUDA OOM in a child process that dies of it (tests/test_vllm_plugin_oom.py
reads what its observer wrote, tests/test_incidents.py classifies it): run once per session, as
the child costs seconds of imports (torch, the twin) and both read the same directory only."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.vllm_server import require_vllm

# the xdist group of the files that read the child's directory: one run for them, on one worker
GROUP = "twin-oom-child"

CHILD = textwrap.dedent(
    """
    import os, sys, threading
    from types import SimpleNamespace
    import torch
    from oomguard import handoff
    from oomguard.twin.executor import GpuTwin
    from oomguard.twin.physics import Step
    from oomguard.vllm_plugin import oom

    directory = sys.argv[1]
    # the race a dying process must win: the twin's periodic publisher (a thread, as the
    # plugin's is on a GPU) has read its stats before the OOM and writes them after the
    # observer wrote the OOM; held here so that the order is certain, not likely
    real_write = handoff.write_report
    held, observed, landed = threading.Event(), threading.Event(), threading.Event()
    def hold_the_periodic_report(path, report):
        if threading.current_thread().name != "twin-gpu-process" or held.is_set():
            return real_write(path, report)
        held.set()
        observed.wait(60)
        try:
            return real_write(path, report)
        finally:
            landed.set()
    handoff.write_report = hold_the_periodic_report
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=64,
                                         enable_chunked_prefill=True),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9, block_size=16),
        model_config=SimpleNamespace(max_model_len=32768),
    )
    twin = GpuTwin(config, {"gpu": "H100", "allocator_dir": directory, "target": "llama"})
    assert held.wait(60)  # the thread's periodic report, read before the OOM: no OOM in it
    twin.neighbour = 6 * 2**30  # another process holds 6 GiB of the H100
    # the step the engine was running: a 6,000-token prompt asking for prompt_logprobs
    new = SimpleNamespace(
        req_id="cmpl-big", prompt_token_ids=list(range(6000)), prefill_token_ids=None,
        num_computed_tokens=0,
        sampling_params=SimpleNamespace(n=1, best_of=None, logprobs=None, prompt_logprobs=5,
                                        max_tokens=4),
    )
    cached = SimpleNamespace(req_ids=["cmpl-small"], num_computed_tokens=[130])
    oom.note_step(SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
        num_scheduled_tokens={"cmpl-big": 6000, "cmpl-small": 1},
        total_num_scheduled_tokens=6001,
    ))
    try:
        twin.step(Step(tokens=6001, logits=6000))
    except torch.OutOfMemoryError:
        observed.set()  # the observer wrote ooms 1; now the older report lands
        landed.wait(60)
        os._exit(1)  # dies at once: no atexit, no publisher, no cleanup
    os._exit(0)
    """
)


def run_child(directory: Path) -> int:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(directory)], timeout=240, check=False
    ).returncode


@pytest.fixture(scope="session")
def twin_oom_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The child's allocator hand-off directory (pid-*.json, incidents/oom-*.json), once it died
    of the OOM: exit code 1, from the twin's 6,000-token prompt-logprobs step that did not fit."""
    require_vllm()
    directory = tmp_path_factory.mktemp("twin-oom")
    assert run_child(directory) == 1, "the twin's prompt-logprobs step did not raise its OOM"
    return directory
