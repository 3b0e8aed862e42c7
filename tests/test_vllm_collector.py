from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.vllm import WANTED, VllmCollector
from oomguard.exporter.render import FamilyBuilder
from oomguard.exporter.textparse import _VALUES as _VALUES_SPLIT
from oomguard.exporter.textparse import parse
from tests.conftest import VLLM_FIXTURE

M = 'model_name="m"'


def test_fixture_engines_and_numbers(local_server):
    server = local_server(VLLM_FIXTURE.read_text())
    reading = VllmCollector("llama", server.url).collect()
    e0, e1 = reading.engines
    assert (e0.engine, e1.engine) == ("0", "1")
    assert e0.model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert (e0.kv_usage, e0.running, e0.waiting, e0.preemptions) == (0.9731, 61, 33, 36)
    assert e0.finished == {"stop": 2124, "length": 349, "abort": 27, "error": 0, "repetition": 0}
    assert e0.finished_total == 2500
    assert (e0.kv_blocks, e0.block_size, e0.kv_capacity_tokens) == (54912, 16, 878592)
    assert e0.gpu_memory_utilization == 0.92
    assert (e0.prompt_sum, e0.prompt_count) == (4921271, 2500)


def test_families_use_the_target_label(local_server):
    server = local_server(VLLM_FIXTURE.read_text())
    collector = VllmCollector("llama", server.url)
    out = FamilyBuilder()
    collector.families(collector.collect(), out)
    fams = {f.spec.name: f for f in out.families()}
    labels, value = fams["oomguard_vllm_kv_cache_usage_ratio"].samples[0]
    assert labels == ("llama", "meta-llama/Llama-3.1-8B-Instruct", "0") and value == 0.9731
    assert len(fams["oomguard_vllm_requests_finished_total"].samples) == 10


def reading_of(text: str):
    return VllmCollector.reading_from(parse(text, WANTED))


def test_legacy_gpu_cache_usage_is_used_when_kv_cache_usage_is_absent():
    reading = reading_of(f'vllm:gpu_cache_usage_perc{{{M},engine="0"}} 0.5\n')
    assert reading.engines[0].kv_usage == 0.5
    both = reading_of(
        f'vllm:gpu_cache_usage_perc{{{M},engine="0"}} 0.5\n'
        f'vllm:kv_cache_usage_perc{{{M},engine="0"}} 0.25\n'
    )
    assert both.engines[0].kv_usage == 0.25


def test_multiprocess_pid_series_sum_counters_and_take_max_of_gauges():
    text = f"""# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{M},engine="0",pid="1"}} 3
vllm:num_preemptions_total{{{M},engine="0",pid="2"}} 4
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M},engine="0",pid="1"}} 7
vllm:num_requests_running{{{M},engine="0",pid="2"}} 5
"""
    (e,) = reading_of(text).engines
    assert e.preemptions == 7 and e.running == 7


def test_nan_values_are_dropped_and_counted():
    reading = reading_of(
        f'vllm:kv_cache_usage_perc{{{M},engine="0"}} NaN\n'
        f'vllm:num_requests_running{{{M},engine="0"}} 2\n'
    )
    assert reading.engines[0].kv_usage is None and reading.invalid["nan"] == 1


def test_out_of_range_kv_usage_is_dropped():
    reading = reading_of(f'vllm:kv_cache_usage_perc{{{M},engine="0"}} 7\n')
    assert reading.engines[0].kv_usage is None and reading.invalid["out_of_range"] == 1


def test_cache_config_none_values_are_missing():
    reading = reading_of(
        'vllm:cache_config_info{engine="0",num_gpu_blocks="None",block_size="16",'
        'kv_cache_size_tokens="None",gpu_memory_utilization="garbage"} 1\n'
    )
    (e,) = reading.engines
    assert e.kv_blocks is None and e.block_size == 16 and e.kv_capacity_tokens is None
    assert e.gpu_memory_utilization is None


