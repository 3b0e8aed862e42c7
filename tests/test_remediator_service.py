"""`oomguard remediator` as a process: its HTTP API, authentication and refusals, and the CLI."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import pytest

from oomguard.lab.processes import RemediatorProcess, free_port
from tests.remediator_helpers import alert, payload

TOKEN = "remediator-token-42"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def remediator(tmp_path_factory):
    work = tmp_path_factory.mktemp("remediator")
    (work / "token").write_text(TOKEN + "\n")
    (work / "password").write_text("s3cret\n")
    proc = RemediatorProcess(
        work,
        {
            "auth": {
                "bearer_token_file": str(work / "token"),
                "basic": {"username": "am", "password_file": str(work / "password")},
            },
            # nothing listens there: the engine is unreachable and the target is held
            "targets": [{"name": "a", "url": f"http://127.0.0.1:{free_port()}", "model": "m"}],
            "audit_log": str(work / "audit.jsonl"),
            "max_body_bytes": 4096,
            "actuation_attempts": 1,
            "actuation_timeout_seconds": 0.5,
        },
    )
    proc.work = work
    yield proc
    proc.stop()


def post(r, body, headers=BEARER):
    return httpx.post(f"{r.url}/v1/alertmanager", content=body, headers=headers, timeout=10)


def test_credentials_are_required_and_checked(remediator):
    body = payload(alert("OomguardMemoryPressure", "a"))
    assert post(remediator, body, headers={}).status_code == 401
    assert post(remediator, body, headers={"Authorization": "Bearer nope"}).status_code == 401
    wrong_basic = base64.b64encode(b"am:wrong").decode()
    assert post(remediator, body, {"Authorization": f"Basic {wrong_basic}"}).status_code == 401
    assert httpx.get(f"{remediator.url}/v1/targets").status_code == 401
    assert httpx.put(f"{remediator.url}/v1/pause", json={"paused": True}).status_code == 401
    view = httpx.get(f"{remediator.url}/v1/targets", headers=BEARER).json()
    assert view["firing_alerts"] == 0 and not view["paused"]  # nothing was let in
    basic = base64.b64encode(b"am:s3cret").decode()
    ok = post(remediator, body, {"Authorization": f"Basic {basic}"})
    assert ok.status_code == 200 and ok.json()["new"] == 1


def test_malformed_and_oversized_bodies_are_refused_with_reasons(remediator):
    r = post(remediator, b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = post(remediator, json.dumps({"version": "3", "alerts": []}).encode())
    assert r.status_code == 400 and "version" in r.json()["error"]
    bad = json.loads(payload(alert("OomguardMemoryPressure", "a")))
    del bad["alerts"][0]["fingerprint"]
    r = post(remediator, json.dumps(bad).encode())
    assert r.status_code == 400 and "alerts[0].fingerprint" in r.json()["error"]
    r = post(remediator, b"[" + b" " * 5000 + b"]")
    assert r.status_code == 413


def test_duplicates_and_forged_targets(remediator):
    body = payload(alert("OomguardMemoryCritical", "a", start=500))
    assert post(remediator, body).json()["new"] == 1
    again = post(remediator, body).json()
    assert again["new"] == 0 and again["duplicates"] == 1
    forged = post(remediator, payload(alert("OomguardMemoryCritical", "not-ours"))).json()
    assert next(iter(forged["ignored"].values())).startswith("no allowlisted target")
    view = httpx.get(f"{remediator.url}/v1/targets", headers=BEARER).json()
    assert set(view["targets"]) == {"a"}
    target = view["targets"]["a"]
    assert target["mode"] == "held" and "unreachable" in target["reason"]
    metrics = httpx.get(f"{remediator.url}/metrics").text
    assert 'oomguard_remediator_webhook_requests_total{outcome="duplicate"} 1.0' in metrics
    assert 'oomguard_remediator_webhook_requests_total{outcome="invalid"} 3.0' in metrics
    assert 'oomguard_remediator_webhook_requests_total{outcome="too_large"} 1.0' in metrics
    assert 'oomguard_remediator_target_mode{mode="held",target="a"} 1.0' in metrics
    audit = [
        json.loads(line) for line in (remediator.work / "audit.jsonl").read_text().splitlines()
    ]
    assert any(e["event"] == "held" and e["target"] == "a" for e in audit)
    assert any(e["event"] == "received" and e["result"] == "ignored" for e in audit)


def test_pause_switch_over_the_api(remediator):
    bad = httpx.put(f"{remediator.url}/v1/pause", json={"paused": "yes"}, headers=BEARER)
    assert bad.status_code == 400
    r = httpx.put(
        f"{remediator.url}/v1/pause", json={"paused": True, "reason": "deploy"}, headers=BEARER
    )
    assert r.json() == {"paused": True}
    assert "oomguard_remediator_paused 1.0" in httpx.get(f"{remediator.url}/metrics").text
    httpx.put(f"{remediator.url}/v1/pause", json={"paused": False}, headers=BEARER)
    assert "oomguard_remediator_paused 0.0" in httpx.get(f"{remediator.url}/metrics").text
    audit = (remediator.work / "audit.jsonl").read_text()
    assert '"event":"paused"' in audit and "API: deploy" in audit


def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oomguard.cli", "remediator", *args],
        input=stdin.decode() if stdin else None,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_explain_prints_the_decision_and_changes_nothing(remediator, tmp_path):
    state = {
        "startup_max_num_seqs": 64,
        "admission_cap": 64,
        "mode": "serving",
        "since_cap_change": {"seconds": 300, "admitted": 0, "finished": 0, "preemptions": 0},
    }
    (tmp_path / "a.json").write_text(json.dumps(state))
    (tmp_path / "p.json").write_bytes(
        payload(alert("OomguardMemoryPressure", "a"), alert("OomguardMemoryPressure", "other"))
    )
    out = cli(
        "--config",
        str(remediator.path),
        "explain",
        str(tmp_path / "p.json"),
        "--state",
        f"a={tmp_path / 'a.json'}",
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["ignored"] == "not on the allowlist"
    assert lines[1]["target"] == "a" and lines[1]["steps"] == ["lower_cap 51"]


def test_a_wrong_config_names_the_field(tmp_path):
    (tmp_path / "bad.yaml").write_text("auth: {}\ntargets: [{name: a, url: ftp://x}]\n")
    out = cli("--config", str(tmp_path / "bad.yaml"))
    assert out.returncode == 2
    assert "targets.0.url" in out.stderr and "auth" in out.stderr
