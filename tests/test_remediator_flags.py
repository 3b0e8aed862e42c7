"""Restart flags on a vLLM command line: a step down of --max-num-seqs must leave a command
line vLLM accepts, which means --max-num-active-seqs clamped to it (vLLM's SchedulerConfig
refuses max_num_active_seqs > max_num_seqs)."""

from __future__ import annotations

import pytest

from oomguard.remediator.flags import FlagLimits, Flags, apply, read

# from a `vllm serve` line with a separate active limit (the twin's engines use one)
ARGV = [
    "vllm",
    "serve",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "--gpu-memory-utilization",
    "0.9",
    "--max-num-seqs",
    "16",
    "--max-num-active-seqs",
    "16",
]


def _option(argv: list[str], flag: str) -> str:
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


def test_a_step_down_clamps_the_active_limit_to_the_new_max_num_seqs():
    lowered = read(ARGV, default_seqs=256).lower(FlagLimits())
    assert lowered == Flags(0.86, 12)
    out = apply(ARGV, lowered)
    assert _option(out, "--max-num-seqs") == "12"
    assert _option(out, "--max-num-active-seqs") == "12"  # was 16: vLLM would refuse it
    assert len(out) == len(ARGV)  # replaced in place, nothing appended


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--max-num-active-seqs=16"], ["--max-num-active-seqs=12"]),
        (["--max_num_active_seqs", "16"], ["--max_num_active_seqs", "12"]),  # vLLM's _ spelling
        (["--max-num-active-seqs", "8"], ["--max-num-active-seqs", "8"]),  # already below
        ([], []),  # not set: vLLM's default follows max_num_seqs
    ],
)
def test_the_active_limit_in_every_spelling(given, expected):
    argv = ["vllm", "serve", "m", "--max-num-seqs", "16", *given]
    out = apply(argv, Flags(0.86, 12))
    assert out[5:] == [*expected, "--gpu-memory-utilization", "0.86"]
    assert out[:5] == ["vllm", "serve", "m", "--max-num-seqs", "12"]


def test_walking_back_from_the_original_line_restores_the_active_limit():
    # the supervisor applies each step to the operator's original line
    assert _option(apply(ARGV, Flags(0.9, 16)), "--max-num-active-seqs") == "16"


def test_vllm_accepts_the_stepped_command_line(monkeypatch):
    """vLLM's own argument parser and scheduler config, on the line before and after."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # as the twin runs it (no GPU here)
    from vllm.config.scheduler import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())

    def scheduler(argv: list[str]) -> SchedulerConfig:
        args = parser.parse_args(["--model", argv[2], *argv[3:]])
        return SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_active_seqs=args.max_num_active_seqs,
            max_model_len=2048,
            is_encoder_decoder=False,
        )

    flags = Flags(0.86, 12)
    unclamped = [*ARGV[:6], "12", *ARGV[7:]]  # what stepping max_num_seqs alone produced
    with pytest.raises(ValueError, match="max_num_active_seqs"):
        scheduler(unclamped)
    config = scheduler(apply(ARGV, flags))
    assert (config.max_num_seqs, config.max_num_active_seqs) == (12, 12)
