"""`oomguard serve`: vLLM's log rotated by size (and a full disk never stops the pipe's reader),
`--help` that shows every default, and the code's defaults that match the single-box unit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from oomguard.cli import build_parser
from oomguard.remediator import logfile
from oomguard.remediator.logfile import RotatingLog
from oomguard.remediator.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent


def test_the_log_rotates_by_size_and_keeps_n_backups(tmp_path):
    path = tmp_path / "vllm.log"
    line = b"x" * 99 + b"\n"  # 100 bytes
    with RotatingLog(path, max_bytes=1000, backups=3) as out:
        for _ in range(55):  # 5,500 bytes: the current file and 3 backups hold the last 4,000
            out.write(line)
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert set(sizes) == {"vllm.log", "vllm.log.1", "vllm.log.2", "vllm.log.3"}
    assert all(size <= 1000 for size in sizes.values())
    assert sizes["vllm.log.1"] == sizes["vllm.log.2"] == 1000
    assert sum(sizes.values()) == 3500  # the oldest 2,000 bytes went with the oldest backup


def test_rotation_keeps_the_newest_lines_in_order(tmp_path):
    path = tmp_path / "vllm.log"
    with RotatingLog(path, max_bytes=30, backups=2) as out:
        for i in range(12):
            out.write(f"line {i:02d}\n".encode())  # 8 bytes each: 3 per file
    text = b"".join(
        (tmp_path / name).read_bytes() for name in ("vllm.log.2", "vllm.log.1", "vllm.log")
    ).decode()
    assert text.splitlines() == [f"line {i:02d}" for i in range(3, 12)]


def test_an_existing_log_counts_towards_the_size(tmp_path):
    """A supervisor restart appends to vllm.log: its size so far counts."""
    path = tmp_path / "vllm.log"
    path.write_bytes(b"y" * 950)
    with RotatingLog(path, max_bytes=1000, backups=1) as out:
        out.write(b"z" * 100)
    assert (tmp_path / "vllm.log.1").read_bytes() == b"y" * 950
    assert path.read_bytes() == b"z" * 100


def test_a_failed_write_drops_lines_and_recovers(tmp_path, monkeypatch):
    """A full disk (or a log path that cannot be opened) must not raise in the thread that reads
    vLLM's pipe: the line is dropped and counted, and writing resumes once it can."""
    monkeypatch.setattr(logfile, "RETRY_SECONDS", 0.0)
    path = tmp_path / "vllm.log"
    out = RotatingLog(path, max_bytes=0)
    out.write(b"one\n")
    out.close()
    path.unlink()
    path.mkdir()  # opening it for append fails now, for root too
    out.write(b"two\n")
    assert out.dropped == 1
    path.rmdir()
    out.write(b"three\n")
    out.close()
    assert path.read_bytes() == b"three\n"


def test_a_full_disk_while_writing_drops_the_line(tmp_path):
    class Full:
        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    out = RotatingLog(tmp_path / "vllm.log")
    out._out = Full()  # type: ignore[assignment]
    out.write(b"lost\n")
    assert out.dropped == 1


def test_the_supervisor_writes_a_rotated_log(tmp_path):
    """The real child's output: a shell printing 1,000 lines, rotated at 2 KiB with 2 backups."""
    script = "for i in $(seq 1 1000); do echo line-$i; done; exit 3"
    sup = Supervisor(
        ["sh", "-c", script, "--max-num-seqs", "8"],
        tmp_path,
        restart_delay=60,
        log_max_bytes=2048,
        log_backups=2,
        cgroup_dir="",
    )
    sup.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not sup.exits:
            time.sleep(0.05)
        assert sup.exits, "the child's exit was not recorded"
    finally:
        sup.stop()
    names = sorted(p.name for p in tmp_path.glob("vllm.log*"))
    assert names == ["vllm.log", "vllm.log.1", "vllm.log.2"]
    assert all(p.stat().st_size <= 2048 for p in tmp_path.glob("vllm.log*"))
    assert (tmp_path / "vllm.log").read_text().splitlines()[-1] == "line-1000"


# -- --help and the defaults --------------------------------------------------------------------
def _serve_help() -> dict[str, str]:
    """Each option's help entry (`  --name METAVAR  text...` and its continuation lines)."""
    r = subprocess.run(
        [sys.executable, "-m", "oomguard", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "OOMGUARD_TWIN_GPU_FILE"},
    )
    assert r.returncode == 0
    entries: dict[str, str] = {}
    name = ""
    for line in r.stdout.split("options:", 1)[1].splitlines():
        m = re.match(r"  (--[a-z-]+)(.*)", line)
        if m:
            name = m.group(1)
            entries[name] = m.group(2)
        elif name:
            entries[name] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_serve_help_shows_every_default():
    from oomguard.units import parse_duration, parse_size

    text = _serve_help()
    defaults = vars(build_parser().parse_args(["serve", "--", "vllm", "serve", "m"]))
    for option in (
        "--listen",
        "--state-dir",
        "--max-crashes",
        "--crash-window",
        "--restart-delay",
        "--stop-timeout",
        "--max-restarts",
        "--restart-window",
        "--log-max-size",
        "--log-backups",
        "--log-level",
    ):
        m = re.search(r"\(default ([^,)]+)", text.get(option, ""))
        assert m, f"{option}: no default in --help"
        shown, actual = m.group(1), defaults[option.removeprefix("--").replace("-", "_")]
        if isinstance(actual, float):
            assert parse_duration(shown) == actual, option
        elif option == "--log-max-size":
            assert parse_size(shown) == actual, option
        else:
            assert shown == str(actual), option


def test_serve_state_dir_is_the_units():
    """The default state directory is the vLLM unit's StateDirectory: a command run by hand
    (`oomguard serve ...`) and the unit share flags.json."""
    unit = (ROOT / "deploy" / "single-box" / "oomguard-vllm.service").read_text()
    (state,) = re.findall(r"^StateDirectory=(\S+)$", unit, re.M)
    defaults = build_parser().parse_args(["serve", "--", "vllm", "serve", "m"])
    assert defaults.state_dir == f"/var/lib/{state}"