def test_openmetrics_response_is_parsed(local_server):
    text = f"""# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{{M},engine="0"}} 9.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{M},engine="0"}} 0.5
# EOF
"""
    server = local_server()
    server.serve_text(text, "application/openmetrics-text; version=1.0.0; charset=utf-8")
    (e,) = VllmCollector("t", server.url).collect().engines
    assert e.preemptions == 9 and e.kv_usage == 0.5


@pytest.mark.parametrize(
    ("body", "ctype", "reason"),
    [
        ('vllm:num_requests_running{engine="0" 1\n', "text/plain", "parse_error"),
        ("# HELP x y\nnot a metric line at all {{{\n", "text/plain", "no_data"),
        ("", "text/plain", "no_data"),
        # truncated OpenMetrics (no # EOF) must not be served as a complete page
        (
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\n',
            "application/openmetrics-text",
            "parse_error",
        ),
        ("\udcff", "text/plain", "parse_error"),
    ],
)
def test_garbage_is_a_collector_error(local_server, body, ctype, reason):
    server = local_server()
    raw = body.encode("utf-8", "surrogateescape")
    server.responder = lambda _h: (200, raw, ctype)
    with pytest.raises(CollectorError) as exc:
        VllmCollector("t", server.url).collect()
    assert exc.value.reason == reason


def test_huge_response_is_refused(local_server):
    server = local_server(VLLM_FIXTURE.read_text() * 3)
    with pytest.raises(CollectorError) as exc:
        VllmCollector("t", server.url, max_bytes=100_000).collect()
    assert exc.value.reason == "too_large"
    assert VllmCollector("t", server.url, max_bytes=1_000_000).collect().engines


def test_http_error_status(local_server):
    server = local_server()
    server.responder = lambda _h: (500, b"boom", "text/plain")
    with pytest.raises(CollectorError) as exc:
        VllmCollector("t", server.url).collect()
    assert exc.value.reason == "http_status"


def test_unreachable_engine():
    from tests.conftest import free_port

    with pytest.raises(CollectorError) as exc:
        VllmCollector("t", f"http://127.0.0.1:{free_port()}/metrics", timeout=1).collect()
    assert exc.value.reason == "unreachable"


def test_slow_engine_times_out(local_server):
    server = local_server()

    def slow(_h):
        time.sleep(1.5)
        return 200, VLLM_FIXTURE.read_bytes(), "text/plain"

    server.responder = slow
    t0 = time.monotonic()
    with pytest.raises(CollectorError) as exc:
        VllmCollector("t", server.url, timeout=0.3).collect()
    assert exc.value.reason == "timeout"
    assert time.monotonic() - t0 < 1.4


def test_a_repeated_series_is_dropped_not_summed():
    # Before: the fixture's preemption counter, repeated once (a broken page or a proxy that
    # concatenates), read 72 instead of 36.
    lines = VLLM_FIXTURE.read_text().splitlines(keepends=True)
    i = next(n for n, ln in enumerate(lines) if ln.startswith("vllm:num_preemptions_total{"))
    text = "".join([*lines[: i + 1], lines[i], *lines[i + 1 :]])
    reading = reading_of(text)
    assert reading.engines[0].preemptions == 36
    assert reading.invalid["duplicate_series"] == 1


CACHE = 'num_gpu_blocks="-1",block_size="16",gpu_memory_utilization="1.5",kv_cache_size_tokens="x"'


def test_negative_counters_counts_and_cache_figures_are_refused():
    text = f"""# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{M},engine="0"}} -5
# TYPE vllm:request_success_total counter
vllm:request_success_total{{{M},engine="0",finished_reason="stop"}} -1
vllm:request_success_total{{{M},engine="0",finished_reason="length"}} 4
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M},engine="0"}} -3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{M},engine="0"}} 2
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{engine="0",{CACHE}}} 1
"""
    reading = reading_of(text)
    (e,) = reading.engines
    assert e.preemptions is None and e.running is None and e.waiting == 2
    assert e.finished == {"length": 4}
    assert (e.kv_blocks, e.block_size, e.gpu_memory_utilization) == (None, 16, None)
    assert e.kv_capacity_tokens is None
    assert reading.invalid == {"negative": 3, "out_of_range": 2, "not_a_number": 1}


