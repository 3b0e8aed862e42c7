"""The exporter at node scale (issue 30): faster, and the same exposition as before.

The node scenario of bench/exporter.py (8 GPUs, 28 MIG instances, 16 data-parallel vLLM servers,
32 ranks, per-process series) rendered by the code before the speed-ups is kept in
tests/fixtures/exporter/node-2000.prom.gz (2,000 series: every family and path of the 10,000-series
run, fewer per-process series). The caches the speed-ups added (each family's text while its
samples hold still, each MIG identity, the per-process series) are checked against a renderer
without them over random sequences of snapshots.
"""

from __future__ import annotations

import difflib
import gzip
import http.client
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.exporter.collectors.nvml import MIG_RECHECK_SECONDS, NvmlCollector
from oomguard.exporter.render import (
    Family,
    FamilyBuilder,
    OpenMetricsRenderer,
    TextRenderer,
    render_openmetrics,
    render_openmetrics_reference,
)
from tests.fake_nvml import GIB, FakeGpu, FakeMig, FakeNvml

GOLDEN = Path(__file__).parent / "fixtures" / "exporter" / "node-2000.prom.gz"
NOW = 2_000_000_000.0
_DURATION = re.compile(r"^(oomguard_\w+_duration_seconds(?:\{[^}]*\})?) .*$", re.M)


def node_exposition(series: int) -> str:
    """The node scenario polled twice on a fixed clock; timings (durations) masked."""
    from bench.exporter import node, running

    scenario = node(series, now=NOW)
    with running(scenario, clock=lambda: NOW) as poller:
        poller.render()
        for state in poller.states:
            poller.poll(state)
        text = poller.render().text.decode()
    return _DURATION.sub(r"\1 X", text)


@pytest.mark.slow  # serves the scenario's 16 vLLM pages from a subprocess
def test_node_exposition_is_what_the_code_before_issue_30_rendered() -> None:
    before = gzip.decompress(GOLDEN.read_bytes()).decode()
    now = node_exposition(2000)
    if now != before:
        diff = difflib.unified_diff(before.splitlines(), now.splitlines(), "before", "now", n=0)
        pytest.fail("the exposition changed:\n" + "\n".join(list(diff)[:40]))
    assert now.count("\noomguard_gpu_process_memory_used_bytes{") > 1000
    assert 'GPU_I_PROFILE="1g.10gb"' in now  # MIG instances, with their own series


# -- the renderer's family cache against a renderer without one --------------------------------
NAMES = (
    "oomguard_gpu_process_memory_used_bytes",  # 9 labels
    "oomguard_vllm_requests_running",  # 3 labels
    "oomguard_exporter_polls_total",  # none, a counter
)
LABELS = {"oomguard_gpu_process_memory_used_bytes": 9, "oomguard_vllm_requests_running": 3}
values = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.5, math.nan, math.inf, -math.inf, 1e300]),
    st.floats(allow_nan=True),
    st.sampled_from(["1", None, "x"]),  # added around FamilyBuilder's checks: dropped, counted
)


@st.composite
def snapshots(draw: st.DrawFn) -> list[list[Family]]:
    """Renders in a row, each a few families; later ones repeat, edit or drop earlier samples."""
    out: list[list[Family]] = []
    for _ in range(draw(st.integers(1, 6))):
        families = []
        for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=3)):
            family = Family(name)
            width = LABELS.get(name, 0)
            keys = draw(st.lists(st.sampled_from(["a", "b", "c", 'd"\n']), max_size=4))
            for key in keys:
                labels = tuple(f"{key}{i}" for i in range(width))
                family.samples.append((labels, draw(values)))  # type: ignore[arg-type]
            families.append(family)
        if out and draw(st.booleans()):
            families = out[-1]  # the same families again: the cache's common case
        out.append(families)
    return out


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_a_long_lived_renderer_renders_what_a_fresh_one_renders(
    sequence: list[list[Family]],
) -> None:
    cached = TextRenderer()
    dropped = 0
    for families in sequence:
        fresh = TextRenderer()
        assert cached.render(families) == fresh.render(families)
        dropped += sum(fresh.dropped.values())
        assert sum(cached.dropped.values()) == dropped  # a repeated bad sample counts again


def test_negative_zero_after_zero_is_not_served_from_the_cache() -> None:
    renderer = TextRenderer()
    zero, negative = (
        Family("oomguard_exporter_polls_total"),
        Family("oomguard_exporter_polls_total"),
    )
    zero.samples, negative.samples = [((), 0.0)], [((), -0.0)]
    assert renderer.render([zero]).endswith(b"oomguard_exporter_polls_total 0.0\n")
    assert renderer.render([negative]).endswith(b"oomguard_exporter_polls_total -0.0\n")


