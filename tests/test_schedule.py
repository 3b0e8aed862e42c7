"""The 2-worker schedule of `make test` (tests/conftest.py): every file that starts a vLLM server
is a unit xdist hands out early, longest first. A new such file left off UNIT_SECONDS would count
as short and could be the last unit to start, a minute or more with the other worker idle."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.conftest import UNIT_SECONDS

TESTS = Path(__file__).parent
# what starts a vLLM server (or a fleet of them, or vLLM's own sizing in a child) in a test file
STARTS_VLLM = re.compile(
    r"VllmServer\(|VllmProcess\(|SupervisedVllm\(|vllm_command\(|plain_vllm\b|fleet\.start\(\)"
    r"|\"bench\.(outcome|detection)\"|step_guard\.phase\(|vllm_path\.run\(|twin_oom_dir\b"
)
# files that start vLLM in a way the pattern cannot see: the docs' own systemd units
STARTS_VLLM_UNSEEN = ("test_rehearsal.py",)


def unit_of(path: Path) -> str:
    """The file's xdist unit as conftest names it: its own xdist_group, else the file name."""
    marks = getattr(importlib.import_module(f"tests.{path.stem}"), "pytestmark", [])
    for mark in marks if isinstance(marks, list) else [marks]:
        if mark.name == "xdist_group":
            return str(mark.args[0])
    return path.name


def test_every_file_that_starts_vllm_is_scheduled_by_its_length():
    starting = sorted(
        p
        for p in TESTS.glob("test_*.py")
        if p.name != Path(__file__).name
        and (STARTS_VLLM.search(p.read_text()) or p.name in STARTS_VLLM_UNSEEN)
    )
    assert len(starting) >= 15  # the pattern still finds them
    missing = [f"{p.name} ({unit_of(p)})" for p in starting if unit_of(p) not in UNIT_SECONDS]
    assert not missing, f"add to tests/conftest.py UNIT_SECONDS: {missing}"


def test_units_go_longest_first_and_files_keep_their_order():
    """conftest's hook, run on a worker's collection: the listed units first, by length, the
    rest after them in collection order, and each unit's tests in their own order."""
    from tests import conftest

    class Item:
        def __init__(self, group: str, n: int) -> None:
            self.mark = pytest.mark.xdist_group(group).mark
            self.name = f"{group}::{n}"

        def get_closest_marker(self, name: str) -> object:
            return self.mark if name == "xdist_group" else None

    items = [
        Item("test_a.py", 0),
        Item("test_vllm_plugin_dp.py", 0),
        Item("wheel", 0),
        Item("test_vllm_plugin_dp.py", 1),
        Item("test_b.py", 0),
        Item("test_restart.py", 0),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_XDIST_WORKER", "gw0")
        conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.name for i in items] == [
        "wheel::0",
        "test_restart.py::0",
        "test_vllm_plugin_dp.py::0",
        "test_vllm_plugin_dp.py::1",
        "test_a.py::0",
        "test_b.py::0",
    ]
