"""The plugin's refusals as routers see them (vllm_plugin/refusals.py, api.StatusFirst), the
router settings the docs give, and the remediator's router step: the fast parts. The real
routers in front of real engines: tests/test_routers.py."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from oomguard.lab.processes import free_port
from oomguard.lab.routers import NginxSettings, nginx_config
from oomguard.remediator.actuator import ActuatorError, Target
from oomguard.remediator.config import RemediatorConfig
from oomguard.remediator.router import Route, RoutedActuator, RouterConfig, routes, with_routers
from oomguard.vllm_plugin.api import StatusFirst, stream_error
from oomguard.vllm_plugin.refusals import Refusals

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_settings(monkeypatch):
    r = Refusals.from_env()
    assert (r.defer_status, r.defer_retry_after, r.drain_retry_after) == (429, 2, 10)
    assert r.drain_grace_seconds == 0.0
    assert (r.retry_after(429), r.retry_after(503), r.retry_after(400)) == (2, 10, None)
    monkeypatch.setenv("OOMGUARD_DEFER_STATUS", "503")
    monkeypatch.setenv("OOMGUARD_DRAIN_GRACE_SECONDS", "12.5")
    r = Refusals.from_env()
    assert (r.defer_status, r.drain_grace_seconds) == (503, 12.5)
    assert r.retry_after(503) == 10  # one 503: the drain's delay


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OOMGUARD_DEFER_STATUS", "418"),
        ("OOMGUARD_DEFER_STATUS", "abc"),
        ("OOMGUARD_DEFER_RETRY_AFTER", "0"),
        ("OOMGUARD_PLUGIN_RETRY_AFTER", "1e9"),
        ("OOMGUARD_DRAIN_GRACE_SECONDS", "-1"),
        ("OOMGUARD_DRAIN_GRACE_SECONDS", "nan"),
        ("OOMGUARD_DRAIN_GRACE_SECONDS", "601"),
    ],
)
def test_bad_settings_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        Refusals.from_env()


def test_a_bad_setting_never_stops_the_plugin(monkeypatch):
    from oomguard.vllm_plugin.api import OomguardEndpointPlugin

    monkeypatch.setenv("OOMGUARD_DEFER_STATUS", "200")
    assert OomguardEndpointPlugin().refusals == Refusals()  # logged, defaults used


ERROR = b'data: {"error": {"message": "draining; retry", "type": "x", "param": null, "code": 503}}'


def test_stream_error_reads_the_first_event_only():
    status, body = stream_error(ERROR + b"\n\ndata: [DONE]\n\n")
    assert status == 503 and json.loads(body)["error"]["message"] == "draining; retry"
    assert stream_error(b'data: {"choices": [{"text": "a"}]}\n\n') is None
    assert stream_error(b"data: [DONE]\n\n") is None
    assert stream_error(b"data: {not json\n\n") is None
    assert stream_error(b'data: {"error": {"code": 200}}\n\n')[0] == 500
    assert stream_error(b'data: {"error": "text"}\n\n') is None


def run_app(messages: list[dict[str, Any]], refusals: Refusals | None = None) -> list[dict]:
    """What a client receives when an app sends `messages` through StatusFirst."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        wrapper = StatusFirst(send, refusals or Refusals())
        for m in messages:
            await wrapper(m)

    asyncio.run(go())
    return sent


SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def start(status: int, headers: list[Any]) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": headers}


def body(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_stream_that_begins_with_an_error_is_answered_with_its_status():
    sent = run_app(
        [
            start(200, SSE),
            body(b""),
            body(ERROR + b"\n\n"),
            body(b"data: [DONE]\n\n"),
            body(b"", False),
        ]
    )
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 503
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"retry-after"] == b"10" and headers[b"x-should-retry"] == b"true"
    assert int(headers[b"content-length"]) == len(sent[1]["body"])
    assert json.loads(sent[1]["body"])["error"]["code"] == 503
    assert sent[1]["more_body"] is False


def test_a_stream_that_begins_with_a_token_is_passed_on_whole():
    token = b'data: {"choices": [{"text": "hi"}]}\n\n'
    messages = [
        start(200, SSE),
        body(b""),
        body(token),
        body(b"data: [DONE]\n\n"),
        body(b"", False),
    ]
    sent = run_app(messages)
    assert sent[0] == messages[0]  # the same 200, sent with the first token
    assert [m.get("body") for m in sent[1:]] == [token, b"data: [DONE]\n\n", b""]


