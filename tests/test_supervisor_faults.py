"""`oomguard serve` under faults: a full state directory, a restart of the supervisor itself, a
state file that is garbage, a reader thread that dies (issue 25: defects 6, 7, 8). The child is a
real process (a shell standing in for vLLM's output and exit); the full disk is a real tmpfs."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from oomguard.remediator import logfile
from oomguard.remediator.config import AuthConfig
from oomguard.remediator.flags import Flags
from oomguard.remediator.supervisor import RateLimited, Supervisor, create_app
from tests.faults import fill, free, pad, small_fs

OPEN = AuthConfig(allow_unauthenticated=True)


def until(check, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def shell(script: str) -> list[str]:
    return ["sh", "-c", script, "--max-num-seqs", "8", "--gpu-memory-utilization", "0.9"]


SLEEPER = shell("echo up; sleep 600")
# vLLM's death by CUDA OOM after a burst of output larger than a pipe's buffer (64 KiB)
OOM_AFTER_OUTPUT = shell(
    "i=0; while [ $i -lt 2000 ]; do echo line $i of output that fills the pipe and the log; "
    "i=$((i+1)); done; echo 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate'; "
    "exit 1"
)


def test_a_full_state_directory_never_wedges_serve(tmp_path):
    """Defect 6: with the state directory full, the child's OOM exit lowered the flags, saving
    them raised ENOSPC in the thread that watches the child: it died, vLLM was never started
    again, and the status said running. Now the lowered flags are in force (reported as not
    saved), the child comes back, and /healthz says degraded."""
    with small_fs(tmp_path / "state", 256 * 1024) as state:
        sup = Supervisor(OOM_AFTER_OUTPUT, state, restart_delay=0.2, max_crashes=50, cgroup_dir="")
        filler = fill(state)
        try:
            sup.start()
            assert until(lambda: sup.generation >= 2), "vLLM was not started again"
            status = sup.status()
            assert status["flags"]["current"]["max_num_seqs"] < 8  # lowered after the OOM
            assert status["flags"]["persisted"] is False
            assert sup.command()[sup.command().index("--max-num-seqs") + 1] != "8"
            assert any("not saved" in p for p in status["problems"])
            with TestClient(create_app(sup, OPEN)) as client:
                health = client.get("/healthz")
                assert health.status_code == 503 and health.json()["status"] == "degraded"
                metrics = client.get("/metrics").text
                assert "oomguard_supervisor_state_write_errors_total" in metrics
                assert "oomguard_supervisor_log_dropped_lines_total" in metrics
        finally:
            sup.stop()
            free(filler)


def test_a_restart_the_state_directory_cannot_record_changes_nothing(tmp_path):
    """Defect 7: with the state directory full, a restart answered 500 while /v1/status already
    reported the new flags, which were not in force (the old generation still ran)."""
    with small_fs(tmp_path / "state", 256 * 1024) as state:
        sup = Supervisor(SLEEPER, state, cgroup_dir="")
        sup.start()
        pid = sup.child.pid if sup.child else None
        filler = fill(state)
        for name in ("flags.json", "restarts.json", "vllm.log"):
            if (state / name).exists():
                pad(state / name)
        try:
            with TestClient(create_app(sup, OPEN), raise_server_exceptions=False) as client:
                r = client.post(
                    "/v1/restart",
                    json={"flags": {"gpu_memory_utilization": 0.86, "max_num_seqs": 6}},
                )
                assert r.status_code == 503, r.text
                assert "nothing restarted" in r.json()["error"]
                status = client.get("/v1/status").json()
            assert status["flags"]["current"] == {"gpu_memory_utilization": 0.9, "max_num_seqs": 8}
            assert status["generation"] == 1 and status["pid"] == pid
            free(filler)
            filler = None
            sup.restart(Flags(0.86, 6), None, "room again")  # and it works once there is room
            assert sup.generation == 2 and sup.flags.current == Flags(0.86, 6)
        finally:
            sup.stop()
            if filler is not None:
                free(filler)


def test_the_restart_rate_limit_survives_a_restart_of_serve(tmp_path):
    """Defect 8: the limit was kept in memory only; a restarted supervisor accepted at once."""
    first = Supervisor(SLEEPER, tmp_path, max_restarts=1, restart_window_seconds=600, cgroup_dir="")
    first.start()
    try:
        first.restart(None, None, "one")
    finally:
        first.stop()
    second = Supervisor(
        SLEEPER, tmp_path, max_restarts=1, restart_window_seconds=600, cgroup_dir=""
    )
    second.start()
    try:
        with pytest.raises(RateLimited):
            second.restart(None, None, "two")
        with TestClient(create_app(second, OPEN)) as client:
            r = client.post("/v1/restart", json={})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) > 500
    finally:
        second.stop()


@pytest.mark.parametrize(
    "content",
    [b"\xff\xfe not UTF-8", b"[]", b"null", b"[" * 100_000, b'{"original": ' + b"9" * 5000 + b"}"],
    ids=["not_utf8", "list", "null", "deep", "huge_int"],
)
def test_a_state_file_of_garbage_is_set_aside_and_serve_starts(tmp_path, content):
    (tmp_path / "flags.json").write_bytes(content)
    (tmp_path / "restarts.json").write_bytes(content)
    sup = Supervisor(SLEEPER, tmp_path, cgroup_dir="")  # start-up never fails on file content
    assert sup.flags.current == Flags(0.9, 8)  # the command line's
    assert len(sup.problems()) == 2
    assert (tmp_path / "flags.json.bad").read_bytes() == content
    assert not (tmp_path / "flags.json").exists()


class Killed(BaseException):
    """What no loop catches: the injected death of a thread."""


@pytest.mark.slow  # waits out a restart backoff (seconds)
def test_a_dead_log_reader_is_restarted_and_the_pipe_stays_drained(tmp_path, monkeypatch):
    script = shell(
        "i=0; while [ $i -lt 3000 ]; do echo line $i; i=$((i+1)); done; echo last; sleep 600"
    )
    real = logfile.RotatingLog.write
    calls: list[int] = []

    def dies_once(self: logfile.RotatingLog, line: bytes) -> None:
        calls.append(1)
        if len(calls) == 100:
            raise Killed("injected")
        real(self, line)

    monkeypatch.setattr(logfile.RotatingLog, "write", dies_once)
    sup = Supervisor(script, tmp_path, cgroup_dir="")
    sup.start()
    try:
        assert sup._reader is not None
        sup._reader.settle = 2.0
        assert until(lambda: sup.thread_restarts["log-reader"] == 1)
        assert any("log-reader" in p for p in sup.problems())
        # restarted after its backoff: it read on to the end of the output (3,000 lines, well
        # past a pipe's buffer: had nobody read, the child would block in echo)
        assert until(lambda: bool(sup._tail) and sup._tail[-1].strip() == "last")
        with TestClient(create_app(sup, OPEN)) as client:
            text = client.get("/metrics").text
            assert 'oomguard_supervisor_thread_restarts_total{thread="log-reader"} 1' in text
            assert until(lambda: client.get("/healthz").status_code == 200, 10)
        assert (Path(tmp_path) / "vllm.log").read_text().splitlines()[-1] == "last"
    finally:
        sup.stop()


def test_a_vllm_that_outlives_sigkill_is_not_doubled_by_a_restart(tmp_path, monkeypatch):
    """A process in uninterruptible sleep (the GPU driver) survives SIGKILL for a while. The
    restart answered 500 (TimeoutExpired out of the wait) and a stop raised; now the restart is
    a 503 that starts nothing beside it (the GPU and the port are still taken), and stop goes on."""
    from oomguard import children
    from oomguard.remediator import supervisor

    real = children.signal_group
    undelivered: list[int] = []

    def kill_not_delivered(pid: int, sig: int) -> None:
        if sig == signal.SIGKILL:
            undelivered.append(pid)  # as if the process were in uninterruptible sleep
            return
        real(pid, sig)

    monkeypatch.setattr(children, "signal_group", kill_not_delivered)
    monkeypatch.setattr(supervisor, "KILL_WAIT_SECONDS", 0.5)
    stubborn = shell("trap '' TERM; echo up; while :; do sleep 1; done")
    sup = Supervisor(stubborn, tmp_path, stop_timeout=0.5, cgroup_dir="")
    sup.start()
    assert sup.child is not None
    pid = sup.child.pid
    try:
        with TestClient(create_app(sup, OPEN), raise_server_exceptions=False) as client:
            r = client.post("/v1/restart", json={"reason": "test"})
            assert r.status_code == 503, r.text
            assert "after SIGKILL" in r.json()["error"] and r.headers["Retry-After"] == "30"
            status = client.get("/v1/status").json()
        assert undelivered == [pid]
        assert sup.generation == 1 and status["pid"] == pid and sup.child.poll() is None
        sup.stop()  # logs what is left behind instead of raising
        assert sup.child.poll() is None
    finally:
        monkeypatch.setattr(children, "signal_group", real)
        real(pid, signal.SIGKILL)
        sup.child.wait(10)
