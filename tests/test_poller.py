from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oomguard.catalog import CATALOG
from oomguard.errors import CollectorError
from oomguard.exporter.collectors.base import GpuIdentity, GpuMemory, GpuReading
from oomguard.exporter.collectors.dcgm import DcgmCollector
from oomguard.exporter.collectors.nvml import NvmlCollector
from oomguard.exporter.collectors.vllm import VllmCollector
from oomguard.exporter.poller import Poller
from oomguard.exporter.render import FamilyBuilder
from tests.conftest import DCGM_K8S, VLLM_FIXTURE
from tests.fake_nvml import GIB, FakeGpu, FakeNvml


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """A collector whose behaviour the test sets: a reading, an error, or a block."""

    def __init__(self, name="scripted", target="", timeout=1.0):
        self.name, self.target, self.timeout = name, target, timeout
        self.reading = GpuReading(
            gpus=[
                GpuMemory(
                    GpuIdentity("0", "GPU-s", "", "", "", "h"), 80 * GIB, 1 * GIB, 78 * GIB, 1 * GIB
                )
            ]
        )
        self.error: Exception | None = None
        self.gate: threading.Event | None = None

    def collect(self):
        if self.gate is not None:
            self.gate.wait(5)
        if self.error:
            raise self.error
        return self.reading

    def families(self, reading, out: FamilyBuilder) -> None:
        pass


def series(text: bytes) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: bytes, name: str, **labels) -> float | None:
    for (n, ls), v in series(text).items():
        if n == name and all((k, val) in ls for k, val in labels.items()):
            return v
    return None


def test_stale_results_are_not_served_as_fresh():
    clock = Clock()
    c = Scripted()
    poller = Poller([c], interval=1.0, clock=clock)
    poller.poll(poller.states[0])
    text = poller.render().text
    assert value(text, "oomguard_gpu_memory_free_bytes") == 78 * GIB
    assert value(text, "oomguard_exporter_collector_up", collector="scripted") == 1
    clock.now += 10  # no new poll for 10 intervals
    text = poller.render().text
    assert value(text, "oomguard_gpu_memory_free_bytes") is None
    assert value(text, "oomguard_exporter_collector_up", collector="scripted") == 0


def test_a_failing_collector_reports_itself_and_the_others_keep_serving():
    clock = Clock()
    good, bad = Scripted("good"), Scripted("bad")
    bad.error = CollectorError("parse_error", "garbage")
    poller = Poller([good, bad], clock=clock)
    for _ in range(3):
        for s in poller.states:
            poller.poll(s)
    text = poller.render().text
    assert value(text, "oomguard_exporter_collector_up", collector="good") == 1
    assert value(text, "oomguard_exporter_collector_up", collector="bad") == 0
    assert (
        value(
            text, "oomguard_exporter_collector_errors_total", collector="bad", reason="parse_error"
        )
        == 3
    )


def test_unexpected_exceptions_never_escape():
    c = Scripted()
    c.error = ZeroDivisionError("bug")
    poller = Poller([c])
    result = poller.poll(poller.states[0])
    assert result.error == "unexpected"


def test_a_stuck_collector_is_reported_as_timeout_while_it_hangs():
    clock = Clock()
    c = Scripted(timeout=2.0)
    poller = Poller([c], interval=1.0, clock=clock)
    poller.poll(poller.states[0])
    c.gate = threading.Event()
    t = threading.Thread(target=poller.poll, args=(poller.states[0],))
    t.start()
    try:
        clock.now += 3  # hanging for longer than its timeout
        deadline = time.monotonic() + 5  # the poll thread may start late on a loaded machine
        while poller.states[0].running_since is None and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert poller.states[0].running_since is not None
        text = poller.render().text
        assert value(text, "oomguard_exporter_collector_up", collector="scripted") == 0
        assert value(text, "oomguard_exporter_collector_errors_total", reason="timeout") == 1
        poller.render()  # counted once per hang, not once per render
        assert poller.states[0].errors["timeout"] == 1
    finally:
        c.gate.set()
        t.join(5)


