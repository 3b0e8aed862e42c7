"""Benchmark results carry their provenance, and bench/stale.py lists those measuring old code.

The recorder and the check run in a scratch git repository holding copies of bench/record.py and
bench/stale.py (they find the repository from their own path), with real commits, amends and
uncommitted edits, as on an engineer's branch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
}


class Scratch:
    """A git repository with the recorder, the check, and the fleet benchmark's measured paths."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bench" / "results").mkdir(parents=True)
        for name in ("__init__.py", "record.py", "stale.py"):
            shutil.copy(REPO / "bench" / name, root / "bench" / name)
        (root / "bench" / "fleet.py").write_text("# the fleet benchmark\n")
        (root / "remediator" / "oomguard" / "remediator").mkdir(parents=True)
        self.code = root / "remediator" / "oomguard" / "remediator" / "controller.py"
        self.code.write_text("PASS_SECONDS = 1\n")
        (root / "README.md").write_text("not measured\n")
        self.git("init", "-q", "-b", "main")
        self.commit("initial")

    def git(self, *args: str) -> str:
        r = subprocess.run(
            ["git", *args],
            cwd=self.root,
            env={**os.environ, **GIT_ENV},
            capture_output=True,
            text=True,
            check=True,
        )
        return r.stdout

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD").strip()

    def record(self, **fields: Any) -> dict[str, Any]:
        code = (
            "import json, sys; from bench import record; "
            "record.write('bench/results/fleet.json', 'fleet', False, **json.loads(sys.argv[1]))"
        )
        subprocess.run([sys.executable, "-c", code, json.dumps(fields)], cwd=self.root, check=True)
        return json.loads((self.root / "bench" / "results" / "fleet.json").read_text())

    def stale(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "bench.stale", *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=60,
        )


@pytest.fixture
def scratch(tmp_path: Path) -> Scratch:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    return Scratch(tmp_path)


def test_a_record_carries_commit_tree_state_machine_and_load(scratch: Scratch) -> None:
    head = scratch.git("rev-parse", "HEAD").strip()
    rec = scratch.record(results={"reads_per_s": 44.5})
    prov = rec["provenance"]
    assert prov["commit"] == head
    assert prov["dirty"] is False and prov["dirty_measured"] == []
    assert prov["measures"] == ["bench/fleet.py", "remediator/oomguard/remediator"]
    assert prov["measured_digest"]
    assert len(prov["load_average"]["at_start"]) == 3 and len(prov["load_average"]["at_end"]) == 3
    assert prov["started"] <= prov["when"]
    assert rec["machine"]["cpus"] and rec["machine"]["python"]
    assert rec["results"] == {"reads_per_s": 44.5}


def test_a_dirty_run_names_the_uncommitted_measured_files(scratch: Scratch) -> None:
    (scratch.root / "README.md").write_text("edited\n")
    assert scratch.record()["provenance"]["dirty_measured"] == []
    scratch.code.write_text("PASS_SECONDS = 2\n")
    prov = scratch.record()["provenance"]
    assert prov["dirty"] is True
    assert prov["dirty_measured"] == ["remediator/oomguard/remediator/controller.py"]
    # it measured the edited file: current while the edit stays, and once it is committed
    assert "1 current, 0 stale" in scratch.stale().stdout
    scratch.commit("pass of two seconds")
    assert "1 current, 0 stale" in scratch.stale().stdout


def test_a_result_is_stale_once_its_measured_code_changes(scratch: Scratch) -> None:
    scratch.record(results={})
    scratch.commit("fleet recorded")
    r = scratch.stale()
    assert r.returncode == 0 and "1 current, 0 stale" in r.stdout, r.stdout

    # a change elsewhere leaves it current
    (scratch.root / "README.md").write_text("edited\n")
    scratch.commit("readme")
    assert "1 current, 0 stale" in scratch.stale().stdout

    # an uncommitted change to measured code: listed, not failed
    scratch.code.write_text("PASS_SECONDS = 3\n")
    r = scratch.stale()
    assert r.returncode == 0, r.stdout
    assert "STALE  bench/results/fleet.json" in r.stdout
    assert "uncommitted changes: remediator/oomguard/remediator/controller.py" in r.stdout
    assert "re-record: python -m bench.fleet" in r.stdout

    # committed: the commit that changed it is listed
    scratch.commit("controller: a three-second pass")
    r = scratch.stale()
    assert r.returncode == 0
    assert "controller: a three-second pass" in r.stdout
    assert "readme" not in r.stdout  # only commits touching measured paths
    # on a branch that changed the measured code since main, --since fails until re-recorded
    assert scratch.stale("--since", "HEAD~1").returncode == 1
    assert scratch.stale("--since", "HEAD").returncode == 0  # nothing changed since HEAD

    scratch.record(results={})
    r = scratch.stale("--since", "HEAD~1")
    assert r.returncode == 0 and "1 current, 0 stale" in r.stdout, r.stdout


def test_a_rebased_result_stays_current(scratch: Scratch) -> None:
    """The commit hash changes with a rebase or amend; the measured files do not."""
    scratch.record(results={})
    old = scratch.commit("fleet recorded")
    scratch.git("commit", "-q", "--amend", "-m", "fleet recorded (reworded)")
    assert scratch.git("rev-parse", "HEAD").strip() != old
    r = scratch.stale()
    assert "1 current, 0 stale" in r.stdout, r.stdout


