from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from oomguard.errors import CollectorError
from oomguard.exporter.textparse import ShapedParser, parse
from tests.conftest import VLLM_FIXTURE


def test_agrees_with_prometheus_client_on_the_vllm_fixture():
    text = VLLM_FIXTURE.read_text()
    ours = parse(text)
    reference: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            reference.setdefault(s.name, []).append((s.labels, s.value))
    assert {k: [(s.labels, s.value) for s in v] for k, v in ours.samples.items()} == reference


def test_wanted_filter_keeps_only_named_samples():
    text = VLLM_FIXTURE.read_text()
    p = parse(text, ["vllm:num_preemptions_total", "vllm:request_prompt_tokens_sum"])
    assert set(p.samples) == {"vllm:num_preemptions_total", "vllm:request_prompt_tokens_sum"}
    assert len(p.get("vllm:num_preemptions_total")) == 2


def test_escapes_timestamps_and_special_values():
    text = (
        'a{x="q\\"uote",y="back\\\\slash",z="new\\nline"} 1.5e+06 1700000000000\n'
        "b 2\n"
        "c{} +Inf\n"
        'd{l="v",} -3\n'
    )
    p = parse(text)
    assert p.get("a")[0].labels == {"x": 'q"uote', "y": "back\\slash", "z": "new\nline"}
    assert p.get("a")[0].value == 1.5e6 and p.get("b")[0].value == 2
    assert p.get("c") == [] and p.dropped == {"nan": 1}
    assert p.get("d")[0].labels == {"l": "v"} and p.get("d")[0].value == -3


@pytest.mark.parametrize(
    "line",
    ['a{x="unterminated} 1', "a 1 2 3", 'a{x="1"} notanumber', 'a{9x="1"} 1', "a{x=1} 1"],
)
def test_malformed_lines_are_parse_errors(line):
    with pytest.raises(CollectorError) as exc:
        parse(line + "\n")
    assert exc.value.reason == "parse_error"


def test_typed_blocks_and_untyped_lines_are_both_found():
    text = (
        '# HELP x_total help\n# TYPE x_total counter\nx_total{a="1"} 1\nx_total{a="2"} 2\n'
        '# TYPE h histogram\nh_bucket{le="1"} 1\nh_sum 5\nh_count 2\n'
        "untyped_metric 7\n"
        "x_totally_different 9\n"
    )
    p = parse(text, ["x_total", "h_sum", "h_count", "untyped_metric"])
    assert [s.value for s in p.get("x_total")] == [1, 2]
    assert p.get("h_sum")[0].value == 5 and p.get("h_count")[0].value == 2
    assert p.get("untyped_metric")[0].value == 7
    assert "x_totally_different" not in p.samples and "h_bucket" not in p.samples


def test_filtered_parse_equals_full_parse_restricted_to_the_wanted_names():
    from oomguard.exporter.collectors.vllm import WANTED

    text = VLLM_FIXTURE.read_text()
    full = parse(text)
    filtered = parse(text, WANTED)
    assert filtered.samples == {k: v for k, v in full.samples.items() if k in WANTED}


def test_repeated_series_keep_the_first_sample_in_any_label_order():
    text = (
        '# TYPE c_total counter\nc_total{a="1",b="2"} 36\nc_total{b="2",a="1"} 36\n'
        'c_total{a="1",b="3"} 5\nc_total{a="1",b="2"} 40\n'
    )
    for p in (parse(text), parse(text, ["c_total"])):
        assert [(s.labels["b"], s.value) for s in p.get("c_total")] == [("2", 36), ("3", 5)]
        assert p.dropped == {"duplicate_series": 2}


def test_repeated_series_in_openmetrics_are_never_summed():
    adjacent = '# TYPE c counter\nc_total{a="1"} 36\nc_total{a="1"} 36\n# EOF\n'
    assert [s.value for s in parse(adjacent, openmetrics=True).get("c_total")] == [36]
    # Interleaved, prometheus_client refuses the grouping: the whole page is a parse error.
    apart = '# TYPE c counter\nc_total{a="1"} 36\nc_total{a="2"} 7\nc_total{a="1"} 36\n# EOF\n'
    with pytest.raises(CollectorError) as exc:
        parse(apart, openmetrics=True)
    assert exc.value.reason == "parse_error"