def test_nvml_is_preferred_over_dcgm_for_the_same_gpu(monkeypatch):
    # the same UUID from both sources: NVML's numbers win, no duplicate series
    FakeNvml(monkeypatch, [FakeGpu("GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90", free=11 * GIB)])
    poller = Poller([DcgmCollector("h", file=str(DCGM_K8S)), NvmlCollector("h")])
    for s in poller.states:
        poller.poll(s)
    text = poller.render().text
    frees = {
        dict(ls)["UUID"]: v
        for (n, ls), v in series(text).items()
        if n == "oomguard_gpu_memory_free_bytes"
    }
    assert frees["GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90"] == 11 * GIB
    assert len(frees) == 2  # the other GPU still comes from dcgm
    sources = {
        dict(ls)["gpu"] + dict(ls)["source"]
        for (n, ls), _ in series(text).items()
        if n == "oomguard_gpu_info"
    }
    assert sources == {"0nvml", "1dcgm"}


def test_everything_rendered_is_in_the_catalog_with_its_labels(local_server, monkeypatch, tmp_path):
    FakeNvml(monkeypatch, [FakeGpu("GPU-a", processes=[(1, GIB)])])
    server = local_server(VLLM_FIXTURE.read_text())
    poller = Poller(
        [
            NvmlCollector("h"),
            DcgmCollector("h", file=str(DCGM_K8S)),
            VllmCollector("llama", server.url),
        ]
    )
    for s in poller.states:
        poller.poll(s)
    snapshot = poller.render()
    names = set()
    for fam in text_string_to_metric_families(snapshot.text.decode()):
        for s in fam.samples:
            spec = CATALOG[s.name]
            assert set(s.labels) <= set(spec.labels), (s.name, s.labels)
            names.add(s.name)
    assert "oomguard_engine_pressure_level" in names and "oomguard_gpu_pressure_level" in names
    assert b"oomguard_vllm_kv_projected_demand_ratio" in snapshot.text
    # OpenMetrics form of the same snapshot parses and ends with # EOF
    assert snapshot.openmetrics.rstrip().endswith(b"# EOF")


def test_pressure_follows_new_results_only(local_server):
    """Counters are observed once per new scrape, so re-rendering does not fake a rate."""
    server = local_server(VLLM_FIXTURE.read_text())
    poller = Poller([VllmCollector("llama", server.url)])
    poller.poll(poller.states[0])
    for _ in range(5):
        poller.render()
    history = poller.pressure._history[("llama", "meta-llama/Llama-3.1-8B-Instruct", "0")]
    assert len(history) == 1


def test_threads_start_and_stop_cleanly():
    c = Scripted()
    poller = Poller([c], interval=0.1)
    poller.start()
    try:
        threading.Event().wait(0.35)
        assert poller.latest.text and poller.polls >= 2
        threads = poller.threads()
        assert [t.name for t in threads] == ["collectors", "render"]  # one lane for all
    finally:
        poller.stop()
    assert all(not t.is_alive() for t in threads)


def test_a_collector_hung_at_start_up_does_not_hold_the_others_back():
    good, hung = Scripted("good"), Scripted("hung", timeout=0.2)
    hung.gate = threading.Event()  # never set during start-up: a wedged driver
    poller = Poller([good, hung], interval=0.1)
    t0 = time.monotonic()
    try:
        # 1.5 s for the good one's first poll on a loaded machine; the bound is what is tested
        poller.start(first_results_within=1.5)
        assert time.monotonic() - t0 < 5.0
        text = poller.latest.text
        assert value(text, "oomguard_exporter_collector_up", collector="good") == 1
        assert value(text, "oomguard_exporter_collector_up", collector="hung") == 0
        assert value(text, "oomguard_gpu_memory_free_bytes") == 78 * GIB
    finally:
        hung.gate.set()
        poller.stop()


def test_a_collector_whose_families_raise_does_not_take_the_page_down():
    class Broken(Scripted):
        def families(self, reading, out: FamilyBuilder) -> None:
            raise RuntimeError("bug")

    good, bad = Scripted(name="good"), Broken(name="bad")
    poller = Poller([good, bad])
    for s in poller.states:
        poller.poll(s)
    text = poller.render().text
    assert value(text, "oomguard_exporter_collector_up", collector="good") == 1
    assert (
        value(
            text, "oomguard_exporter_collector_errors_total", collector="bad", reason="unexpected"
        )
        == 1
    )


def test_unrenderable_samples_are_counted_not_fatal():
    class Huge(Scripted):
        def families(self, reading, out: FamilyBuilder) -> None:
            out.add("oomguard_vllm_up", ("x",), 10**400)  # cannot be a float

    poller = Poller([Huge()])
    poller.poll(poller.states[0])
    text = poller.render().text
    assert (
        value(
            text,
            "oomguard_exporter_invalid_samples_total",
            collector="render",
            reason="unrenderable",
        )
        == 1
    )
    assert b"oomguard_exporter_polls_total" in text


