"""`oomguard preflight` against the GPU twin: real vLLM servers (model-free executor) whose twin
GPUs raise a CUDA OOM when a step's peak exceeds the device. Preflight must find each twin's
known limit for a prompt with prompt_logprobs within 10 %, without an OOM, on two GPU sizes;
pushing past that limit must then OOM the twin (the danger was real)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from oomguard.cli import main
from oomguard.engine_state import EngineCoreState, EngineState, SinceCapChange
from oomguard.handoff import read_reports
from oomguard.incident_records import OOM_NAME
from oomguard.lab.processes import VllmProcess
from oomguard.sizing.preflight import (
    GIB,
    Load,
    PreflightError,
    Report,
    Settings,
    Stage,
    _slope,
    allocator_state,
    render,
    run,
)
from tests.vllm_server import TOKEN, require_vllm

# (twin GPU, --max-model-len = --max-num-batched-tokens): both long enough that a max_model_len
# prompt with prompt_logprobs does not fit the memory vLLM leaves free at gmu 0.92.
CASES = [("RTX4090", 8192), ("H100", 16384)]


def true_limit(gpu: str, batched: int) -> int:
    """The longest prompt_logprobs prefill step the twin's physics lets through (one chunk)."""
    from oomguard.twin.physics import Physics, Step

    p = Physics.for_model(
        "llama-3-8b", gpu=gpu, gpu_memory_utilization=0.92, max_num_batched_tokens=batched
    )
    low, high = 1, batched
    while low < high:
        mid = (low + high + 1) // 2
        if p.fits(Step(tokens=mid, logits=mid)):
            low = mid
        else:
            high = mid - 1
    return low


def twin_server(*args: str, env: dict[str, str], log: Path) -> VllmProcess:
    """`vllm serve` with the model-free executor on a twin GPU (start-up is slow on a busy
    two-core machine: a generous bound)."""
    return VllmProcess(*args, log=log, token=TOKEN, env=env, timeout=480)


def alive(server: VllmProcess) -> bool:
    try:
        return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# -- without vLLM -----------------------------------------------------------------------------
def test_slope_is_zero_while_the_peak_is_flat() -> None:
    assert _slope([(512, 10)]) == 0.0
    assert _slope([(512, 10), (640, 10)]) == 0.0
    assert _slope([(1000, 100), (2000, 1100)]) == 1.0


def test_no_allocator_stats_refuses_to_push(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match="will not push memory it cannot see"):
        allocator_state(str(tmp_path))


def test_report_exit_codes_and_render() -> None:
    r = Report("http://x", "m", 8192, 64, 0.97, None, 24 * GIB, 23 * GIB)
    r.stages.append(Stage(Load(1, 512, True), True, 20 * GIB, 3 * GIB))
    r.longest_safe_prompt_logprobs = 512
    assert r.exit_code == 1
    text = render(r)
    assert "LIMIT FOUND" in text and "1 x 512 tokens, prompt_logprobs" not in text
    r.safe_at_target = True
    assert r.exit_code == 0 and json.loads(json.dumps(r.to_dict()))["exit_code"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["preflight", "http://127.0.0.1:1", "--gpu-memory", "80"], "no unit"),
        (["preflight", "127.0.0.1:1", "--gpu", "H100"], "http://"),
        (["preflight", "http://127.0.0.1:1", "--gpu", "H100"], "cannot reach"),
    ],
)
def test_cli_cannot_run_exits_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


# -- against the twin -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def twins(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[tuple[str, int, VllmProcess, Path]]]:
    require_vllm()
    from oomguard.lab.processes import start_all

    root = tmp_path_factory.mktemp("preflight")
    made = []
    for gpu, length in CASES:
        alloc = root / f"alloc-{gpu}"
        alloc.mkdir()
        env = {
            "OOMGUARD_TWIN_GPU": gpu,
            "OOMGUARD_TWIN_MODEL": "llama-3-8b",
            "OOMGUARD_ALLOCATOR_DIR": str(alloc),
            "OOMGUARD_TWIN_TIME_COMPRESSION": "50",
        }
        args = ("--max-model-len", str(length), "--max-num-batched-tokens", str(length))
        made.append((gpu, length, alloc, env, args))
    servers = start_all(
        [
            (
                lambda a=args, e=env, g=gpu: twin_server(
                    *a, "--max-num-seqs", "64", env=e, log=root / f"vllm-{g}.log"
                )
            )
            for gpu, _, _, env, args in made
        ]
    )
    try:
        yield [
            (gpu, length, server, alloc)
            for (gpu, length, alloc, _, _), server in zip(made, servers, strict=True)
        ]
    finally:
        for server in servers:
            server.stop()