def test_a_family_with_zeros_is_reused_while_each_zero_keeps_its_sign() -> None:
    """An engine's empty queue, a counter of OOMs, a pressure level: families with zeros are
    kept too (their text reused), and rendered afresh when any zero changes its sign."""
    text, openmetrics = TextRenderer(), OpenMetricsRenderer()

    def family(*values: float) -> Family:
        f = Family("oomguard_vllm_requests_running")
        f.samples = [((f"t{i}", "m", "0"), v) for i, v in enumerate(values)]
        return f

    def body(renderer: TextRenderer | OpenMetricsRenderer, f: Family) -> str:
        return next(t for name, t in renderer.render_parts([f]) if name)

    for renderer in (text, openmetrics):
        first = body(renderer, family(0.0, 3.0, -0.0, 0.0))
        assert body(renderer, family(0.0, 3.0, -0.0, 0.0)) is first  # reused
        flipped = body(renderer, family(0.0, 3.0, 0.0, 0.0))  # the third zero's sign
        assert flipped is not first and "-0.0" not in flipped
        assert body(renderer, family(-0.0, 3.0, 0.0, 0.0)).startswith(
            'oomguard_vllm_requests_running{engine="0",model_name="m",target="t0"} -0.0\n'
            if renderer is openmetrics
            else 'oomguard_vllm_requests_running{target="t0",model_name="m",engine="0"} -0.0\n'
        )
        for f in (family(0.0, -0.0), family(-0.0, 0.0), family(-0.0, 0.0), family(0.0, 0.0)):
            assert body(renderer, f) == body(type(renderer)(), f)


# -- the NVML collector's kept series ---------------------------------------------------------
def process_series(collector: NvmlCollector) -> dict[tuple[str, ...], float]:
    out = FamilyBuilder()
    collector.families(collector.collect(), out)
    (family,) = [f for f in out.families() if f.spec.name.endswith("process_memory_used_bytes")]
    return dict(family.samples)


def test_process_series_follow_every_change_of_the_process_lists(monkeypatch) -> None:
    gpus = [
        FakeGpu("GPU-a", processes=[(101, 40 * GIB), (102, GIB)]),
        FakeGpu(
            "GPU-b",
            bus_id="00000000:2A:00.0",
            minor=1,
            mig=[FakeMig(9, "1g.10gb", 10 * GIB, 9 * GIB, GIB, processes=[(201, 9 * GIB)])],
        ),
    ]
    FakeNvml(monkeypatch, gpus)
    clock = [0.0]
    collector = NvmlCollector("node-1", clock=lambda: clock[0])
    first = process_series(collector)
    assert sorted((k[0], k[6], k[8], v) for k, v in first.items()) == [
        ("0", "", "101", 40 * GIB),
        ("0", "", "102", GIB),
        ("1", "9", "201", 9 * GIB),
    ]
    assert process_series(collector) == first  # nothing moved

    gpus[0].processes[1] = (102, 2 * GIB)  # a process grows
    gpus[1].mig[0].processes.append((202, GIB))  # one starts in the MIG instance
    second = process_series(collector)
    assert (
        second[("0", "GPU-a", "00000000:18:00.0", "nvidia0", gpus[0].name, "node-1", "", "", "102")]
        == 2 * GIB
    )
    assert sorted(k[8] for k in second) == ["101", "102", "201", "202"]

    gpus[1].mig[0] = FakeMig(3, "1g.10gb", 10 * GIB, 9 * GIB, GIB, processes=[(201, 9 * GIB)])
    clock[0] += MIG_RECHECK_SECONDS  # the MIG layout is read again (tests/test_nvml.py)
    third = process_series(collector)  # the GPU re-partitioned: instance 9 became 3
    assert sorted((k[6], k[8]) for k in third if k[0] == "1") == [("3", "201")]


# -- OpenMetrics: what Prometheus 2.x asks for first ----------------------------------------------
PROMETHEUS_2_ACCEPT = (  # Prometheus 2.42's scrapeAcceptHeader (scrape/scrape.go)
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.mark.slow  # serves the scenario's 16 vLLM pages from a subprocess
def test_node_openmetrics_is_what_prometheus_client_renders() -> None:
    from bench.exporter import node, running

    scenario = node(2000, now=NOW)
    with running(scenario, clock=lambda: NOW) as poller:
        for _ in range(3):  # a fresh render, then the caches' turn (counters move each poll)
            for state in poller.states:
                poller.poll(state)
            families = poller.render().families
            assert render_openmetrics(families) == render_openmetrics_reference(families)


finite = st.floats(allow_nan=False, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e21])