class Killed(BaseException):
    """What no loop catches: the injected death of a thread."""


@pytest.mark.slow  # waits out a restart backoff (seconds)
def test_a_dead_collector_thread_is_restarted_counted_and_degrades_healthz():
    import time

    import httpx

    from oomguard.exporter.server import MetricsServer

    class DiesOnce(Scripted):
        """collect() raises, once, what poll() does not catch: one death whatever the timing
        (a test that stopped the failures itself raced the restart on a loaded machine)."""

        died = False

        def collect(self):
            if not self.died:
                self.died = True
                raise Killed("injected")
            return super().collect()

    dies = DiesOnce(name="nvml")
    ok = Scripted(name="dcgm")
    poller = Poller([dies, ok], interval=0.05)
    server = MetricsServer(("127.0.0.1", 0), lambda: poller.latest, 30.0, problems=poller.problems)
    poller.lanes.settle = 5.0  # degraded this long after the death: the 503 has time to be seen
    poller.start(first_results_within=0.5)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        deadline = time.monotonic() + 10
        while not poller.problems() and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(f"{url}/healthz")
        assert r.status_code == 503 and "collector-nvml-" in r.text
        # it runs again once restarted (after 1 s)
        deadline = time.monotonic() + 10
        while dies_results(poller) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dies_results(poller) is not None
        got = series(httpx.get(f"{url}/metrics").content)
        key = (
            "oomguard_exporter_thread_restarts_total",
            frozenset({("thread", "collector-nvml-")}),
        )
        assert got[key] == 1
        render = ("oomguard_exporter_thread_restarts_total", frozenset({("thread", "render")}))
        assert got[render] == 0  # every thread's series, present at 0 from the start
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/healthz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{url}/healthz").status_code == 200
    finally:
        server.stop()
        poller.stop()


def dies_results(poller: Poller):
    return poller.states[0].result


def test_processes_taken_by_runs_are_the_ones_the_filter_takes(monkeypatch):
    # NVML lists processes device by device (GpuReading.process_runs): a GPU another source
    # already gave is left out whole, the rest taken in order, as the per-process filter does;
    # runs that no longer cover the list (something added after them) are not trusted.
    uuid = "GPU-3f7c1a2e-5b1d-4c0e-9a7f-2d6b8e4c1a90"  # also in the dcgm page
    FakeNvml(
        monkeypatch,
        [
            FakeGpu(uuid, processes=[(11, GIB), (12, 2 * GIB)]),
            FakeGpu("GPU-n", minor=1, processes=[(21, GIB)]),
            FakeGpu("GPU-e", minor=2),  # no processes: no run
            FakeGpu("GPU-m", minor=3, processes=[(41, GIB), (42, GIB)]),
        ],
    )
    nvml = NvmlCollector("h")
    poller = Poller([DcgmCollector("h", file=str(DCGM_K8S)), nvml])
    reading = nvml.collect()
    assert reading.process_runs is not None and len(reading.process_runs) == 3

    def taken(dcgm_first: bool) -> list[tuple[str, int]]:
        nvml_state, dcgm_state = poller.states[1], poller.states[0]
        nvml_state.collector, dcgm_state.collector.name = nvml, "nvml" if dcgm_first else "dcgm"
        fresh = [(dcgm_state, dcgm_state.collector.collect()), (nvml_state, reading)]
        nvml_state.collector.name = "dcgm" if dcgm_first else "nvml"
        try:
            return [(i.uuid, pid) for i, pid, _ in poller._merge_gpus(fresh)[1]]
        finally:
            nvml_state.collector.name, dcgm_state.collector.name = "nvml", "dcgm"

    everything = [(uuid, 11), (uuid, 12), ("GPU-n", 21), ("GPU-m", 41), ("GPU-m", 42)]
    assert taken(dcgm_first=False) == everything
    by_filter = reading.process_runs
    reading.process_runs = None
    assert taken(dcgm_first=True) == everything[2:]  # dcgm has that GPU first: its processes
    reading.process_runs = by_filter
    assert taken(dcgm_first=True) == everything[2:]
    reading.processes.append(reading.processes[0])  # past the runs: the filter, not the runs
    assert taken(dcgm_first=False) == [*everything, (uuid, 11)]
