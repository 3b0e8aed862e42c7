"""Routing an alert through the fleet's selector index gives what a scan of every target's
selector gives (intake.select), in allowlist order, ambiguity and all."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.remediator.fleet import Fleet
from oomguard.remediator.intake import select
from oomguard.remediator.targets import TargetConfig
from oomguard.remediator.webhook import Alert

KEYS = ["target", "instance", "engine", "pod"]  # "target" also names t0, t1, ... by default
VALUES = ["", "a", "t0", "t1", "node-1:9840"]
selector_st = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=3)
labels_st = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(selector_st, min_size=1, max_size=8), labels_st)
def test_the_index_selects_exactly_what_a_scan_selects(selectors, labels):
    targets = [
        TargetConfig(name=f"t{i}", url=f"http://127.0.0.1:1/t{i}", match=sel)
        for i, sel in enumerate(selectors)
    ]
    alert = Alert("fp", "firing", labels, datetime(2026, 12, 1, tzinfo=UTC), None)
    assert Fleet(targets).select(alert.labels) == select(alert, targets)


def test_ten_thousand_targets_route_by_lookup():
    targets = [TargetConfig(name=f"e{i}", url=f"http://127.0.0.1:1/e{i}") for i in range(10_000)]
    fleet = Fleet(targets)
    assert fleet.select({"target": "e9999", "instance": "x"}) == ["e9999"]
    assert fleet.select({"instance": "x"}) == []
    fleet.replace(targets[:10])  # the index follows the allowlist
    assert fleet.select({"target": "e9999"}) == []