def test_a_result_without_a_commit_fails(scratch: Scratch) -> None:
    results = scratch.root / "bench" / "results"
    (results / "old.json").write_text(json.dumps({"benchmark": "fleet", "results": {}}))
    r = scratch.stale()
    assert r.returncode == 1
    assert "NO PROVENANCE  bench/results/old.json" in r.stdout

    rec = scratch.record()
    rec["provenance"]["commit"] = None
    (results / "old.json").write_text(json.dumps(rec))
    r = scratch.stale()
    assert r.returncode == 1 and "no commit recorded" in r.stdout


def test_merged_runs_are_checked_each_and_history_is_not(scratch: Scratch) -> None:
    """A trace or case merged into the file carries its own provenance; `previous` is history."""
    rec = scratch.record()
    first = dict(rec["provenance"])
    scratch.code.write_text("PASS_SECONDS = 4\n")
    scratch.commit("controller: four")
    rec = scratch.record(
        provenance_by_case={"idle": first},  # recorded before the change
        previous={"provenance": first},
        repeats={"idle": {"runs": [{"provenance": first}]}},  # bench.outcome --repeat's
    )
    # the record's own key is this run's, whatever the caller passed back
    assert rec["provenance"]["commit"] == scratch.git("rev-parse", "HEAD").strip()
    r = scratch.stale()
    assert "provenance_by_case.idle: recorded" in r.stdout
    assert "previous" not in r.stdout and "repeats" not in r.stdout
    assert "controller: four" in r.stdout


def test_an_unknown_benchmark_name_is_refused_before_writing(scratch: Scratch) -> None:
    code = "from bench import record; record.write('bench/results/x.json', 'nosuch', False)"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=scratch.root, capture_output=True, text=True
    )
    assert r.returncode != 0 and "MEASURES has no entry for benchmark 'nosuch'" in r.stderr
    assert not (scratch.root / "bench" / "results" / "x.json").exists()


def test_a_result_recorded_before_the_move_compares_at_the_new_paths(scratch: Scratch) -> None:
    """Issue 28 moved src/oomguard/<component>/ to <component>/oomguard/<component>/. A result
    recorded before names the old paths: a pure move leaves it current (also for --since), a
    change to the moved code makes it stale."""
    old = scratch.root / "src" / "oomguard" / "remediator"
    old.mkdir(parents=True)
    scratch.git("mv", "remediator/oomguard/remediator/controller.py", str(old / "controller.py"))
    (old.parent / "__init__.py").write_text('__version__ = "0.1.0"\n')
    before = scratch.commit("the old layout")
    code = (
        "import json; from bench import record; "
        "paths = ('bench/fleet.py', 'src/oomguard/remediator'); "
        "print(json.dumps({'commit': record._git('rev-parse', 'HEAD').strip(), "
        "'measures': list(paths), 'measured_digest': record.tree_digest(paths)}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=scratch.root, capture_output=True, text=True, check=True
    ).stdout
    results = scratch.root / "bench" / "results" / "fleet.json"
    results.write_text(json.dumps({"benchmark": "fleet", "provenance": json.loads(out)}))
    recorded = scratch.commit("fleet recorded under src/oomguard")
    assert "1 current, 0 stale" in scratch.stale().stdout

    scratch.git("mv", str(old / "controller.py"), str(scratch.code))
    scratch.git("rm", "-q", str(old.parent / "__init__.py"))
    scratch.commit("issue 28: the move")
    # git leaves the emptied folders (and, in a used checkout, their ignored caches) behind
    assert (scratch.root / "src" / "oomguard").is_dir()
    r = scratch.stale("--since", recorded)
    assert r.returncode == 0 and "1 current, 0 stale" in r.stdout, r.stdout
    assert scratch.stale("--since", before).returncode == 0

    scratch.code.write_text("PASS_SECONDS = 5\n")
    scratch.commit("controller: a five-second pass")
    r = scratch.stale("--since", recorded)
    assert r.returncode == 1 and "0 current, 1 stale" in r.stdout, r.stdout
    assert "controller: a five-second pass" in r.stdout


# -- the repository's own results ----------------------------------------------------------------
def test_every_declared_measured_path_exists() -> None:
    from bench import record

    missing = [p for paths in record.MEASURES.values() for p in paths if not (REPO / p).exists()]
    assert missing == []


def test_every_recorded_result_carries_its_commit_and_measured_paths() -> None:
    from bench import record, stale

    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert data["benchmark"] in record.MEASURES, path.name
        parts = stale.parts_of(path.name, data)
        assert parts, path.name
        for part in parts:
            assert not part.problem, (path.name, part.problem)
            prov = part.provenance
            assert isinstance(prov["commit"], str) and len(prov["commit"]) == 40, part.name
            assert prov["measures"] and prov["measured_digest"], part.name
            assert isinstance(prov["backfilled"], bool), part.name


def test_outcome_repeat_summaries_agree_with_the_rows_they_summarize() -> None:
    """`repeats.<trace>.oomguard_vs_default` is derived from the trace's row and the repeats made
    as it was; docs/benchmarks.md prints it as the recorded run's spread. A row re-recorded
    without recomputing it left the old row's ratios there (bench/outcome.py's main() writes a
    new row without touching `repeats`: recompute the summary there when the row changes)."""
    from bench.outcome import repeats_summary

    recorded = json.loads((RESULTS / "outcome.json").read_text())
    for key, repeats in recorded.get("repeats", {}).items():
        row = recorded["traces"].get(key)
        assert repeats["oomguard_vs_default"] == repeats_summary(row, repeats["runs"]), key
