"""`oomguard preflight URL`: the longest prompt at max batch, before production.

The prevention checklist says: test with the longest prompt you will accept, at max batch. This
does it against a live vLLM with the oomguard plugin, safely:

1. **Facts**: `max_model_len` (`/v1/models`), `max_num_seqs` and `gpu_memory_utilization`
   (`/oomguard/v1/state`, read as the plugin's typed `EngineState`), the KV pool
   (`vllm:cache_config_info` on `/metrics`), and the allocator's peak, retries and OOMs from
   the hand-off directory the ranks publish into (`--allocator-dir`, core/oomguard/handoff.py).
2. **Longest prompt** (phase A): one request at a time with `prompt_logprobs`, the heaviest
   transient a prompt can ask for (its logits, their FP32 copy and log-softmax for every prompt
   token of a prefill chunk: oomguard.logits). The
   prompt grows by at most 25 % a stage; after each stage the allocator peak is read and the
   next stage is only run if the peak, extrapolated along the measured slope, stays a margin
   below the device. Near the limit the step shrinks until it is under 1 % (or 64 tokens).
3. **Max batch** (phase B): the target prompt (default `max_model_len - 1`) at doubling
   concurrency up to `max_num_seqs` (without logprobs), watching the same peak, retries and
   errors.
4. **Fan-out** (phase C): the target prompt with `n=4` at a quarter of the largest safe batch,
   so as many sequences sample; skipped when the server refuses `n`.

Any error answer, a dead engine, a new allocator retry or OOM, or a peak inside the margin stops
the run. The report gives the largest safe load, the headroom at the peak, the projected limit,
and recommended flags; the exit status gates CI: 0 safe at the target, 1 a limit below it (or
a failure), 2 the preflight could not run (usage, unreachable, no allocator data).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from oomguard import bounded, vllm_seam
from oomguard.contract import ALLOCATOR_DIR_ENV, API_PREFIX
from oomguard.digits import decimal
from oomguard.engine_state import StateError
from oomguard.engine_state import parse as parse_state
from oomguard.errors import ConfigError
from oomguard.handoff import read_reports

MIB = 1024**2
GIB = 1024**3
GROWTH = 1.25  # a stage's prompt is at most this much longer than the last safe one
MAX_MODEL_LEN_SANE = 16 * 2**20  # above any released model's context (Llama 4 Scout: 10M)
MIN_STEP_TOKENS = 64
# What the engine's answers may cost (oomguard.bounded): /v1/models and the plugin's /state are
# a few KB; vLLM's /metrics is some hundred KB.
JSON_LIMITS = bounded.Limits(max_bytes=1 * MIB, timeout=15.0)
HEALTH_LIMITS = bounded.Limits(max_bytes=64 * 1024, timeout=10.0)
METRICS_LIMITS = bounded.Limits(max_bytes=16 * MIB, timeout=15.0)


class PreflightError(ConfigError):
    """The preflight cannot run: bad flags, the server unreachable, no allocator data."""


@dataclass(frozen=True)
class Settings:
    url: str
    device_bytes: int  # NVML total of one GPU
    driver_reserved_bytes: int  # NVML "reserved": never usable by the CUDA runtime
    allocator_dir: str
    margin_bytes: int = 256 * MIB  # the peak must stay this far below the device
    max_concurrency: int = 256  # phase B stops here even if max_num_seqs is higher
    request_timeout: float = 600.0
    settle_seconds: float = 1.0  # the ranks publish stats every 0.5 s
    target_prompt_len: int | None = None  # default: max_model_len - 1


@dataclass(frozen=True)
class Load:
    concurrency: int
    prompt_len: int
    prompt_logprobs: bool
    n: int = 1  # sequences sampled per request
    logprobs: int = 0  # top logprobs returned per sampled token

    def __str__(self) -> str:
        lp = ", prompt_logprobs" if self.prompt_logprobs else ""
        fan = f", n={self.n}" if self.n > 1 else ""
        fan += f", logprobs={self.logprobs}" if self.logprobs else ""
        return f"{self.concurrency} x {self.prompt_len:,} tokens{lp}{fan}"


@dataclass
class Stage:
    load: Load
    ok: bool
    peak_bytes: int
    headroom_bytes: int
    errors: int = 0
    seconds: float = 0.0
    reason: str = ""


@dataclass
class Report:
    url: str
    model: str
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float | None
    kv_cache_tokens: int | None
    device_bytes: int
    usable_bytes: int
    stages: list[Stage] = field(default_factory=list)
    target_prompt_len: int = 0  # the longest prompt this run set out to test
    longest_safe_prompt_logprobs: int = 0
    projected_limit_prompt_logprobs: int | None = None
    peak_bytes_per_prompt_token: float = 0.0  # measured slope with prompt_logprobs
    largest_safe_batch: Load | None = None
    fan_out: Load | None = None  # phase C's load, when it ran clean
    peak_bytes: int = 0
    headroom_at_peak_bytes: int = 0
    limit: str = ""  # what bounded the load (phase A's projection), not a failure
    stopped: str = ""  # a failure that ended the run
    safe_at_target: bool = False
    recommendations: dict[str, str] = field(default_factory=dict)
    checklist: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 0 if self.safe_at_target else 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


# -- the server ----------------------------------------------------------------------------------
class Server:
    """What preflight reads from and sends to one vLLM API server."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient) -> None:
        self.s = settings
        self.client = client

    async def get(self, path: str, limits: bounded.Limits) -> tuple[int, bytes]:
        """(status, body): the body bounded in size and time (oomguard.bounded), read only on
        a 200. Raises httpx.HTTPError (unreachable) or bounded.InputError (the body)."""
        url = self.s.url + path
        async with self.client.stream("GET", url, timeout=limits.timeout) as r:
            if r.status_code != 200:
                return r.status_code, b""
            return 200, await bounded.acollect(r.aiter_bytes(), url, limits)

    async def get_json(self, path: str) -> Any:
        url = self.s.url + path
        try:
            status, body = await self.get(path, JSON_LIMITS)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise PreflightError(f"cannot reach {url}: {exc}") from exc
        except bounded.InputError as exc:  # too large, too slow
            raise PreflightError(str(exc)) from None
        if status == 404 and path.startswith(API_PREFIX):
            raise PreflightError(
                f"{url} answered 404: the oomguard plugin is not loaded (start vLLM "
                "with VLLM_PLUGINS=oomguard)"
            )
        if status != 200:
            raise PreflightError(f"{url} answered {status}")
        try:
            return bounded.parse_json(body, url, JSON_LIMITS)
        except bounded.InputError as exc:  # not JSON, bad UTF-8, deep nesting, huge numbers
            raise PreflightError(
                f"{exc} (not an answer of vLLM with the oomguard plugin)"
            ) from None

    async def healthy(self) -> bool:
        try:
            return (await self.get(vllm_seam.HEALTH, HEALTH_LIMITS))[0] == 200
        except (httpx.HTTPError, httpx.InvalidURL, bounded.InputError):
            return False

    async def kv_cache_tokens(self) -> int | None:
        try:
            status, body = await self.get(vllm_seam.METRICS_PATH, METRICS_LIMITS)
            text = bounded.decode(body, self.s.url + vllm_seam.METRICS_PATH)
        except (httpx.HTTPError, httpx.InvalidURL, bounded.InputError):
            return None
        m = re.search(rf"^{re.escape(vllm_seam.CACHE_CONFIG)}\{{([^}}]*)\}}", text, re.MULTILINE)
        if status != 200 or not m:
            return None
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        blocks = decimal(labels.get("num_gpu_blocks", "")[:20])  # no real figure has 20 digits
        block_size = decimal(labels.get("block_size", "")[:20])
        return blocks * block_size if blocks is not None and block_size is not None else None

    async def complete(self, model: str, i: int, load: Load) -> int:
        """One request; its HTTP status (599 for a transport failure)."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": [(i * 7919 + k * 31) % 20000 + 10 for k in range(load.prompt_len)],
            "max_tokens": 1,
            "temperature": 0,
        }
        if load.prompt_logprobs:
            body["prompt_logprobs"] = 1
        if load.n > 1:
            body["n"] = load.n
            body["temperature"] = 1.0  # vLLM refuses n > 1 with greedy sampling
        if load.logprobs:
            body["logprobs"] = load.logprobs
        try:
            # streamed and closed unread: only the status counts, and an answer of any size
            # costs nothing
            async with self.client.stream(
                "POST", self.s.url + "/v1/completions", json=body, timeout=self.s.request_timeout
            ) as r:
                return r.status_code
        except (httpx.HTTPError, httpx.InvalidURL):
            return 599


def allocator_state(directory: str) -> tuple[int, int, int]:
    """(peak reserved bytes, retries, OOMs) over the fresh reports of every rank."""
    reports, _ = read_reports(directory, time.time(), stale_after=30.0)
    if not reports:
        raise PreflightError(
            f"no allocator stats in {directory}: start vLLM with the oomguard plugin and "
            f"{ALLOCATOR_DIR_ENV} pointing there (preflight will not push memory it cannot see)"
        )
    peak = max(r.reserved_peak_bytes for r in reports)
    return peak, sum(r.alloc_retries for r in reports), sum(r.ooms for r in reports)


# -- the run -------------------------------------------------------------------------------------
class Preflight:
    def __init__(
        self, settings: Settings, progress: Callable[[str], None] = lambda _line: None
    ) -> None:
        self.s = settings
        self.progress = progress
        self.usable = settings.device_bytes - settings.driver_reserved_bytes
        self.sent = 0

    def headroom(self, peak: int) -> int:
        return self.usable - peak

    async def _stage(self, server: Server, model: str, load: Load, base: tuple[int, int]) -> Stage:
        started = time.monotonic()
        statuses = await asyncio.gather(
            *(server.complete(model, self.sent + i, load) for i in range(load.concurrency))
        )
        self.sent += load.concurrency
        await asyncio.sleep(self.s.settle_seconds)
        errors = sum(1 for st in statuses if st != 200)
        alive = await server.healthy()
        peak, retries, ooms = allocator_state(self.s.allocator_dir) if alive else (0, 0, 0)
        stage = Stage(load, True, peak, self.headroom(peak), errors, time.monotonic() - started)
        if not alive:
            stage.ok, stage.reason = False, "the engine stopped answering /health"
        elif ooms > base[1]:
            stage.ok, stage.reason = False, "the allocator reported a CUDA OOM"
        elif retries > base[0]:
            stage.ok, stage.reason = False, "the allocator had to retry (free and retry on OOM)"
        elif errors:
            codes = sorted({st for st in statuses if st != 200})
            stage.ok, stage.reason = False, f"{errors} request(s) failed (HTTP {codes})"
        elif stage.headroom_bytes < self.s.margin_bytes:
            stage.ok, stage.reason = False, "the peak came inside the safety margin"
        verdict = "ok" if stage.ok else f"STOP: {stage.reason}"
        self.progress(
            f"  {load}: peak {peak / GIB:.2f} GiB, headroom {stage.headroom_bytes / GIB:.2f} GiB, "
            f"{stage.seconds:.1f} s: {verdict}"
        )
        return stage

    async def run(self) -> Report:
        async with httpx.AsyncClient() as client:
            server = Server(self.s, client)
            return await self._run(server)

    async def _run(self, server: Server) -> Report:
        models = await server.get_json("/v1/models")
        try:
            card = models["data"][0]
            model, max_len = str(card["id"]), int(card["max_model_len"])
        except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
            raise PreflightError("/v1/models has no model with max_model_len") from exc
        if not 2 <= max_len <= MAX_MODEL_LEN_SANE:
            # the prompts preflight builds are this long: refuse a figure no model has
            raise PreflightError(f"/v1/models reports max_model_len {max_len}: not plausible")
        try:
            state = parse_state(await server.get_json(f"{API_PREFIX}/state"))
        except StateError as exc:
            # the contract's checks: a max_num_seqs below 1 or a non-integer never passes
            raise PreflightError(
                f"{API_PREFIX}/state is not the oomguard plugin's state ({exc})"
            ) from None
        max_seqs = state.startup_max_num_seqs
        gmu = state.gpu_memory_utilization
        # One short request first: ranks publish allocator stats as they step.
        warm = Load(1, 16, False)
        if await server.complete(model, 0, warm) != 200:
            raise PreflightError(f"a 16-token completion to {self.s.url} failed")
        self.sent = 1
        await asyncio.sleep(self.s.settle_seconds)
        peak0, retries0, ooms0 = allocator_state(self.s.allocator_dir)
        report = Report(
            url=self.s.url,
            model=model,
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            gpu_memory_utilization=gmu,
            kv_cache_tokens=await server.kv_cache_tokens(),
            device_bytes=self.s.device_bytes,
            usable_bytes=self.usable,
            peak_bytes=peak0,
            headroom_at_peak_bytes=self.headroom(peak0),
        )
        if self.headroom(peak0) < self.s.margin_bytes:
            report.stopped = "the engine's resting peak is already inside the margin"
            self._finish(report)
            return report
        target = min(self.s.target_prompt_len or max_len - 1, max_len - 1)
        report.target_prompt_len = target
        base = (retries0, ooms0)
        self.progress(f"phase A: longest prompt with prompt_logprobs (target {target:,} tokens)")
        await self._longest_prompt(server, model, target, base, report)
        if not report.stopped or report.stopped.startswith("the server refuses"):
            self.progress(f"phase B: max batch of {target:,}-token prompts")
            await self._max_batch(server, model, target, max_seqs, base, report)
        if not report.stopped and report.largest_safe_batch is not None:
            self.progress("phase C: fan-out (n=4)")
            await self._fan_out(server, model, target, base, report)
        self._finish(report)
        return report

    async def _longest_prompt(
        self, server: Server, model: str, target: int, base: tuple[int, int], report: Report
    ) -> None:
        length = min(512, target)
        points: list[tuple[int, int]] = []  # (prompt length, peak) of safe stages
        while True:
            stage = await self._stage(server, model, Load(1, length, True), base)
            report.stages.append(stage)
            if stage.errors and "HTTP [400]" in stage.reason and not points:
                report.stopped = "the server refuses prompt_logprobs; phase A skipped"
                return
            if not stage.ok:
                report.stopped = f"{stage.load}: {stage.reason}"
                break
            points.append((length, stage.peak_bytes))
            report.longest_safe_prompt_logprobs = length
            if length >= target:
                break
            slope = _slope(points)
            nxt = min(target, math.floor(length * GROWTH))
            if slope > 0:
                report.peak_bytes_per_prompt_token = slope
                room = self.usable - self.s.margin_bytes - stage.peak_bytes
                report.projected_limit_prompt_logprobs = length + int(
                    (self.usable - stage.peak_bytes) / slope
                )
                nxt = min(nxt, length + int(room / slope))
            if nxt - length < max(MIN_STEP_TOKENS, length // 100):
                report.limit = (
                    f"prompts past {length:,} tokens with prompt_logprobs would bring the peak "
                    "inside the safety margin"
                )
                break
            length = nxt
        report.peak_bytes = max(s.peak_bytes for s in report.stages)

    async def _max_batch(
        self,
        server: Server,
        model: str,
        length: int,
        max_seqs: int,
        base: tuple[int, int],
        report: Report,
    ) -> None:
        top = min(max_seqs, self.s.max_concurrency)
        concurrency = 1
        while True:
            concurrency = min(concurrency * 2, top)
            stage = await self._stage(server, model, Load(concurrency, length, False), base)
            report.stages.append(stage)
            if not stage.ok:
                report.stopped = f"{stage.load}: {stage.reason}"
                break
            report.largest_safe_batch = stage.load
            if concurrency >= top:
                break
        report.peak_bytes = max(s.peak_bytes for s in report.stages)

    async def _fan_out(
        self, server: Server, model: str, length: int, base: tuple[int, int], report: Report
    ) -> None:
        assert report.largest_safe_batch is not None
        # n=4 at a quarter of the batch: as many sequences as the batch, sampling. Sampled
        # `logprobs` are left out: their FP32 logits are what vLLM's sampler profile already
        # reserved for max_num_seqs sequences.
        load = Load(max(1, report.largest_safe_batch.concurrency // 4), length, False, 4, 0)
        stage = await self._stage(server, model, load, base)
        report.stages.append(stage)
        if stage.ok:
            report.fan_out = load
        elif "HTTP [400]" in stage.reason and stage.errors == load.concurrency:
            report.checklist["n"] = "refused by the server (400): not exercised"
            stage.ok = True  # a refusal is the server's policy, not a memory failure
        else:
            report.stopped = f"{stage.load}: {stage.reason}"

    def _finish(self, report: Report) -> None:
        if report.stages:
            report.peak_bytes = max(report.peak_bytes, *(s.peak_bytes for s in report.stages))
        report.headroom_at_peak_bytes = self.headroom(report.peak_bytes)
        target = report.target_prompt_len or report.max_model_len - 1
        top = min(report.max_num_seqs, self.s.max_concurrency)
        report.safe_at_target = (
            report.longest_safe_prompt_logprobs >= target
            and report.largest_safe_batch is not None
            and report.largest_safe_batch.concurrency >= top
            and all(s.ok for s in report.stages)
            and not report.stopped
        )
        rec = report.recommendations
        longest = report.longest_safe_prompt_logprobs
        if longest and longest < target:
            rec["gateway input cap (requests with prompt_logprobs)"] = (
                f"{int(longest * 0.8):,} tokens (80 % of the longest safe, {longest:,})"
            )
            rec["max_num_batched_tokens"] = (
                f"at most {int(longest * 0.8):,}: chunked prefill bounds each step's logits "
                "to one chunk"
            )
        elif longest:
            rec["gateway input cap"] = f"none needed up to the tested {longest:,} tokens"
        if report.kv_cache_tokens:
            fits = report.kv_cache_tokens / report.max_model_len
            low, high = max(1, math.floor(0.7 * fits)), max(1, math.floor(0.8 * fits))
            if high < report.max_num_seqs:
                rec["max_num_seqs"] = (
                    f"{low}-{high} (70-80 % of the {fits:.1f} max_model_len requests the KV pool "
                    f"holds; startup {report.max_num_seqs}; beyond that vLLM queues)"
                )
        gmu = report.gpu_memory_utilization
        slope = report.peak_bytes_per_prompt_token
        if gmu is not None and slope > 0 and longest < target:
            # what a max_model_len prompt with prompt_logprobs needs beyond today's headroom
            need = (target - longest) * slope - (
                report.headroom_at_peak_bytes - self.s.margin_bytes
            )
            drop = need / self.usable
            if 0 < drop <= 0.05:
                lowered = math.floor((gmu - drop) * 100) / 100  # round down: toward safety
                rec["gpu_memory_utilization"] = (
                    f"{lowered:.2f} (now {gmu:.2f}) takes max_model_len prompts with "
                    "prompt_logprobs; the KV pool shrinks by the same bytes"
                )
            elif drop > 0:
                rec["gpu_memory_utilization"] = (
                    f"keep {gmu:.2f}: max_model_len prompts with prompt_logprobs would need it "
                    f"{drop:.2f} lower, more than the 0.03-0.05 operators move it; cap the input"
                )
        check = report.checklist
        if report.fan_out is not None:
            check["n"] = f"exercised: {report.fan_out}"
        if gmu is None:
            check["gpu_memory_utilization"] = "not reported by the plugin"
        elif 0.88 <= gmu <= vllm_seam.GPU_MEMORY_UTILIZATION:
            check["gpu_memory_utilization"] = (
                f"{gmu:.2f}: inside 0.88-{vllm_seam.GPU_MEMORY_UTILIZATION}"
            )
        else:
            check["gpu_memory_utilization"] = (
                f"{gmu:.2f}: outside 0.88-{vllm_seam.GPU_MEMORY_UTILIZATION}"
            )
        a = [s for s in report.stages if s.load.prompt_logprobs and s.ok]
        if len(a) >= 2 and a[-1].peak_bytes == a[-2].peak_bytes and a[-1].load.prompt_len > 4096:
            check["chunked prefill"] = "on: the peak stopped growing with the prompt"
        else:
            check["chunked prefill"] = "not visible from this run (see vLLM's startup log)"
        check["expandable_segments"] = (
            "not visible over HTTP: check PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in "
            "the engine's environment"
        )
        check["container memory limit vs host buffers"] = (
            "not visible over HTTP: compare the pod's memory limit with vLLM's CPU-side buffers"
        )


def _slope(points: list[tuple[int, int]]) -> float:
    """Peak bytes per prompt token from the last two safe stages (0 while the peak is flat)."""
    if len(points) < 2:
        return 0.0
    (l1, p1), (l2, p2) = points[-2], points[-1]
    return max(0.0, (p2 - p1) / (l2 - l1)) if l2 > l1 else 0.0


def render(report: Report) -> str:
    lines = [
        f"preflight {report.url} ({report.model})",
        f"  max_model_len {report.max_model_len:,}, max_num_seqs {report.max_num_seqs}, "
        f"gpu_memory_utilization {report.gpu_memory_utilization}",
        f"  device {report.device_bytes / GIB:.2f} GiB, usable {report.usable_bytes / GIB:.2f} GiB"
        + (f", KV pool {report.kv_cache_tokens:,} tokens" if report.kv_cache_tokens else ""),
        f"  longest safe prompt with prompt_logprobs: {report.longest_safe_prompt_logprobs:,}"
        + (
            f" (projected limit {report.projected_limit_prompt_logprobs:,})"
            if report.projected_limit_prompt_logprobs
            else ""
        ),
        f"  largest safe batch: {report.largest_safe_batch or 'none'}",
        f"  fan-out: {report.fan_out or 'not run clean'}",
        f"  peak {report.peak_bytes / GIB:.2f} GiB, headroom at the peak "
        f"{report.headroom_at_peak_bytes / GIB:.2f} GiB",
    ]
    if report.limit:
        lines.append(f"  limit: {report.limit}")
    if report.stopped:
        lines.append(f"  stopped: {report.stopped}")
    lines.append(
        "  verdict: " + ("safe at the target load" if report.safe_at_target else "LIMIT FOUND")
    )
    for k, v in report.recommendations.items():
        lines.append(f"  recommend {k}: {v}")
    for k, v in report.checklist.items():
        lines.append(f"  checklist {k}: {v}")
    return "\n".join(lines)


def run(settings: Settings, progress: Callable[[str], None] = lambda _line: None) -> Report:
    return asyncio.run(Preflight(settings, progress).run())
