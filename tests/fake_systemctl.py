"""A stand-in for `systemctl` that starts the units' real commands (tests/test_rehearsal.py).

Usage, as the docs call it: `systemctl daemon-reload | enable [--now] UNIT... | disable [--now]
UNIT... | start | stop | restart UNIT...`. It reads what systemd would:
`$SANDBOX/etc/systemd/system/UNIT.service` and its drop-ins `UNIT.service.d/*.conf`
(Environment=, EnvironmentFile=, ExecStart=, RuntimeDirectory=, StateDirectory=; a drop-in's
Environment= adds to the unit's). Debian's `prometheus` and `prometheus-alertmanager` run the
commands the generated Procfile gives them. User= and the sandboxing settings are not applied
(the test runs as one user).

The machine is the sandbox: every absolute path of /etc, /opt/oomguard, /var/lib and /run lives
under $SANDBOX, every well-known port is mapped to a free one ($SANDBOX_PORTS, JSON), in the
commands and in the config files the services read (rewritten before each start, as an
operator's copies would say), and the unit's cgroup is this process's own. Each unit runs in a
session of its own, its pid in $SANDBOX/run/units/UNIT.pid and its output in
$SANDBOX/log/UNIT.log; the test stops whatever is left. Units outlive this command, as daemons
outlive systemctl, so nothing ties them to the test: with $SANDBOX_OWNER (the test's pid) a
watcher stops every unit left when the test process is gone, however it ended (a CI timeout's
SIGKILL leaves no teardown to run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from oomguard.remediator.supervisor import own_cgroup_dir
from oomguard.singlebox import OTHERS, env_file, expand, unit_settings

MOVED = re.compile(r"(?<![\w.\-/])(/etc/|/opt/oomguard|/var/lib/|/run/)")
PORT = re.compile(r"(?:(?<=127\.0\.0\.1:)|(?<=localhost:)|(?<=--port ))(\d{2,5})\b")
CGROUP = re.compile(r"/sys/fs/cgroup/system\.slice/[\w.@-]+")
PACKAGES = {"prometheus": "prometheus", "prometheus-alertmanager": "alertmanager"}
CONFIGS = ("etc/oomguard/*.yaml", "etc/oomguard/vllm.env", "etc/prometheus/*.yml")


def sandboxed(text: str, root: str, ports: dict[str, str]) -> str:
    """`text` as it reads on the sandboxed machine: paths under `root`, ports mapped."""
    text = MOVED.sub(lambda m: root + m.group(1), text)
    return PORT.sub(lambda m: ports.get(m.group(1), m.group(1)), text)


def rewrite_configs(root: Path, ports: dict[str, str]) -> None:
    cgroup = own_cgroup_dir() or "/sys/fs/cgroup"
    for pattern in CONFIGS:
        for path in root.glob(pattern):
            text = path.read_text()
            new = CGROUP.sub(cgroup, sandboxed(text, str(root), ports))
            if new != text:
                path.write_text(new)


def _pidfile(root: Path, unit: str) -> Path:
    return root / "run" / "units" / f"{unit}.pid"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def watch(root: Path, owner: int) -> None:
    """Until no unit is left: once `owner` is gone, stop every unit still running."""
    units = root / "run" / "units"
    while any(units.glob("*.pid")):
        if not _running(owner):
            for pidfile in units.glob("*.pid"):
                stop(root, pidfile.stem, grace=10)
            return
        time.sleep(0.5)


def ensure_watcher(root: Path) -> None:
    """One watcher per sandbox, started with the first unit (module docstring)."""
    owner = os.environ.get("SANDBOX_OWNER", "")
    mark = root / "run" / "units" / ".watcher"
    if not owner.isdigit() or (mark.exists() and _running(int(mark.read_text() or 0))):
        return
    proc = subprocess.Popen(
        [sys.executable, __file__, "--watch", owner],
        env=os.environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    mark.write_text(str(proc.pid))


def stop(root: Path, unit: str, grace: float = 60) -> None:
    pidfile = _pidfile(root, unit)
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.killpg(pid, 0)
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pidfile.unlink(missing_ok=True)


def command(root: Path, unit: str, ports: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The unit's command and environment, as systemd would run it on the sandboxed machine."""
    if unit in PACKAGES:
        return sandboxed(OTHERS[PACKAGES[unit]], str(root), ports).split(), {}
    system = root / "etc" / "systemd" / "system"
    path = system / f"{unit}.service"
    settings = unit_settings(path.read_text())
    for dropin in sorted((system / f"{unit}.service.d").glob("*.conf")):
        for key, values in unit_settings(dropin.read_text()).items():
            settings.setdefault(key, []).extend(values)
    env: dict[str, str] = {}
    for name in settings.get("Service.EnvironmentFile", []):
        env.update(env_file(Path(sandboxed(name, str(root), ports)).read_text()))
    for assignment in settings.get("Service.Environment", []):
        key, _, value = assignment.partition("=")
        env[key] = sandboxed(value, str(root), ports)
    for kind in ("RuntimeDirectory", "StateDirectory"):
        base = "run" if kind == "RuntimeDirectory" else "var/lib"
        for name in settings.get(f"Service.{kind}", []):
            (root / base / name).mkdir(parents=True, exist_ok=True)
    exec_start = [v for v in settings["Service.ExecStart"] if v][-1]
    argv = [sandboxed(word, str(root), ports) for word in expand(exec_start, env)]
    return argv, env


def start(root: Path, unit: str, ports: dict[str, str]) -> None:
    if _pidfile(root, unit).exists():
        return  # already running
    if unit not in PACKAGES and not (root / f"etc/systemd/system/{unit}.service").exists():
        print(f"fake systemctl: {unit} is not installed here: not started", file=sys.stderr)
        return  # grafana-server: optional, and not on this machine
    rewrite_configs(root, ports)
    argv, env = command(root, unit, ports)
    log = root / "log" / f"{unit}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _pidfile(root, unit).parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _pidfile(root, unit).write_text(str(proc.pid))
    ensure_watcher(root)


def main(args: list[str]) -> int:
    root = Path(os.environ["SANDBOX"])
    if args[:1] == ["--watch"]:
        watch(root, int(args[1]))
        return 0
    ports = json.loads(os.environ.get("SANDBOX_PORTS", "{}"))
    verb, *rest = args
    now = "--now" in rest
    units = [u.removesuffix(".service") for u in rest if not u.startswith("-")]
    if verb in ("daemon-reload", "enable") and not now:
        return 0
    if verb in ("start", "enable"):
        for unit in units:
            start(root, unit, ports)
    elif verb in ("stop", "disable"):
        for unit in units:
            stop(root, unit)
    elif verb == "restart":
        for unit in units:
            stop(root, unit)
            start(root, unit, ports)
    else:
        print(f"fake systemctl: {verb} is not simulated", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
