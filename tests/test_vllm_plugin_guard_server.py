"""The request guard on the real vLLM server (issue 16): prompt_logprobs and chat run through
vLLM with the twin's offline tokenizer, the twin's FP32 logits peak raises a CUDA OOM when it does
not fit, and the guard in enforce mode answers 400 / 429 instead.

The served model is the twin's Llama-3-8B config (vocab 128,256, hidden 4096), and the twin's
physics uses the same config, so the guard's estimate and the twin's memory agree. On an H100 at
gpu_memory_utilization 0.96 the twin leaves about 3.2 GiB for a request's extra transient memory:
the logits of an 8,192-token prompt (9.8 GiB at the peak, oomguard.logits) never fit, those of a
1,500-token prompt (1.8 GiB) do.
"""

from __future__ import annotations

import json

import httpx
import pytest

from oomguard.forensics.incidents import incidents
from oomguard.forensics.reader import load
from oomguard.lab.processes import MODELS, VllmProcess
from oomguard.logits import LogitsShape
from oomguard.twin.physics import Physics, Step
from tests.vllm_server import TOKEN, require_vllm

pytestmark = pytest.mark.slow

MODEL = MODELS / "llama-3-8b"
GIB = 2**30
PHYSICS = Physics.for_model(
    "llama-3-8b", gpu="H100", gpu_memory_utilization=0.96, max_num_batched_tokens=8192
)
IDLE = PHYSICS.total - PHYSICS.peak(Step(tokens=8192))  # the twin's room for extra transients


def start(tmp_path, mode: str, state_file) -> VllmProcess:
    return VllmProcess(
        "--no-skip-tokenizer-init",  # the twin's offline tokenizer (twin/models/*/tokenizer.json)
        "--gpu-memory-utilization",
        "0.96",
        "--max-model-len",
        "16384",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "16",
        log=tmp_path / f"vllm-{mode}.log",
        token=TOKEN,
        model=MODEL,
        timeout=600,  # a loaded 2-core box needs minutes to import vLLM
        env={
            "OOMGUARD_TWIN_GPU": "H100",
            "OOMGUARD_TWIN_MODEL": "llama-3-8b",
            "OOMGUARD_TWIN_TIME_COMPRESSION": "50",
            "OOMGUARD_TWIN_STATE_FILE": str(state_file),
            "OOMGUARD_ALLOCATOR_DIR": str(tmp_path / f"allocator-{mode}"),
            "OOMGUARD_GUARD_MODE": mode,
            "OOMGUARD_GUARD_REFRESH_SECONDS": "0.2",
            "HF_HUB_OFFLINE": "1",  # the tokenizer is local; never wait on the network
        },
    )


def ids(n: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + k * 7) % 1000 + 3 for k in range(n)]  # within the tokenizer's 1,024


def logprobs_request(url: str, tokens: int, seed: int = 0) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={
            "model": str(MODEL),
            "prompt": ids(tokens, seed),
            "max_tokens": 2,
            "prompt_logprobs": 1,
        },
        timeout=120,
    )


