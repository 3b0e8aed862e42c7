"""`oomguard status` against real running parts: an `oomguard exporter` process on a twin GPU, an
`oomguard remediator` process, an `oomguard serve` supervisor. What cannot be read (an engine
that is down, a refused token, an unreadable token file, an exporter that is down) is shown as
such, with the reason, never a traceback; the exit status says whether anything needs attention.

tests/test_rehearsal.py runs it against the whole single-box stack with the real vLLM server
(engine state, a withheld drain, the cap, recovery)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from oomguard.lab.processes import Process, RemediatorProcess, free_port
from tests.stack import start_exporter, stop

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """Exporter (twin H100, one vLLM target that is down), supervisor (a child that only
    sleeps), remediator (that target, its supervisor): real processes, real tokens."""
    tmp = tmp_path_factory.mktemp("status")
    for name in ("remediator-token", "plugin-token", "supervisor-token"):
        (tmp / name).write_text(f"{name}-s3cret\n")
    gpu = tmp / "gpu0.json"
    subprocess.run(
        [sys.executable, "-m", "oomguard", "twin-gpu", str(gpu), "--gpu", "H100"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    engine = f"http://127.0.0.1:{free_port()}"  # nothing listens: vLLM is down
    exporter, exporter_address = start_exporter(
        "--twin-gpu", str(gpu), "--cgroup", f"self={tmp}", "--vllm", f"llama={engine}/metrics"
    )
    api = f"127.0.0.1:{free_port()}"
    supervisor = Process(
        [
            sys.executable,
            "-m",
            "oomguard",
            "serve",
            "--listen",
            api,
            "--token-file",
            str(tmp / "supervisor-token"),
            "--state-dir",
            str(tmp / "serve"),
            "--",
            "sh",
            "-c",
            "sleep 600",
            "--max-num-seqs",
            "64",
        ],
        tmp / "serve.log",
    )
    supervisor.wait_http(f"http://{api}/healthz", 30)
    config = {
        "auth": {"bearer_token_file": str(tmp / "remediator-token")},
        "targets": [
            {
                "name": "llama",
                "url": engine,
                "match": {"target": "llama"},
                "token_file": str(tmp / "plugin-token"),
                "restart": {
                    "supervisor": {
                        "url": f"http://{api}",
                        "token_file": str(tmp / "supervisor-token"),
                    }
                },
            }
        ],
        "audit_log": str(tmp / "audit.jsonl"),
    }
    remediator = RemediatorProcess(tmp / "remediator", config)
    (tmp / "exporter.yaml").write_text(yaml.safe_dump({"listen": exporter_address}))
    (tmp / "remediator.yaml").write_text(yaml.safe_dump(remediator.config))
    yield tmp, exporter_address
    remediator.stop()
    supervisor.stop()
    stop(exporter)


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oomguard", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_target(report: dict) -> dict:
    (target,) = report["targets"]
    return target


def test_every_part_is_read_and_what_is_down_is_named(box):
    tmp, exporter = box
    # the exporter beside the config (a single box's /etc/oomguard/exporter.yaml) is found
    r = status("--config", str(tmp / "remediator.yaml"), "--json")
    assert r.returncode == 1, r.stderr  # the engine is down: needs attention
    report = json.loads(r.stdout)
    assert report["exporters"][0]["url"] == f"http://{exporter}/metrics"
    assert report["exporters"][0]["ok"] and report["remediator"]["ok"]
    gpus = report["exporters"][0]["gpus"]
    assert [g["model"] for g in gpus] == ["NVIDIA H100 80GB HBM3 (twin)"]
    t = one_target(report)
    # blind from the first poll: vLLM never answered
    assert [(lv["level"], lv["reason"]) for lv in t["levels"]] == [(-1, "engine_unreachable")]
    assert t["plugin"] is None and t["plugin_error"].startswith("unreachable")
    assert t["supervisor"]["generation"] == 1 and t["supervisor"]["running"]
    assert t["supervisor"]["flags"]["current"]["max_num_seqs"] == 64
    assert "blind (engine_unreachable)" in t["attention"]
    # the text: each part on its line, no traceback
    r = status("--config", str(tmp / "remediator.yaml"))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "level       -1 blind (engine_unreachable)" in r.stdout
    assert "engine      CANNOT READ: unreachable" in r.stdout
    assert "supervisor  generation 1, running" in r.stdout
    assert "needs attention:" in r.stdout


def test_a_refused_token_is_named(box, tmp_path):
    tmp, _ = box
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token\n")
    r = status("--config", str(tmp / "remediator.yaml"), "--remediator-token-file", str(wrong))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "remediator http://" in r.stdout and "HTTP 401 (the token was refused)" in r.stdout


def test_an_unreadable_token_file_is_named(box, tmp_path):
    """Given on the command line: a usage error (exit 2, one line). Named by the config (a
    token only root or the group can read, a file gone): that part cannot be read, the rest is."""
    tmp, _ = box
    missing = tmp_path / "nowhere" / "token"
    r = status("--config", str(tmp / "remediator.yaml"), "--remediator-token-file", str(missing))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--remediator-token-file" in r.stderr and str(missing) in r.stderr
    config = yaml.safe_load((tmp / "remediator.yaml").read_text())
    config["targets"][0]["token_file"] = str(missing)
    (tmp_path / "remediator.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "exporter.yaml").write_text((tmp / "exporter.yaml").read_text())
    r = status("--config", str(tmp_path / "remediator.yaml"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"engine      CANNOT READ: token file {missing}" in r.stdout, r.stdout
    assert "supervisor  generation 1" in r.stdout  # the other parts are read


def test_an_exporter_that_is_down_is_named(box):
    tmp, _ = box
    down = f"http://127.0.0.1:{free_port()}/metrics"
    r = status("--config", str(tmp / "remediator.yaml"), "--exporter", down)
    assert r.returncode == 1
    assert f"exporter   {down}: CANNOT READ: unreachable" in r.stdout
    assert "level       none: no exporter reports this target" in r.stdout


def test_without_a_config_the_parts_come_from_flags(box):
    _, exporter = box
    r = status(
        "--exporter",
        f"http://{exporter}/metrics",
        "--json",
        "--engine",
        "other=http://127.0.0.1:1",
    )
    report = json.loads(r.stdout)
    assert report["remediator"]["url"] is None
    # the exporter's engine that no target selects is listed: nothing protects it
    assert [lv["labels"]["target"] for lv in report["unlisted"]] == ["llama"]
    assert any("no target selects it" in a for a in report["attention"])


def test_wait_reads_again_until_its_deadline(box):
    tmp, _ = box
    started = time.monotonic()
    r = status("--config", str(tmp / "remediator.yaml"), "--wait", "6s")
    assert r.returncode == 1 and time.monotonic() - started >= 5


def test_a_bad_config_is_a_usage_error(tmp_path):
    path = tmp_path / "remediator.yaml"
    path.write_text("listen: [nonsense\n")
    r = status("--config", str(path))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr


def test_status_is_the_first_command_in_help():
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "--help"], capture_output=True, text=True, timeout=60
    )
    commands = [
        line.split()[0] for line in r.stdout.split("COMMAND", 2)[2].splitlines()[1:] if line.strip()
    ]
    assert commands[0] == "status", commands


def test_the_supervisor_status_needs_its_token(box):
    """What status reads is behind the tokens: without one, a 401 (the API is not open)."""
    tmp, _ = box
    config = yaml.safe_load((tmp / "remediator.yaml").read_text())
    api = config["targets"][0]["restart"]["supervisor"]["url"]
    assert httpx.get(f"{api}/v1/status", timeout=5).status_code == 401
    assert Path(config["audit_log"]).parent.is_dir()


def test_a_waiting_walk_back_is_shown_and_needs_no_attention():
    # the walk-back of a model's only engine waits for good (remediator/decision.py): shown, so
    # that on-call sees why the flags stay lowered, but nothing for anyone to answer
    from oomguard.status import EngineLevel, TargetReport, _attention, _remediator_lines

    view = {
        "mode": "serving",
        "reason": "no alerts: full admission",
        "limited": None,
        "waiting": "walk flags back: waits for the single_replica limit",
    }
    lines = _remediator_lines(view, time.time())
    assert "waiting: walk flags back: waits for the single_replica limit" in lines
    level = EngineLevel("http://127.0.0.1:9848/metrics", {"target": "llama"}, 0, "ok")
    report = TargetReport("llama", "http://127.0.0.1:8000", levels=[level], remediator=view)
    assert _attention(report, remediator_read=True) == []
    # a withheld action is still one
    limited = {**view, "waiting": None, "limited": {"action": "drain", "limit": "single_replica"}}
    report = TargetReport("llama", "http://127.0.0.1:8000", levels=[level], remediator=limited)
    assert _attention(report, remediator_read=True) == [
        "drain withheld by the single_replica limit"
    ]
