"""Poison-proof intake: each payload defect found against the running remediator, reproduced
here first, then refused at the boundary (a 4xx naming the field) or handled; nothing from a
payload raises inside a pass, and a pass that fails anyway is visible."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from oomguard.remediator.alertbook import AlertBook
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.controller import Controller
from oomguard.remediator.main import Remediator
from oomguard.remediator.metrics import RemediatorMetrics
from oomguard.remediator.server import create_app
from oomguard.remediator.webhook import Alert, BodyTooLarge, PayloadError, parse
from tests.remediator_helpers import T0, Engines, alert, config, payload


def make(tmp_path, engines: Engines, **overrides) -> Controller:
    cfg = config(tmp_path, *engines.engines, **overrides)
    return Controller(cfg, engines, AuditLog(cfg.audit_log), RemediatorMetrics())


def raw(*alerts: dict, **fields) -> bytes:
    data = json.loads(payload(*alerts))
    data.update(fields)
    return json.dumps(data).encode()


def force_prune(c: Controller) -> None:
    c.intake.pruned_at = time.monotonic() - 3600  # the next pass prunes the book


def test_a_naive_starts_at_is_refused_and_can_never_break_the_passes(tmp_path):
    # found: accepted, then ~60 s later the pruning raised TypeError in every pass, forever
    naive = alert("OomguardMemoryPressure", "a", status="resolved")
    naive["startsAt"] = "2026-11-29T03:00:00"
    with pytest.raises(PayloadError, match=r"alerts\[0\]\.startsAt has no time zone"):
        parse(payload(naive))
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    c.receive(parse(payload(alert("OomguardMemoryPressure", "a", status="resolved"))))
    force_prune(c)
    c.reconcile()
    assert c.failed_passes == 0
    c.receive(parse(payload(alert("OomguardMemoryCritical", "a", start=600))))
    c.reconcile()
    assert engines.engines["a"].draining  # a later drain alert is still executed


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"version": "4", "alerts": [], "x": ' + b"9" * 5000 + b"}", "not JSON"),
    ],
)
def test_deep_nesting_and_huge_integers_are_a_400_not_a_500(body, message):
    with pytest.raises(PayloadError, match=message):
        parse(body)


def test_a_lone_surrogate_is_refused_before_anything_is_applied(tmp_path):
    bad = alert("OomguardMemoryPressure", "a", fingerprint="\ud800")
    body = json.dumps(json.loads(payload(bad))).encode()  # JSON escapes it: \ud800
    with pytest.raises(PayloadError, match=r"alerts\[0\]\.fingerprint is not valid Unicode"):
        parse(body)
    labels = alert("OomguardMemoryPressure", "a", note="\udfff")
    with pytest.raises(PayloadError, match=r"labels\.note is not valid Unicode"):
        parse(json.dumps(json.loads(payload(labels))).encode())


def test_a_reused_fingerprint_never_moves_the_first_alert_and_resync_heals(tmp_path, local_server):
    # found: a phantom alert left on the first target (stepped down to cap 1), negative
    # counters on the second, and a resync that did not heal it
    engines = Engines.of("a", "b", "c")
    server = local_server("[]")
    c = make(tmp_path, engines, alertmanager={"url": server.url.removesuffix("/metrics")})
    c.receive(parse(payload(alert("OomguardMemoryPressure", "a", fingerprint="f1"))))
    c.reconcile()
    assert engines.engines["a"].cap == 80
    reused = alert("OomguardMemoryPressure", "b", fingerprint="f1")
    c.receive(parse(payload(reused)))
    c.reconcile()
    assert engines.engines["b"].cap == 80
    c.receive(parse(payload(alert("OomguardMemoryPressure", "b", "resolved", fingerprint="f1"))))
    routed = c.firing_by_target()
    assert [a.labels["target"] for a in routed["a"]] == ["a"] and routed["b"] == []
    # f1 fires again for b, and Alertmanager lists f1 only with b's labels: a's copy is gone
    again = alert("OomguardMemoryPressure", "b", start=100, fingerprint="f1")
    c.receive(parse(payload(again)))
    listed = json.loads(payload(again))["alerts"]
    for item in listed:
        item["status"] = {"state": "active"}
    server.serve_text(json.dumps(listed))
    assert c.resync()
    routed = c.firing_by_target()
    assert routed["a"] == [] and [a.labels["target"] for a in routed["b"]] == ["b"]
    c.close()


def test_a_start_time_far_in_the_future_is_refused_and_near_ones_age_out():
    future = alert("OomguardMemoryPressure", "a")
    future["startsAt"] = (datetime.now(UTC) + timedelta(days=400)).isoformat()
    with pytest.raises(PayloadError, match=r"startsAt is more than 1:00:00 in the future"):
        parse(payload(future))
    book = AlertBook()
    now = datetime.now(UTC)
    soon = Alert("f", "resolved", {"alertname": "X"}, now + timedelta(minutes=30), None)
    book.apply(soon)
    assert book.prune(now, keep=timedelta(minutes=10)) == 1  # either side of now ages out


def test_the_configured_body_limit_is_honoured_and_answered_413(tmp_path):
    # found: above 1 MiB the configured limit had no effect (a hard limit answered 400)
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines, max_body_bytes=4 * 1024 * 1024)
    client = TestClient(create_app(c, c.config.auth, c.config.max_body_bytes))
    many = [alert("OomguardKVCacheUsageHigh", "a", fingerprint=f"kv{i}") for i in range(6000)]
    body = payload(*many)
    assert 1024 * 1024 < len(body) < 4 * 1024 * 1024
    assert client.post("/v1/alertmanager", content=body).status_code == 200
    small = make(tmp_path / "s", Engines.of("a", "b"), max_body_bytes=1024 * 1024)
    client = TestClient(create_app(small, small.config.auth, small.config.max_body_bytes))
    r = client.post("/v1/alertmanager", content=body)
    assert r.status_code == 413
    with pytest.raises(BodyTooLarge):
        parse(body, max_bytes=1024)
    c.close()
    small.close()


def test_truncated_alerts_are_audited_and_answered_by_an_immediate_resync(tmp_path, local_server):
    # found: truncatedAlerts was parsed and then ignored
    hits = []
    listed = json.loads(payload(alert("OomguardMemoryPressure", "a")))["alerts"]
    for item in listed:
        item["status"] = {"state": "active"}
    server = local_server(json.dumps(listed))
    answer = server.responder
    server.responder = lambda h: (hits.append(h.path), answer(h))[1]
    cfg = config(
        tmp_path,
        "a",
        "b",
        alertmanager={"url": server.url.removesuffix("/metrics"), "resync_seconds": 3600},
    )
    r = Remediator(cfg, Engines.of("a", "b"))
    r.start()
    try:
        assert len(hits) == 1  # the start's resync; the next one is an hour away
        client = TestClient(r.app)
        body = raw(alert("OomguardKVCacheUsageHigh", "b"), truncatedAlerts=7)
        assert client.post("/v1/alertmanager", content=body).status_code == 200
        deadline = time.monotonic() + 10
        while len(hits) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(hits) == 2
        (truncated,) = [e for e in r.controller.audit.entries() if e["event"] == "truncated"]
        assert "7 alerts left out" in truncated["reason"]
        deadline = time.monotonic() + 10
        while (
            r.controller.status["a"].observed is None
            or r.controller.status["a"].observed["admission_cap"] != 80
        ):
            assert time.monotonic() < deadline, "the resynced alert did not act"
            time.sleep(0.05)
    finally:
        r.stop()
    with pytest.raises(PayloadError, match="truncatedAlerts must be a non-negative integer"):
        parse(raw(truncatedAlerts="7"))


def test_one_episode_one_identity_whichever_way_it_arrived(tmp_path, local_server):
    # found: webhooks carry nanoseconds, /api/v2/alerts milliseconds; the rebuilt episode key
    # differed and a restarted remediator restarted the same engine again for the same alert
    from oomguard.remediator.flags import Flags
    from oomguard.remediator.targets import RestartConfig, SupervisorRef
    from tests.test_remediator_controller import FakeBackend

    oom = alert("OomguardCudaOomObserved", "a", oomguard_action="restart")
    oom["startsAt"] = "2026-11-29T03:00:00.123456789Z"
    hook = parse(payload(oom))
    listed = json.loads(payload(oom))["alerts"]
    for item in listed:
        item["startsAt"] = "2026-11-29T03:00:00.123Z"
        item["status"] = {"state": "active"}
    server = local_server(json.dumps(listed))
    engines = Engines.of("a", "b", startup=64)
    engines.drains_finish = True
    cfg = config(tmp_path, "a", "b", alertmanager={"url": server.url.removesuffix("/metrics")})
    restart = RestartConfig(
        supervisor=SupervisorRef(url="http://127.0.0.1:1"),
        drain_timeout_seconds=5,
        ready_timeout_seconds=5,
    )
    cfg.targets[0] = cfg.targets[0].model_copy(update={"restart": restart})
    backend = FakeBackend(engines, "a", Flags(0.9, 64), Flags(0.9, 64), time.time())

    def run_once(receive) -> None:
        c = Controller(cfg, engines, AuditLog(cfg.audit_log), backends={"a": backend})
        receive(c)
        c.reconcile()
        for thread in list(c._restarting.values()):
            thread.join(10)
        c.close()

    run_once(lambda c: c.receive(hook))
    assert [r[0] for r in backend.restarts] == [Flags(0.86, 51)]
    run_once(lambda c: c.resync())  # a restarted remediator rebuilds from Alertmanager's API
    assert len(backend.restarts) == 1  # the same episode: no second restart
    assert hook.alerts[0].starts_at == T0.replace(microsecond=123000)


def test_a_failing_pass_is_counted_and_degrades_healthz(tmp_path, monkeypatch):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    client = TestClient(create_app(c, c.config.auth, c.config.max_body_bytes, 3))

    def broken() -> list[Alert]:
        raise TypeError("can't compare offset-naive and offset-aware datetimes")

    monkeypatch.setattr(c.book, "current", broken)
    for failures in (1, 2):
        c.reconcile()
        assert c.failed_passes == failures
        assert client.get("/healthz").status_code == 200
    c.reconcile()
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json()["failed_passes"] == 3
    metric = c.metrics.registry.get_sample_value("oomguard_remediator_pass_failures_total")
    assert metric == 3
    monkeypatch.undo()
    c.reconcile()
    assert client.get("/healthz").status_code == 200
    assert c.metrics.registry.get_sample_value(
        "oomguard_remediator_last_pass_timestamp_seconds"
    ) == pytest.approx(time.time(), abs=30)
    c.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=8,
)
field_values = st.one_of(
    json_values,
    st.sampled_from(
        [
            "2026-11-29T03:00:00",
            "2026-11-29T03:00:00Z",
            "2026-11-29T03:00:00.123456789+05:30",
            "9999-12-31T23:59:59Z",
            "0001-01-01T00:30:00+01:00",
            "0001-01-01T00:00:00Z",
            "firing",
            "resolved",
            "\ud800",
        ]
    ),
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(["status", "startsAt", "endsAt", "fingerprint", "labels"]),
            field_values,
        ),
        max_size=3,
    ),
    st.sampled_from(["OomguardMemoryCritical", "OomguardMemoryPressure"]),
)
@pytest.mark.slow  # seconds each: in make test, not in the 2-minute check lane
def test_whatever_a_payload_holds_it_is_refused_or_handled_never_raised_in_a_pass(
    tmp_path, overrides, name
):
    engines = Engines.of("a", "b")
    c = make(tmp_path, engines)
    alerts = [{**alert(name, "a", fingerprint=f"f{i}"), **o} for i, o in enumerate(overrides)]
    body = json.loads(payload())
    body["alerts"] = alerts
    try:
        hook = parse(json.dumps(body).encode())
    except PayloadError:
        c.close()
        return
    c.receive(hook)
    force_prune(c)
    c.reconcile()
    assert c.failed_passes == 0
    c.close()
