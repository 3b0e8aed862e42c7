"""Children die with their parent (oomguard.children): a demo or a test killed with SIGKILL left
its `oomguard serve`, vLLM, Prometheus and Alertmanager processes running (each in a session of
its own, reparented to init), and a supervisor killed that way left its vLLM holding the GPU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard import children
from oomguard.lab.processes import free_port

pytestmark = pytest.mark.skipif(not children.SUPPORTED, reason="Linux only (PR_SET_PDEATHSIG)")
ROOT = Path(__file__).resolve().parent.parent


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def wait_lines(path: Path, n: int, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.1)
    raise AssertionError(f"{path}: fewer than {n} lines within {seconds}s")


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Process groups a failed test must not leave behind."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from oomguard.lab.processes import Process, start_all
    work = Path(sys.argv[1])
    # started in parallel threads that end at once, as the demo starts its fleets
    started = start_all(
        [lambda i=i: Process(["sleep", "600"], work / f"{i}.log") for i in range(3)]
    )
    print(" ".join(str(p.proc.pid) for p in started), flush=True)
    time.sleep(600)
    """
)


def test_twin_processes_die_when_their_parent_is_killed(tmp_path, reap):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    reap.append(parent.pid)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        reap.extend(pids)
        assert len(pids) == 3
        time.sleep(1)  # the threads that started them are gone: the children are not
        assert all(alive(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)  # as a CI timeout or the OOM killer ends it
        parent.wait(10)
        assert gone_within(pids, 15) == []
    finally:
        parent.kill()
        parent.wait(10)


FAKE_VLLM = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    pids = Path(sys.argv[1])
    first = not pids.exists()
    with pids.open("a") as fh:
        fh.write(f"{os.getpid()}\\n")
    if first:
        sys.exit(1)  # crash once: the next one is started from the dying one's log reader
    time.sleep(600)
    """
)


def test_vllm_dies_with_a_killed_supervisor_also_after_a_restart(tmp_path, reap):
    pids_file = tmp_path / "pids"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oomguard",
            "serve",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--allow-unauthenticated",
            "--state-dir",
            str(tmp_path / "state"),
            "--restart-delay",
            "0.1",
            "--",
            sys.executable,
            "-c",
            FAKE_VLLM,
            str(pids_file),
            "--max-num-seqs",
            "8",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    reap.append(serve.pid)
    try:
        first, second = (int(p) for p in wait_lines(pids_file, 2, 60)[:2])
        reap.append(second)
        time.sleep(1)  # the first generation's log reader, which started this one, has ended
        assert alive(second) and not alive(first)
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(10)
        assert gone_within([second], 15) == []
    finally:
        serve.kill()
        serve.wait(10)


def test_fake_systemctl_units_are_stopped_once_the_test_process_is_gone(tmp_path, reap):
    """The rehearsal's units outlive `systemctl start`, as daemons do: its watcher stops them
    when the test process that owns the sandbox dies."""
    owner = subprocess.Popen(["sleep", "600"])
    unit = subprocess.Popen(["sleep", "600"], start_new_session=True)
    reap.append(unit.pid)
    units = tmp_path / "run" / "units"
    units.mkdir(parents=True)
    (units / "oomguard-serve.pid").write_text(str(unit.pid))
    watcher = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/fake_systemctl.py"), "--watch", str(owner.pid)],
        cwd=ROOT,
        env={**os.environ, "SANDBOX": str(tmp_path)},
    )
    try:
        time.sleep(1)
        assert alive(unit.pid)  # the owner lives: the unit runs
        owner.kill()
        owner.wait(10)
        assert watcher.wait(30) == 0
        unit.wait(10)
        assert not alive(unit.pid) and not (units / "oomguard-serve.pid").exists()
    finally:
        owner.kill()
        owner.wait(10)
        watcher.kill()
        watcher.wait(10)


def test_a_group_whose_leader_was_reaped_still_gets_the_signal(tmp_path: Path) -> None:
    """CI: the supervisor's stop polled its child (running), the thread that watches the child
    reaped it, and `os.getpgid` then raised ProcessLookupError out of `stop()`. The group id is
    the leader's pid: the signal reaches what the leader left in its group (vLLM's EngineCore),
    and a group with nobody left is reported, not raised."""
    pid_file = tmp_path / "grandchild"
    leader = subprocess.Popen(
        ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; exit 0"], start_new_session=True
    )
    leader.wait(10)  # reaped, as the watching thread does
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.getpgid(leader.pid)  # what the old code called
    assert children.signal_group(leader.pid, signal.SIGTERM)
    assert gone_within([grandchild], 10) == []


def test_the_supervisor_stops_a_child_reaped_under_it(tmp_path: Path) -> None:
    """The race itself: `poll()` says running, the process is already reaped."""
    from oomguard.remediator.supervisor import Supervisor

    argv = ["sh", "-c", "true", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.9"]
    sup = Supervisor(argv, tmp_path / "state", cgroup_dir="")
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    os.waitpid(child.pid, 0)  # reaped behind Popen's back: poll() will not know

    class Running:
        pid = child.pid
        returncode = None

        def poll(self) -> None:
            return None

        def wait(self, timeout: float | None = None) -> int:
            return 0

    sup.child = Running()  # type: ignore[assignment]
    sup.stop()  # raised ProcessLookupError before
    assert not children.signal_group(child.pid, signal.SIGTERM)  # nobody left in the group
