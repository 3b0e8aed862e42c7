"""The incident records: one model per kind, built and written by their writers and read back by
the forensics (`oomguard.forensics`), so that the three agree on every field by construction.

- `OomRecord`, `oom-<pid>-<n>.json`: written by the vLLM plugin's out-of-memory observer in the
  dying worker (vllm_plugin/oom.py);
- `ExitRecord`, `exit-<pid>-<generation>.json`: written by the `oomguard serve` supervisor when
  its child exits (remediator/supervisor.py).

Both go into one directory (`OOMGUARD_INCIDENT_DIR`). The models are strict (no "5" for 5, no
NaN, bounded sizes): the reader takes every file as untrusted input and refuses what does not
validate, and a writer validates what it builds the same way, so it never writes a record the
reader would refuse. Fields the reader does not know are ignored (an older reader reads a newer
record). `dump()` is the on-disk form: JSON by the field aliases, unknown values (None) left out,
and the record's `kind`.

The core holds this contract so the plugin, inside vLLM's environment, needs pydantic only (vLLM
brings it), not the forensics.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, computed_field

OOM_SCHEMA = "oomguard.oom_incident.v1"
EXIT_SCHEMA = "oomguard.exit_incident.v1"
MAX_COUNT = 2**63 - 1

# The file names: one process, one name (the reader checks the pid in the name against the record)
OOM_NAME = re.compile(r"oom-([1-9][0-9]{0,9})-([1-9][0-9]{0,9})\.json")
EXIT_NAME = re.compile(r"exit-([1-9][0-9]{0,9})-([1-9][0-9]{0,9})\.json")
MAX_TEXT = 256  # ids, targets, names: writers cut to this


def oom_file_name(pid: int, n: int) -> str:
    """The n-th (from 1) OOM record of a process."""
    return f"oom-{pid}-{n}.json"


def exit_file_name(pid: int, generation: int) -> str:
    return f"exit-{pid}-{generation}.json"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


_Count = Field(0, ge=0, le=MAX_COUNT)
_Time = Field(ge=0, le=1e11)
_MaybeCount = Field(None, ge=0, le=MAX_COUNT)


class _Record(_Model):
    def dump(self) -> str:
        """The record as its file holds it."""
        return self.model_dump_json(by_alias=True, exclude={"name"}, exclude_unset=True)


class BatchRequest(_Model):
    id: str = Field("", max_length=MAX_TEXT)
    new: bool = False
    prompt_tokens: int = _Count
    computed_tokens: int = _Count
    scheduled_tokens: int = _Count
    params: dict[str, int | None] = Field(default_factory=dict, max_length=16)


class Batch(_Model):
    requests: int = _Count
    scheduled_tokens: int = _Count
    largest: list[BatchRequest] = Field(default_factory=list, max_length=1024)


class Allocator(_Model):
    allocated_bytes: int = _Count
    reserved_bytes: int = _Count
    allocated_peak_bytes: int = _Count
    reserved_peak_bytes: int = _Count
    inactive_split_bytes: int = _Count
    alloc_retries: int = _Count
    ooms: int = _Count
    segments: int | None = _MaybeCount
    largest_free_block_bytes: int | None = _MaybeCount
    # what the GPU twin simulated (twin/executor.py), absent from a real GPU's records
    simulated: bool | None = None
    step_peak_bytes: int | None = _MaybeCount
    device_total_bytes: int | None = _MaybeCount
    neighbour_bytes: int | None = _MaybeCount
    fragmentation_bytes: int | None = _MaybeCount
    leaked_bytes: int | None = _MaybeCount


class OomRecord(_Record):
    """An observer record (vllm_plugin/oom.py). `name` is the file's name (set by the reader)."""

    name: str = ""
    schema_: str = Field(alias="schema", pattern=f"^{re.escape(OOM_SCHEMA)}$")
    timestamp: float = _Time
    pid: int = Field(ge=1, le=2**31 - 1)
    rank: int = Field(0, ge=0, le=2**31 - 1)
    target: str = Field("", max_length=MAX_TEXT)
    engine: str = Field("", max_length=MAX_TEXT)
    device_index: int = Field(0, ge=0, le=2**31 - 1)
    device_uuid: str = Field("", max_length=MAX_TEXT)
    requested_bytes: int = _Count
    device_limit_bytes: int = _Count
    device_free_bytes: int = _Count
    allocator: Allocator = Field(default_factory=Allocator)
    batch: Batch | None = None
    # requests the engine held as it died (running and queued), and whether EngineCore's
    # scheduler or only the failing step's batch told (vllm_plugin/oom.py); the served model
    in_flight: int | None = Field(None, ge=0, le=MAX_COUNT)
    in_flight_source: str = Field("", max_length=16)
    model_name: str = Field("", max_length=MAX_TEXT)
    flags: dict[str, int | float | bool] = Field(default_factory=dict, max_length=32)
    process_started_at: float | None = Field(None, ge=0, le=1e11)
    uptime_seconds: float | None = Field(None, ge=0, le=1e10)
    steps: int | None = Field(None, ge=0, le=MAX_COUNT)
    history: list[tuple[float, int, int]] = Field(default_factory=list, max_length=MAX_TEXT)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kind(self) -> str:
        return "cuda_oom"


class CgroupKills(_Model):
    dir: str | None = Field(None, max_length=4096)
    oom_kills_at_start: int | None = Field(None, ge=0, le=MAX_COUNT)
    oom_kills_at_exit: int | None = Field(None, ge=0, le=MAX_COUNT)


class ExitRecord(_Record):
    """A supervisor exit record (remediator/supervisor.py). `name` is the file's name (set by
    the reader)."""

    name: str = ""
    schema_: str = Field(alias="schema", pattern=f"^{re.escape(EXIT_SCHEMA)}$")
    timestamp: float = _Time
    started_at: float = _Time
    pid: int = Field(ge=1, le=2**31 - 1)
    target: str = Field("", max_length=MAX_TEXT)  # the engine's OOMGUARD_TARGET
    generation: int = Field(0, ge=0, le=MAX_COUNT)
    returncode: int = Field(ge=-255, le=255)
    signal: int | None = Field(None, ge=0, le=255)
    reason: str = Field(max_length=32)
    flags: dict[str, int | float] = Field(default_factory=dict, max_length=32)
    oom_records: list[str] = Field(default_factory=list, max_length=MAX_TEXT)
    log_tail: list[str] = Field(default_factory=list, max_length=200)
    exception_lines: list[str] = Field(default_factory=list, max_length=50)

    @property
    def lines(self) -> list[str]:
        """The exceptions the log raised (from further back), then its last lines."""
        return [*self.exception_lines, *self.log_tail]

    cgroup: CgroupKills | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kind(self) -> str:
        return "exit"
