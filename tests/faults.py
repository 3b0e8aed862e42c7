"""Real faults for tests: a file system that fills up (ENOSPC from the kernel, not a mock).

`small_fs(path, size)` mounts a tmpfs of `size` bytes at `path` (root, or a user namespace with
CAP_SYS_ADMIN, as on this build machine and in CI containers). Where mounting is not permitted
the test is skipped with the reason, never faked: what the kernel does on a full disk (a write
that stops mid-line, then ENOSPC) is the point. `fill(path)` takes every free byte; deleting the
file it returns gives them back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_fs(path: Path, size: int = 256 * 1024) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(directory: Path, leave: int = 0) -> Path:
    """Write a filler file until the file system is full (ENOSPC), then give back `leave`
    bytes (so a later write can stop mid-line). Returns the filler."""
    filler = directory / ".filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        block = b"\0" * 65536
        while True:
            os.write(fd, block)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    if leave:
        size = filler.stat().st_size
        os.truncate(filler, max(0, size - leave))
    return filler


def free(filler: Path) -> None:
    filler.unlink(missing_ok=True)


def pad(path: Path) -> None:
    """Fill the slack of `path`'s last block with newlines (blank lines, skipped by readers)
    until ENOSPC: on a full file system an append that fits in the block already allocated
    still succeeds, and a test that wants the next append to fail must take that room too."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\n" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
