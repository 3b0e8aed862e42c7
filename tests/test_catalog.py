from __future__ import annotations

import re

from oomguard.catalog import CATALOG, exported_names, spec

NAME = re.compile(r"^oomguard_[a-z0-9_]+$")


def test_names_follow_prometheus_conventions():
    for s in CATALOG.values():
        assert NAME.match(s.name), s.name
        assert (s.type == "counter") == s.name.endswith("_total"), s.name
        if s.unit == "bytes":
            assert s.name.endswith("_bytes"), s.name
        if s.unit == "seconds":
            assert s.name.endswith("_seconds"), s.name
        if s.unit == "ratio":
            assert s.name.endswith("_ratio"), s.name
        assert s.help.endswith("."), s.name
        assert len(set(s.labels)) == len(s.labels), s.name


def test_lookup_names_unknown_metrics():
    import pytest

    assert spec("oomguard_vllm_up").type == "gauge"
    with pytest.raises(KeyError, match="not in the oomguard catalog"):
        spec("oomguard_nope")


def test_remediator_names_are_reserved_apart_from_the_exporter():
    rem = exported_names("remediator")
    assert "oomguard_remediator_actions_total" in rem
    assert not rem & exported_names("exporter")
