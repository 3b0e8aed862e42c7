"""The worker's memory readings (vllm_plugin/engine.py: worker_memory for the request guard,
worker_step_memory for the step guard), which run only in a CUDA worker: here on torch's own
`torch.cuda` functions replaced by a GPU's figures (no GPU on this machine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oomguard.vllm_plugin import engine
from oomguard.vllm_plugin.guard import ModelMemory, activation_bytes

torch = pytest.importorskip("torch")
GIB = 2**30


def worker(peak: int | None = None) -> SimpleNamespace:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        model_config=SimpleNamespace(get_vocab_size=lambda: 128_256, get_hidden_size=lambda: 4096),
    )
    return SimpleNamespace(vllm_config=config, peak_activation_memory=peak)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """An 80 GiB GPU: 60 GiB reserved by the allocator (50 allocated, 2 of the rest split
    into fragments), 1 GiB of non-torch memory (CUDA context), the rest free."""
    state = {"total": 80 * GIB, "reserved": 60 * GIB, "allocated": 50 * GIB, "fragments": 2 * GIB}
    state["free"] = state["total"] - state["reserved"] - GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (state["free"], state["total"]))
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats",
        lambda: {
            "reserved_bytes.all.current": state["reserved"],
            "allocated_bytes.all.current": state["allocated"],
            "inactive_split_bytes.all.current": state["fragments"],
        },
    )
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return state


def test_the_step_guard_reads_free_memory_plus_unfragmented_cache(gpu):
    w = worker(peak=3 * GIB)
    assert engine.worker_step_memory(w) == {
        "available": 19 * GIB + (10 - 2) * GIB,  # free + cache not split into fragments
        "idle": 80 * GIB - 50 * GIB - GIB,  # total - allocated - the non-torch GiB
        "profiled": 3 * GIB,
    }


def test_a_neighbour_arriving_later_lowers_available_not_idle(gpu):
    w = worker()
    first = engine.worker_step_memory(w)
    gpu["free"] -= 6 * GIB  # another process takes 6 GiB after the first reading
    later = engine.worker_step_memory(w)
    assert later["available"] == first["available"] - 6 * GIB
    assert later["idle"] == first["idle"]  # the non-torch memory is the first reading's
    assert later["profiled"] == 0


def test_expandable_segments_count_fragments_as_room(gpu, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert engine.worker_step_memory(worker())["available"] == 19 * GIB + 10 * GIB


def test_the_request_guard_reads_the_same_room_less_a_full_step(gpu):
    w = worker()
    step = activation_bytes(8192, ModelMemory(128_256, 4096))
    room = engine.worker_step_memory(w)
    assert engine.worker_memory(w) == {
        "now": room["available"] - step,
        "idle": room["idle"] - step,
    }
