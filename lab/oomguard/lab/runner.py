"""Replay a trace on twin GPUs running the real vLLM server, with or without oomguard.

The fleet: vLLM 0.33 servers (model-free executor with the GPU physics, plugin installed) serving
the trace's model folder (twin/models/<model>: its config, so vocabulary and sizes match the
physics, and its offline tokenizer, so prompt_logprobs requests run), each
under `oomguard serve` (a crash reloads the model after the trace's `reload_s`), behind a gateway
that balances requests and, like a real one, sends a request to another engine when one answers
503 (draining) or refuses the connection (restarting); a closed-loop user (the outcome
benchmark's in-flight load) waits for its own engine instead, unless that engine drains. The
trace's GPU events hit engine 0's GPU; the others are its healthy peers. Configurations:

- `default`: vLLM's flags from the trace, no oomguard (crashes restart with the same flags);
- `static`: the same with `max_num_seqs` 48, as conservative operators run it;
- `guard`: vLLM's flags from the trace with the plugin's request guard enforcing (a request
  whose own transient memory never fits is answered 400, one that fits only later 503), and
  nothing else of oomguard: no exporter, no remediator (default and static run the guard off);
- `oomguard-no-step-guard`: `oomguard` below with the plugin's step guard off;
- `oomguard`: the exporter reading the twin GPUs, the remediator (standalone mode: pressure
  levels from the exporter) with its shipped policy, safety and alert-timing defaults, each
  clock scaled by the trace's time compression (`remediator_config`), acting through the plugin
  and restarting engines through their supervisor (its restart backend), and the supervisor
  lowering flags after a CUDA OOM. A caller that runs its own
  remediator (the demo: Prometheus, Alertmanager, one remediator for several fleets) passes
  `own_remediator=False` and gives it `remediator_targets()`.

`run()` does it all in one call (the outcome benchmark); `Fleet` exposes the steps (start,
replay, outcome, stop) and a live `snapshot()` so the demo can run fleets side by side.
Everything is measured in trace seconds (wall seconds x time compression).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from oomguard.contract import ALLOCATOR_DIR_ENV, API_PREFIX, DRAIN_GRACE_ENV, DRAINING, TARGET_ENV
from oomguard.engine_state import parse as parse_state
from oomguard.exporter.config import ExporterConfig
from oomguard.exporter.main import Exporter
from oomguard.lab.processes import (
    MODELS,
    TINY_MODEL,
    RemediatorProcess,
    SupervisedVllm,
    start_all,
    step_guard_hold_on_trace_clock,
    twin_exporter,
)
from oomguard.lab.routers import ROUTERS, Nginx, VllmRouter, VllmRouterSettings
from oomguard.remediator.config import RemediatorConfig, StandaloneConfig
from oomguard.remediator.policy import PolicyConfig
from oomguard.remediator.safety import SafetyConfig
from oomguard.thresholds import PressureThresholds
from oomguard.twin.gpu import TwinGpu, TwinNvml
from oomguard.twin.traces import Fragments, Request, Trace, requests

CONFIGS = ("default", "static", "oomguard")  # the outcome benchmark's three
GUARD = "guard"  # the request guard alone (bench/guard.py)
# oomguard with the plugin's step guard off: what the alerting path and the request guard do
# alone against memory taken within seconds (bench/outcome.py runs it on the step traces)
NO_STEP_GUARD = "oomguard-no-step-guard"
WITH_OOMGUARD = ("oomguard", NO_STEP_GUARD)  # the configurations that run oomguard's loop
STATIC_MAX_NUM_SEQS = 48
EXPORTER_INTERVAL_S = ExporterConfig.model_fields["interval_seconds"].default  # shipped: 1 s
TOKEN = "twin-plugin-token"
NEIGHBOUR_PID = 424242
# Wall seconds the lab's own chain takes from engine 0 running its last request to a watcher
# level without that request's fragments: the runner's view of the engine (HTTP), the GPU
# state it writes, the twin executor's idle publishing (0.5 s), the exporter's poll and the
# standalone watcher's. Up to 3.4 s was seen on the 2-CPU machine with two engines busy; in the
# field it is about a scrape interval. It does not shrink with the trace's compression, so the
# settle before a fragmentation restart keeps at least this much beyond keep_firing_for in
# wall seconds (remediator_timings): at x15 the scaled margin was 2 s, and an engine whose
# fragments had coalesced was restarted anyway (a 70 s reload on this machine, 17 trace min).
LAB_IDLE_TO_LEVEL_S = 5.0
RECOVERY_WATCH_S = 600.0  # trace seconds to keep watching for recovery after the trace
PATIENCE_S = 300.0  # trace seconds a client keeps retrying a request before giving up
STREAM_CHUNKS = 8  # chunks per streamed response at most, besides the first token (each one
# costs the API server and the gateway CPU that a 2-core machine needs for 128+ streams)
MAX_STREAMS = 512  # requests the gateway has open at once (the rest wait their turn)
# vllm-router in front of a fleet: readiness checked every 5 s, out after 2 failures (vllm-router's
# own default is /health every 60 s, out after 3: 3 minutes for a drain to take effect)
ROUTER_SETTINGS = VllmRouterSettings(interval_s=5, failures=2, timeout_s=2)
DEFERRALS = (429, 503)  # the plugin's deferral and drain (vllm_plugin/refusals.py)
CLIENT_RETRIED = (408, 409, 429, 500, 502, 503, 504)  # what OpenAI's clients retry
STICKY_RETRY_S = 10.0  # trace seconds a waiting user backs off without a Retry-After (the
# plugin's own default)


@dataclass
class Outcome:
    trace: str
    config: str
    requests: int = 0
    completed: int = 0
    lost: int = 0  # failed mid-flight (engine died under it) or never served
    crashes: int = 0  # CUDA OOMs
    goodput_tokens_per_s: float = 0.0  # output tokens/s of requests within the TTFT objective
    good_tokens: int = 0
    ttft_p99_s: float | None = None
    preemptions: int = 0
    recovery_s: float | None = None  # pressure end -> engine 0 back at full admission (a
    # trace whose pressure ends only with a restart: the restarted engine 0 up -> full admission)
    actions: list[str] = field(default_factory=list)
    lost_why: dict[str, int] = field(default_factory=dict)  # why requests were lost, counted
    router: str = "gateway"  # what was in front of the engines (lab/routers.py)
    answers: dict[str, int] = field(default_factory=dict)  # non-200 answers clients saw, by status
    refusals: list[str] = field(default_factory=list)  # each HTTP 400's "param: message"
    wall_s: float = 0.0


@dataclass(frozen=True)
class ClosedLoop:
    """Users who each keep one request in flight, sending the next as soon as the last ends
    (a benchmark's fixed concurrency): the fleet holds `users` requests from `start_s` to
    `end_s` (trace seconds) however fast or slow the engines run. An open-loop arrival rate
    cannot promise that on a machine whose engines fall behind their compressed clock (their
    queues grow without bound) or run ahead of it. Users start spread over `ramp_s`."""

    users: int
    start_s: float
    end_s: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    ramp_s: float = 10.0
    seed: int = 0


@dataclass
class _Sent:
    request: Request
    first_token_s: float | None = None
    done_s: float | None = None  # when it ended, served or lost (trace seconds)
    tokens: int = 0
    status: str = "pending"  # ok | lost | pending
    why: str = ""  # for a lost request: what the client saw
    engine: int = -1  # the engine it was last sent to
    detail: str = ""  # a refused request: the error's parameter and message
    user: int | None = None  # the closed-loop user that sent it (None: a trace request)
    # (trace seconds, engine) of each attempt: where it was at any moment, not only at its end
    path: list[tuple[float, int]] = field(default_factory=list)

    def engine_at(self, t: float) -> int:
        """The engine the request was in at `t`: the last one sent to by then (-1: none yet).
        A request that moved (a drain's 503 or shed answered long after it was sent, on a busy
        machine) was in its first engine until then, not in the last one all along."""
        if not self.path:
            return self.engine
        engine = -1
        for at, e in self.path:
            if at > t:
                break
            engine = e
        return engine


class Gateway:
    """Round-robin over engines; a deferral (429, 503) or a refused connection go to the next
    engine (a closed-loop user's request stays on its own engine while the load runs, unless
    the engine answers that it drains).

    With `front` (a real router's URL: lab/routers.py), it is the clients behind that router
    instead: every request goes to the router, which chooses the engine, and an answer OpenAI's
    clients retry (408, 409, 429, 5xx: a deferral, a drain's 503, a tripped breaker, nginx's 502)
    is retried after its Retry-After until the client's patience ends; an error event inside a
    200 stream is lost, as it is for such a client. Every non-200 answer is counted by status
    (`answers`)."""

    def __init__(
        self,
        urls: list[str],
        compression: float,
        t0: float,
        model: str = str(TINY_MODEL),
        front: str | None = None,
    ) -> None:
        self.urls, self.compression, self.t0, self.model = urls, compression, t0, model
        self.front = front
        self.sent: list[_Sent] = []
        self.answers: dict[str, int] = {}  # non-200 answers the clients saw, by status

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.compression

    def _end(self, s: _Sent, status: str, why: str = "") -> None:
        s.status, s.done_s, s.why = status, self.now(), why

    async def _one(
        self,
        client: httpx.AsyncClient,
        s: _Sent,
        k: int,
        deadline: float,
        sticky_until: float = 0.0,
    ) -> None:
        """Send one request until served, lost or `deadline` (trace s). Until `sticky_until` it
        stays on engine k mod n (a closed-loop user waits for its own engine, honouring
        Retry-After) unless that engine is draining: a drain is the incident under test, and a
        gateway re-sends a draining replica's requests to a peer. Otherwise a 503 or a refused
        connection goes to the next engine."""
        r = s.request
        body = {
            "model": self.model,
            "prompt": [(k * 7919 + j * 31) % 30000 + 10 for j in range(r.prompt_tokens)],
            "max_tokens": r.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},  # chunks may carry several tokens
            # vLLM sends the first token at once, then one chunk per STREAM_CHUNKS-th of the
            # output: TTFT and completion times are unchanged, and 64+ streams per engine stay
            # within what a small machine's event loop can read
            "stream_interval": max(1, r.output_tokens // STREAM_CHUNKS),
        }
        if r.prompt_logprobs:
            # 0: the prompt tokens' own logprobs, the only kind vLLM streams; the memory is the
            # same as for any k (FP32 log-softmax over the whole vocabulary per prompt token)
            body["prompt_logprobs"] = 0
        attempt = 0
        drained = False  # its engine answered that it drains: this request no longer waits there
        # a client waits PATIENCE_S from its arrival, and always makes its first attempt (a busy
        # event loop may start this task late)
        deadline = max(deadline, r.at_s + PATIENCE_S)
        front = self.front
        while attempt == 0 or self.now() < deadline:
            sticky = not drained and self.now() < sticky_until and front is None
            if front is None:
                s.engine = (k + (0 if sticky else attempt)) % len(self.urls)
                url = self.urls[s.engine]
            else:
                s.engine, url = -1, front  # the router chooses; the engine is not known here
            s.path.append((self.now(), s.engine))
            attempt += 1
            accepted = False  # the engine answered 200: the request is in it
            retry_after = STICKY_RETRY_S
            try:
                async with self._stream(client, f"{url}/v1/completions", body) as resp:
                    code = resp.status_code
                    if code != 200:
                        key = str(code)
                        self.answers[key] = self.answers.get(key, 0) + 1
                    if code in DEFERRALS or (front is not None and code in CLIENT_RETRIED):
                        retry_after = _retry_after(resp.headers.get("retry-after"))
                        drained = drained or DRAINING in (await resp.aread()).decode(
                            errors="replace"
                        )
                        # behind a router the client waits its Retry-After; the twin's gateway
                        # goes to the next engine at once (a waiting user: after Retry-After)
                        await self._backoff(
                            front is not None or (sticky and not drained), retry_after
                        )
                        continue
                    if resp.status_code != 200:
                        s.detail = _error_detail(await resp.aread())
                        self._end(s, "lost", f"HTTP {resp.status_code}")
                        return
                    accepted, failed = True, False
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        failed = failed or "error" in chunk
                        if chunk.get("choices") and s.first_token_s is None:
                            s.first_token_s = self.now()
                        if chunk.get("usage"):
                            s.tokens = int(chunk["usage"]["completion_tokens"])
                    if failed and s.first_token_s is None and front is None:
                        # ended before its first token (a drain ended it while queued): nothing
                        # reached the user yet, so the twin's gateway retries it elsewhere (a
                        # real router has passed the 200 on: the client sees an error)
                        drained = True
                        await self._backoff(False, retry_after)
                        continue
                    if s.tokens:
                        self._end(s, "ok")
                    elif failed and s.first_token_s is None:
                        self._end(s, "lost", "error inside a 200 stream")
                    else:
                        self._end(s, "lost", "error mid-stream" if failed else "no tokens")
                    return
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if s.first_token_s is not None or (accepted and isinstance(exc, httpx.ReadError)):
                    # the engine died under a request in flight
                    self._end(s, "lost", "engine died mid-request")
                    return
                # refused, or reset before the engine answered (a restarting engine, a closed
                # keep-alive connection): nothing was served, the gateway tries again
                await self._backoff(sticky, retry_after)
        self._end(s, "lost", "no engine took it before the deadline")

    async def _backoff(self, sticky: bool, retry_after_s: float) -> None:
        """Before the next attempt: a gateway goes to the next engine at once (50 ms); a user
        waiting for its own engine comes back after Retry-After (trace seconds: the twin's
        clock), so 64 waiting users do not hammer a draining or restarting engine."""
        await asyncio.sleep(max(0.05, retry_after_s / self.compression) if sticky else 0.05)

    @contextlib.asynccontextmanager
    async def _stream(
        self, client: httpx.AsyncClient, url: str, body: dict[str, Any]
    ) -> AsyncIterator[httpx.Response]:
        # Requests past the pool's size wait here, not in httpx's pool: httpcore matches every
        # queued request against every connection on each pool event, so a few thousand queued
        # requests (64+ long streams per engine) starved the event loop and stalled the replay.
        async with self._slots, client.stream("POST", url, json=body) as resp:
            yield resp

    async def _user(
        self, client: httpx.AsyncClient, u: int, load: ClosedLoop, deadline: float, k0: int
    ) -> None:
        """One closed-loop user: a request, and the next when it ends, until `load.end_s`."""
        rnd = random.Random(load.seed * 1_000_003 + u)
        start = load.start_s + load.ramp_s * u / max(1, load.users)
        delay = start / self.compression - (time.monotonic() - self.t0)
        if delay > 0:
            await asyncio.sleep(delay)
        i = 0
        while self.now() < load.end_s:
            r = Request(
                round(self.now(), 3),
                rnd.randint(*load.prompt_tokens),
                rnd.randint(*load.output_tokens),
                False,
            )
            s = _Sent(r, user=u)
            self.sent.append(s)
            # k: a prompt of its own (no prefix-cache hits), sent to engine u mod n, where it
            # waits while the load runs: a user that drifted to the peer when its engine
            # answered 503 or refused a connection left the engine under test short of its
            # load at the incident (12 of 64 at the 15:52 run); after the load, the gateway's
            # failover as for any request
            await self._one(client, s, k0 + i * load.users + u, deadline, load.end_s)
            i += 1
            if s.status == "lost":
                await asyncio.sleep(0.05)  # a user who saw an error retries, not in a hot loop

    async def replay(
        self, reqs: list[Request], end_s: float, load: ClosedLoop | None = None
    ) -> None:
        self._slots = asyncio.Semaphore(MAX_STREAMS)  # bound to this replay's event loop
        # every connection kept alive: one per stream at most, none reopened per request
        limits = httpx.Limits(max_connections=MAX_STREAMS, max_keepalive_connections=MAX_STREAMS)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            tasks = []
            if load is not None:
                # users' k start past the trace's (rounded to a multiple of the users, so
                # user u's requests go first to engine u mod the engines)
                k0 = -(-(len(reqs) + 1) // load.users) * load.users
                tasks = [
                    asyncio.create_task(self._user(client, u, load, end_s, k0))
                    for u in range(load.users)
                ]
            for k, r in enumerate(reqs):
                delay = r.at_s / self.compression - (time.monotonic() - self.t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                s = _Sent(r)
                self.sent.append(s)
                tasks.append(asyncio.create_task(self._one(client, s, k, end_s)))
            await asyncio.gather(*tasks)


def _retry_after(value: str | None) -> float:
    """A Retry-After header's delay in seconds (the plugin sends whole seconds), else the
    default."""
    try:
        return min(60.0, max(0.0, float(value))) if value is not None else STICKY_RETRY_S
    except ValueError:
        return STICKY_RETRY_S


def _error_detail(body: bytes) -> str:
    """'param: message' of an OpenAI-style error body (vLLM's 400s), or its first 200 bytes."""
    try:
        error = json.loads(body)["error"]
        return f"{error.get('param')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


@dataclass
class EngineView:
    """What the GPU driver last saw of one engine (trace time `t`)."""

    t: float = 0.0
    up: bool = False
    mode: str = "starting"  # serving | capped | draining | down
    cap: int | None = None
    startup_cap: int | None = None
    running: int = 0
    waiting: int = 0
    kv: float = 0.0
    gpu_free: int = 0
    neighbour: int = 0
    generation: int = 0
    ooms: int = 0  # CUDA OOM exits so far


def _flags_args(trace: Trace, config: str) -> list[str]:
    e = trace.engine
    seqs = min(e.max_num_seqs, STATIC_MAX_NUM_SEQS) if config == "static" else e.max_num_seqs
    return [
        "--max-num-seqs",
        str(seqs),
        "--max-model-len",
        str(e.max_model_len),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--gpu-memory-utilization",
        str(e.gpu_memory_utilization),
    ]


class Fleet:
    """Engines on twin GPUs for one trace and one configuration; see the module docstring."""

    def __init__(
        self,
        trace: Trace,
        config: str,
        workdir: Path | None = None,
        log: Callable[[str], None] = print,
        *,
        engines: int = 2,
        prefix: str = "engine",
        hostname: str = "twin-node",
        own_remediator: bool = True,
        period: float = 0.1,
        served_name: str | None = None,
        audit: Path | None = None,
        recovery_watch_s: float = RECOVERY_WATCH_S,
        start_timeout: float = 180.0,
        load: ClosedLoop | None = None,
        guard_mode: str | None = None,
        router: str = "gateway",
        step_guard_mode: str | None = None,
    ) -> None:
        """`period`: wall seconds between the GPU driver's passes (GPU state, engine reads);
        `served_name`: vLLM's --served-model-name (the `model_name` label of its metrics);
        `audit`: the remediator's audit log when the caller runs the remediator;
        `recovery_watch_s`: trace seconds to keep watching for engine 0's recovery after the
        trace (a crashed engine reloads for the trace's `reload_s`); `start_timeout`: wall
        seconds each vLLM may take to load; `load`: closed-loop users on top of the trace;
        `guard_mode`, `step_guard_mode`: the request and step guards' modes (default: see
        `start`); `router`: what is in front of the engines (lab/routers.py): the twin's own
        gateway, or vllm-router or nginx set up as docs/vllm-plugin.md says (vllm-router:
        readiness health checks, and the fleet's remediator takes an engine out of its rotation
        before a drain)."""
        assert config in (*CONFIGS, GUARD, NO_STEP_GUARD), config
        assert router in ROUTERS, router
        self.trace, self.config, self.log = trace, config, log
        self.work = workdir or Path(tempfile.mkdtemp(prefix=f"oomguard-{trace.name}-{config}-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.n, self.prefix, self.hostname = engines, prefix, hostname
        self.own_remediator = own_remediator
        self.period = period
        self.c = trace.time_compression
        self.model = MODELS / trace.model  # served with its tokenizer (see the module docstring)
        self.engines: list[SupervisedVllm] = []
        self.procs: list[Any] = []
        self.exporter: Exporter | None = None
        self.exporter_port: int | None = None
        self._lab_clock = contextlib.ExitStack()  # what runs on the trace's clock while up
        self.gateway: Gateway | None = None
        self.t0 = 0.0
        self.t0_wall = 0.0
        self.ended_s = 0.0  # trace time when the replay (and the recovery watch) ended
        self.views = [EngineView() for _ in range(engines)]
        self.history: list[list[EngineView]] = []  # the views at each driver pass
        self.crash_times: list[float] = []  # trace seconds of every CUDA OOM exit
        self.sent: list[_Sent] = []
        self.audit = audit or self.work / "audit.jsonl"
        self.served_name = served_name
        self.recovery_watch_s = recovery_watch_s
        self.start_timeout = start_timeout
        self.load = load
        self.guard_mode = guard_mode
        self.router = router
        self.front: VllmRouter | Nginx | None = None
        self.step_guard_mode = step_guard_mode
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._gmu = [trace.engine.gpu_memory_utilization] * engines
        self._restarted_at = [0.0] * engines
        self._gpu_seen = [(0, 0)] * engines  # (free bytes, neighbour bytes) last written
        self._preempt_seen: dict[int, int] = {}
        self._preempt_total = 0
        self._wall0 = time.monotonic()
        self.done = False
        self.states = [self.work / f"gpu{i}.json" for i in range(engines)]
        self.gpus = [
            TwinGpu(f"GPU-twin-{prefix}-{i}-0000-0000-00000000000{i}", trace.gpu, i)
            for i in range(engines)
        ]
        self.nvml = TwinNvml(self.gpus)

    @property
    def names(self) -> list[str]:
        return [f"{self.prefix}-{i}" for i in range(self.n)]

    # -- start-up ------------------------------------------------------------------------------
    def start(self) -> None:
        w, c, trace = self.work, self.c, self.trace
        (w / "stoken").write_text("twin-supervisor-token")
        (w / "ptoken").write_text(TOKEN)
        (w / "rtoken").write_text("twin-remediator-token")
        for s in self.states:
            s.write_text(json.dumps({}))
            Path(f"{s}.started").unlink(missing_ok=True)  # the first start loads no model twice

        # the request guard: enforcing in `guard`, vLLM as shipped in default and static, and
        # oomguard's own default (observe) in `oomguard` unless the caller chose a mode
        guard_mode = self.guard_mode or {
            GUARD: "enforce",
            "oomguard": "observe",
            NO_STEP_GUARD: "observe",
        }.get(self.config, "off")
        # the step guard: oomguard's own default (observe) in `oomguard` unless the caller chose
        # a mode; off in vLLM as shipped, the request guard alone and `oomguard-no-step-guard`
        step_guard_mode = (
            (self.step_guard_mode or "observe") if self.config == "oomguard" else "off"
        )

        def launch(i: int) -> SupervisedVllm:
            served = ["--served-model-name", self.served_name] if self.served_name else []
            return SupervisedVllm(
                w / f"engine{i}",
                *_flags_args(trace, self.config),
                *served,
                plugin_token=TOKEN,
                supervisor_token_file=w / "stoken",
                model=self.model,
                tokenizer=True,
                env={
                    "HF_HUB_OFFLINE": "1",  # the tokenizer is in the folder: no network wait
                    "OOMGUARD_GUARD_MODE": guard_mode,
                    "OOMGUARD_STEP_GUARD_MODE": step_guard_mode,
                    **self._router_env(),
                    "OOMGUARD_TWIN_GPU": trace.gpu,
                    "OOMGUARD_TWIN_MODEL": trace.model,
                    "OOMGUARD_TWIN_STATE_FILE": str(self.states[i]),
                    "OOMGUARD_TWIN_TIME_COMPRESSION": str(c),
                    # the model reload of every restart, crashed or requested (the twin's
                    # worker waits it out on each start after the first): a requested restart
                    # is not free
                    "OOMGUARD_TWIN_RELOAD_SECONDS": str(trace.reload_s / c),
                    ALLOCATOR_DIR_ENV: str(w / "allocator"),
                    TARGET_ENV: self.names[i],
                },
                restart_delay=1.0,  # the reload itself is the twin worker's (above)
                max_crashes=1000 if self.config not in WITH_OOMGUARD else 20,
                keep_flags_on_crash=self.config not in WITH_OOMGUARD,
                timeout=self.start_timeout,
            )

        self.engines = start_all([functools.partial(launch, i) for i in range(self.n)])
        self.procs.extend(self.engines)
        self._start_router()
        # the GPUs hold the engines' memory from now on (trace time 0 until the replay starts)
        self._threads = [
            threading.Thread(target=self._drive, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        if self.config not in WITH_OOMGUARD:
            return
        # the exporter's event holds on the trace's clock, as every other clock of the loop
        self._lab_clock.enter_context(step_guard_hold_on_trace_clock(c))
        self.exporter, self.exporter_port = twin_exporter(
            dict(zip(self.names, (e.url for e in self.engines), strict=True)),
            self.nvml,
            w / "allocator",
            interval=poll_seconds(EXPORTER_INTERVAL_S, c, 0.5, floor=0.25),
            hostname=self.hostname,
            pressure=exporter_thresholds(c),
        )
        if self.own_remediator:
            rem = RemediatorProcess(
                w / "remediator",
                remediator_config(
                    self.remediator_targets(restart=True),
                    c,
                    audit=self.audit,
                    token_file=w / "rtoken",
                    exporters=[f"http://127.0.0.1:{self.exporter_port}/metrics"],
                    routers=self.remediator_routers(),
                ),
            )
            self.procs.append(rem)

    # -- the router in front -------------------------------------------------------------------
    def _router_env(self) -> dict[str, str]:
        """The plugin's settings for the router in front (docs/vllm-plugin.md): behind
        vllm-router a drain keeps queueing until its readiness checks took the engine out
        (interval x failures + timeout; the remediator removes it at once through the admin
        API and asks for no grace), elsewhere it sheds at once (nginx and the twin's gateway
        retry a 503 on the peer)."""
        if self.router != "vllm-router":
            return {}
        s = ROUTER_SETTINGS
        return {DRAIN_GRACE_ENV: str(s.interval_s * s.failures + s.timeout_s)}

    def _start_router(self) -> None:
        urls = [e.url for e in self.engines]
        if self.router == "vllm-router":
            self.front = VllmRouter(self.work / "vllm-router", urls, ROUTER_SETTINGS)
        elif self.router == "nginx":
            self.front = Nginx(self.work / "nginx", urls)
        if self.front is not None:
            self.procs.append(self.front)
            self.log(f"  {self.router} in front of the engines: {self.front.url}")

    def remediator_routers(self) -> list[dict[str, Any]]:
        """The remediator's router allowlist for this fleet (vllm-router's admin API)."""
        if isinstance(self.front, VllmRouter):
            return [{"name": f"{self.prefix}-router", "url": self.front.url}]
        return []

    def remediator_targets(self, restart: bool = False) -> list[dict[str, Any]]:
        """The engines as the remediator's allowlist; `restart`: with their supervisor as the
        restart backend (lower memory flags after a crash or critical memory that stays)."""
        targets: list[dict[str, Any]] = []
        routers = self.remediator_routers()
        for name, e in zip(self.names, self.engines, strict=True):
            target: dict[str, Any] = {
                "name": name,
                "url": e.url,
                "model": self.trace.model,
                "token_file": str(self.work / "ptoken"),
            }
            if routers:
                target["router"] = {"name": routers[0]["name"]}
            if restart:
                supervisor = {"url": e.api, "token_file": str(self.work / "stoken")}
                target["restart"] = {"supervisor": supervisor}
            targets.append(target)
        return targets

    # -- the replay ----------------------------------------------------------------------------
    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.c if self.t0 else 0.0

    def trace_time(self, wall_clock: float) -> float:
        """Trace seconds at a `time.time()` instant (0 before the replay started)."""
        return max(0.0, (wall_clock - self.t0_wall) * self.c) if self.t0 else 0.0

    def replay(self) -> None:
        """Replay the trace (blocking), then watch until engine 0 is back at full admission."""
        self.t0, self.t0_wall = time.monotonic(), time.time()
        trace, c = self.trace, self.c
        gateway = self.gateway = Gateway(
            [e.url for e in self.engines],
            c,
            self.t0,
            self.served_name or str(self.model),
            front=self.front.url if self.front is not None else None,
        )
        reqs = requests(trace)
        self.log(
            f"  {trace.name}/{self.config}: {len(reqs)} requests over {trace.duration_s:.0f} s "
            f"(x{c:g}: {trace.duration_s / c:.0f} s wall)"
        )
        asyncio.run(gateway.replay(reqs, trace.duration_s + 120, self.load))
        self.sent = list(gateway.sent)  # the trace's requests (the recovery watch adds its own)
        if trace.pressure_ends:
            # keep watching (with light traffic, so staged re-admission can proceed) until
            # engine 0 is back at full admission, for at most `recovery_watch_s`
            end = max(trace.duration_s, trace.pressure_ends_s or 0.0) + self.recovery_watch_s
            tail = [
                Request(at, 256, 16, False)
                for at in range(int(gateway.now()) + 1, int(end), max(1, int(c / 2)))
            ]

            async def watch() -> None:
                feeder = asyncio.create_task(gateway.replay(tail, end))
                while self.recovered_at() is None and gateway.now() < end:
                    await asyncio.sleep(0.2)
                feeder.cancel()

            asyncio.run(watch())
        self.ended_s = self.now()
        self._stop.set()
        for thread in self._threads:
            thread.join(15)
        self.done = True

    def pressure_ended_at(self) -> float | None:
        """When engine 0's pressure ended (trace s): the trace's `pressure_ends_s`, or, where it
        ends only with a restart (fragmentation lives in the process), when engine 0's first
        restarted process answered its plugin's state: ready, on a clean allocator. None
        before then (never restarted: the pressure never ended)."""
        if self.trace.pressure_ends_s is not None:
            return self.trace.pressure_ends_s
        if not self.trace.pressure_ends_with_restart:
            return None
        for views in list(self.history):
            v = views[0]
            if v.generation > 1 and v.up:  # generation 1: the process the fleet started
                return v.t
        return None

    def recovered_at(self) -> float | None:
        """Trace time when engine 0 was first back at full admission after the pressure ended."""
        end = self.pressure_ended_at()
        if end is None:
            return None
        for views in list(self.history):
            v = views[0]
            if v.t >= end and v.up and v.mode == "serving":
                return v.t
        return None

    def _drive(self) -> None:
        """Writes each GPU's state for the executor and the exporter's NVML, every 0.1 s wall
        at most; never waits on an engine (the trace's GPU events must keep their time).
        Engine 0's fragmentation is its process's (twin.traces.Fragments): a restart starts it
        from none, and fragments its requests made coalesce when the last view of the engine
        (its plugin's state, read by `_watch`) shows it running none."""
        trace = self.trace
        fragments = [Fragments(trace) for _ in range(self.n)]
        while not self._stop.is_set():
            t = self.now()
            for i in range(self.n):
                neighbour, frag = 0, 0
                if i == 0:  # the trace's GPU events hit engine 0's GPU only
                    neighbour = trace.gpu_at(t)[0]
                    if fragments[i].started_at != self._restarted_at[i]:
                        fragments[i].restarted(self._restarted_at[i])
                    view = self.views[i]
                    frag = fragments[i].at(t, idle=view.up and view.running == 0)
                self.states[i].write_text(
                    json.dumps({"neighbour_bytes": neighbour, "fragmentation_bytes": frag})
                )
                # vLLM plans gmu x the CUDA runtime's total (NVML total less reserved)
                usable = self.gpus[i].total - self.gpus[i].reserved
                self.nvml.set_process(i, 1000 + i, int(self._gmu[i] * usable) + frag)
                self.nvml.set_process(i, NEIGHBOUR_PID, neighbour or None)
                self._gpu_seen[i] = (self.gpus[i].free, neighbour)
            self._stop.wait(min(self.period, 0.1))

    def _watch(self) -> None:
        """Reads each engine (supervisor status, plugin state) every `period` wall seconds."""
        # one client for every read: httpx.get builds a client (and its SSL context) per call,
        # ~70 ms of CPU under load; four per pass held the GIL from the gateway's event loop
        with httpx.Client(timeout=2) as client:
            self._watch_with(client)

    def _watch_with(self, client: httpx.Client) -> None:
        generation = [0] * self.n
        exits_seen = [0] * self.n
        while not self._stop.is_set():
            t = self.now()
            views = []
            for i, e in enumerate(self.engines):
                v = EngineView(t=t)
                alive = False  # the supervisor says vLLM runs and answers its health check
                try:
                    auth = {"Authorization": f"Bearer {e.token}"}
                    status = client.get(f"{e.api}/v1/status", headers=auth).json()
                    alive = bool(status.get("running")) and bool(status.get("ready"))
                    if status["generation"] != generation[i]:
                        generation[i] = status["generation"]
                        self._restarted_at[i] = t if generation[i] > 1 else 0.0
                    self._gmu[i] = float(status["flags"]["current"]["gpu_memory_utilization"])
                    ooms = [x for x in status["exits"] if x["reason"] == "cuda_oom"]
                    # the exit's own wall clock, in trace time (this loop may run late)
                    self.crash_times.extend(
                        self.trace_time(float(x.get("time", 0))) or t for x in ooms[exits_seen[i] :]
                    )
                    exits_seen[i] = max(exits_seen[i], len(ooms))
                except (httpx.HTTPError, KeyError, ValueError, TypeError):
                    pass
                v.generation, v.ooms = generation[i], exits_seen[i]
                v.gpu_free, v.neighbour = self._gpu_seen[i]
                try:
                    st = parse_state(client.get(f"{e.url}{API_PREFIX}/state", timeout=1).json())
                    total = st.preemptions_total
                    key = i * 1000 + generation[i]
                    self._preempt_total += total - self._preempt_seen.get(key, 0)
                    self._preempt_seen[key] = total
                    v.up = True
                    v.cap, v.startup_cap = st.admission_cap, st.startup_max_num_seqs
                    full = v.cap >= v.startup_cap
                    v.mode = "draining" if st.draining else "serving"
                    if v.mode == "serving" and not full:
                        v.mode = "capped"
                    v.running, v.waiting = st.running or 0, st.waiting or 0
                    v.kv = st.kv_cache_usage or 0.0
                except (httpx.HTTPError, ValueError):  # StateError too: a ValueError
                    # slow to answer is not dead: keep what was last seen while vLLM runs
                    last = self.views[i]
                    if alive and last.generation == v.generation and last.mode != "down":
                        v.up, v.mode, v.cap, v.startup_cap = (
                            True,
                            last.mode,
                            last.cap,
                            last.startup_cap,
                        )
                        v.running, v.waiting, v.kv = last.running, last.waiting, last.kv
                    else:
                        v.mode = "down"
                views.append(v)
            self.views = views
            self.history.append(views)
            self._stop.wait(self.period)

    # -- results -------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int, int]:
        """(served, lost, in flight) among the requests sent so far."""
        sent = list(self.gateway.sent) if self.gateway else []
        ok = sum(1 for s in sent if s.status == "ok")
        lost = sum(1 for s in sent if s.status == "lost")
        return ok, lost, len(sent) - ok - lost

    def outcome(self) -> Outcome:
        trace = self.trace
        o = Outcome(trace.name, self.config, router=self.router)
        if self.gateway is not None:
            o.answers = dict(self.gateway.answers)
        sent = self.sent
        o.requests = len(sent)
        ok = [s for s in sent if s.status == "ok"]
        o.completed = len(ok)
        o.lost = len(sent) - len(ok)
        for x in sent:
            if x.status != "ok":
                why = x.why or "unfinished"
                o.lost_why[why] = o.lost_why.get(why, 0) + 1
                if x.why == "HTTP 400":
                    o.refusals.append(x.detail)
        ttfts = [s.first_token_s - s.request.at_s for s in ok if s.first_token_s is not None]
        if ttfts:
            ranked = sorted(ttfts)
            o.ttft_p99_s = round(ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))], 2)
        o.good_tokens = sum(
            s.tokens
            for s in ok
            if s.first_token_s is not None and s.first_token_s - s.request.at_s <= trace.ttft_slo_s
        )
        # over the trace's own duration: the same requests served well give the same goodput
        o.goodput_tokens_per_s = round(o.good_tokens / trace.duration_s, 2)
        o.preemptions = self._preempt_total
        o.crashes = len(self.crash_times)
        back, ended = self.recovered_at(), self.pressure_ended_at()
        if back is not None and ended is not None:
            o.recovery_s = round(back - ended, 1)
        if self.audit.exists():
            for line in self.audit.read_text().splitlines():
                entry = json.loads(line)
                if entry["event"] == "acted" and entry["target"] in self.names:
                    o.actions.append(f"{entry['target']}:{entry['action']}")
        o.wall_s = round(time.monotonic() - self._wall0, 1)
        return o

    def stop(self) -> None:
        self._stop.set()
        if self.exporter is not None:
            self.exporter.stop()
        self._lab_clock.close()
        # engines stop side by side: each waits for its vLLM to shut down
        threads = [threading.Thread(target=p.stop) for p in reversed(self.procs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def poll_seconds(shipped: float, compression: float, slowest: float, floor: float = 0.1) -> float:
    """A polling interval (the exporter's, the standalone watcher's, the reconcile pass) toward
    the trace's clock: the shipped default divided by the compression, never slower than
    `slowest` wall seconds (what the twin ran before at every compression; at x1 it stays so),
    and never faster than `floor`: on the 2-CPU machine the engines' own steps need the CPU
    (each poll is an HTTP request to vLLM's API server). At x20 the shipped second would be
    0.05 wall s; 0.25 wall s was five trace seconds per reconcile pass, and each step of a
    staged re-admission waits for one; 0.1 is two."""
    return max(floor, min(slowest, shipped / compression))


def remediator_timings(compression: float) -> dict[str, Any]:
    """The remediator's shipped policy and safety defaults, each clock scaled to the trace's:
    the remediator runs in wall time, so at x`compression` every trace-time default is divided
    by it. Derived from the config models, so the twin runs what an operator gets. One floor:
    the fragmentation settle keeps LAB_IDLE_TO_LEVEL_S of wall time beyond the alert's
    hysteresis (unchanged at x1, where its margin is 30 s)."""
    c = compression
    policy, safety = PolicyConfig(), SafetyConfig()
    shipped_reconcile = RemediatorConfig.model_fields["reconcile_seconds"].default
    keep = StandaloneConfig.model_fields["keep_firing_seconds"].default
    # the settle's margin over the alert's hysteresis is the time the level has to fall once
    # the engine is idle: the lab's part of that is wall time (LAB_IDLE_TO_LEVEL_S)
    margin = max((policy.fragmentation_settle_seconds - keep) / c, LAB_IDLE_TO_LEVEL_S)
    return {
        "policy": {
            "step_seconds": policy.step_seconds / c,
            "restart_after_drain_seconds": policy.restart_after_drain_seconds / c,
            "fragmentation_settle_seconds": keep / c + margin,
            "readmit_idle_seconds": policy.readmit_idle_seconds / c,
        },
        "safety": {
            "cooldown_seconds": safety.cooldown_seconds / c,
            "window_seconds": safety.window_seconds / c,
        },
        "reconcile_seconds": poll_seconds(shipped_reconcile, c, 0.25),
    }


def exporter_thresholds(compression: float) -> PressureThresholds:
    """The exporter's shipped pressure thresholds, its event hold on the trace's clock: an
    allocator retry holds the level for event_hold_seconds (120 s) of trace time, not of wall
    time (at x15 that was half an hour of trace). The rate window stays as shipped: it is a ratio
    of counts the twin makes at its own wall-time pace, not a clock. The step-guard hold:
    processes.step_guard_hold_on_trace_clock."""
    shipped = PressureThresholds()
    return shipped.model_copy(
        update={"event_hold_seconds": shipped.event_hold_seconds / compression}
    )


def standalone_timings(compression: float, exporters: list[str]) -> dict[str, Any]:
    """Standalone mode's alert timings (the rules' `for` and action `keep_firing_for`) at their
    shipped defaults, scaled to the trace's clock, and the exporters polled at theirs."""
    c = compression
    d = StandaloneConfig(exporters=exporters)
    return {
        "exporters": exporters,
        "interval_seconds": poll_seconds(d.interval_seconds, c, 0.25),
        "pressure_for_seconds": d.pressure_for_seconds / c,
        "critical_for_seconds": d.critical_for_seconds / c,
        "keep_firing_seconds": d.keep_firing_seconds / c,
    }


def remediator_config(
    targets: list[dict[str, Any]],
    compression: float,
    *,
    audit: Path,
    token_file: Path,
    exporters: list[str],
    routers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A standalone remediator with its shipped defaults at the trace's clock (the outcome
    benchmark and the fleet's own remediator run this one); `routers`: the routers its targets
    name (Fleet.remediator_routers)."""
    return {
        "auth": {"bearer_token_file": str(token_file)},
        "targets": targets,
        **({"routers": routers} if routers else {}),
        **remediator_timings(compression),
        "audit_log": str(audit),
        "mode": "standalone",
        "standalone": standalone_timings(compression, exporters),
    }


def run(
    trace: Trace,
    config: str,
    workdir: Path | None = None,
    log: Callable[[str], None] = print,
) -> Outcome:
    fleet = Fleet(trace, config, workdir, log)
    try:
        fleet.start()
        fleet.replay()
        return fleet.outcome()
    finally:
        fleet.stop()