def test_cli_json_report_and_exit_status_against_a_twin(
    twins: list[tuple[str, int, VllmProcess, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A target the twin takes (4,096-token prompts, 8 at a time, on the H100 twin): preflight
    reaches it and exits 0. Runs before the limit tests, which end by crashing each twin."""
    _, _, server, alloc = twins[1]
    code = main(
        [
            "preflight",
            server.url,
            "--gpu",
            "H100",
            "--allocator-dir",
            str(alloc),
            "--target-prompt-len",
            "4096",
            "--max-concurrency",
            "8",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert captured.out, f"exit {code}, no report; stderr: {captured.err[-2000:]}"
    report = json.loads(captured.out)
    assert code == 0 and report["exit_code"] == 0 and report["safe_at_target"]
    assert report["longest_safe_prompt_logprobs"] == 4096
    assert report["largest_safe_batch"] == {
        "concurrency": 8,
        "prompt_len": 4096,
        "prompt_logprobs": False,
        "n": 1,
        "logprobs": 0,
    }
    # phase C: a quarter of the batch, each request sampling 4 sequences
    assert report["fan_out"] == {
        "concurrency": 2,
        "prompt_len": 4096,
        "prompt_logprobs": False,
        "n": 4,
        "logprobs": 0,
    }
    # the known GPU's reserved memory, not the 1 GiB default
    assert report["device_bytes"] - report["usable_bytes"] == 567 * 2**20
    assert "phase A" in captured.err and "phase B" in captured.err  # progress on stderr
    assert alive(server)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[gpu for gpu, _ in CASES])
def test_preflight_finds_the_twin_limit_without_an_oom(
    twins: list[tuple[str, int, VllmProcess, Path]], index: int
) -> None:
    from oomguard.twin.gpu import GPU_MODELS

    gpu, length, server, alloc = twins[index]
    model = GPU_MODELS[gpu]
    lines: list[str] = []
    report = run(
        Settings(
            url=server.url,
            device_bytes=model.total_mib * 2**20,
            driver_reserved_bytes=model.reserved_mib * 2**20,
            allocator_dir=str(alloc),
            max_concurrency=64,
        ),
        progress=lines.append,
    )
    limit = true_limit(gpu, length)
    assert limit < length - 1  # the target is past the limit: there is something to find
    found = report.longest_safe_prompt_logprobs
    assert 0.9 * limit <= found <= limit, (found, limit, "\n".join(lines))
    assert report.projected_limit_prompt_logprobs == pytest.approx(limit, rel=0.02)
    # no OOM: the engine is up, the allocator never reported one, every stage was clean
    assert alive(server) and not report.stopped
    reports, _ = read_reports(alloc, time.time(), 60)
    assert reports and all(r.ooms == 0 for r in reports)
    # phase B ran the max batch of max_model_len prompts (vLLM queues what the KV pool cannot hold)
    assert report.largest_safe_batch == Load(64, length - 1, False)
    assert report.exit_code == 1 and "gateway input cap" in " ".join(report.recommendations)
    assert any(line.startswith("phase B") for line in lines)
    assert report.fan_out == Load(16, length - 1, False, 4, 0)

    # Past the limit the twin really runs out of memory: the danger preflight stopped before.
    over = min(int(limit * 1.1), length - 1)
    body = {"model": report.model, "prompt": [11] * over, "max_tokens": 1, "prompt_logprobs": 1}
    try:
        status = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code
    except httpx.HTTPError:
        status = 599
    assert status != 200

    def oomed() -> bool:
        # the OOM observer's record, written as the step fails, outlives the engine; the live
        # report counts it only until the engine's exit removes the report (which a 0.5 s poll
        # can miss: the publisher writes once a second)
        records = alloc / "incidents"
        if records.is_dir() and any(OOM_NAME.fullmatch(f.name) for f in records.iterdir()):
            return True
        return any(r.ooms for r in read_reports(alloc, time.time(), 60)[0])

    deadline = time.monotonic() + 30
    while not oomed() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert oomed()


# -- a server's answers are untrusted -----------------------------------------------------------
# The plugin's state document (core/oomguard/engine_state.py), one engine core serving.
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
MODELS = {"data": [{"id": "m", "max_model_len": 4096}]}


def run_against(answer: Callable[[httpx.Request], httpx.Response], tmp_path: Path) -> None:
    """A preflight run against a stand-in server that answers each request with `answer`."""
    import asyncio

    from oomguard.sizing.preflight import Preflight, Server

    settings = Settings("http://127.0.0.1:9", 80 * GIB, GIB, str(tmp_path))

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await Preflight(settings)._run(Server(settings, client))

    asyncio.run(go())


@pytest.mark.parametrize(
    ("models", "state", "message"),
    [
        ({"data": [{"id": "m", "max_model_len": 10**12}]}, STATE, "not plausible"),
        ({"data": []}, STATE, "no model with max_model_len"),
        ({"data": [{"id": "m", "max_model_len": "x"}]}, STATE, "no model with max_model_len"),
        (MODELS, {"x": 1}, "not the oomguard plugin's state.*startup_max_num_seqs"),
        (MODELS, [STATE], "expected a JSON object"),
        (MODELS, {**STATE, "startup_max_num_seqs": "lots"}, "startup_max_num_seqs"),
        (MODELS, {**STATE, "startup_max_num_seqs": 64.0}, "startup_max_num_seqs"),
        (MODELS, {**STATE, "startup_max_num_seqs": 0}, "startup_max_num_seqs"),
        (MODELS, {**STATE, "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_implausible_server_answers_stop_before_any_load(
    tmp_path: Path, models: object, state: object, message: str
) -> None:
    """What /v1/models and the plugin's state say decides how long the prompts get: a value no
    real server reports stops the run before a single completion is sent."""

    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models)
        if request.url.path == "/oomguard/v1/state":
            return httpx.Response(200, json=state)
        return httpx.Response(500)

    with pytest.raises(PreflightError, match=message):
        run_against(answer, tmp_path)
    assert "/v1/completions" not in sent


def test_a_vllm_without_the_plugin_is_named_as_such(tmp_path: Path) -> None:
    """vLLM started without VLLM_PLUGINS=oomguard answers 404 on the plugin's routes: the one
    line says what to do, not only the status."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        return httpx.Response(404, json={"detail": "Not Found"})

    with pytest.raises(PreflightError, match=r"answered 404.*VLLM_PLUGINS=oomguard"):
        run_against(answer, tmp_path)


def test_a_valid_plugin_state_is_read_as_the_typed_engine_state(tmp_path: Path) -> None:
    """The control for the cases above: the plugin's real document passes, so the run goes on
    to its first (16-token) completion, which this stand-in server refuses."""

    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if request.url.path == "/oomguard/v1/state":
            return httpx.Response(200, json=STATE)
        return httpx.Response(503)

    with pytest.raises(PreflightError, match="16-token completion"):
        run_against(answer, tmp_path)
    assert sent == ["/v1/models", "/oomguard/v1/state", "/v1/completions"]


# -- hostile answers over real sockets (issue 25, defect 16) -----------------------------------
HOSTILE_BODIES: dict[str, bytes] = {
    "deep": b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError before
    "nested": b'{"data": ' + b"[" * 500 + b"]" * 500 + b"}",
    "digits": b'{"data": [{"id": "m", "max_model_len": ' + b"9" * 5000 + b"}]}",
    "utf8": b'{"data": [{"id": "\xff\xfe", "max_model_len": 4096}]}',
    "surrogate": b'{"data": [{"id": "\\udc80", "max_model_len": 4096}]}',
    "huge": b'{"data": "' + b"x" * (3 * 2**20) + b'"}',
    "nan": b'{"data": [{"id": "m", "max_model_len": NaN}]}',
}


@pytest.fixture(scope="module")
def hostile_server() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1: /<case>/v1/models answers HOSTILE_BODIES[case], and
    /ok-<case>/v1/models a valid answer with the hostile body on the plugin's /state."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            case, _, rest = self.path.lstrip("/").partition("/")
            if case.startswith("ok-") and rest == "v1/models":
                body = json.dumps(MODELS).encode()
            elif case.startswith("ok-"):
                body = HOSTILE_BODIES[case.removeprefix("ok-")]
            else:
                body = HOSTILE_BODIES[case]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("where", ["v1/models", "state"])
@pytest.mark.parametrize("case", sorted(HOSTILE_BODIES))
def test_hostile_answers_are_one_line_and_exit_2(
    hostile_server: str, case: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: deeply nested JSON from /v1/models or the plugin's /state raised RecursionError
    out of the command (a traceback), a 5,000-digit number ValueError."""
    prefix = case if where == "v1/models" else f"ok-{case}"
    url = f"{hostile_server}/{prefix}"
    argv = ["preflight", url, "--gpu", "H100", "--allocator-dir", str(tmp_path)]
    start = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - start < 30
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("oomguard preflight: ") and url in line, line
