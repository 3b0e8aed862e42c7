"""The single-box recipe: systemd units and a Procfile whose commands the CLI accepts."""

from __future__ import annotations

import shlex

import pytest
import yaml
from oomguard.remediator.config import RemediatorConfig

from oomguard.cli import build_parser

UNITS = ["oomguard-exporter.service", "oomguard-vllm.service", "oomguard-remediator.service"]


def unit(path) -> dict[str, list[str]]:
    """key -> values (systemd allows repeated keys such as Environment)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def oomguard_args(command: str) -> list[str]:
    argv = shlex.split(command)
    assert argv[0].endswith("oomguard"), argv[0]
    return argv[1:]


@pytest.mark.parametrize("name", UNITS)
def test_units_run_commands_the_cli_accepts(repo_root, name):
    u = unit(repo_root / "deploy" / "single-box" / name)
    assert {"Unit.Description", "Service.ExecStart", "Install.WantedBy"} <= set(u)
    assert u["Service.Restart"] == ["always"]
    args = build_parser().parse_args(oomguard_args(u["Service.ExecStart"][0]))
    assert args.command in ("exporter", "serve", "remediator")


def test_vllm_unit_runs_vllm_under_the_supervisor_with_the_plugin(repo_root):
    u = unit(repo_root / "deploy" / "single-box" / "oomguard-vllm.service")
    args = build_parser().parse_args(oomguard_args(u["Service.ExecStart"][0]))
    vllm = args.vllm[1:] if args.vllm[0] == "--" else args.vllm
    assert vllm[1] == "serve" and "--max-num-seqs" in vllm
    env = dict(e.split("=", 1) for e in u["Service.Environment"])
    assert env["VLLM_PLUGINS"] == "oomguard" and env["OOMGUARD_PLUGIN_TOKEN_FILE"]
    assert u["Service.KillMode"] == ["mixed"]  # the supervisor stops vLLM's group itself


def test_single_box_remediator_config_and_procfile(repo_root):
    box = repo_root / "deploy" / "single-box"
    config = RemediatorConfig.model_validate(yaml.safe_load((box / "remediator.yaml").read_text()))
    assert config.targets[0].restart and config.targets[0].restart.supervisor
    for line in (box / "Procfile").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, command = line.partition(": ")
        if command.startswith("oomguard "):
            build_parser().parse_args(shlex.split(command)[1:])
        else:
            assert name in ("prometheus", "alertmanager")
