"""Mistakes on the command line or in a config: one line on stderr that names what to fix, exit 2,
and a service that cannot work stops before it starts anything (vLLM included)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "twin" / "oomguard" / "twin" / "models" / "llama-3-8b"


def oomguard(
    *args: str, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oomguard", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{r.stderr}"
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def remediator_config(tmp_path: Path, listen: str, token_file: Path) -> Path:
    config = tmp_path / "remediator.yaml"
    config.write_text(
        f"listen: {listen}\n"
        f"auth:\n  bearer_token_file: {token_file}\n"
        "targets:\n  - name: llama\n    url: http://127.0.0.1:9/\n"
        f"audit_log: {tmp_path / 'audit.jsonl'}\n"
    )
    return config


# -- sizes --------------------------------------------------------------------------------------
def test_budget_size_without_a_unit_is_refused():
    one_line_error(oomguard("budget", str(LLAMA), "--gpu-memory", "80"), "'80'", "unit")


def test_budget_size_with_a_unit_is_fine():
    r = oomguard("budget", str(LLAMA), "--gpu-memory", "80GiB")
    assert r.returncode == 0, r.stderr
    assert "80.00 GiB" in r.stdout


def test_budget_config_with_strings_names_the_field(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(
        (LLAMA / "config.json").read_text().replace('"hidden_size": 4096', '"hidden_size": "4096"')
    )
    assert '"4096"' in bad.read_text()
    one_line_error(oomguard("budget", str(bad), "--gpu", "H100"), "hidden_size")


# -- flags and configs --------------------------------------------------------------------------
def test_exporter_url_with_an_impossible_port_is_one_line():
    r = oomguard(
        "exporter", "--no-nvml", "--vllm", "llama=http://127.0.0.1:99999/metrics", timeout=30
    )
    one_line_error(r, "llama", "port")


def test_missing_extra_names_the_install_command(tmp_path):
    code = (
        "import sys; sys.modules['grafanalib'] = None\n"
        "from oomguard.cli import main\n"
        f"sys.exit(main(['generate', '--root', {str(tmp_path)!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    one_line_error(r, "grafanalib", "oomguard[generate]")


# -- services fail fast -------------------------------------------------------------------------
def test_remediator_missing_token_file_fails_at_start(tmp_path):
    config = remediator_config(tmp_path, "127.0.0.1:0", tmp_path / "nope")
    one_line_error(oomguard("remediator", "--config", str(config)), "bearer_token_file", "nope")


def test_remediator_empty_token_file_fails_at_start(tmp_path):
    token = tmp_path / "token"
    token.write_text("\n")
    config = remediator_config(tmp_path, "127.0.0.1:0", token)
    one_line_error(oomguard("remediator", "--config", str(config)), "bearer_token_file", "empty")


def test_remediator_taken_port_is_exit_2(tmp_path, taken_port):
    token = tmp_path / "token"
    token.write_text("secret\n")
    config = remediator_config(tmp_path, f"127.0.0.1:{taken_port}", token)
    one_line_error(oomguard("remediator", "--config", str(config)), f"127.0.0.1:{taken_port}")


def test_exporter_taken_port_is_exit_2(taken_port):
    r = oomguard("exporter", "--no-nvml", "--listen", f"127.0.0.1:{taken_port}", timeout=30)
    one_line_error(r, f"127.0.0.1:{taken_port}")


def test_serve_taken_port_fails_before_vllm_starts(tmp_path, taken_port):
    marker = tmp_path / "started"
    start = time.monotonic()
    r = oomguard(
        "serve",
        "--allow-unauthenticated",
        "--listen",
        f"127.0.0.1:{taken_port}",
        "--state-dir",
        str(tmp_path / "state"),
        "--",
        "sh",
        "-c",
        f"touch {marker}; sleep 30",
        "--max-num-seqs",
        "8",
    )
    one_line_error(r, "--listen", f"127.0.0.1:{taken_port}")
    assert time.monotonic() - start < 30
    time.sleep(0.5)
    assert not marker.exists(), "the child (vLLM) was started although the port was taken"


def test_serve_bad_listen_value_is_one_line(tmp_path):
    r = oomguard(
        "serve",
        "--allow-unauthenticated",
        "--listen",
        "nonsense",
        "--state-dir",
        str(tmp_path),
        "--",
        "true",
    )
    one_line_error(r, "--listen", "HOST:PORT")


@pytest.mark.parametrize(
    "command", ["budget", "preflight", "incidents", "generate", "demo", "remediator", "serve"]
)
def test_help_shows_percent_signs_as_written(command):
    """argparse %-formats a description only when it holds '%(prog)', so a '%%' there is printed
    as is ('70-80 %%' in `oomguard budget --help`)."""
    r = oomguard(command, "--help")
    assert r.returncode == 0, r.stderr
    assert "%%" not in r.stdout, r.stdout


def test_serve_without_a_token_refuses_a_network_address(tmp_path):
    """--allow-unauthenticated is for loopback: on 0.0.0.0 anyone could restart vLLM."""
    marker = tmp_path / "started"
    r = oomguard(
        "serve",
        "--allow-unauthenticated",
        "--listen",
        "0.0.0.0:0",
        "--state-dir",
        str(tmp_path / "state"),
        "--",
        "sh",
        "-c",
        f"touch {marker}",
        "--max-num-seqs",
        "8",
    )
    one_line_error(r, "--allow-unauthenticated", "0.0.0.0:0", "--token-file")
    assert not marker.exists()


# -- budget on a hostile config.json (issue 25, defect 16) --------------------------------------
def _llama_with(**fields: object) -> str:
    config = json.loads((LLAMA / "config.json").read_text())
    config.update(fields)
    return json.dumps(config)


def _hostile_config(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "not_utf8":
        path.write_bytes(_llama_with(model_type="llama").encode().replace(b"llama", b"ll\xffma"))
    elif kind == "deep":
        path.write_text('{"hidden_size": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif kind == "digits":
        path.write_text(
            _llama_with().replace('"hidden_size": 4096', '"hidden_size": ' + "9" * 5000)
        )
    elif kind == "layers":
        path.write_text(_llama_with(num_hidden_layers=10**8))
    elif kind == "directory":
        path.mkdir()  # a folder without config.json inside
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("fifo", ["FIFO"]),  # before: the command hung in open()
        ("not_utf8", ["not UTF-8"]),  # before: UnicodeDecodeError traceback
        ("deep", ["nests deeper"]),  # before: RecursionError traceback
        ("digits", ["5,000 digits"]),  # before: ValueError traceback (int digit limit)
        ("layers", ["num_hidden_layers", "100,000,000"]),  # before: 13 s, then MemoryError
        ("directory", ["no such file"]),
    ],
)
def test_budget_on_a_hostile_config_is_one_line_and_exit_2(tmp_path, kind, words):
    path = tmp_path / ("folder" if kind == "directory" else "config.json")
    _hostile_config(kind, path)
    start = time.monotonic()
    r = oomguard("budget", str(path), "--gpu", "H100", timeout=60)
    one_line_error(r, *words)
    assert time.monotonic() - start < 30