# -- a page of a learnt shape, read by its recipe ------------------------------------------------
_SHAPES = [
    VLLM_FIXTURE.read_text(),
    # the legacy gauge beside the current one, per engine; pid series; a cache config whose
    # engine has no other series; invalid cache figures
    f"""# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{M},engine="0"}} 1
vllm:gpu_cache_usage_perc{{{M},engine="1"}} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{M},engine="1"}} 1
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{M},engine="0",pid="1"}} 1
vllm:num_preemptions_total{{{M},engine="0",pid="2"}} 1
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M},engine="0",pid="1"}} 1
vllm:num_requests_running{{{M},engine="0",pid="2"}} 1
# TYPE vllm:request_success_total counter
vllm:request_success_total{{{M},engine="0",finished_reason="stop"}} 1
vllm:request_success_total{{{M},engine="0",finished_reason="stop",pid="2"}} 1
vllm:request_success_total{{{M},engine="1",finished_reason="length"}} 1
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{engine="0",{CACHE}}} 1
vllm:cache_config_info{{engine="2",num_gpu_blocks="8",block_size="16"}} 1
""",
]
_VALUES = st.sampled_from(
    ["0", "-0.0", "0.25", "1", "1.5", "7", "2.5e9", "-3", "NaN", "+Inf", "-Inf", "1_0", "x"]
)


def _outcome_of(read) -> object:
    try:
        return read()
    except CollectorError as exc:
        return exc.reason


@settings(max_examples=200, deadline=None)
@given(
    shape=st.sampled_from(range(len(_SHAPES))),
    polls=st.lists(st.lists(_VALUES, min_size=1, max_size=40), min_size=1, max_size=6),
)
def test_a_page_read_by_its_shape_is_read_as_sample_by_sample(shape, polls):
    # poll after poll the same shape with other values (healthy, negative, NaN, not numbers):
    # every reading is reading_from's of the parsed page, whether its recipe read it or not
    collector = VllmCollector("t", "http://127.0.0.1:1/metrics")
    pieces = _VALUES_SPLIT.split(_SHAPES[shape])
    count = len(pieces) // 3
    for values in [["1"], ["2"], *polls, *polls]:
        pieces[2::3] = [values[i % len(values)] for i in range(count)]
        page = "".join(pieces)
        expected = _outcome_of(lambda page=page: reading_of(page))
        assert _outcome_of(lambda page=page: collector.read(page)) == expected


def test_a_steady_page_is_read_by_its_recipe_not_sample_by_sample(monkeypatch):
    collector = VllmCollector("t", "http://127.0.0.1:1/metrics")
    calls = []
    real = VllmCollector.reading_from
    monkeypatch.setattr(
        VllmCollector, "reading_from", staticmethod(lambda p: calls.append(1) or real(p))
    )
    text = VLLM_FIXTURE.read_text()
    for poll in range(5):
        page = text.replace(" 2124", f" {2124 + poll}")  # a counter moves
        reading = collector.read(page)
        assert reading.engines[0].finished["stop"] == 2124 + poll
    assert len(calls) == 2  # the first page and the one its shape was learnt on
    # a page of the shape that the recipe does not read (a NaN) is read sample by sample
    nan = text.replace("vllm:num_requests_running{", "vllm:num_requests_running{", 1)
    at = nan.index(" ", nan.index("vllm:num_requests_running{"))
    nan = nan[:at] + " NaN" + nan[nan.index("\n", at) :]
    assert collector.read(nan).invalid["nan"] == 1 and len(calls) == 3
