"""Every `oomguard` subcommand turns bad input into one line and exit 2 (issue 25, item 7).

The subcommands and their arguments are read from the CLI's own parser, so a new subcommand or
flag is covered without editing this file: each argument gets the hostile corpus of its kind
(files: missing, a directory, a FIFO, a device, bad UTF-8, 100,000-deep nesting, 400- and
5,000-digit numbers, over the size limit, a YAML alias bomb, the wrong top-level type, a
non-UTF-8 name; numbers: NaN, infinities, negatives, 400 and 5,000 digits, other scripts'
digits; sizes, durations, addresses, URLs, directories...), one argument at a time in a command
line that is otherwise valid. A case passes when the command exits 2 with exactly one line on
stderr that starts with `oomguard <command>:`, names the argument (its flag, name or value) and
holds no traceback, within the case's deadline (a FIFO must not hang it). A new subcommand
needs a valid command line in BASELINES; the test says so when one is missing.

Cases run in forked children of one warm interpreter (tests/cli_corpus.py): hundreds of cases
in seconds, each isolated, each killed with whatever it started if it overruns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from oomguard.cli import _parsers, build_parser
from oomguard.engine_state import EngineCoreState, EngineState, SinceCapChange

pytestmark = pytest.mark.slow  # hundreds of command runs: `make test`, not `make check`

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "twin" / "oomguard" / "twin" / "models" / "llama-3-8b" / "config.json"
CASE_TIMEOUT = 40.0  # a loaded 2-core box; a hang is far longer, a normal case ~0.1 s
MAX_LINE = 600  # an error line quotes a long value shortened, not whole
BAD_NAME = "\udcff\udcfe"  # what a non-UTF-8 file name becomes in argv (surrogateescape)

# -- the hostile corpus, by kind -----------------------------------------------------------------
FILES = (
    "missing",
    "directory",
    "fifo",
    "device",
    "not_utf8",
    "deep",
    "digits_400",
    "digits_5000",
    "too_large",
    "alias_bomb",
    "wrong_type",
    "bad_name",
)
TEXT_FILES = (
    "missing",
    "directory",
    "fifo",
    "device",
    "not_utf8",
    "too_large",
    "bad_name",
    "empty",
)
DIRS = ("regular_file", "fifo", "device", "under_a_file")
NUMBERS = ("nan", "inf", "-inf", "-1", "1e309", "9" * 400, "9" * 5000)
INTEGERS = ("-1", "9" * 400, "9" * 5000, "nan", "1.5", "١٣", "0x10")
SIZES = ("nan", "-1GiB", "9" * 5000 + "GiB", "1e309GiB", "80", "inf GiB")
LISTENS = ("x", "127.0.0.1:99999", "127.0.0.1:" + "9" * 5000, "no-such-host.invalid:80", ":")
URLS = ("not a url", "http://127.0.0.1:99999/", "ftp://127.0.0.1/", "http://[::1/")
KEYED_URLS = (
    "no-equals",
    "a=",
    "a=ftp://127.0.0.1/metrics",
    "a=http://127.0.0.1:99999/metrics",
    "x" * 5000 + "=http://127.0.0.1/metrics",
)
WHENS = ("yesterday", "9" * 5000 + "s", "-5m", "2026-13-45T00:00Z")
TEXTS = ("x" * 5000, BAD_NAME)

# Arguments read later by a long-running service, where only part of the corpus is wrong at
# start: a dcgm-exporter file may not be written yet (missing) and its content changes with
# every write (the collector counts bad content); a directory or FIFO is never right.
RUNTIME_FILE_CASES = {
    ("exporter", "--dcgm-file"): ("directory", "fifo", "device"),
    # created when missing (a new twin GPU); anything there must be a twin GPU's state
    ("twin-gpu", "file"): tuple(c for c in FILES if c not in ("missing", "bad_name")),
}
# Arguments this test does not drive, each with the reason (checked to still exist).
EXEMPT = {
    ("serve", "vllm"): "the engine's own command line, run as given",
}


@dataclass
class Env:
    tmp: Path
    files: dict[str, Path]  # hostile files by corpus name
    good: dict[str, Path]  # valid inputs the baselines use
    server: str  # a stand-in vLLM answering hostile bodies


def make_files(tmp: Path) -> dict[str, Path]:
    d = tmp / "hostile"
    d.mkdir()
    f: dict[str, Path] = {}
    f["missing"] = d / "missing.yaml"
    f["directory"] = d / "a-directory"
    f["directory"].mkdir()
    f["fifo"] = d / "fifo"
    os.mkfifo(f["fifo"])
    f["device"] = Path("/dev/zero")
    f["not_utf8"] = d / "not-utf8"
    f["not_utf8"].write_bytes(b'{"a": "\xff\xfe"}\n')
    f["deep"] = d / "deep"
    f["deep"].write_text("[" * 100_000 + "]" * 100_000)
    f["digits_400"] = d / "digits-400"
    f["digits_400"].write_text('{"a": ' + "9" * 400 + "}")
    f["digits_5000"] = d / "digits-5000"
    f["digits_5000"].write_text('{"a": ' + "9" * 5000 + "}")
    f["too_large"] = d / "too-large"
    f["too_large"].write_bytes(b" " * (5 * 2**20) + b"{}")
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev, name = chr(96 + i), chr(97 + i)
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 10)}]")
    f["alias_bomb"] = d / "alias-bomb"
    f["alias_bomb"].write_text("\n".join(lines) + "\n")
    f["empty"] = d / "empty"
    f["empty"].write_text("\n")
    f["wrong_type"] = d / "wrong-type"
    f["wrong_type"].write_text("[1, 2, 3]\n")
    f["bad_name"] = d / BAD_NAME
    f["regular_file"] = d / "regular-file"
    f["regular_file"].write_text("not a directory\n")
    f["under_a_file"] = f["regular_file"] / "sub"
    return f


def make_good(tmp: Path, server: str) -> dict[str, Path]:
    g: dict[str, Path] = {}
    g["token"] = tmp / "token"
    g["token"].write_text("s3cret-token\n")
    g["remediator"] = tmp / "remediator.yaml"
    g["remediator"].write_text(
        "listen: 127.0.0.1:0\n"
        f"auth: {{bearer_token_file: {g['token']}}}\n"
        f"targets:\n  - {{name: llama, url: 'http://127.0.0.1:9/', token_file: {g['token']}}}\n"
        f"audit_log: {tmp / 'audit.jsonl'}\n"
    )
    g["payload"] = tmp / "payload.json"
    g["payload"].write_text(json.dumps({"version": "4", "status": "firing", "alerts": []}))
    g["incidents"] = tmp / "incidents"
    g["incidents"].mkdir()
    g["alloc"] = tmp / "alloc"
    g["alloc"].mkdir()
    return g


# A valid command line per subcommand (the corpus replaces one argument at a time). Commands
# that serve forever are given what makes them start quickly, so an input that is not refused
# shows up as a hang.
BASELINES: dict[tuple[str, ...], Callable[[Env], list[str]]] = {
    ("exporter",): lambda e: ["exporter", "--no-nvml", "--listen", "127.0.0.1:0"],
    # the pure-Python sizing: vLLM's own (where importable) spends most of a minute importing
    # vLLM in a child, after every input here has been read (tests/test_budget_vllm.py)
    ("budget",): lambda e: ["budget", str(LLAMA), "--gpu", "H100", "--sizing", "python"],
    ("preflight",): lambda e: [
        "preflight",
        f"{e.server}/ok",
        "--gpu",
        "H100",
        "--allocator-dir",
        str(e.good["alloc"]),
    ],
    ("generate",): lambda e: ["generate", "--check", "--root", str(e.tmp / "generated")],
    ("demo",): lambda e: ["demo", "--quick", "--no-prometheus", "--report", str(e.tmp / "r")],
    ("remediator",): lambda e: ["remediator", "--config", str(e.good["remediator"]), "--check"],
    ("remediator", "explain"): lambda e: [
        "remediator",
        "--config",
        str(e.good["remediator"]),
        "explain",
        str(e.good["payload"]),
    ],
    ("serve",): lambda e: [
        "serve",
        "--allow-unauthenticated",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        str(e.tmp / "serve-state"),
        "--",
        "sh",
        "-c",
        "sleep 120",
        "--max-num-seqs",
        "8",
    ],
    ("incidents",): lambda e: ["incidents", str(e.good["incidents"])],
    ("status",): lambda e: ["status", "--config", str(e.good["remediator"]), "--timeout", "1s"],
    ("twin-gpu",): lambda e: ["twin-gpu", str(e.tmp / "twin-gpu.json")],
}


def command_path(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    return tuple(parser.prog.split()[1:])


def kind_of(action: argparse.Action) -> str | None:
    """Which corpus an argument gets (None: nothing to feed it)."""
    if action.nargs == 0 or action.choices or action.nargs == argparse.REMAINDER:
        return None
    if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
        return None
    metavar = str(action.metavar or "")
    kinds = {
        "SIZE": "size",
        "HOST:PORT": "listen",
        "FILE": "file",
        "CONFIG_JSON": "file",
        "TARGET=FILE": "keyed_file",
        "NAME=PATH": "keyed_dir",
        "NAME=URL": "keyed_url",
        "URL": "url",
        "DIR": "dir",
        "WHEN": "when",
    }
    if metavar == "FILE" and action.dest.endswith("token_file"):
        return "text_file"  # any text is a token: only the file itself can be wrong
    if metavar in kinds:
        return kinds[metavar]
    if action.dest.endswith("_dir") or action.dest in ("root", "report", "directory"):
        return "dir"
    if action.dest == "payload":
        return "file"
    if action.type is not None:
        try:
            probe = action.type("12")
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            return "text"
        return "integer" if isinstance(probe, int) else "number"
    return "text"


def values_for(kind: str, env: Env) -> list[tuple[str, str]]:
    """(case name, argument value) for one kind."""
    f = env.files
    if kind == "file":
        return [(name, str(f[name])) for name in FILES]
    if kind == "text_file":
        return [(name, str(f[name])) for name in TEXT_FILES]
    if kind == "keyed_file":
        return [(name, f"t={f[name]}") for name in FILES] + [("no_equals", "no-equals")]
    if kind == "dir":
        return [(name, str(f[name])) for name in DIRS]
    if kind == "keyed_dir":
        return [(name, f"a={f[name]}") for name in DIRS] + [("no_equals", "no-equals")]
    table = {
        "integer": INTEGERS,
        "number": NUMBERS,
        "size": SIZES,
        "listen": LISTENS,
        "url": URLS,
        "keyed_url": KEYED_URLS,
        "when": WHENS,
        "text": TEXTS,
    }
    return [(value[:12], value) for value in table[kind]]


def with_argument(base: list[str], action: argparse.Action, value: str) -> list[str]:
    """`base` with `action` set to `value`: replaced where it is, else added before `--`."""
    argv = list(base)
    if not action.option_strings:  # a positional: the baseline's value at its place
        for i, token in enumerate(argv):
            if token == POSITIONAL_PLACEHOLDER.get(action.dest):
                argv[i] = value
                return argv
        raise AssertionError(f"no placeholder for positional {action.dest}")
    for i, token in enumerate(argv):
        if token in action.option_strings:
            argv[i + 1] = value
            return argv
    # options go before a sub-subcommand or `--`
    cut = len(argv)
    for marker in ("explain", "--"):
        if marker in argv:
            cut = min(cut, argv.index(marker))
    return [*argv[:cut], action.option_strings[-1], value, *argv[cut:]]


POSITIONAL_PLACEHOLDER: dict[str, str] = {}


def names_the_input(line: str, action: argparse.Action, value: str) -> bool:
    def norm(text: str) -> str:
        return text.lower().replace("-", "_").replace(" ", "_")

    wanted = [*action.option_strings, action.dest, str(action.metavar or "")]
    shown = value.encode("utf-8", "backslashreplace").decode()
    path = shown.partition("=")[2] if "=" in shown and "/" in shown else shown
    return any(w and norm(w.lstrip("-")) in norm(line) for w in wanted) or path[:40] in line


@dataclass
class Case:
    id: str
    argv: list[str]
    action: argparse.Action
    value: str
    # valid input with an absurd figure: any clear outcome (a report, exit 1, or exit 2), as
    # long as it is quick and no traceback
    lenient: bool = False


def build_cases(path: tuple[str, ...], parser: argparse.ArgumentParser, env: Env) -> list[Case]:
    base = BASELINES[path](env)
    POSITIONAL_PLACEHOLDER.clear()
    for action in parser._actions:
        if not action.option_strings and action.dest in ("model_config", "url", "payload"):
            POSITIONAL_PLACEHOLDER[action.dest] = {
                "model_config": str(LLAMA),
                "url": f"{env.server}/ok",
                "payload": str(env.good["payload"]),
            }[action.dest]
        elif not action.option_strings and action.dest == "directory":
            POSITIONAL_PLACEHOLDER[action.dest] = str(env.good["incidents"])
        elif not action.option_strings and action.dest == "file":
            POSITIONAL_PLACEHOLDER[action.dest] = str(env.tmp / "twin-gpu.json")
    cases = []
    for action in parser._actions:
        key = (" ".join(path), action.option_strings[-1] if action.option_strings else action.dest)
        if (path[0], key[1]) in EXEMPT or (" ".join(path), key[1]) in EXEMPT:
            continue
        kind = kind_of(action)
        if kind is None:
            continue
        only = RUNTIME_FILE_CASES.get((" ".join(path), key[1]))
        for name, value in values_for(kind, env):
            if only is not None and name not in only:
                continue
            argv = with_argument(base, action, value)
            cases.append(Case(f"{' '.join(path)} {key[1]} {name}", argv, action, value))
    return cases + extra_cases(path, env)


def extra_cases(path: tuple[str, ...], env: Env) -> list[Case]:
    """Inputs reached through another input: token files named in a config, the answers of
    the server preflight reads."""
    out: list[Case] = []
    dummy = argparse.Action(["--config"], "config")
    if path == ("remediator",):
        for where in ("auth: {bearer_token_file: %s}", "targets-token"):
            for name in ("missing", "directory", "fifo", "device", "not_utf8", "too_large"):
                token = env.files[name]
                config = env.tmp / f"remediator-{name}-{len(out)}.yaml"
                text = env.good["remediator"].read_text()
                if where == "targets-token":
                    text = text.replace(f"token_file: {env.good['token']}", f"token_file: {token}")
                else:
                    text = text.replace(
                        f"auth: {{bearer_token_file: {env.good['token']}}}", where % token
                    )
                config.write_text(text)
                argv = ["remediator", "--config", str(config), "--check"]
                out.append(Case(f"remediator token {where[:6]} {name}", argv, dummy, str(token)))
    if path == ("preflight",):
        url = argparse.Action([], "url")
        for body in sorted(HOSTILE_BODIES):
            for prefix in (body, f"ok-{body}"):
                value = f"{env.server}/{prefix}"
                argv = [
                    "preflight",
                    value,
                    "--gpu",
                    "H100",
                    "--allocator-dir",
                    str(env.good["alloc"]),
                ]
                out.append(Case(f"preflight answer {prefix}", argv, url, value))
    if path == ("budget",):
        # a checkpoint folder: config.json valid, the quantization file beside it hostile
        for name in ("not_utf8", "deep", "digits_5000", "too_large", "wrong_type"):
            folder = env.tmp / f"checkpoint-{name}"
            folder.mkdir(exist_ok=True)
            (folder / "config.json").write_text(LLAMA.read_text())
            (folder / "hf_quant_config.json").write_bytes(env.files[name].read_bytes())
            quant = str(folder / "hf_quant_config.json")
            argv = ["budget", str(folder), "--gpu", "H100", "--sizing", "python"]
            out.append(Case(f"budget hf_quant_config {name}", argv, dummy, quant))
        config = json.loads(LLAMA.read_text())
        fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
        for field in (*fields, "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            for value in (10**8, 2**47 - 1):
                bad = env.tmp / f"config-{field}-{value}.json"
                bad.write_text(json.dumps({**config, field: value}))
                argv = ["budget", str(bad), "--gpu", "H100", "--sizing", "python"]
                # num_hidden_layers 10**8 took 13 s and a MemoryError (defect 16): refused;
                # the others are sized (absurd figures, exit 1) or refused, quickly
                lenient = field != "num_hidden_layers"
                out.append(Case(f"budget {field}={value}", argv, dummy, str(bad), lenient))
    return out


# -- a stand-in vLLM for preflight ----------------------------------------------------------------
HOSTILE_BODIES: dict[str, bytes] = {
    "deep": b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "digits": b'{"data": [{"id": "m", "max_model_len": ' + b"9" * 5000 + b"}]}",
    "utf8": b'{"data": [{"id": "\xff\xfe", "max_model_len": 4096}]}',
    "huge": b'{"data": "' + b"x" * (3 * 2**20) + b'"}',
}
MODELS = {"data": [{"id": "m", "max_model_len": 4096}]}
STATE = EngineState.of(
    [
        EngineCoreState(
            startup_max_num_seqs=64,
            admission_cap=64,
            mode="serving",
            gpu_memory_utilization=0.92,
            since_cap_change=SinceCapChange(seconds=1.0, admitted=0, finished=0, preemptions=0),
        )
    ]
).document()


@pytest.fixture(scope="module")
def stand_in() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            case, _, rest = self.path.lstrip("/").partition("/")
            if case == "ok" or (case.startswith("ok-") and rest == "v1/models"):
                body = json.dumps(MODELS if rest == "v1/models" else STATE).encode()
            else:
                body = HOSTILE_BODIES.get(case.removeprefix("ok-"), b"{}")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, stand_in: str) -> Env:
    tmp = tmp_path_factory.mktemp("hostile-cli")
    return Env(tmp, make_files(tmp), make_good(tmp, stand_in), stand_in)


def run_cases(cases: list[Case]) -> dict[str, dict]:
    payload = json.dumps([{"id": c.id, "argv": c.argv, "timeout": CASE_TIMEOUT} for c in cases])
    r = subprocess.run(
        [sys.executable, "-m", "tests.cli_corpus"],
        input=payload,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=CASE_TIMEOUT * 4 + 30 * len(cases),
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [*sorted(str(p.parent) for p in ROOT.glob("*/oomguard")), str(ROOT)]
            ),
        },
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {res["id"]: res for res in json.loads(r.stdout)}


def verdict(case: Case, res: dict, command: str) -> str | None:
    """Why a case failed, or None."""
    if res["hung"]:
        return f"hung (killed after {CASE_TIMEOUT:.0f} s)"
    err = res["stderr"]
    if "Traceback" in err:
        return "traceback: " + err.strip().splitlines()[-1][:300]
    if case.lenient:
        return None if res["rc"] in (0, 1, 2) else f"exit {res['rc']}: {err[-300:]}"
    if res["rc"] != 2:
        return f"exit {res['rc']}: {(err or res['stdout']).strip()[-300:]}"
    lines = err.strip().splitlines()
    if len(lines) != 1:
        return f"{len(lines)} lines on stderr: {err[:300]}"
    if not lines[0].startswith(f"oomguard {command}: ") and not lines[0].startswith(
        f"oomguard {command.split()[0]}: "
    ):
        return f"does not start with 'oomguard {command}:': {lines[0][:200]}"
    if len(lines[0]) > MAX_LINE:
        return f"a {len(lines[0])}-character line (echoes the input whole?): {lines[0][:200]}"
    if not names_the_input(lines[0], case.action, case.value):
        return f"does not name the input: {lines[0][:300]}"
    return None


SUBCOMMANDS = {command_path(p): p for p in _parsers(build_parser())[1:]}


def test_every_subcommand_has_a_baseline_and_exemptions_are_current():
    """A new subcommand is driven here as soon as it has a valid command line in BASELINES."""
    missing = sorted(" ".join(p) for p in SUBCOMMANDS if p not in BASELINES)
    assert not missing, f"add a valid command line to BASELINES for: {missing}"
    for command, arg in EXEMPT:
        parser = SUBCOMMANDS[tuple(command.split())]
        names = {a.dest for a in parser._actions} | {
            s for a in parser._actions for s in a.option_strings
        }
        assert arg in names, f"EXEMPT names {command} {arg}, which no longer exists"


@pytest.mark.parametrize("path", sorted(BASELINES), ids=" ".join)
def test_hostile_input_is_one_line_and_exit_2(env: Env, path: tuple[str, ...]) -> None:
    parser = SUBCOMMANDS[path]
    cases = build_cases(path, parser, env)
    assert cases or path == ("demo",), f"{' '.join(path)}: no argument to drive"
    results = run_cases(cases)
    failures = [
        f"{c.id}: {why}"
        for c in cases
        if (why := verdict(c, results[c.id], " ".join(path))) is not None
    ]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
