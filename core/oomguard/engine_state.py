"""The engine state the oomguard plugin reports at GET /oomguard/v1/state: one typed model for
the side that writes it (the plugin, inside vLLM), the side that acts on it (the remediator's
actuator and restart sequence) and the side that watches it (the twin runner).

The reader treats it as untrusted input: `parse` is strict (integers are integers, not floats,
strings or booleans; no NaN or infinity; counts not negative) and turns anything malformed into
a `StateError` that names the field, never an exception from deep inside a pass. Fields a newer
plugin adds are ignored, so either side can be upgraded first.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_INT = 2**63 - 1  # no count or cap in a real engine comes near; bigger is garbage
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Cap = Annotated[int, Field(ge=1, le=MAX_INT)]
Mode = Literal["serving", "draining"]


class StateError(ValueError):
    """A state document that does not follow the contract; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class SinceCapChange(_Strict):
    """Progress since the admission cap last changed: what re-admission stages are judged on."""

    seconds: float  # wall time; a clock step may make it briefly negative
    admitted: Count
    finished: Count
    preemptions: Count
    # admissions whose prefill has run (their prompt's KV allocated): absent from older plugins
    prefilled: Count = 0


class EngineCoreState(_Strict):
    """One engine core's state (several behind one API server with data parallelism).

    The plugin sends every field. A reader requires the ones a decision cannot do without
    (caps, mode, progress since the last cap change); the rest default, so a state written by
    hand for `oomguard remediator explain --state` needs only those."""

    startup_max_num_seqs: Cap
    admission_cap: Cap
    mode: Mode
    since_cap_change: SinceCapChange
    # None when absent: only a reader that can assume "nothing" may (a restart never does)
    running: Count | None = None
    waiting: Count | None = None
    drained: bool = False  # draining and nothing running or queued: a restart loses nothing
    # draining and past its grace: new and queued requests are refused (503), not queued
    shedding: bool = False
    engine: Count = 0
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    kv_cache_usage: Annotated[float, Field(ge=0)] | None = None
    admitted_total: Count = 0
    finished_total: Count = 0
    preemptions_total: Count = 0
    shed_total: Count = 0

    @property
    def draining(self) -> bool:
        return self.mode == "draining"

    @property
    def idle(self) -> bool:
        """Known to have nothing running and nothing queued: a restart now drops no request.
        `drained` counts running requests only, so the queue is checked either way."""
        return self.waiting == 0 and (self.drained or self.running == 0)


class EngineState(EngineCoreState):
    """The API server's view: all its engine cores as one (the most constrained of each)."""

    engines: list[EngineCoreState] = Field(default_factory=list)

    @classmethod
    def of(cls, cores: list[EngineCoreState]) -> EngineState:
        """One view of the engine cores behind one API server."""
        if not cores:
            raise StateError("no engine core state")
        since = [c.since_cap_change for c in cores]
        draining = any(c.draining for c in cores)
        return cls(
            mode="draining" if draining else "serving",
            drained=draining and all(c.drained for c in cores),
            shedding=any(c.shedding for c in cores),
            admission_cap=min(c.admission_cap for c in cores),
            startup_max_num_seqs=min(c.startup_max_num_seqs for c in cores),
            gpu_memory_utilization=cores[0].gpu_memory_utilization,
            running=_total([c.running for c in cores]),
            waiting=_total([c.waiting for c in cores]),
            kv_cache_usage=max(
                (c.kv_cache_usage for c in cores if c.kv_cache_usage is not None), default=None
            ),
            admitted_total=sum(c.admitted_total for c in cores),
            finished_total=sum(c.finished_total for c in cores),
            preemptions_total=sum(c.preemptions_total for c in cores),
            shed_total=sum(c.shed_total for c in cores),
            since_cap_change=SinceCapChange(
                seconds=min(s.seconds for s in since),
                admitted=sum(s.admitted for s in since),
                finished=sum(s.finished for s in since),
                preemptions=sum(s.preemptions for s in since),
                prefilled=sum(s.prefilled for s in since),
            ),
            engines=list(cores),
        )

    def document(self) -> dict[str, Any]:
        """The JSON document the plugin answers with."""
        return self.model_dump(mode="json")


def _total(counts: list[int | None]) -> int | None:
    return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)


def parse(data: Any) -> EngineState:
    """A state document from the plugin (decoded JSON), checked; StateError names what is wrong."""
    if isinstance(data, EngineState):
        return data
    if not isinstance(data, dict):
        raise StateError(f"state: expected a JSON object, got {type(data).__name__}")
    try:
        return EngineState.model_validate(data)
    except ValidationError as exc:
        raise StateError(_problems(exc)) from None


def parse_core(data: Any) -> EngineCoreState:
    """One engine core's state (from an engine utility call)."""
    try:
        return EngineCoreState.model_validate(data)
    except ValidationError as exc:
        raise StateError(_problems(exc)) from None


def _problems(exc: ValidationError) -> str:
    first = exc.errors()[:3]
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'state'}: {e['msg']}" for e in first)
    more = exc.error_count() - len(first)
    return f"bad engine state: {shown}" + (f" (+{more} more)" if more > 0 else "")
