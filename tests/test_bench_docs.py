"""docs/benchmarks.md is generated from bench/results/*.json: no figure on it is typed by hand.

`oomguard generate --check` compares the committed page with what bench/report.py makes of the
results and the prose of bench/docs/benchmarks.md; these tests pin the rules behind it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import report
from oomguard.cli import benchmark_docs, main

REPO = Path(__file__).resolve().parents[1]


def test_the_committed_page_is_what_the_results_give() -> None:
    page = benchmark_docs(REPO)[Path("docs/benchmarks.md")]
    assert (REPO / "docs" / "benchmarks.md").read_text() == page, (
        "docs/benchmarks.md differs from bench/results: run `oomguard generate`"
    )


def test_the_prose_types_no_figure() -> None:
    assert report.typed_figures((REPO / report.TEMPLATE).read_text()) == []


@pytest.mark.parametrize(
    "line",
    [
        "recovery took 44.6 s",  # a figure: must come from a result
        "p99 of 3 ms",
        "H100 at 0.92",
        "in `code` but 5 outside",
    ],
)
def test_a_figure_typed_into_the_prose_is_found(line: str) -> None:
    assert report.typed_figures(f"# Title\n\n{line}\n") == [f"{report.TEMPLATE}:3: {line}"]


@pytest.mark.parametrize(
    "line",
    [
        "an H100 80 GB, an A100 40 GB, an L4 and an RTX 4090",
        "MIG 1g.10gb and 3g.40gb",
        "issue 30, engine 0 and engine 1, FP32 logits",
        "what Prometheus 2.x asks for, as vLLM 0.33 does",
        "`--inflight 64` and commit `1b3c99f`",
        "{{exporter/scenarios/node/results/series|,d}} series, {{target:< 1 ms}}",
    ],
)
def test_names_code_and_placeholders_are_not_figures(line: str) -> None:
    assert report.typed_figures(line) == []


def copy_checkout(tmp: Path) -> Path:
    """What `oomguard generate` reads: the template, the results, the generator."""
    for part in ("bench/report.py", "bench/docs", "bench/results"):
        src, dst = REPO / part, tmp / part
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy(src, dst)
    (tmp / "docs").mkdir()
    return tmp


def test_a_new_result_changes_the_page_and_check_fails_until_regenerated(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path)
    assert main(["generate", "--root", str(root)]) == 0
    assert main(["generate", "--root", str(root), "--check"]) == 0
    page = (root / "docs" / "benchmarks.md").read_text()

    results = root / "bench" / "results" / "matrix.json"
    data = json.loads(results.read_text())
    data["seconds"] = 987654.0  # a re-recorded run
    results.write_text(json.dumps(data))
    assert main(["generate", "--root", str(root), "--check"]) == 1
    assert main(["generate", "--root", str(root)]) == 0
    new = (root / "docs" / "benchmarks.md").read_text()
    assert "987654 s" in new and "987654" not in page


def test_a_placeholder_without_its_value_fails_the_generator(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path)
    template = root / report.TEMPLATE
    template.write_text(template.read_text() + "\n{{matrix/no_such_key}}\n")
    with pytest.raises(KeyError, match="no_such_key"):
        report.outputs(root)


def test_a_typed_figure_fails_the_generator(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path)
    template = root / report.TEMPLATE
    template.write_text(template.read_text() + "\nRecovery took 44.6 s.\n")
    with pytest.raises(ValueError, match=r"44\.6"):
        report.outputs(root)


def test_outside_a_checkout_generate_writes_no_benchmark_page(tmp_path: Path) -> None:
    assert benchmark_docs(tmp_path) == {}


def test_every_section_says_where_its_figures_come_from() -> None:
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for name in sorted(p.stem for p in (REPO / "bench" / "results").glob("*.json")):
        assert f"{{{{provenance:{name}}}}}" in (REPO / report.TEMPLATE).read_text(), name
    assert page.count("*Recorded ") >= len(list((REPO / "bench" / "results").glob("*.json")))


def _row(config: str, **extra: object) -> dict[str, object]:
    return {
        "crashes": 0,
        "lost": 0,
        "requests": 10,
        "goodput_tokens_per_s": 5.0,
        "ttft_p99_s": 1.0,
        **extra,
    }


def test_a_step_trace_s_table_shows_the_step_guard_s_shrinks() -> None:
    """The step guard's shrinks are a column once a run counted them (issue 27); the rows
    before the step guard keep their eight columns."""
    trace = {
        "outcomes": {
            "default": _row("default", crashes=1, step_guard_shrinks={}),
            "oomguard-no-step-guard": _row("x", step_guard_shrinks={}),
            "oomguard": _row(
                "oomguard",
                step_guard_shrinks={"wait/activations": 3},
                cpu={"percent_of_one_core": {"engine_core": 104.6, "remediator": 2.2}},
            ),
        }
    }
    lines = report._outcome_table(trace).splitlines()
    assert lines[0].endswith("| engine cores' CPU, % of a core | step guard shrinks |")
    assert [len(line.split("|")) for line in lines] == [12] * len(lines)
    # the engine cores' CPU where the run's census recorded it (bench/census.py), else a dash
    assert lines[-1].endswith("| 105 | 3 wait/activations |")
    assert lines[2].endswith("| – | – |")
    assert "| static | not run |" in lines[3]
    before = {"outcomes": {"default": _row("default")}}
    assert "shrinks" not in report._outcome_table(before)


def test_the_step_traces_summary_says_what_held(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "outcome.json").write_text(json.dumps({"traces": {}}))
    assert "No step trace" in report.block_outcome_step_guard(report.Results(results))
    summary = {
        "traces": ["long-prompt-burst", "neighbour-2s-24gb"],
        "without_step_guard_lost_the_race_on": ["neighbour-2s-24gb"],
        "without_step_guard_lost_at_least_one": True,
        "with_step_guard_no_oom_nothing_lost": False,
    }
    (results / "outcome.json").write_text(json.dumps({"step_guard": summary}))
    text = report.block_outcome_step_guard(report.Results(results))
    assert "lost the race (a CUDA OOM) on neighbour-2s-24gb " in text
    assert "`without_step_guard_lost_at_least_one` met" in text
    assert "`with_step_guard_no_oom_nothing_lost` **missed**" in text


def test_the_gpu_check_table_shows_a_failed_check_without_claiming_it_agreed(
    tmp_path: Path,
) -> None:
    """A GPU run's table says what passed and what disagreed; a failed check's row never keeps
    the words that only a pass earns ("every field equal")."""
    results = tmp_path / "results"
    results.mkdir()
    recorded = json.loads((REPO / "bench" / "results" / "gpu-check.json").read_text())
    (results / "gpu-check.json").write_text(json.dumps(recorded))
    passed = report.block_gpu_check(report.Results(results))
    assert passed.count("| passed |") == sum(c["status"] == "pass" for c in recorded["checks"])
    allocator = next(c for c in recorded["checks"] if c["name"] == "allocator")
    allocator.update(status="fail", detail="reserved_bytes: 6 GiB vs torch 7 GiB")
    (results / "gpu-check.json").write_text(json.dumps(recorded))
    text = report.block_gpu_check(report.Results(results))
    row = next(line for line in text.splitlines() if line.startswith("| `allocator`"))
    assert "**fail**: reserved_bytes: 6 GiB vs torch 7 GiB" in row
    assert "every field equal" not in row


def test_a_steady_matrix_cell_runs_oomguard_alone_and_says_so(tmp_path: Path) -> None:
    """A do-no-harm cell has no vLLM-alone run: its row says so rather than failing the page."""
    results = tmp_path / "results"
    results.mkdir()
    steady = {
        "gpu": "L4",
        "trace": "do-no-harm",
        "replayed": {"from_s": 0.0, "duration_s": 600.0, "time_compression": 10.0},
        "oomguard": {"crashes": 0, "lost": 0, "actions": []},
        "agrees": True,
    }
    (results / "matrix-real.json").write_text(json.dumps({"cells": [steady]}))
    [row] = report.block_matrix_real(report.Results(results)).splitlines()[2:]
    assert "| not run (steady) | 0 crashes, 0 lost, 0 actions | yes |" in row
