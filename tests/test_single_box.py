"""The single-box recipe: systemd units and a Procfile whose commands the CLI accepts."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from oomguard.cli import build_parser
from oomguard.remediator.config import RemediatorConfig
from oomguard.singlebox import env_file, expand, unit_settings

UNITS = ["oomguard-exporter.service", "oomguard-vllm.service", "oomguard-remediator.service"]


def unit(path) -> dict[str, list[str]]:
    """key -> values (systemd allows repeated keys such as Environment)."""
    return unit_settings(path.read_text())


def exec_start(path) -> list[str]:
    """The unit's command as systemd runs it: $VLLM_MODEL and $VLLM_ARGS from vllm.env."""
    u = unit(path)
    env = env_file((path.parent / "vllm.env").read_text())
    return expand(u["Service.ExecStart"][0], env)


def oomguard_args(command: str | list[str]) -> list[str]:
    argv = shlex.split(command) if isinstance(command, str) else command
    assert argv[0].endswith("oomguard"), argv[0]
    return argv[1:]


@pytest.mark.parametrize("name", UNITS)
def test_units_run_commands_the_cli_accepts(repo_root, name):
    u = unit(repo_root / "deploy" / "single-box" / name)
    assert {"Unit.Description", "Service.ExecStart", "Install.WantedBy"} <= set(u)
    assert u["Service.Restart"] == ["always"]
    args = build_parser().parse_args(
        oomguard_args(exec_start(repo_root / "deploy/single-box" / name))
    )
    assert args.command in ("exporter", "serve", "remediator")


def test_vllm_unit_runs_vllm_under_the_supervisor_with_the_plugin(repo_root):
    path = repo_root / "deploy" / "single-box" / "oomguard-vllm.service"
    u = unit(path)
    args = build_parser().parse_args(oomguard_args(exec_start(path)))
    vllm = args.vllm[1:] if args.vllm[0] == "--" else args.vllm
    assert vllm[1] == "serve" and vllm[2] == "/models/llama-3-8b"
    # the remediator steps both flags: they must be on the command line
    assert "--max-num-seqs" in vllm and "--gpu-memory-utilization" in vllm
    assert u["Service.EnvironmentFile"] == ["/etc/oomguard/vllm.env"]
    env = dict(e.split("=", 1) for e in u["Service.Environment"])
    assert env["VLLM_PLUGINS"] == "oomguard" and env["OOMGUARD_PLUGIN_TOKEN_FILE"]
    assert u["Service.KillMode"] == ["mixed"]  # the supervisor stops vLLM's group itself


def test_single_box_remediator_config_and_procfile(repo_root):
    box = repo_root / "deploy" / "single-box"
    config = RemediatorConfig.model_validate(yaml.safe_load((box / "remediator.yaml").read_text()))
    assert config.targets[0].restart and config.targets[0].restart.supervisor
    env = env_file((box / "vllm.env").read_text())
    names = []
    for line in (box / "Procfile").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, command = line.partition(": ")
        names.append(name)
        argv = expand(command, env)
        while argv[0] == "env" or "=" in argv[0]:  # env VAR=value ... command
            argv = argv[1:]
        if argv[0] == "oomguard":
            build_parser().parse_args(argv[1:])
        else:
            assert name in ("prometheus", "alertmanager")
    assert names == ["vllm", "exporter", "remediator", "prometheus", "alertmanager"]


