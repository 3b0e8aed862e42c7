"""Which recorded benchmark results measured code that has changed since (part of `make check`).

Each result under bench/results/ carries its provenance (bench/record.py): the commit it measured,
the paths it measures and a digest of those files as run. A result is **stale** when the digest of
the same paths in the working tree differs: the code its figures describe is not the code here.
For each stale result this lists the commits that touched its measured paths since its commit
(`git log <commit>..HEAD -- <paths>`), uncommitted changes to them, and how to re-record it.

Exit status: 1 when a result has no provenance or no commit (nothing can tell whether it is
stale), or with `--since REV` when code measured by a result changed in REV..HEAD (or in the
working tree) and the result was not re-recorded after: run it on a branch before it is merged,
`python -m bench.stale --since main`, so that an issue that changes measured code re-records the
result before it is resolved. Otherwise stale results are listed and the exit status is 0: the
long benchmarks (outcome, matrix, recovery, fleet) cannot be re-recorded on every change, and
`make check` must not fail for a change elsewhere; the list is the to-do.

Results kept as history (`previous`, `earlier_runs`, `repeats`, *.previous.json) are never listed
as stale.

Usage: python -m bench.stale [--since REV] [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import record

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
# runs kept for comparison, replaced on purpose; `repeats` (bench.outcome) count only while they
# measured their row's code, whose own staleness says when that changed
HISTORY_KEYS = ("previous", "earlier_runs", "repeats")
SHOWN_COMMITS = 8  # per stale result; the rest are counted


@dataclass
class Part:
    """One recorded run: a whole results file, or one trace, case or cell merged into it."""

    file: str
    where: str  # JSON path inside the file, "" for the file's own provenance
    provenance: dict[str, Any]
    history: bool
    stale: bool = False
    commits: list[str] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    problem: str = ""  # no provenance or no commit: a failure

    @property
    def name(self) -> str:
        return f"{self.file} {self.where}".strip()


def is_provenance(value: Any) -> bool:
    return isinstance(value, dict) and "commit" in value and "measures" in value


def _item_name(item: Any, index: int) -> str:
    """A list entry by what it is (a matrix cell's GPU and trace), else by its index."""
    if isinstance(item, dict):
        named = [str(item[k]) for k in ("gpu", "trace", "name") if isinstance(item.get(k), str)]
        if named:
            return " ".join(named)
    return str(index)


def parts_of(file: str, data: Any) -> list[Part]:
    """The file's own provenance and every nested one (a trace's, a case's, a cell's)."""
    history = file.endswith(".previous.json")
    found: list[Part] = []

    def walk(value: Any, where: str, in_history: bool) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                path = f"{where}.{key}" if where else str(key)
                if is_provenance(child):  # `provenance`, or one of `provenance_by_case`
                    named = where if key == "provenance" else path
                    found.append(Part(file, named, child, in_history))
                else:
                    walk(child, path, in_history or key in HISTORY_KEYS)
        elif isinstance(value, list):
            for i, child in enumerate(value):
                walk(child, f"{where}[{_item_name(child, i)}]", in_history)

    if not isinstance(data, dict) or not is_provenance(data.get("provenance")):
        part = Part(file, "", {}, history, problem="no provenance (commit, measured paths)")
        walk(data, "", history)
        return [part, *found]
    walk(data, "", history)
    return found


def check(part: Part, head: str | None) -> None:
    p = part.provenance
    commit, measures = str(p.get("commit") or ""), p.get("measures") or []
    here = _with_moves(measures)
    if not part.problem and not commit:
        part.problem = "no commit recorded"
    if not part.problem and not measures:
        part.problem = "no measured paths recorded"
    if part.problem or part.history:
        return
    now = record.tree_digest(tuple(measures))
    if now is None or now == p.get("measured_digest"):
        return
    part.stale = True
    if record._git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        part.commits = [f"(commit {commit[:10]} is not in this repository: rebased, or shallow)"]
    elif head:
        log = record._git(
            "log",
            "--format=%h %ad %s",
            "--date=format:%Y-%m-%d %H:%M",
            f"{commit}..HEAD",
            "--",
            *here,
        )
        part.commits = (log or "").splitlines()
    diff = record._git("diff", "--name-only", "HEAD", "--", *here) or ""
    part.uncommitted = diff.split()


def _with_moves(measures: list[str]) -> list[str]:
    """The measured paths and, for a result recorded before the move, where they are now."""
    return list(dict.fromkeys([*measures, *(q for m in measures for q in record.current_paths(m))]))


def changed_since(rev: str, part: Part) -> list[str]:
    """Measured files changed between `rev` and the working tree; a file only moved (same
    content, another path: issue 28's move) is not a change."""
    out = record._git(
        "diff",
        "--name-status",
        "--find-renames=100%",
        rev,
        "--",
        *_with_moves(part.provenance.get("measures", [])),
    )
    lines = [ln.split("\t") for ln in (out or "").splitlines() if ln]
    return [f[-1] for f in lines if f[0] != "R100"]


def load(results: Path) -> list[Part]:
    parts: list[Part] = []
    for path in sorted(results.glob("*.json")):
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            parts.append(Part(rel, "", {}, False, problem=f"not JSON: {exc}"))
            continue
        parts.extend(parts_of(rel, data))
    return parts


def rerecord_hint(part: Part) -> str:
    script = next((m for m in part.provenance.get("measures", []) if m.startswith("bench/")), "")
    if not script:
        return ""
    return f"python -m {script.removesuffix('.py').replace('/', '.')}"


def report_file(file: str, stale: list[Part], blocking: list[Part]) -> None:
    """One block per results file: its stale runs, the commits since the oldest, the command."""
    changed_here = any(p in blocking for p in stale)
    print(f"STALE{' (measured code changed on this branch)' if changed_here else ''}  {file}")
    for p in stale:
        prov = p.provenance
        print(
            f"    {p.where or '(the file)'}: recorded {prov.get('when')} at "
            f"{str(prov.get('commit'))[:10]}" + (" (backfilled)" if prov.get("backfilled") else "")
        )
    oldest = max(stale, key=lambda p: len(p.commits))
    if oldest.commits:
        print(f"    measured code changed in {len(oldest.commits)} commits since, newest first:")
        for line in oldest.commits[:SHOWN_COMMITS]:
            print(f"      {line if len(line) <= 110 else line[:107] + '...'}")
        if len(oldest.commits) > SHOWN_COMMITS:
            print(f"      ... and {len(oldest.commits) - SHOWN_COMMITS} more")
    uncommitted = sorted({f for p in stale for f in p.uncommitted})
    if uncommitted:
        print(f"    uncommitted changes: {' '.join(uncommitted)}")
    hint = rerecord_hint(stale[0])
    if hint:
        merged = " (merged runs: see its --help)" if len(stale) > 1 else ""
        print(f"    re-record: {hint}{merged}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--since",
        metavar="REV",
        help="fail when code measured by a stale result changed in REV..HEAD or the working tree",
    )
    parser.add_argument("--results", default=str(RESULTS), help="results folder")
    args = parser.parse_args(argv)
    head = record._git("rev-parse", "HEAD")
    if head is None:
        print("bench/stale.py: not a git checkout: cannot tell which results are stale")
        return 0
    parts = load(Path(args.results))
    for part in parts:
        check(part, head)
    problems = [p for p in parts if p.problem]
    stale = [p for p in parts if p.stale]
    blocking = []
    if args.since:
        blocking = [p for p in stale if changed_since(args.since, p)]
    current = [p for p in parts if not p.problem and not p.stale and not p.history]
    print(
        f"bench results: {len(parts)} recorded runs in {len({p.file for p in parts})} files: "
        f"{len(current)} current, {len(stale)} stale, {len(problems)} without provenance"
    )
    for p in problems:
        print(f"NO PROVENANCE  {p.name}: {p.problem}")
    for file in dict.fromkeys(p.file for p in stale):
        report_file(file, [p for p in stale if p.file == file], blocking)
    if problems:
        print("results without a commit cannot be checked: re-record them (bench/record.py)")
        return 1
    if blocking:
        print(f"{len(blocking)} results measure code changed since {args.since}: re-record them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
