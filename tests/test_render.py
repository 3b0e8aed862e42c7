from __future__ import annotations

from oomguard.exporter.render import Family, TextRenderer, render_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families


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