def decisions(url: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("oomguard_guard_decisions_total{"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            key = (labels["action"].strip('"'), labels["reason"].strip('"'))
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def wait_for_headroom(url: str) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "oomguard_guard_headroom_bytes" in httpx.get(f"{url}/metrics", timeout=10).text:
            return
        time.sleep(0.3)
    raise AssertionError("the guard never received headroom from the engine")


def test_enforce_rejects_never_fit_defers_busy_and_admits_the_rest(tmp_path):
    require_vllm()
    assert PHYSICS.logits(8192) > IDLE > PHYSICS.logits(1500)
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"neighbour_bytes": 0}))
    server = start(tmp_path, "enforce", state)
    try:
        url = server.url
        wait_for_headroom(url)
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": str(MODEL),
                "messages": [{"role": "user", "content": "Is the engine out of GPU memory?"}],
                "max_tokens": 3,
            },
            timeout=60,
        )
        assert chat.status_code == 200, chat.text  # chat runs through the real tokenizer
        ok = logprobs_request(url, 1500)
        assert ok.status_code == 200, ok.text
        plp = ok.json()["choices"][0]["prompt_logprobs"]  # as a GPU runner returns them
        assert len(plp) == 1500 and plp[0] is None and len(plp[1]) >= 1
        never = logprobs_request(url, 8192, seed=1)
        assert never.status_code == 400, never.text
        error = never.json()["error"]
        assert error["param"] == "prompt_logprobs"
        limit = IDLE // (128_256 * 10)  # oomguard.logits: BF16 peak
        assert f"at most {limit} tokens" in error["message"]
        # streamed, the same refusal is a 400 too (decided before the stream begins)
        streamed = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": str(MODEL),
                "prompt": ids(8192, 4),
                "max_tokens": 2,
                "prompt_logprobs": 0,  # the only kind vLLM streams; the same FP32 logits
                "stream": True,
            },
            timeout=120,
        )
        assert streamed.status_code == 400, streamed.text
        assert streamed.json()["error"]["param"] == "prompt_logprobs"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the engine lives

        # another process takes 2 GiB: a 1,500-token prompt_logprobs request fits only later
        state.write_text(json.dumps({"neighbour_bytes": 2 * GIB}))
        import time

        deadline = time.monotonic() + 20
        while True:
            busy = logprobs_request(url, 1500, seed=2)
            if busy.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert busy.status_code == 429 and int(busy.headers["retry-after"]) > 0, busy.text
        assert logprobs_request(url, 500, seed=3).status_code == 200  # small ones still run
        state.write_text(json.dumps({"neighbour_bytes": 0}))

        counts = decisions(url)
        assert counts[("reject", "prompt_logprobs_logits")] >= 1
        assert counts[("defer", "prompt_logprobs_logits")] >= 1
        assert counts[("admit", "fits")] >= 2
        reports = [
            json.loads(p.read_text())
            for p in (tmp_path / "allocator-enforce").glob("*")
            if p.is_file()
        ]
        assert all(r["ooms"] == 0 for r in reports)  # no CUDA OOM happened
    finally:
        server.stop()


def test_observe_only_counts_and_the_twin_dies_of_the_logits_peak(tmp_path):
    """Without enforcement the same request kills the engine with a CUDA OOM, as it would on an
    H100: the guard's 'reject' was a true prediction."""
    require_vllm()
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"neighbour_bytes": 0}))
    server = start(tmp_path, "observe", state)
    try:
        url = server.url
        wait_for_headroom(url)
        assert logprobs_request(url, 1500).status_code == 200
        before = decisions(url)
        assert before.get(("reject", "prompt_logprobs_logits"), 0) == 0
        dead = logprobs_request(url, 8192, seed=1)
        assert dead.status_code >= 500
        log = server.tail(400)
        assert "CUDA out of memory" in log and "8192 prompt-logprob tokens" in log
        incidents_dir = tmp_path / "allocator-observe" / "incidents"
        [record] = [json.loads(p.read_text()) for p in incidents_dir.glob("oom-*.json")]
        assert record["batch"]["largest"][0]["prompt_tokens"] == 8192
        assert record["batch"]["largest"][0]["params"]["prompt_logprobs"] == 1
        # forensics (incidents.py): the real server's OOM is a long-prompt spike, type 2
        [found] = incidents(load(incidents_dir))
        assert (found.type, found.figures["steps"] > 1) == ("long_prompt", True)
        # the incident's estimate is oomguard.logits' peak (BF16 logits, FP32 cast and
        # log-softmax: 10 B a logit) for the chunk the engine died in
        per_token = LogitsShape(128_256).prompt_logprobs_bytes_per_token
        assert 8000 * per_token <= found.figures["logits_bytes"] <= 8192 * per_token
    finally:
        server.stop()
