"""Runs `oomguard` command lines fast and in isolation, for tests/test_cli_hostile.py.

`python -m tests.cli_corpus < cases.json` reads [{"id": ..., "argv": [...], "timeout": s}, ...],
imports oomguard once, then runs each case in a forked child (its own session, so a service it
starts dies with it) exactly as `oomguard ARGV...` would run: `oomguard.cli.main(argv)`, stdout
and stderr captured, stdin empty, an uncaught exception printed as a traceback. A child still
running after its timeout is killed (with its process group) and reported as a hang. Prints
[{"id", "rc", "stdout", "stderr", "seconds", "hung"}, ...] as JSON.

Forking from one warm interpreter costs milliseconds a case where a fresh `python -m oomguard`
costs a second of imports: the corpus has hundreds of cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any


def _child(argv: list[str], out_fd: int, err_fd: int) -> None:
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    code: Any = 0
    try:
        from oomguard.cli import main

        sys.argv = ["oomguard", *argv]
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 99
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    os._exit(code)


def run(case: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child never returns
            _child(case["argv"], out.fileno(), err.fileno())
        hung = False
        deadline = started + float(case.get("timeout", 30))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                hung = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # the child and whatever it started
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        return {
            "id": case["id"],
            "rc": os.waitstatus_to_exitcode(status),
            "stdout": out.read(20_000).decode("utf-8", "backslashreplace"),
            "stderr": err.read(20_000).decode("utf-8", "backslashreplace"),
            "seconds": round(seconds, 3),
            "hung": hung,
        }


def main() -> None:
    cases = json.load(sys.stdin)
    # warm: what most commands import, loaded once before the forks
    import importlib

    for name in (
        "oomguard.cli",
        "oomguard.sizing.budget",
        "oomguard.config",
        "oomguard.forensics.incidents",
        "oomguard.sizing.preflight",
        "oomguard.exporter.main",
        "oomguard.remediator.config",
        "oomguard.remediator.main",
        "oomguard.remediator.supervisor",
        "oomguard.remediator.webhook",
    ):
        with contextlib.suppress(ImportError):  # an optional extra missing: imported per case
            importlib.import_module(name)

    results = [run(case) for case in cases]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