@pytest.mark.parametrize("value", ["1_000", "0x10", "1e5000x"])
def test_values_python_accepts_but_the_format_does_not_are_parse_errors(value):
    with pytest.raises(CollectorError):
        parse(f"a {value}\n")


_EXPOSITION_ALPHABET = st.sampled_from(list('ab_:{}=",# \t\n\\01.-+eEInfNaT_totalcounterTYPEHELP'))


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(_EXPOSITION_ALPHABET, max_size=120),
    openmetrics=st.booleans(),
    wanted=st.sampled_from([None, ["a"], ["a_total", "b"]]),
)
def test_any_page_parses_or_is_a_parse_error(text, openmetrics, wanted):
    try:
        parsed = parse(text, wanted, openmetrics=openmetrics)
    except CollectorError as exc:
        assert exc.reason == "parse_error"
        return
    for samples in parsed.samples.values():
        for s in samples:
            assert math.isfinite(s.value) and all(isinstance(v, str) for v in s.labels.values())
        keys = [tuple(sorted(s.labels.items())) for s in samples]
        assert len(keys) == len(set(keys))  # never the same series twice


def test_parsed_labels_are_the_callers_and_long_label_sets_parse_alike():
    # label sets are parsed once and kept by their text: each sample still gets its own dict
    long = "x" * 3000  # longer than what is kept: parsed every time, the same way
    text = f'a{{k="v"}} 1\nb{{k="v"}} 2\nc{{k="{long}"}} 3\n'
    first = parse(text)
    first.get("a")[0].labels["k"] = "changed"
    again = parse(text)
    assert again.get("a")[0].labels == {"k": "v"} == again.get("b")[0].labels
    assert again.get("a")[0].labels is not again.get("b")[0].labels
    assert again.get("c")[0].labels == {"k": long} == parse(text).get("c")[0].labels


def test_wanted_names_are_found_under_type_lines_at_a_line_start_only():
    text = (
        "# HELP m_total a help text that says # TYPE m_total counter\n"
        "# TYPE m_total counter\nm_total 4\n# TYPE other gauge\nother 1\n"
    )
    assert [s.value for s in parse(text, ["m_total"]).get("m_total")] == [4.0]
    assert parse("# TYPE g gauge\ng 2", ["g"]).get("g")[0].value == 2.0  # at offset 0


def _outcome(text: str, wanted: list[str] | None) -> object:
    try:
        p = parse(text, wanted)
    except CollectorError as exc:
        return exc.reason
    return {k: [(s.labels, s.value) for s in v] for k, v in p.samples.items()}, p.dropped


@pytest.mark.parametrize(
    "value",
    [
        "7",
        "7 1700000000000",
        "7\t",
        "\t7",
        "7 ",
        "7\xa0",
        "\x0b7",
        "7\x0c",
        "",
        "1_0",
        "nan",
        "+Inf",
        "7 8 9",
        "0x7",
        "7e",
        "-0",
    ],
)
def test_a_known_series_reads_its_value_as_the_full_grammar_does(value):
    """Known series are split at their last space and only the value read: every value, good or
    bad, must come out as the full line grammar reads it on a cold cache."""
    from oomguard.exporter import textparse

    line = f'k_total{{a="1",b="x y"}} {value}\n'
    textparse._SERIES.clear()
    cold = _outcome(line, None)
    parse('k_total{a="1",b="x y"} 1\n')  # the series is known now
    assert 'k_total{a="1",b="x y"}' in textparse._SERIES
    assert _outcome(line, None) == cold
    assert _outcome("# TYPE k_total counter\n" + line, ["k_total"]) == cold


@settings(max_examples=300, deadline=None)
@given(text=st.text(_EXPOSITION_ALPHABET, max_size=160))
def test_a_warm_series_cache_never_changes_a_parse(text):
    from oomguard.exporter import textparse

    textparse._SERIES.clear()
    cold = _outcome(text, None), _outcome(text, ["a", "a_total", "b"])
    assert (_outcome(text, None), _outcome(text, ["a", "a_total", "b"])) == cold


