"""The admission cap's ceiling is the engine's startup active limit: vLLM 0.33's
`--max-num-active-seqs` when set (it sets `Scheduler.max_num_active_reqs` below
`max_num_running_reqs`), never the runner's slot count above it. The scheduler is a plain object
with the two attributes the plugin reads: the real server is exercised in test_vllm_plugin.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oomguard.engine_env import INITIAL_CAP_ENV
from oomguard.vllm_plugin import engine as plugin
from oomguard.vllm_plugin.engine import oomguard_set_admission_cap, oomguard_state


@pytest.fixture(autouse=True)
def not_paused(monkeypatch):
    # reading the pause state imports vLLM (a minute on a loaded CPU): not what is tested here
    monkeypatch.setattr(plugin, "_paused", lambda core: False)


def engine(running_slots: int, active: int) -> SimpleNamespace:
    scheduler = SimpleNamespace(
        max_num_running_reqs=running_slots,
        max_num_active_reqs=active,
        get_request_counts=lambda: (0, 0),
        get_kv_cache_usage=lambda: 0.0,
    )
    return SimpleNamespace(scheduler=scheduler, engine_index=0)


def test_the_cap_never_rises_above_max_num_active_seqs(monkeypatch):
    pytest.importorskip("vllm")  # the state read sheds through vLLM's own types
    monkeypatch.delenv(INITIAL_CAP_ENV, raising=False)
    core = engine(
        running_slots=256, active=48
    )  # vllm serve --max-num-seqs 256 --max-num-active-seqs 48
    assert oomguard_state(core)["startup_max_num_seqs"] == 48
    assert oomguard_set_admission_cap(core, 16)["admission_cap"] == 16
    result = oomguard_set_admission_cap(core, 256)  # full re-admission
    assert result["admission_cap"] == 48 and result["clamped"]
    assert core.scheduler.max_num_active_reqs == 48


def test_without_an_active_limit_the_ceiling_is_max_num_seqs(monkeypatch):
    pytest.importorskip("vllm")  # the state read sheds through vLLM's own types
    monkeypatch.delenv(INITIAL_CAP_ENV, raising=False)
    core = engine(running_slots=64, active=64)
    assert oomguard_set_admission_cap(core, 100)["admission_cap"] == 64
    assert oomguard_state(core)["startup_max_num_seqs"] == 64


def test_an_initial_cap_starts_below_the_active_limit(monkeypatch):
    pytest.importorskip("vllm")  # the state read sheds through vLLM's own types
    monkeypatch.setenv(INITIAL_CAP_ENV, "100")
    core = engine(running_slots=256, active=48)
    state = oomguard_state(core)
    assert state["admission_cap"] == 48 and state["startup_max_num_seqs"] == 48
