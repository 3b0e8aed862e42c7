"""Replay a trace on two twin GPUs running the real vLLM server, with or without oomguard.

The fleet: two vLLM 0.33 servers (model-free executor with the GPU physics, plugin installed),
each under `oomguard serve` (a crash reloads the model after the trace's `reload_s`), behind a
gateway that balances requests and, like a real one, sends a request to the other engine when
one answers 503 (draining) or refuses the connection (restarting). The trace's GPU events hit
engine 0's GPU; engine 1 is its healthy peer. Configurations:

- `default`: vLLM's flags from the trace, no oomguard (crashes restart with the same flags);
- `static`: the same with `max_num_seqs` 48, as conservative operators run it;
- `oomguard`: the exporter reading both twin GPUs, the remediator (standalone mode: pressure
  levels from the exporter; its timings scaled by the trace's time compression) acting through
  the plugin, and the supervisor lowering flags after a CUDA OOM.

Everything is measured in trace seconds (wall seconds x time compression).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from oomguard.exporter.main import Exporter
from oomguard.twin.gpu import TwinGpu, TwinNvml
from oomguard.twin.processes import (
    TINY_MODEL,
    RemediatorProcess,
    SupervisedVllm,
    start_all,
    twin_exporter,
)
from oomguard.twin.traces import Request, Trace, requests

CONFIGS = ("default", "static", "oomguard")
STATIC_MAX_NUM_SEQS = 48
TOKEN = "twin-plugin-token"
NEIGHBOUR_PID = 424242
RECOVERY_WATCH_S = 600.0  # trace seconds to keep watching for recovery after the trace


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
    recovery_s: float | None = None  # pressure end -> engine 0 back at full admission
    actions: list[str] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass
class _Sent:
    request: Request
    first_token_s: float | None = None
    done_s: float | None = None
    tokens: int = 0
    status: str = "pending"  # ok | lost | pending


class Gateway:
    """Round-robin over engines; 503 or a refused connection go to the other engine."""

    def __init__(self, urls: list[str], compression: float, t0: float) -> None:
        self.urls, self.compression, self.t0 = urls, compression, t0
        self.sent: list[_Sent] = []

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.compression

    async def _one(self, client: httpx.AsyncClient, s: _Sent, k: int, deadline: float) -> None:
        r = s.request
        body = {
            "model": str(TINY_MODEL),
            "prompt": [(k * 7919 + j * 31) % 30000 + 10 for j in range(r.prompt_tokens)],
            "max_tokens": r.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},  # chunks may carry several tokens
        }
        if r.prompt_logprobs:
            body["prompt_logprobs"] = 1
        attempt = 0
        while self.now() < deadline:
            url = self.urls[(k + attempt) % len(self.urls)]
            attempt += 1
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    if resp.status_code == 503:
                        await asyncio.sleep(0.05)
                        continue
                    if resp.status_code != 200:
                        s.status = "lost"
                        return
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and s.first_token_s is None:
                            s.first_token_s = self.now()
                        if chunk.get("usage"):
                            s.tokens = int(chunk["usage"]["completion_tokens"])
                    s.done_s = self.now()
                    s.status = "ok" if s.tokens else "lost"
                    return
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if s.first_token_s is not None or isinstance(exc, httpx.ReadError):
                    s.status = "lost"  # the engine died under a request in flight
                    return
                await asyncio.sleep(0.05)
        s.status = "lost"

    async def replay(self, reqs: list[Request], end_s: float) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            tasks = []
            for k, r in enumerate(reqs):
                delay = r.at_s / self.compression - (time.monotonic() - self.t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                s = _Sent(r)
                self.sent.append(s)
                tasks.append(asyncio.create_task(self._one(client, s, k, end_s)))
            await asyncio.gather(*tasks)


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


def run(
    trace: Trace,
    config: str,
    workdir: Path | None = None,
    log: Callable[[str], None] = print,
) -> Outcome:
    assert config in CONFIGS, config
    work = workdir or Path(tempfile.mkdtemp(prefix=f"oomguard-{trace.name}-{config}-"))
    work.mkdir(parents=True, exist_ok=True)
    c = trace.time_compression
    (work / "stoken").write_text("twin-supervisor-token")
    (work / "ptoken").write_text(TOKEN)
    (work / "rtoken").write_text("twin-remediator-token")
    states = [work / f"gpu{i}.json" for i in range(2)]
    for s in states:
        s.write_text(json.dumps({}))
    engines: list[SupervisedVllm] = []
    procs: list[Any] = []
    exporter: Exporter | None = None
    outcome = Outcome(trace.name, config)
    wall0 = time.monotonic()
    try:

        def launch(i: int) -> SupervisedVllm:
            return SupervisedVllm(
                work / f"engine{i}",
                *_flags_args(trace, config),
                plugin_token=TOKEN,
                supervisor_token_file=work / "stoken",
                env={
                    "OOMGUARD_TWIN_GPU": trace.gpu,
                    "OOMGUARD_TWIN_MODEL": trace.model,
                    "OOMGUARD_TWIN_STATE_FILE": str(states[i]),
                    "OOMGUARD_TWIN_TIME_COMPRESSION": str(c),
                    "OOMGUARD_ALLOCATOR_DIR": str(work / "allocator"),
                    "OOMGUARD_TARGET": f"engine-{i}",
                },
                restart_delay=trace.reload_s / c,
                max_crashes=1000 if config != "oomguard" else 20,
                keep_flags_on_crash=config != "oomguard",
            )

        engines = start_all([lambda i=i: launch(i) for i in (0, 1)])
        procs.extend(engines)

        gpus = [
            TwinGpu(f"GPU-twin-{i}-0000-0000-0000-00000000000{i}", trace.gpu, i) for i in (0, 1)
        ]
        nvml = TwinNvml(gpus)
        if config == "oomguard":
            exporter, port = twin_exporter(
                {f"engine-{i}": e.url for i, e in enumerate(engines)}, nvml, work / "allocator"
            )
            rem = RemediatorProcess(
                work / "remediator",
                {
                    "auth": {"bearer_token_file": str(work / "rtoken")},
                    "targets": [
                        {
                            "name": f"engine-{i}",
                            "url": e.url,
                            "model": trace.model,
                            "token_file": str(work / "ptoken"),
                        }
                        for i, e in enumerate(engines)
                    ],
                    # the remediator's clock runs in wall time: scale its trace-time settings
                    "policy": {"step_seconds": 30 / c},
                    "safety": {"cooldown_seconds": 10 / c, "window_seconds": 3600 / c},
                    "audit_log": str(work / "audit.jsonl"),
                    "reconcile_seconds": 0.25,
                    "mode": "standalone",
                    "standalone": {
                        "exporters": [f"http://127.0.0.1:{port}/metrics"],
                        "interval_seconds": 0.25,
                        "pressure_for_seconds": 30 / c,
                        "critical_for_seconds": 0,
                        "keep_firing_seconds": 120 / c,
                    },
                },
            )
            procs.append(rem)

        t0 = time.monotonic()
        stop = threading.Event()
        caps: list[tuple[float, int | None]] = []
        preempt_seen: dict[int, int] = {}
        preempt_total = [0]

        def gpu_driver() -> None:
            """Writes each GPU's state for the executor and the exporter's NVML, every 0.1 s."""
            restarted_at = [0.0, 0.0]
            generation = [0, 0]
            while not stop.is_set():
                t = (time.monotonic() - t0) * c
                for i, e in enumerate(engines):
                    try:
                        status = e.status()
                        if status["generation"] != generation[i]:
                            generation[i] = status["generation"]
                            restarted_at[i] = t if generation[i] > 1 else 0.0
                        gmu = status["flags"]["current"]["gpu_memory_utilization"]
                    except (httpx.HTTPError, KeyError, ValueError):
                        gmu = trace.engine.gpu_memory_utilization
                    neighbour, frag = 0, 0
                    if i == 0:  # the trace's GPU events hit engine 0's GPU only
                        neighbour = trace.gpu_at(t)[0]
                        # fragmentation builds up in a process: a restart starts it from zero
                        frag = trace.gpu_at(t - restarted_at[i])[1]
                    states[i].write_text(
                        json.dumps({"neighbour_bytes": neighbour, "fragmentation_bytes": frag})
                    )
                    nvml.set_process(i, 1000 + i, int(gmu * gpus[i].total) + frag)
                    nvml.set_process(i, NEIGHBOUR_PID, neighbour or None)
                    try:
                        st = httpx.get(f"{e.url}/oomguard/v1/state", timeout=1).json()
                        total = int(st["preemptions_total"])
                        key = i * 1000 + generation[i]
                        preempt_total[0] += total - preempt_seen.get(key, 0)
                        preempt_seen[key] = total
                        if i == 0:
                            full = st["admission_cap"] >= st["startup_max_num_seqs"]
                            caps.append((t, 1 if full and st["mode"] == "serving" else -1))
                    except (httpx.HTTPError, KeyError, ValueError):
                        if i == 0:
                            caps.append((t, None))
                stop.wait(0.1)

        driver = threading.Thread(target=gpu_driver, daemon=True)
        driver.start()
        gateway = Gateway([e.url for e in engines], c, t0)
        reqs = requests(trace)
        log(
            f"  {trace.name}/{config}: {len(reqs)} requests over {trace.duration_s:.0f} s "
            f"(x{c:g}: {trace.duration_s / c:.0f} s wall)"
        )
        asyncio.run(gateway.replay(reqs, trace.duration_s + 120))
        sent = list(gateway.sent)  # the trace's requests (the recovery watch adds its own)
        if trace.pressure_ends_s is not None:
            # keep watching (with light traffic, so staged re-admission can proceed) until
            # engine 0 is back at full admission, for at most `recovery_watch_s`
            end = max(trace.duration_s, trace.pressure_ends_s) + RECOVERY_WATCH_S
            tail = [
                Request(at, 256, 16, False)
                for at in range(int(gateway.now()) + 1, int(end), max(1, int(c / 2)))
            ]

            def recovered() -> bool:
                return any(
                    t >= (trace.pressure_ends_s or 0) and cap is not None and cap > 0
                    for t, cap in list(caps)
                )

            async def watch() -> None:
                feeder = asyncio.create_task(gateway.replay(tail, end))
                while not recovered() and gateway.now() < end:
                    await asyncio.sleep(0.2)
                feeder.cancel()

            asyncio.run(watch())
        stop.set()
        driver.join(5)

        outcome.requests = len(sent)
        ok = [s for s in sent if s.status == "ok"]
        outcome.completed = len(ok)
        outcome.lost = len(sent) - len(ok)
        ttfts = [s.first_token_s - s.request.at_s for s in ok if s.first_token_s is not None]
        if ttfts:
            ranked = sorted(ttfts)
            outcome.ttft_p99_s = round(ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))], 2)
        good = sum(
            s.tokens
            for s in ok
            if s.first_token_s is not None and s.first_token_s - s.request.at_s <= trace.ttft_slo_s
        )
        # over the trace's own duration: the same requests served well give the same goodput
        outcome.goodput_tokens_per_s = round(good / trace.duration_s, 2)
        outcome.good_tokens = good
        outcome.preemptions = preempt_total[0]
        for e in engines:
            outcome.crashes += sum(1 for x in e.status()["exits"] if x["reason"] == "cuda_oom")
        if trace.pressure_ends_s is not None:
            end = trace.pressure_ends_s
            back = [t for t, cap in caps if t >= end and cap is not None and cap > 0]
            outcome.recovery_s = round(back[0] - trace.pressure_ends_s, 1) if back else None
        audit = work / "audit.jsonl"
        if audit.exists():
            for line in audit.read_text().splitlines():
                entry = json.loads(line)
                if entry["event"] == "acted":
                    outcome.actions.append(f"{entry['target']}:{entry['action']}")
    finally:
        if exporter is not None:
            exporter.stop()
        for p in reversed(procs):
            p.stop()
    outcome.wall_s = round(time.monotonic() - wall0, 1)
    return outcome