def test_type_blocks_at_the_edges_of_the_page():
    # the first TYPE line of a family counts; a TYPE line that ends the page has no samples
    text = "# TYPE g gauge\ng 1\n# TYPE g gauge\ng 2\n# TYPE h gauge"
    assert [s.value for s in parse(text, ["g", "h"]).get("g")] == [1.0]
    assert parse(text, ["h"]).samples == {}
    assert [s.value for s in parse("x 1\n# TYPE g gauge\ng 3\n", ["g", "x"]).get("x")] == [1.0]


# -- ShapedParser: a page of a learnt shape read by its values ----------------------------------
def _shaped_outcome(parser: ShapedParser, text: str) -> object:
    try:
        p = parser.parse(text)
    except CollectorError as exc:
        return exc.reason
    return {k: [(s.labels, s.value) for s in v] for k, v in p.samples.items()}, p.dropped


def _with_values(text: str, values: list[str]) -> str:
    """`text` with its sample lines' values (ShapedParser's split) replaced, in turn."""
    from oomguard.exporter import textparse

    pieces = textparse._VALUES.split(text)
    pieces[2::3] = [values[i % len(values)] for i in range(len(pieces) // 3)]
    return "".join(pieces)


_VALUE = st.sampled_from(["1", "2.5", "-3", "0", "nan", "+Inf", "1_0", "x", "7e", "1e3", "NaN"])


_LINE = st.sampled_from(
    [
        "# TYPE a gauge",
        "# TYPE a_total counter",
        "# HELP a some help",
        "a",
        'a{x="1"}',
        'a{x="2",y="z z"}',
        "a_total",
        'a_total{x="1"}',
        "b",
        "ab",
        "a 5",  # with the value, a timestamp follows
        'a{x="1',
        "",
        "#",
    ]
)
_PAGE = st.lists(st.tuples(_LINE, st.booleans()), max_size=10).map(
    lambda lines: "".join(f"{ln} 1\n" if valued else f"{ln}\n" for ln, valued in lines)
)


@settings(max_examples=400, deadline=None)
@given(
    text=st.one_of(_PAGE, st.text(_EXPOSITION_ALPHABET, max_size=160)),
    polls=st.lists(st.lists(_VALUE, min_size=1, max_size=6), min_size=1, max_size=5),
    wanted=st.sampled_from([["a"], ["a_total", "b"], ["a", "a_total", "b", "ab"]]),
)
def test_a_shaped_parse_is_parse_on_every_page(text, polls, wanted):
    # the same shape poll after poll with other values (good, bad, NaN), then the page as it
    # came: each page read as parse() reads it, hit, learnt or not
    parser = ShapedParser(wanted)
    for values in [*polls, *polls]:
        page = _with_values(text, values)
        assert _shaped_outcome(parser, page) == _outcome(page, wanted)
    assert _shaped_outcome(parser, text) == _outcome(text, wanted)


@pytest.mark.parametrize(
    "value", ["1", "2.5", "-3", "nan", "NaN", "+Inf", "-Inf", "1_0", "x", "7e", "1e3", "0x7"]
)
def test_a_learnt_shape_reads_each_value_as_parse_does(value):
    page = '# TYPE a gauge\na{x="1"} 1\na{x="2"} 2\n# TYPE b gauge\nb 3\n'
    parser = ShapedParser(["a", "b"])
    for _ in range(2):
        parser.parse(page)
    assert parser._plan is not None
    for at in range(3):
        values = ["4", "5", "6"]
        values[at] = value
        moved = _with_values(page, values)
        assert _shaped_outcome(parser, moved) == _outcome(moved, ["a", "b"])


def _moving(text: str, poll: int) -> str:
    """The fixture with every counter and histogram sum/count grown by `poll`, as a serving
    engine's page moves between scrapes."""
    import re

    return re.sub(
        r"(?m)^(vllm:\S+?(?:_total|_sum|_count)(?:\{[^}]*\})?) (\S+)$",
        lambda m: f"{m.group(1)} {float(m.group(2)) + poll!r}",
        text,
    )


def test_a_vllm_page_of_a_learnt_shape_is_read_by_its_values(monkeypatch):
    from oomguard.exporter import textparse
    from oomguard.exporter.collectors.vllm import WANTED

    text = VLLM_FIXTURE.read_text()
    parser = ShapedParser(WANTED)
    full = []
    real_parse = textparse.parse
    monkeypatch.setattr(textparse, "parse", lambda *a, **k: full.append(1) or real_parse(*a, **k))
    for poll in range(6):
        page = _moving(text, poll)
        assert _shaped_outcome(parser, page) == _outcome(page, list(WANTED))
    # the first page, the second and its learning (two indexed parses); then its values alone
    assert len(full) == 4
    # a bad value on a page of this shape is parse()'s error; a NaN is dropped as parse() drops it
    lines = text.split("\n")
    at = next(i for i, ln in enumerate(lines) if ln.startswith("vllm:num_requests_running{"))
    for value, expected in (("NaN", {"nan": 1}), ("1_0", "parse_error")):
        bad = "\n".join([*lines[:at], lines[at].rpartition(" ")[0] + " " + value, *lines[at + 1 :]])
        assert _shaped_outcome(parser, bad) == _outcome(bad, list(WANTED))
        outcome = _outcome(bad, list(WANTED))
        assert outcome == expected or outcome[1] == expected


@pytest.mark.parametrize(
    ("page", "planned"),
    [
        ('# TYPE a gauge\na 1 1700000000000\na{x="1"} 2\n', False),  # a timestamp: in the shape
        ("# TYPE a gauge\na 1\na 2\n", False),  # a repeated series (a NaN first keeps the second)
        ('# TYPE a gauge\na 1\na{x="1"} NaN\n', True),  # a NaN where the shape was learnt
    ],
)
def test_a_shape_is_planned_only_where_the_plan_is_exact(page, planned):
    parser = ShapedParser(["a"])
    for _ in range(2):
        assert _shaped_outcome(parser, page) == _outcome(page, ["a"])
    assert (parser._plan is not None) == planned
    for moved in (page.replace("1", "5"), page.replace("NaN", "3")):
        assert _shaped_outcome(parser, moved) == _outcome(moved, ["a"])


def _split_shaped(parser: ShapedParser, text: str) -> object:
    """What ShapedParser.shaped answered when it split each page by _VALUES (its walk must
    answer the same): the learnt plan and the page's values when the page is of the shape."""
    from oomguard.exporter import textparse

    state = parser._state
    if state is None or state[2] is None:
        return None
    pieces = textparse._VALUES.split(text)
    if pieces[0::3] != state[0] or pieces[1::3] != state[1]:
        return None
    return state[2], pieces[2::3]


_ODD_VALUE = st.sampled_from(["a 1", "1\n1"]) | st.sampled_from(
    ["1", "2.5", "", " ", "1 2", "1\n", "\n", "1\r", "\u20031", "1\x1c", "\t1", "# x"]
)


@settings(max_examples=400, deadline=None)
@given(
    text=st.one_of(_PAGE, st.text(_EXPOSITION_ALPHABET, max_size=160)),
    polls=st.lists(st.lists(_ODD_VALUE, min_size=1, max_size=6), min_size=1, max_size=5),
    edit=st.sampled_from(["", "\n", " ", "x", "# c\n"]),
)
def test_shaped_walks_a_page_as_the_split_reads_it(text, polls, edit):
    # a learnt shape, then pages with other values (with spaces, line breaks, nothing) and
    # pages edited at either end: the walk finds the shape and values where the split does
    parser = ShapedParser(["a", "a_total", "b", "ab"])
    for values in (["1"], ["2"]):
        try:
            parser.parse(_with_values(text, values))
        except CollectorError:
            return
    for values in polls:
        page = _with_values(text, values)
        for p in (page, page + edit, edit + page):
            assert parser.shaped(p) == _split_shaped(parser, p)
