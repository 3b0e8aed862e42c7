"""Incident traces for the twin: one JSON file format, seeded, reproducible (docs/twin.md).

A trace says what arrives (phases of Poisson arrivals with prompt and output length ranges, and
whether requests ask for prompt_logprobs) and what happens on the GPU besides vLLM (other
processes' memory and allocator fragmentation, as piecewise-linear curves over trace time). The
same file and seed always expand to the same requests. Times are trace seconds; a runner divides
them by `time_compression` to replay a 20-minute incident in about a minute.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TRACES = Path(__file__).resolve().parent / "traces"
GIB = 1024**3
RISE_PROBE_S = 0.01  # how far ahead Fragments looks to tell a rising curve


class Phase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    start_s: float = Field(ge=0)
    end_s: float = Field(gt=0)
    rate_per_s: float = Field(gt=0, description="Mean arrivals per trace second (Poisson).")
    prompt_tokens: tuple[int, int] = Field(description="Uniform range, inclusive.")
    output_tokens: tuple[int, int]
    prompt_logprobs: bool = False


class GpuPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    at_s: float = Field(ge=0)
    neighbour_gib: float = Field(0.0, ge=0, description="Other processes on the GPU.")
    fragmentation_gib: float = Field(0.0, ge=0, description="Allocator reserved - allocated.")


class EngineFlags(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int = Field(8192, ge=16)
    max_num_batched_tokens: int = Field(8192, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)


class Trace(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    seed: int
    gpu: str = "H100"
    model: str = "llama-3-8b"
    duration_s: float = Field(gt=0)
    time_compression: float = Field(20.0, gt=0)
    reload_s: float = Field(720.0, ge=0, description="Crash to serving again (model reload).")
    engine: EngineFlags = Field(default_factory=EngineFlags)
    phases: list[Phase] = Field(min_length=1)
    gpu_events: list[GpuPoint] = Field(default_factory=list)
    fragments: Literal["process", "requests"] = Field(
        "process",
        description="What holds the fragmentation of `gpu_events`: `process`, tensors that "
        "outlive requests (only a new process gives it back); `requests`, the requests running "
        "while it grew (it coalesces once the engine runs none: Fragments).",
    )
    pressure_ends_s: float | None = Field(
        None, description="When the trace's pressure is over (recovery is measured from here)."
    )
    ttft_slo_s: float = Field(10.0, gt=0, description="A request counts for goodput within it.")

    @field_validator("gpu_events")
    @classmethod
    def _in_time_order(cls, events: list[GpuPoint]) -> list[GpuPoint]:
        # gpu_at walks them in order on every call (each tick of every simulation)
        return sorted(events, key=lambda p: p.at_s)

    @property
    def pressure_ends_with_restart(self) -> bool:
        """No `pressure_ends_s`, and fragmentation to the end: it lives in the engine process
        (the twin starts a restarted one from zero), so the pressure ends only when a restarted
        engine is up with a clean allocator (the outcome runner measures recovery from there)."""
        last = max(self.gpu_events, key=lambda p: p.at_s, default=None)
        return (
            self.pressure_ends_s is None
            and self.fragments == "process"
            and last is not None
            and last.fragmentation_gib > 0
        )

    @property
    def pressure_ends(self) -> bool:
        """The pressure ends, at `pressure_ends_s` or with a restart: recovery is measured."""
        return self.pressure_ends_s is not None or self.pressure_ends_with_restart

    @classmethod
    def load(cls, name_or_path: str | Path) -> Trace:
        path = Path(name_or_path)
        if not path.suffix:
            path = TRACES / f"{name_or_path}.json"
        return cls.model_validate(json.loads(path.read_text()))

    def gpu_at(self, t: float) -> tuple[int, int]:
        """(neighbour bytes, fragmentation bytes) at trace time t: linear between points, the
        first point's values before it, the last one's after it."""
        points = self.gpu_events  # in time order (_in_time_order)
        if not points:
            return 0, 0
        a = b = points[0]
        for p in points:
            if p.at_s <= t:
                a = b = p
            else:
                b = p
                break
        w = (t - a.at_s) / (b.at_s - a.at_s) if b.at_s > a.at_s else 0.0
        n = a.neighbour_gib + w * (b.neighbour_gib - a.neighbour_gib)
        f = a.fragmentation_gib + w * (b.fragmentation_gib - a.fragmentation_gib)
        return int(n * GIB), int(f * GIB)

    def window(self, start_s: float, end_s: float) -> Trace:
        """The part of the trace from `start_s` to `end_s`, as a trace of its own starting at 0:
        memory events cut at both ends (the values there kept), phases clipped."""
        start_s, end_s = max(0.0, start_s), min(self.duration_s, end_s)
        if end_s <= start_s:
            raise ValueError(f"empty window {start_s}..{end_s} of {self.name}")

        def point(t: float) -> GpuPoint:
            n, f = self.gpu_at(t)
            return GpuPoint(at_s=t - start_s, neighbour_gib=n / GIB, fragmentation_gib=f / GIB)

        events: list[GpuPoint] = []
        if self.gpu_events:
            inside = [p for p in self.gpu_events if start_s < p.at_s < end_s]
            events = [
                point(start_s),
                *(p.model_copy(update={"at_s": p.at_s - start_s}) for p in inside),
                point(end_s),
            ]
        phases = [
            ph.model_copy(
                update={
                    "start_s": max(ph.start_s, start_s) - start_s,
                    "end_s": min(ph.end_s, end_s) - start_s,
                }
            )
            for ph in self.phases
            if ph.end_s > start_s and ph.start_s < end_s
        ]
        ends = self.pressure_ends_s
        return self.model_copy(
            update={
                "duration_s": end_s - start_s,
                "gpu_events": events,
                "phases": phases,
                "pressure_ends_s": ends - start_s
                if ends is not None and start_s < ends < end_s
                else None,
            }
        )


class Fragments:
    """One engine's allocator fragmentation as its process lives the trace (engine 0's GPU).

    A restarted process has none of its predecessor's fragments: it sees only what the trace's
    curve grew by since it started (the curve is not replayed from the start: a spike met again
    by every new process made each restart look necessary). With `fragments: requests` the
    fragments belong to the requests running while they grew: once the engine runs none, the
    allocator has freed and merged their blocks (on an H200, 1.6 GiB of inactive split went to
    0 the moment the last request finished), so what the curve holds then is gone for this
    process, and only what it grows by later comes back. While the curve rises it is the
    requests' arrival: an idle moment then gives nothing back. Pure: the caller says when.
    """

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.started_at = 0.0
        self.released = 0  # bytes of the curve this process has given back
        self._base = 0  # the curve when this process started (the first process: none)
        self._last_t: float | None = None

    def restarted(self, t: float) -> None:
        """A new process from trace time `t` (a crash and restart, or a requested restart)."""
        self.started_at, self.released = t, 0
        self._base = self.trace.gpu_at(t)[1] if t > 0 else 0

    def _grown(self, t: float, curve: int | None = None) -> int:
        """What the curve (its value at `t`, if known) grew by at `t` since this process
        started."""
        frag = self.trace.gpu_at(t)[1] if curve is None else curve
        return max(0, frag - self._base)

    def at(self, t: float, idle: bool = False) -> int:
        """The fragmentation (bytes) at trace time `t`; `idle`: the engine runs no request now."""
        curve = self.trace.gpu_at(t)[1]
        frag = self._grown(t, curve)
        if self.trace.fragments != "requests":
            return frag
        # where the curve went below what was given back since the last call, a later rise is
        # new requests' fragments again (the curve is linear between its points)
        last = t if self._last_t is None else min(self._last_t, t)
        inside = (p.at_s for p in self.trace.gpu_events if last < p.at_s < t)
        low = min((frag, self._grown(last), *(self._grown(at) for at in inside)))
        self._last_t = t
        # while the curve rises its requests are still coming in and making fragments: an
        # engine idle between two arrivals has not had them yet (the burst's rise is its
        # arrival), so only an engine idle once the curve stopped rising gives them back
        rising = self.trace.gpu_at(t + RISE_PROBE_S)[1] > curve
        self.released = frag if idle and not rising else min(self.released, low)
        return frag - self.released


@dataclass(frozen=True)
class Request:
    at_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_logprobs: bool


def requests(trace: Trace) -> list[Request]:
    """The trace's requests: the same trace (and seed) always gives the same list."""
    rnd = random.Random(trace.seed)
    out: list[Request] = []
    for phase in trace.phases:
        t = phase.start_s
        while True:
            t += rnd.expovariate(phase.rate_per_s)
            if t >= min(phase.end_s, trace.duration_s):
                break
            out.append(
                Request(
                    round(t, 3),
                    rnd.randint(*phase.prompt_tokens),
                    rnd.randint(*phase.output_tokens),
                    phase.prompt_logprobs,
                )
            )
    return sorted(out, key=lambda r: r.at_s)


def names() -> list[str]:
    return sorted(p.stem for p in TRACES.glob("*.json"))
