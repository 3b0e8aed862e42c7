"""Webhook parsing and the alert book: strict where it matters, order- and replay-safe."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.remediator.alertbook import AlertBook
from oomguard.remediator.webhook import MAX_BODY_BYTES, Alert, PayloadError, parse

T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)


def alert_json(fp="abc", status="firing", starts="2026-11-29T03:00:00Z", **labels) -> dict:
    return {
        "status": status,
        "labels": {"alertname": "OomguardMemoryCritical", "target": "llama", **labels},
        "annotations": {"summary": "x."},
        "startsAt": starts,
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-29T03:05:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": fp,
    }


def body(*alerts, **extra) -> bytes:
    return json.dumps(
        {
            "receiver": "remediator",
            "status": "firing",
            "alerts": list(alerts),
            "groupLabels": {},
            "commonLabels": {},
            "commonAnnotations": {},
            "externalURL": "http://am",
            "version": "4",
            "groupKey": "{}:{}",
            "truncatedAlerts": 0,
            **extra,
        }
    ).encode()


def test_parses_a_version_4_payload_and_reads_each_alerts_own_status():
    hook = parse(body(alert_json("a"), alert_json("b", status="resolved"), futureField=[1]))
    assert [(a.fingerprint, a.status) for a in hook.alerts] == [("a", "firing"), ("b", "resolved")]
    assert hook.alerts[0].ends_at is None and hook.alerts[1].ends_at is not None
    assert hook.alerts[0].starts_at == T0 and hook.alerts[0].name == "OomguardMemoryCritical"
    assert hook.alerts[0].dedup_key == (hook.alerts[0].key, T0, "firing")
    assert hook.alerts[0].key.startswith("a/")
    assert hook.receiver == "remediator"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (body(version="3"), "version"),
        (json.dumps({"version": "4"}).encode(), "alerts must be a list"),
        (body({**alert_json(), "status": "pending"}), "status must be firing or resolved"),
        (body({**alert_json(), "labels": {"target": "x"}}), "no alertname"),
        (body({**alert_json(), "labels": {"alertname": "A", "n": 1}}), "string values"),
        (body({**alert_json(), "fingerprint": ""}), "fingerprint"),
        (body({**alert_json(), "startsAt": "yesterday"}), "RFC 3339"),
        (body({**alert_json(), "startsAt": "0001-01-01T00:00:00Z"}), "startsAt is not set"),
        (body("not an object"), "must be an object"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_malformed_payloads_are_refused_with_the_field_named(raw, message):
    with pytest.raises(PayloadError, match=message):
        parse(raw)


def test_oversized_bodies_are_refused():
    with pytest.raises(PayloadError, match="exceeds"):
        parse(b" " * (MAX_BODY_BYTES + 1))


def mk(fp: str, status: str, minutes: int) -> Alert:
    return Alert(fp, status, {"alertname": "A"}, T0 + timedelta(minutes=minutes), None)


def test_duplicates_change_nothing_the_second_time():
    book = AlertBook()
    assert book.apply(mk("a", "firing", 0)) is True
    assert book.apply(mk("a", "firing", 0)) is False
    assert book.apply(mk("a", "resolved", 0)) is True
    assert book.apply(mk("a", "resolved", 0)) is False
    assert book.firing() == []


def test_late_resolution_of_an_old_episode_does_not_clear_a_new_one():
    book = AlertBook()
    book.apply(mk("a", "firing", 10))  # second episode
    assert book.apply(mk("a", "resolved", 0)) is False  # first episode's late resolution
    assert [a.starts_at for a in book.firing()] == [T0 + timedelta(minutes=10)]


def test_replayed_firing_of_an_ended_episode_stays_ended():
    book = AlertBook()
    book.apply(mk("a", "resolved", 5))
    assert book.apply(mk("a", "firing", 5)) is False
    assert book.apply(mk("a", "firing", 3)) is False
    assert book.apply(mk("a", "firing", 6)) is True  # a new episode fires


def test_prune_forgets_old_resolutions_only():
    book = AlertBook()
    book.apply(mk("old", "resolved", 0))
    book.apply(mk("new", "resolved", 60 * 30))
    assert book.prune(T0 + timedelta(hours=30)) == 1


def test_prune_keeps_at_most_the_newest_resolutions():
    book = AlertBook()
    for i in range(10):
        book.apply(mk(f"fp{i}", "resolved", i))
    assert book.prune(T0, most=4) == 6
    book.apply(mk("fp9", "firing", 9))  # a late copy of a kept resolution stays out
    book.apply(mk("fp0", "firing", 0))  # forgotten: it may come back (the resync heals it)
    assert [a.fingerprint for a in book.firing()] == ["fp0"]


events = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]), st.sampled_from(["firing", "resolved"]), st.integers(0, 5)
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(events, st.randoms(use_true_random=False))
def test_any_order_and_repetition_gives_the_same_firing_set(evs, rnd: random.Random):
    """Level-triggered: the result depends on the set of deliveries, not on their order."""
    alerts = [mk(fp, status, m) for fp, status, m in evs]
    expected = set()
    for fp in {a.fingerprint for a in alerts}:
        fired = [a.starts_at for a in alerts if a.fingerprint == fp and a.status == "firing"]
        ended = [a.starts_at for a in alerts if a.fingerprint == fp and a.status == "resolved"]
        if fired and (not ended or max(fired) > max(ended)):
            expected.add((fp, max(fired)))
    shuffled = alerts + rnd.sample(alerts, len(alerts))  # reordered, and everything twice
    rnd.shuffle(shuffled)
    book = AlertBook()
    book.apply_all(shuffled)
    assert {(a.fingerprint, a.starts_at) for a in book.firing()} == expected
