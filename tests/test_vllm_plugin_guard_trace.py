"""The request guard on a twin trace (issue 16): the trace runner serves the twin model folder
with its offline tokenizer, so prompt_logprobs requests run through the real vLLM server (they
were refused under --skip-tokenizer-init); with the guard enforcing, a prompt_logprobs request
whose FP32 logits do not fit is answered 400 naming the parameter and the limit, the ones that fit
are served, and the engine serves on. Without the guard such a request kills the engine with a
CUDA OOM: tests/test_vllm_plugin_guard_server.py (observe mode) shows that on the real server,
and bench/guard.py runs the defaults on the whole prompt-logprobs trace.

The smallest such comparison: one engine, an A100 40 GB twin at gpu_memory_utilization 0.92 (the
prompt-logprobs trace's GPU): 3.16 GiB free beyond a full 8,192-token step, so the logits of a
1,500-token prompt (1.8 GiB at the peak, oomguard.logits) fit and those of an 8,000-token prompt
(9.6 GiB) never do.
"""

from __future__ import annotations

import pytest

from oomguard.lab.runner import Fleet
from oomguard.twin.physics import Physics, Step
from oomguard.twin.traces import Trace, requests
from tests.vllm_server import require_vllm

pytestmark = pytest.mark.slow

TRACE = Trace.model_validate(
    {
        "name": "guard-smallest",
        "description": "two prompt_logprobs requests that fit, then two that never fit",
        "seed": 3,
        "gpu": "A100-40GB",
        "duration_s": 40,
        "time_compression": 2,
        "reload_s": 10,
        "engine": {
            "max_num_seqs": 16,
            "max_model_len": 8192,
            "max_num_batched_tokens": 8192,
            "gpu_memory_utilization": 0.92,
        },
        "phases": [
            # plain traffic besides (no logprobs): the guard must let all of it through
            {"start_s": 0, "end_s": 40, "rate_per_s": 0.2, "prompt_tokens": [500, 1000],
             "output_tokens": [8, 16]},
            {"start_s": 2, "end_s": 12, "rate_per_s": 0.2, "prompt_tokens": [1500, 1500],
             "output_tokens": [4, 4], "prompt_logprobs": True},
            {"start_s": 20, "end_s": 30, "rate_per_s": 0.2, "prompt_tokens": [8000, 8000],
             "output_tokens": [4, 4], "prompt_logprobs": True},
        ],
        "ttft_slo_s": 20,
    }
)  # fmt: skip
PHYSICS = Physics.for_model(
    "llama-3-8b", gpu="A100-40GB", gpu_memory_utilization=0.92, max_num_batched_tokens=8192
)
ROOM = PHYSICS.total - PHYSICS.peak(Step(tokens=8192))  # what the guard reads as `idle`
LIMIT = ROOM // (128_256 * 10)  # the longest prompt whose prompt logits fit


def run(config: str, tmp_path) -> Fleet:
    fleet = Fleet(TRACE, config, tmp_path / config, log=lambda _: None, engines=1,
                  start_timeout=600)  # fmt: skip
    try:
        fleet.start()
        fleet.replay()
    finally:
        fleet.stop()
    return fleet


@pytest.mark.timeout(1500)
def test_the_enforcing_guard_answers_400_to_never_fit_prompt_logits_and_serves_the_rest(tmp_path):
    require_vllm()
    reqs = requests(TRACE)
    fits = [r for r in reqs if r.prompt_logprobs and r.prompt_tokens == 1500]
    never = [r for r in reqs if r.prompt_logprobs and r.prompt_tokens == 8000]

    def fitting(fleet: Fleet) -> list[str]:
        """How each request whose prompt logits fit ended."""
        return [s.status for s in fleet.sent if s.request in fits]

    assert fits and never  # the seed gives both kinds
    assert PHYSICS.logits(1500) < ROOM < PHYSICS.logits(8000)

    guard = run("guard", tmp_path)
    o = guard.outcome()
    assert o.crashes == 0
    assert fitting(guard) == ["ok"] * len(fits)  # served, not refused
    # every loss is a never-fit prompt_logprobs request, answered 400 with the limit
    assert o.lost == len(never) and o.lost_why == {"HTTP 400": len(never)}
    assert len(o.refusals) == len(never)
    for refusal in o.refusals:
        assert refusal.startswith("prompt_logprobs: ")
        assert f"at most {LIMIT} tokens" in refusal