@st.composite
def valid_snapshots(draw: st.DrawFn) -> list[list[Family]]:
    """As `snapshots`, with values prometheus_client can render (it raises on the others)."""
    out: list[list[Family]] = []
    for _ in range(draw(st.integers(1, 6))):
        families = []
        for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=3)):
            family = Family(name)  # an empty family too: HELP and TYPE all the same
            width = LABELS.get(name, 0)
            for key in draw(st.lists(st.sampled_from(["a", "", 'q"\\\n']), max_size=3)):
                labels = tuple(f"{key}{i}" if key else "" for i in range(width))
                family.samples.append((labels, draw(finite | st.just(math.nan))))
            families.append(family)
        if out and draw(st.booleans()):
            families = out[-1]
        out.append(families)
    return out


@settings(max_examples=300, deadline=None)
@given(valid_snapshots())
def test_openmetrics_renderer_matches_prometheus_client(sequence: list[list[Family]]) -> None:
    renderer = OpenMetricsRenderer()  # long-lived: its caches across the sequence
    for families in sequence:
        assert renderer.render(families) == render_openmetrics_reference(families)


def test_a_prometheus_scrape_gets_gzipped_openmetrics() -> None:
    from oomguard.exporter.poller import Snapshot
    from oomguard.exporter.server import MetricsServer

    family = Family("oomguard_vllm_requests_running")
    family.samples = [(("t", "m", "0"), 3.0)]
    snapshot = Snapshot(NOW, [family], TextRenderer().render([family]))
    server = MetricsServer(("127.0.0.1", 0), lambda: snapshot, max_snapshot_age=1e12)
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request(
            "GET", "/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT, "Accept-Encoding": "gzip"}
        )
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    finally:
        server.stop()
    assert resp.getheader("Content-Type", "").startswith("application/openmetrics-text")
    assert resp.getheader("Content-Encoding") == "gzip"
    assert gzip.decompress(body) == snapshot.openmetrics
    assert snapshot.openmetrics.endswith(b"# EOF\n")
    assert b'oomguard_vllm_requests_running{engine="0",model_name="m",target="t"} 3.0' in (
        snapshot.openmetrics
    )


# -- gzip from cached pieces, made before a scrape expected to ask -------------------------------
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_is_zlibs(a: bytes, b: bytes) -> None:
    import zlib

    from oomguard.exporter.render import _crc_shift, crc32_combine

    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), _crc_shift(len(b))) == zlib.crc32(a + b)


@settings(max_examples=300, deadline=None)
@given(valid_snapshots(), st.sampled_from([1, 40, 8192]), st.sampled_from([0, 1, 40, 2048]))
def test_gzip_from_pieces_inflates_to_the_rendering(
    sequence: list[list[Family]], large: int, run: int
) -> None:
    from oomguard.exporter.render import PartsGzip, join_parts

    text, om = TextRenderer(), OpenMetricsRenderer()
    text_gzip, om_gzip = PartsGzip(), PartsGzip()
    text_gzip.LARGE = om_gzip.LARGE = large  # 1: every body spliced from the cache
    text_gzip.RUN = om_gzip.RUN = run  # 0: every run of unchanged pieces spliced
    for families in sequence:  # long-lived: caches across snapshots, never a stale piece
        for renderer, gz in ((text, text_gzip), (om, om_gzip)):
            parts = renderer.render_parts(families)
            assert gzip.decompress(gz.compress(parts)) == join_parts(parts)
    assert text.render(sequence[-1]) == TextRenderer().render(sequence[-1])


@settings(max_examples=200, deadline=None)
@given(valid_snapshots(), st.sampled_from([1, 40, 8192]))
def test_bytes_from_pieces_are_the_joined_rendering(
    sequence: list[list[Family]], large: int
) -> None:
    from oomguard.exporter.render import PartsBytes, join_parts

    text, om = TextRenderer(), OpenMetricsRenderer()
    text_bytes, om_bytes = PartsBytes(), PartsBytes()
    text_bytes.LARGE = om_bytes.LARGE = large  # 1: every body from the cache when unchanged
    for families in sequence:  # long-lived: caches across snapshots, never a stale piece
        for renderer, joined in ((text, text_bytes), (om, om_bytes)):
            parts = renderer.render_parts(families)
            assert joined.join(parts) == join_parts(parts)


def test_a_large_body_changed_in_place_is_encoded_again() -> None:
    from oomguard.exporter.render import PartsBytes

    joined = PartsBytes()
    body = "x 1\n" * 5000
    assert joined.join([(None, "# a\n"), ("x", body), (None, "# EOF\n")]) == (
        b"# a\n" + body.encode() + b"# EOF\n"
    )
    changed = body[:-2] + "2\n"  # same length, another object: never the cached bytes
    assert joined.join([("x", changed)]) == changed.encode()


