"""Blind from the first poll: a GPU or an engine that oomguard has never read is level -1 with the
reason, exactly as one that stopped being readable, never "ok" (the README's promise).

Through the real poller, the real NVML and vLLM collectors and the real renderer: pynvml's own
error classes (the real library where this host has no driver, else pynvml patched with its own
types), a vLLM /metrics fixture served over HTTP, and a closed port for an engine that is down.
"""

from __future__ import annotations

import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families

from oomguard.exporter.collectors.nvml import NvmlCollector
from oomguard.exporter.collectors.vllm import VllmCollector
from oomguard.exporter.poller import Poller
from tests.conftest import VLLM_FIXTURE, LocalServer, free_port
from tests.fake_nvml import GIB, FakeGpu, FakeNvml

LEVEL = "oomguard_engine_pressure_level"
GPU_LEVEL = "oomguard_gpu_pressure_level"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def levels(poller: Poller, name: str = LEVEL) -> dict[tuple[str, ...], tuple[float, str]]:
    """One poll of every collector, one render: each series' (value, reason) by its key."""
    for state in poller.states:
        poller.poll(state)
    out = {}
    for family in text_string_to_metric_families(poller.render().text.decode()):
        for s in family.samples:
            if s.name == name:
                labels = dict(s.labels)
                reason = labels.pop("reason")
                key = (
                    tuple(labels.get(k, "") for k in ("target", "model_name", "engine"))
                    if name == LEVEL
                    else (labels["UUID"],)
                )
                out[key] = (s.value, reason)
    return out


@pytest.fixture
def vllm(local_server):
    return local_server(VLLM_FIXTURE.read_text())


def healthy_gpu() -> FakeGpu:
    # an engine at gmu 0.9 holding its plan: 72 of 80 GiB used, level 0 when read
    return FakeGpu("GPU-a", total=80 * GIB, used=72 * GIB, free=8 * GIB, reserved=0)


def test_nvml_absent_from_the_start_is_blind_not_ok(vllm, monkeypatch):
    """The defect: with NVML failing from the first poll the engine read `{reason="ok"} 0`."""
    fake = FakeNvml(monkeypatch, [])
    fake.init_error = pynvml.NVMLError_LibraryNotFound
    poller = Poller([NvmlCollector("h"), VllmCollector("llama", vllm.url)], clock=Clock())
    engines = levels(poller)
    assert engines, "the engines were read: each has a level"
    assert set(engines.values()) == {(-1.0, "nvml_library_not_found")}
    assert {e for _, _, e in engines} == {"0", "1"}  # the fixture's two data-parallel engines


def test_the_real_nvml_library_absent_is_blind(vllm):
    """This host's own pynvml, with no NVIDIA driver: the exporter as a user would run it."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this host has an NVIDIA driver")
    poller = Poller([NvmlCollector("h"), VllmCollector("llama", vllm.url)], clock=Clock())
    assert set(levels(poller).values()) == {(-1.0, "nvml_library_not_found")}


def test_a_gpu_unreadable_from_the_start_is_blind(vllm, monkeypatch):
    gpu = healthy_gpu()
    gpu.fail = pynvml.NVMLError_Unknown  # listed, but its memory cannot be read
    FakeNvml(monkeypatch, [gpu])
    poller = Poller([NvmlCollector("h"), VllmCollector("llama", vllm.url)], clock=Clock())
    assert set(levels(poller).values()) == {(-1.0, "nvml_unknown")}


def test_a_gpu_lost_after_it_was_read_is_blind(vllm, monkeypatch):
    fake = FakeNvml(monkeypatch, [healthy_gpu()])
    poller = Poller([NvmlCollector("h"), VllmCollector("llama", vllm.url)], clock=Clock())
    assert set(levels(poller).values()) == {(0.0, "ok")}
    fake.gpus[0].fail = pynvml.NVMLError_GpuIsLost
    poller.clock.now += 1  # type: ignore[attr-defined]
    assert set(levels(poller).values()) == {(-1.0, "gpu_lost")}
    assert levels(poller, GPU_LEVEL) == {("GPU-a",): (-1.0, "gpu_lost")}


def test_an_engine_configured_on_a_gpu_never_read_is_blind(vllm, monkeypatch):
    """GPU 0 reads fine, the engine's own GPU 1 never did: judging it by GPU 0 would be a guess."""
    broken = FakeGpu("GPU-b", minor=1, bus_id="00000000:19:00.0", fail=pynvml.NVMLError_Unknown)
    FakeNvml(monkeypatch, [healthy_gpu(), broken])
    poller = Poller(
        [NvmlCollector("h"), VllmCollector("llama", vllm.url)],
        engine_gpus={"llama": ["1"]},
        clock=Clock(),
    )
    assert set(levels(poller).values()) == {(-1.0, "nvml_unknown")}


def test_no_gpu_source_at_all_is_blind(vllm):
    poller = Poller([VllmCollector("llama", vllm.url)], clock=Clock())
    assert set(levels(poller).values()) == {(-1.0, "no_gpu_source")}


def down_then_up() -> tuple[LocalServer, list[bool]]:
    """A vLLM /metrics endpoint that answers 503 until `up[0]` is set."""
    up = [False]
    text = VLLM_FIXTURE.read_text().encode()

    def respond(_handler: object) -> tuple[int, bytes, str]:
        return (200, text, "text/plain") if up[0] else (503, b"starting", "text/plain")

    return LocalServer(respond), up


def test_an_engine_never_read_is_one_blind_series_until_it_answers(monkeypatch):
    """A target down since the start had no series at all: absent is not blind."""
    FakeNvml(monkeypatch, [healthy_gpu()])
    server, up = down_then_up()
    try:
        poller = Poller([NvmlCollector("h"), VllmCollector("llama", server.url)], clock=Clock())
        assert levels(poller) == {("llama", "", ""): (-1.0, "engine_unreachable")}
        # it answers: its engines replace the placeholder (nothing lingers blind)
        up[0] = True
        poller.clock.now += 1  # type: ignore[attr-defined]
        now = levels(poller)
        assert ("llama", "", "") not in now and set(now.values()) == {(0.0, "ok")}
    finally:
        server.close()


def test_a_closed_port_is_blind_from_the_first_poll(monkeypatch):
    FakeNvml(monkeypatch, [healthy_gpu()])
    closed = VllmCollector("llama", f"http://127.0.0.1:{free_port()}/metrics", timeout=1.0)
    poller = Poller([NvmlCollector("h"), closed], clock=Clock())
    assert levels(poller) == {("llama", "", ""): (-1.0, "engine_unreachable")}


def test_an_engine_that_stops_answering_is_blind_with_the_same_reason(monkeypatch):
    FakeNvml(monkeypatch, [healthy_gpu()])
    server, up = down_then_up()
    up[0] = True
    try:
        poller = Poller([NvmlCollector("h"), VllmCollector("llama", server.url)], clock=Clock())
        before = levels(poller)
        assert set(before.values()) == {(0.0, "ok")}
        up[0] = False
        poller.clock.now += 1  # type: ignore[attr-defined]
        after = levels(poller)
        assert set(after) == set(before)
        assert set(after.values()) == {(-1.0, "engine_unreachable")}
    finally:
        server.close()
