"""The built wheel and a fresh virtualenv with it installed, shared by the tests that need them
(tests/test_packaging.py, tests/test_demo.py): one build and one install per session, since each
takes minutes on a busy 2-core machine. tests/conftest.py registers the fixtures and, under
pytest-xdist, keeps every test that uses them on one worker (so one build there too)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from oomguard import children

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
DOCKER = ROOT / "deploy" / "docker"


def install_step(dockerfile: Path, wheels: Path) -> list[str]:
    """The arguments after `pip install` in the final stage's RUN, with /wheels/ pointing at a
    local folder (no container runtime runs here; the step runs in a virtualenv instead)."""
    final = dockerfile.read_text().rsplit("\nFROM ", 1)[1]
    (run,) = [
        line for line in final.splitlines() if line.startswith("RUN ") and " install " in line
    ]
    argv = shlex.split(run.removeprefix("RUN ").split("&&")[0])
    args = argv[argv.index("install") + 1 :]
    # --no-cache-dir keeps an image small; here the pip cache only saves downloads
    return [a.replace("/wheels/", f"{wheels}/") for a in args if a != "--no-cache-dir"]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built without network access (setuptools from the venv) from a copy of the
    checkout's sources: a build folder left in the checkout could carry deleted files along."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (built,) = out.glob("oomguard-*.whl")
    return built


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the oomguard image's install step run in it (the wheel,
    non-editable, with the lock), plus the `generate` extra. Returns its bin folder."""
    home = tmp_path_factory.mktemp("wheel-venv")
    wheels = home / "wheels"
    wheels.mkdir()
    shutil.copy(wheel, wheels)
    shutil.copy(LOCK, wheels / "lock.txt")
    venv.create(home / "venv", with_pip=True)
    pip = [str(home / "venv" / "bin" / "python"), "-m", "pip", "install", "-q"]
    for step in (
        install_step(DOCKER / "oomguard.Dockerfile", wheels),
        ["-c", str(LOCK), f"{wheel}[generate]"],
    ):
        r = subprocess.run([*pip, *step], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    return home / "venv" / "bin"


def run_oomguard(
    bin_dir: Path, *args: str, cwd: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`oomguard ARGS` from the wheel's venv. Past its time (or when pytest-timeout ends the
    test) it gets SIGTERM first: the demo then stops the vLLMs, Prometheus and Alertmanager it
    started in their own sessions, which a plain SIGKILL would leave running."""
    base = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    # SIGTERM to it should this test process die (a CI timeout's SIGKILL): the demo then stops
    # what it started, and each of those dies with it in any case (oomguard.children)
    proc = children.popen(
        [str(bin_dir / "oomguard"), *args],
        cwd=cwd,
        env={**base, "PATH": f"{bin_dir}:{base.get('PATH', '')}", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def site_packages(bin_dir: Path) -> Path:
    return next((bin_dir.parent / "lib").glob("python3*/site-packages"))


def borrow_vllm(bin_dir: Path) -> None:
    """vLLM from this environment in the wheel's venv (installing torch again would take
    minutes): its site-packages goes on the new venv's path after the venv's own, and its
    console script is the one pip wrote here with the new venv's Python in the shebang.

    The script must be pip's, `if __name__ == "__main__"` guard included: on the CPU vLLM
    starts its engine process with multiprocessing's spawn, which re-runs the main script in
    the child; a script calling main() unguarded starts a second server there, which fails
    ("An attempt has been made to start a new process before the current process has finished
    its bootstrapping phase") and vLLM exits with code 1 at start."""
    import sysconfig

    purelib = Path(sysconfig.get_paths()["purelib"])
    (site_packages(bin_dir) / "zz-borrowed-vllm.pth").write_text(f"{purelib}\n")
    ours = shutil.which("vllm", path=str(Path(sys.executable).parent))
    assert ours, "no vllm console script beside this Python"
    _, body = Path(ours).read_text().split("\n", 1)
    assert "__main__" in body, body
    (bin_dir / "vllm").write_text(f"#!{bin_dir / 'python'}\n{body}")
    (bin_dir / "vllm").chmod(0o755)