def test_a_large_body_changed_in_place_is_compressed_again() -> None:
    from oomguard.exporter.render import PartsGzip

    gz = PartsGzip()
    body = "x 1\n" * 5000
    assert gzip.decompress(gz.compress([("x", body)])) == body.encode()
    changed = body[:-2] + "2\n"  # same length, another object: never the cached blocks
    assert gzip.decompress(gz.compress([("x", changed)])) == changed.encode()


def test_runs_of_unchanged_small_pieces_are_spliced_not_compressed_again() -> None:
    from oomguard.exporter.render import Parts, PartsGzip, join_parts

    def family(i: int, body: str) -> Parts:
        return [(None, f"# TYPE f{i} gauge\n"), (f"f{i}", body)]

    still = [family(i, f'f{i}{{a="x"}} {i}\n' * 100) for i in range(6)]  # 1,300 chars each

    def page(poll: int) -> Parts:  # one small family moves every poll, between still ones
        return [*still[0], *still[1], *still[2], *family(9, f"f9 {poll}\n"), *still[3], *still[4],
                *still[5], (None, "# EOF\n")]  # fmt: skip

    gz = PartsGzip()
    for poll in range(3):
        assert gzip.decompress(gz.compress(page(poll))) == join_parts(page(poll))
    blocks = {key: cached[0] for key, cached in gz._runs.items()}
    assert len(blocks) == 2  # before the moving family (its header too), and after it
    assert gzip.decompress(gz.compress(page(3))) == join_parts(page(3))
    assert {key: cached[0] for key, cached in gz._runs.items()} == blocks
    assert all(gz._runs[key][0] is b for key, b in blocks.items())  # reused, not made again
    moved = [*page(4)[:2], (page(4)[1][0], page(4)[1][1] + "f0 7\n"), *page(4)[2:]]
    assert gzip.decompress(gz.compress(moved)) == join_parts(moved)  # a still family moves


def test_forms_expected_from_the_gap_between_requests() -> None:
    from oomguard.exporter.poller import Forms

    now = [100.0]
    forms = Forms(clock=lambda: now[0])
    assert forms.expected(1.0) == []  # never asked
    forms.asked("openmetrics_gzip")
    assert forms.expected(1.0) == []  # once: no rhythm yet
    now[0] += 1.0
    forms.asked("openmetrics_gzip")
    now[0] += 0.2
    assert forms.expected(1.0) == ["openmetrics_gzip"]  # every second: next is due
    forms = Forms(clock=lambda: now[0])
    forms.asked("text_gzip")
    now[0] += 60.0
    forms.asked("text_gzip")  # once a minute
    now[0] += 1.0
    assert forms.expected(1.0) == []  # not before 59 s from now
    now[0] += 58.5
    assert forms.expected(1.0) == ["text_gzip"]
    now[0] += 200.0
    assert forms.expected(1.0) == []  # the scraper stopped


def test_plain_text_is_joined_before_publishing_only_for_a_scraper_that_asks_for_it() -> None:
    from oomguard.exporter.poller import Poller

    poller = Poller([], interval=1.0)
    snapshot = poller.render()
    assert snapshot._text is None  # nobody asked: kept in pieces
    assert snapshot.text == TextRenderer().render(snapshot.families)
    poller.render().text  # noqa: B018  a scrape every cycle
    snapshot = poller.render()
    assert snapshot._text is not None  # expected: joined before it was published
    assert snapshot.text == TextRenderer().render(snapshot.families)


@pytest.mark.slow  # serves the scenario's 16 vLLM pages from a subprocess
def test_a_scraped_snapshot_is_made_before_it_is_published_and_never_stale() -> None:
    from bench.exporter import node, running
    from oomguard.exporter.poller import Forms

    scenario = node(2000, now=NOW)
    with running(scenario, clock=lambda: NOW) as poller:
        snapshot = poller.render()
        assert snapshot._openmetrics_gzip is None  # nobody asked: not made
        poller.forms = Forms()
        previous = None
        for i in range(4):  # scraped every cycle, as by Prometheus (counters move each poll)
            for state in poller.states:
                poller.poll(state)
            snapshot = poller.render()
            if i >= 2:  # asked twice: expected, made in the render pass
                assert snapshot._openmetrics_gzip is not None
            body = gzip.decompress(snapshot.openmetrics_gzip)
            assert body == render_openmetrics_reference(snapshot.families)
            assert body != previous
            previous = body


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, 1e6, 1234567.0, 12345678.9, 85899345920.0, 1e16, 1e-7]),
        st.integers(-(2**60), 2**60).map(float),
    )
)
def test_go_float_is_prometheus_clients(value: float) -> None:
    from prometheus_client.utils import floatToGoString

    from oomguard.exporter.render import go_float

    assert go_float(value) == floatToGoString(value)
