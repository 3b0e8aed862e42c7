"""bench.outcome's repeats: one more run of a trace at the same code, recorded beside its row,
and the summary over the runs that measured the row's code (docs/benchmarks.md reads it)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from bench import outcome

_RUNS = itertools.count()


def _row(default: float, oomguard: float, digest: str, when: str | None = None) -> dict:
    """A trace's recorded row (each call another run, unless `when` says which)."""

    def o(goodput: float) -> dict[str, Any]:
        return {"goodput_tokens_per_s": goodput, "requests": 10, "lost": 0, "crashes": 0, "x": 1}

    return {
        "when": when or f"2026-12-05T10:{next(_RUNS):02d}:00Z",
        "outcomes": {"default": o(default), "oomguard": o(oomguard)},
        "provenance": {"commit": "c0ffee", "measured_digest": digest},
    }


def test_a_repeat_keeps_each_configurations_counts_and_its_ratio():
    entry = outcome.repeat_entry(_row(100.0, 95.0, "d1"))
    assert entry["oomguard_vs_default"] == 0.95
    assert set(entry["outcomes"]) == {"default", "oomguard"}
    assert "x" not in entry["outcomes"]["default"]  # only REPEAT_FIELDS
    assert entry["provenance"]["measured_digest"] == "d1"
    # without vLLM alone's run (or with no goodput at all) there is no ratio, not a crash
    assert outcome.versus_default({"oomguard": {"goodput_tokens_per_s": 1.0}}) is None
    assert outcome.versus_default(_row(0.0, 5.0, "d1")["outcomes"]) is None


def test_the_summary_counts_only_runs_of_the_rows_code():
    recorded: dict[str, Any] = {"traces": {"creep": _row(100.0, 94.0, "d1")}}
    outcome.add_repeats(recorded, "creep", [outcome.repeat_entry(_row(100.0, 101.0, "d1"))])
    outcome.add_repeats(
        recorded,
        "creep",
        [
            outcome.repeat_entry(_row(100.0, 99.0, "d1")),
            outcome.repeat_entry(_row(100.0, 150.0, "other code")),
        ],
    )
    summary = recorded["repeats"]["creep"]["oomguard_vs_default"]
    assert summary["ratios"] == [0.94, 1.01, 0.99]
    assert (summary["n"], summary["min"], summary["median"], summary["max"]) == (
        3,
        0.94,
        0.99,
        1.01,
    )
    assert summary["left_out"] == 1 and len(recorded["repeats"]["creep"]["runs"]) == 3
    # re-recorded at new code: the old repeats stay listed and leave the figures
    recorded["traces"]["creep"] = _row(100.0, 97.0, "d2")
    outcome.add_repeats(recorded, "creep", [])
    summary = recorded["repeats"]["creep"]["oomguard_vs_default"]
    assert summary["ratios"] == [0.97] and summary["left_out"] == 3


def test_add_repeat_records_a_partial_runs_file_and_keeps_the_rows(tmp_path: Path):
    out, run = tmp_path / "outcome.json", tmp_path / "repeat.json"
    out.write_text(json.dumps({"traces": {"creep": _row(100.0, 94.0, "d1")}, "note": "kept"}))
    run.write_text(json.dumps({"traces": {"creep": _row(100.0, 104.0, "d1")}}))
    assert outcome.add_repeat_files(out, [run]) == 0
    written = json.loads(out.read_text())
    assert written["benchmark"] == "outcome" and written["note"] == "kept"
    assert written["traces"]["creep"]["outcomes"]["oomguard"]["goodput_tokens_per_s"] == 94.0
    summary = written["repeats"]["creep"]["oomguard_vs_default"]
    assert summary["n"] == 2 and summary["max"] == 1.04


def test_runs_made_otherwise_or_twice_leave_the_figures_alone():
    row = _row(100.0, 94.0, "d1") | {"time_compression": 20.0, "inflight": 64}
    recorded: dict[str, Any] = {"traces": {"creep": row}}
    same = outcome.repeat_entry(
        _row(100.0, 98.0, "d1") | {"time_compression": 20.0, "inflight": 64}
    )
    faster = outcome.repeat_entry(
        _row(100.0, 130.0, "d1") | {"time_compression": 40.0, "inflight": 64}
    )
    assert outcome.add_repeats(recorded, "creep", [same, faster]) == 2
    assert outcome.add_repeats(recorded, "creep", [same]) == 0  # the same run again
    assert outcome.add_repeats(recorded, "creep", [outcome.repeat_entry(row)]) == 0  # the row
    summary = recorded["repeats"]["creep"]["oomguard_vs_default"]
    assert summary["ratios"] == [0.94, 0.98] and summary["left_out"] == 1


def test_a_run_without_vllm_alone_is_counted_apart_and_no_runs_give_dashes():
    recorded: dict[str, Any] = {"traces": {"creep": _row(100.0, 94.0, "d1")}}
    failed = _row(100.0, 97.0, "d1", when="2026-12-05T11:00:00Z")
    del failed["outcomes"]["default"]  # vLLM alone did not start
    outcome.add_repeats(recorded, "creep", [outcome.repeat_entry(failed)])
    summary = recorded["repeats"]["creep"]["oomguard_vs_default"]
    assert (summary["n"], summary["without_ratio"]) == (1, 1)
    # a trace without its row (nothing comparable): the page shows dashes, not a traceback
    empty = outcome.repeats_summary(None, [])
    assert (empty["n"], empty["min"], empty["median"], empty["max"]) == (0, None, None, None)
    from bench.report import fmt

    assert fmt(empty["median"], ".3f") == "–"
    assert fmt([0.9441, 1.0], "list:.3f") == "0.944, 1.000"


def test_a_new_row_recomputes_the_summary_of_the_repeats_beside_it():
    """A normal run replacing a trace's row (bench.outcome main) re-sums its repeats: the page
    never shows the old row's ratio beside the new row."""
    recorded: dict[str, Any] = {"traces": {"creep": _row(100.0, 94.0, "d1")}}
    outcome.add_repeats(recorded, "creep", [outcome.repeat_entry(_row(100.0, 96.0, "d1"))])
    new_row = _row(100.0, 99.0, "d1")
    recorded["traces"]["creep"] = new_row
    outcome.resummarise(recorded, "creep", new_row)
    summary = recorded["repeats"]["creep"]["oomguard_vs_default"]
    assert summary["ratios"] == [0.99, 0.96] and summary["median"] == 0.975
    outcome.resummarise(recorded, "spike", new_row)  # a trace without repeats: none made
    assert set(recorded["repeats"]) == {"creep"}
