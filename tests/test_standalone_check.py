"""Standalone mode cannot be misconfigured silently: `oomguard remediator --check` (and the start)
fetch each exporter once and refuse anything that is not an oomguard exporter's /metrics.

Against a real `oomguard exporter` process: its HTML index page (`http://host:9848`, the URL a
user copies from the browser) passed `--check` and the watch read it as "no engines" forever; a
bare `host:port` passed too and warned every second."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import VLLM_FIXTURE, free_port
from tests.stack import start_exporter, stop


@pytest.fixture(scope="module")
def exporter():
    proc, address = start_exporter("--no-nvml", "--interval", "500ms")
    yield address
    stop(proc)


def check(tmp_path, exporters: list[str], *extra: str) -> subprocess.CompletedProcess:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    path = tmp_path / "remediator.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{free_port()}",
                "auth": {"bearer_token_file": str(token)},
                "targets": [{"name": "a", "url": "http://127.0.0.1:1", "token_file": str(token)}],
                "audit_log": str(tmp_path / "audit.jsonl"),
                "mode": "standalone",
                "standalone": {"exporters": exporters},
            }
        )
    )
    return subprocess.run(
        [sys.executable, "-m", "oomguard", "remediator", "--config", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_the_exporters_metrics_pass(tmp_path, exporter):
    r = check(tmp_path, [f"http://{exporter}/metrics"], "--check")
    assert r.returncode == 0, r.stderr
    assert f"http://{exporter}/metrics: 0 engine levels" in r.stdout
    assert "mode standalone" in r.stdout


@pytest.mark.slow
def test_the_exporters_index_page_is_refused_with_the_fix(tmp_path, exporter):
    r = check(tmp_path, [f"http://{exporter}"], "--check")
    assert r.returncode == 2, r.stdout
    [line] = r.stderr.strip().splitlines()
    assert "standalone.exporters.0" in line and "HTML page" in line
    assert f"did you mean http://{exporter}/metrics?" in line


@pytest.mark.slow
def test_the_remediator_does_not_start_on_an_index_page(tmp_path, exporter):
    """Without --check too: a service that would never act must not start."""
    r = check(tmp_path, [f"http://{exporter}/"])
    assert r.returncode == 2 and "HTML page" in r.stderr, r.stderr
    assert not (tmp_path / "audit.jsonl").exists()


def test_a_bare_host_port_is_refused(tmp_path):
    r = check(tmp_path, ["127.0.0.1:9848"], "--check")
    assert r.returncode == 2 and "standalone.exporters.0" in r.stderr, r.stderr


def test_another_servers_metrics_are_refused(tmp_path, local_server):
    """vLLM's own /metrics, say: it parses, but no oomguard exporter wrote it."""
    server = local_server(VLLM_FIXTURE.read_text())
    r = check(tmp_path, [server.url], "--check")
    assert r.returncode == 2
    assert "not with an oomguard exporter's /metrics" in r.stderr, r.stderr


def test_an_exporter_that_cannot_be_read_fails_the_check(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/metrics"
    r = check(tmp_path, [closed], "--check")
    assert r.returncode == 2 and f"cannot read {closed}" in r.stderr, r.stderr