def test_refusals_get_their_headers_and_other_answers_pass():
    deferral = run_app([start(429, [(b"content-type", b"application/json")]), body(b"{}", False)])
    headers = dict(deferral[0]["headers"])
    assert headers[b"retry-after"] == b"2" and headers[b"x-should-retry"] == b"true"
    own = run_app([start(503, [(b"Retry-After", b"7")]), body(b"{}", False)])
    assert [v for k, v in own[0]["headers"] if k.lower() == b"retry-after"] == [b"7"]
    ok = run_app([start(200, [(b"content-type", b"application/json")]), body(b"{}", False)])
    assert ok[0]["headers"] == [(b"content-type", b"application/json")]
    refused = run_app([start(400, []), body(b"{}", False)])
    assert refused[0]["headers"] == []  # a never-fit 400 is not to be retried


# -- the documented router settings are the ones the tests run ---------------------------------
def test_the_docs_give_the_nginx_settings_the_tests_run(tmp_path):
    conf = nginx_config(tmp_path, 8080, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    doc = (ROOT / "docs" / "vllm-plugin.md").read_text()
    for directive in ("proxy_next_upstream", "proxy_next_upstream_tries", "proxy_buffering"):
        [ours] = re.findall(rf"^\s*{directive} [^;]*;", conf, re.M)
        assert ours.strip() in doc, ours
    assert "http_429" not in conf and "http_503 non_idempotent" in conf
    told = nginx_config(tmp_path, 8080, ["http://a:1"], NginxSettings(retry_429=True))
    assert "http_503 http_429 non_idempotent" in told


def test_the_docs_give_the_vllm_router_flags_the_fleet_runs():
    from oomguard.lab.runner import ROUTER_SETTINGS

    doc = (ROOT / "docs" / "vllm-plugin.md").read_text()
    s = ROUTER_SETTINGS
    assert "--health-check-endpoint /oomguard/v1/ready" in doc
    assert f"--health-check-interval-secs {s.interval_s}" in doc
    assert f"--health-failure-threshold {s.failures}" in doc
    assert f"--health-check-timeout-secs {s.timeout_s}" in doc
    assert f"OOMGUARD_DRAIN_GRACE_SECONDS={s.interval_s * s.failures + s.timeout_s}" in doc


# -- the remediator's router step -----------------------------------------------------------------
def config(**extra: Any) -> dict[str, Any]:
    return {
        "auth": {"allow_unauthenticated": True},
        "targets": [{"name": "e0", "url": "http://127.0.0.1:8000", **extra}],
    }


def test_a_target_may_name_only_a_listed_router():
    with pytest.raises(ValueError, match="routers not in routers: front"):
        RemediatorConfig.model_validate(config(router={"name": "front"}))
    c = RemediatorConfig.model_validate(
        {
            **config(router={"name": "front"}),
            "routers": [{"name": "front", "url": "http://127.0.0.1:30000"}],
        }
    )
    [(name, route)] = routes(c.routers, c.targets).items()
    assert (name, route.worker_url, route.router.url) == (
        "e0",
        "http://127.0.0.1:8000",
        "http://127.0.0.1:30000",
    )
    with pytest.raises(ValueError):  # a router is an http(s) URL, nothing else
        RemediatorConfig.model_validate(
            {**config(), "routers": [{"name": "r", "url": "file:///etc/passwd"}]}
        )


class Recorder:
    """Stands in for the plugin actuator: records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def drain(self, target: Target, grace_seconds: float | None = None) -> dict[str, Any]:
        self.calls.append(("drain", grace_seconds))
        return {"mode": "draining"}

    def resume(self, target: Target) -> dict[str, Any]:
        self.calls.append(("resume", None))
        return {"mode": "serving"}


def test_an_unreachable_router_still_drains_with_the_plugins_grace():
    inner = Recorder()
    closed = f"http://127.0.0.1:{free_port()}"
    route = Route(RouterConfig(name="r", url=closed, timeout_seconds=2), "http://127.0.0.1:1")
    actuator = RoutedActuator(inner, {"e0": route})
    out = actuator.drain(Target("e0", "http://127.0.0.1:1"))
    assert inner.calls == [("drain", None)]  # no grace override: the router was not told
    assert out["router"]["removed"] is False and "remove_worker" in out["router"]["error"]
    with pytest.raises(ActuatorError) as exc:  # resumed, but not back in rotation: retried
        actuator.resume(Target("e0", "http://127.0.0.1:1"))
    assert exc.value.reason == "router_unreachable" and inner.calls[-1] == ("resume", None)
    # a target without a router goes straight through
    assert RoutedActuator(inner, {}).drain(Target("e1", "http://x"))["mode"] == "draining"
    assert with_routers(inner, [], []) is inner  # type: ignore[arg-type]