def test_the_procfile_runs_the_units_commands_with_their_environment(repo_root):
    """One set of vLLM flags (vllm.env) and one command per service: the Procfile is generated
    from the units (`oomguard generate --check` fails when it drifts), environment included:
    the hand-written one started vLLM without the plugin (no VLLM_PLUGINS) and with other flags."""
    box = repo_root / "deploy" / "single-box"
    env = env_file((box / "vllm.env").read_text())
    lines = dict(
        line.split(": ", 1)
        for line in (box / "Procfile").read_text().splitlines()
        if line and not line.startswith("#")
    )
    for name, unit_name in (
        ("vllm", "oomguard-vllm.service"),
        ("exporter", "oomguard-exporter.service"),
        ("remediator", "oomguard-remediator.service"),
    ):
        u = unit(box / unit_name)
        argv = expand(lines[name], env)
        assigned = []
        if argv[0] == "env":
            argv = argv[1:]
            while "=" in argv[0]:
                assigned.append(argv.pop(0))
        assert assigned == u.get("Service.Environment", []), name
        units = [
            w.rsplit("/", 1)[-1] if w.startswith("/opt/") else w
            for w in exec_start(box / unit_name)
        ]
        assert argv == units, name


def test_target_names_agree_between_exporter_remediator_and_vllm(repo_root):
    """An alert carries the exporter's target name; the remediator must select exactly that."""
    from oomguard.exporter.config import ExporterConfig

    box = repo_root / "deploy" / "single-box"
    exporter = ExporterConfig.model_validate(yaml.safe_load((box / "exporter.yaml").read_text()))
    remediator = RemediatorConfig.model_validate(
        yaml.safe_load((box / "remediator.yaml").read_text())
    )
    names = {t.name for t in exporter.vllm}
    for target in remediator.targets:
        assert target.match, f"{target.name}: give `match` explicitly"
        assert target.selector().get("target") in names, (target.name, names)
    env = dict(e.split("=", 1) for e in unit(box / "oomguard-vllm.service")["Service.Environment"])
    assert env["OOMGUARD_TARGET"] in names


@pytest.mark.parametrize("config", ["single-box/exporter.yaml", "exporter.example.yaml"])
def test_exporter_cgroup_is_the_vllm_unit(repo_root, config):
    from oomguard.exporter.config import ExporterConfig

    data = yaml.safe_load((repo_root / "deploy" / config).read_text())
    cfg = ExporterConfig.model_validate(data)
    (vllm_cgroup,) = [c.path for c in cfg.cgroups if c.name == "vllm"]
    unit_name = vllm_cgroup.rsplit("/", 1)[1]
    assert (repo_root / "deploy" / "single-box" / unit_name).is_file(), vllm_cgroup


def test_units_that_read_tokens_can_read_them(repo_root):
    """/etc/oomguard is root:oomguard 0750 (docs/single-box.md): readers need the group."""
    box = repo_root / "deploy" / "single-box"
    for name in ("oomguard-vllm.service", "oomguard-remediator.service"):
        u = unit(box / name)
        assert "oomguard" in " ".join(u.get("Service.SupplementaryGroups", [])).split(), name


def test_state_directories_are_separate(repo_root):
    """A DynamicUser unit owns its StateDirectory; another unit's must not live inside it."""
    box = repo_root / "deploy" / "single-box"
    dirs = {n: unit(box / n).get("Service.StateDirectory", [""])[0] for n in UNITS}
    dirs = {n: d for n, d in dirs.items() if d}
    for a, da in dirs.items():
        for b, db in dirs.items():
            assert a == b or not db.startswith(f"{da}/"), (a, da, b, db)


def test_units_pass_systemd_analyze_verify(repo_root, tmp_path):
    import shutil
    import subprocess

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    system = tmp_path / "etc" / "systemd" / "system"
    system.mkdir(parents=True)
    for name in UNITS:
        shutil.copy(repo_root / "deploy" / "single-box" / name, system / name)
    venv_bin = tmp_path / "opt" / "oomguard" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    for exe in ("oomguard", "vllm"):
        (venv_bin / exe).write_text("#!/bin/sh\n")
        (venv_bin / exe).chmod(0o755)
    # the host's own units (targets such as sysinit.target) for the dependency checks
    for lib in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(lib).is_dir():
            shutil.copytree(lib, tmp_path / "usr" / "lib" / "systemd" / "system", symlinks=True)
            break
    r = subprocess.run(
        ["systemd-analyze", "verify", f"--root={tmp_path}", *(str(system / n) for n in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
