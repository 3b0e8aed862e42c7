from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families

from oomguard.exporter.render import Family, TextRenderer, render_openmetrics


def fam(name: str, *samples) -> Family:
    f = Family(name)
    for labels, v in samples:
        f.add(labels, v)
    return f


def test_text_output_parses_back_exactly_with_escapes_and_empty_labels():
    gpu = ("0", 'GPU-"quoted"', "bus\\x", "nvidia0", "H100\nnew", "node", "", "")
    families = [
        fam("oomguard_gpu_memory_free_bytes", (gpu, 1.5e10)),
        fam("oomguard_exporter_polls_total", ((), 7)),
    ]
    text = TextRenderer().render(families).decode()
    parsed = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    s = parsed["oomguard_gpu_memory_free_bytes"]
    assert s.value == 1.5e10
    assert s.labels["UUID"] == 'GPU-"quoted"' and s.labels["modelName"] == "H100\nnew"
    assert "GPU_I_ID" not in s.labels  # empty label = absent label
    assert parsed["oomguard_exporter_polls_total"].value == 7
    assert "# TYPE oomguard_exporter_polls_total counter" in text


def test_cached_prefixes_stay_correct_when_values_change_and_cache_is_bounded():
    r = TextRenderer(max_cached_series=2)
    for i in range(5):
        f = fam("oomguard_vllm_up", ((f"t{i}",), i), (("fixed",), i))
        text = r.render([f]).decode()
        assert f'oomguard_vllm_up{{target="t{i}"}} {float(i)}' in text
        assert len(r._prefixes) <= 2


def test_empty_families_are_not_rendered():
    assert TextRenderer().render([Family("oomguard_vllm_up")]) == b""


def test_openmetrics_rendering_parses():
    families = [fam("oomguard_exporter_polls_total", ((), 3)), fam("oomguard_vllm_up", (("a",), 1))]
    parsed = {
        s.name: s.value for f in om_parse(render_openmetrics(families).decode()) for s in f.samples
    }
    assert parsed == {"oomguard_exporter_polls_total": 3, "oomguard_vllm_up": 1}


def test_wrong_label_count_is_refused():
    import pytest

    with pytest.raises(ValueError, match="expected labels"):
        Family("oomguard_vllm_up").add(("a", "b"), 1)


def test_values_round_trip_including_special_ones():
    from oomguard.exporter.render import format_value

    for v in (0.0, 1.0, 61.0, 0.9731, 1.5e10, 8.5520809984e10, 1e-9, -3.25, 2.0**63):
        assert float(format_value(v)) == v
    assert format_value(float("nan")) == "NaN"
    assert format_value(float("inf")) == "+Inf" and format_value(float("-inf")) == "-Inf"


def test_builder_drops_and_counts_values_that_cannot_be_rendered():
    from collections import Counter

    from oomguard.exporter.render import FamilyBuilder

    lifetime: Counter[str] = Counter()
    for _ in range(2):  # a long-lived counter accumulates across snapshots
        out = FamilyBuilder(lifetime)
        out.add("oomguard_vllm_up", ("ok",), 1)
        out.add("oomguard_vllm_up", ("huge",), 10**400)  # OverflowError in float()
        out.add("oomguard_vllm_up", ("text",), "12abc")  # ValueError
        out.add("oomguard_vllm_up", ("obj",), object())  # TypeError
        out.add("oomguard_vllm_up", ("a", "b"), 1)  # wrong label count
        out.add("oomguard_vllm_up", ("none",), None)  # absent, not a drop
        text = TextRenderer().render(out.families()).decode()
        assert text.count("oomguard_vllm_up{") == 1 and 'target="ok"' in text
    assert lifetime == {"unrenderable": 8}


def test_renderer_drops_only_the_bad_sample_of_a_family():
    f = fam("oomguard_vllm_up", (("a",), 1), (("c",), 3))
    f.samples.insert(1, ((7,), 2.0))  # a label that is not a string, added around the builder
    r = TextRenderer()
    text = r.render([f, fam("oomguard_exporter_polls_total", ((), 5))]).decode()
    parsed = {
        (s.name, s.labels.get("target")): s.value
        for fm in text_string_to_metric_families(text)
        for s in fm.samples
    }
    assert parsed == {
        ("oomguard_vllm_up", "a"): 1,
        ("oomguard_vllm_up", "c"): 3,
        ("oomguard_exporter_polls_total", None): 5,
    }
    assert r.dropped == {"unrenderable": 1}
    om = render_openmetrics([f]).decode()  # the OpenMetrics path skips it too
    assert [s.labels["target"] for fm in om_parse(om) for s in fm.samples] == ["a", "c"]


@settings(max_examples=200, deadline=None)
@given(
    samples=st.lists(
        st.tuples(
            st.text(max_size=20),
            st.one_of(
                st.none(),
                st.integers(min_value=-(10**400), max_value=10**400),
                st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=5),
            ),
        ),
        max_size=20,
    )
)
def test_any_value_and_label_text_render_to_a_parseable_page(samples):
    from oomguard.exporter.render import FamilyBuilder

    out = FamilyBuilder()
    for target, value in samples:
        out.add("oomguard_vllm_up", (target,), value)
    text = TextRenderer().render(out.families()).decode()  # never raises
    parsed = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert len(parsed) + sum(out.dropped.values()) == sum(v is not None for _, v in samples)


def test_a_drop_is_logged_once_not_on_every_poll(caplog, monkeypatch):
    from oomguard.exporter import render

    monkeypatch.setattr(render, "_warned", set())
    for _ in range(3):  # three polls, a fresh builder each
        render.FamilyBuilder().add("oomguard_exporter_polls_total", (), 10**400)
    warnings = [r for r in caplog.records if "cannot be rendered" in r.getMessage()]
    assert len(warnings) == 1
