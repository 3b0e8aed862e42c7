"""The exporter's configuration: YAML file, then command-line flags on top.

Every field is documented in docs/configuration.md; `oomguard exporter --help` lists the flags.
"""

from __future__ import annotations

import os
import re
import socket

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from oomguard.digits import decimal
from oomguard.thresholds import PressureThresholds

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NvmlConfig(_Strict):
    enabled: bool = True
    process_metrics: bool = Field(True, description="Export per-process GPU memory.")
    timeout_seconds: float = Field(2.0, gt=0, le=60)


class DcgmConfig(_Strict):
    url: str | None = Field(None, description="dcgm-exporter /metrics URL.")
    file: str | None = Field(None, description="A file holding dcgm-exporter output.")
    timeout_seconds: float = Field(2.0, gt=0, le=60)

    @model_validator(mode="after")
    def _one_source(self) -> DcgmConfig:
        if self.url and self.file:
            raise ValueError("set url or file, not both")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.file)


class VllmTarget(_Strict):
    name: str = Field(description="Target name: the `target` label and the remediator's key.")
    url: str = Field(description="The vLLM server's /metrics URL.")
    timeout_seconds: float = Field(2.0, gt=0, le=60)
    gpus: list[str] = Field(
        default_factory=list,
        description="GPU indices or UUIDs the engine runs on; empty: learned from the plugin's "
        "allocator reports (or the node's only GPU).",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The engine's memory plan; empty: read from vLLM's cache_config_info.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("use 1-64 letters, digits, '_', '.', ':' or '-'")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v


class AllocatorConfig(_Strict):
    enabled: bool = True
    directory: str = "/run/oomguard/allocator"
    stale_after_seconds: float = Field(30.0, gt=0)
    incident_directory: str | None = Field(
        None,
        description="OOM incident records (plugin observer, oomguard serve), classified into "
        "oomguard_incidents_total; default <directory>/incidents.",
    )


class CgroupTarget(_Strict):
    name: str = "self"
    path: str = "/sys/fs/cgroup"


class ExporterConfig(_Strict):
    listen: str = Field("0.0.0.0:9848", description="host:port to serve /metrics on.")
    interval_seconds: float = Field(1.0, ge=0.1, le=60, description="Poll interval.")
    hostname: str = Field(
        default_factory=lambda: os.environ.get("NODE_NAME") or socket.gethostname(),
        description="The node's name, the Hostname label of every GPU series (flag --hostname, "
        "then this field, then $NODE_NAME, then the host name). Never taken from dcgm-exporter: "
        "on the GPU Operator its Hostname label is the dcgm-exporter pod's name.",
    )
    nvml: NvmlConfig = Field(default_factory=NvmlConfig)
    dcgm: DcgmConfig = Field(default_factory=DcgmConfig)
    vllm: list[VllmTarget] = Field(default_factory=list)
    allocator: AllocatorConfig = Field(default_factory=AllocatorConfig)
    cgroups: list[CgroupTarget] = Field(default_factory=lambda: [CgroupTarget()])
    pressure: PressureThresholds = Field(default_factory=PressureThresholds)

    @field_validator("hostname")
    @classmethod
    def _hostname(cls, v: str) -> str:
        v = v.strip()
        if not 0 < len(v) <= 253 or not all(c.isprintable() and not c.isspace() for c in v):
            raise ValueError("must be the node's name: 1-253 printable characters, no spaces")
        return v

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        _host, sep, port = v.rpartition(":")
        number = decimal(port)
        if not sep or number is None or not 0 <= number <= 65535:
            raise ValueError("must be host:port, e.g. 0.0.0.0:9848")
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> ExporterConfig:
        for what, names in (
            ("vllm", [t.name for t in self.vllm]),
            ("cgroups", [c.name for c in self.cgroups]),
        ):
            dupes = {n for n in names if names.count(n) > 1}
            if dupes:
                raise ValueError(f"duplicate {what} names: {sorted(dupes)}")
        return self

    @property
    def listen_address(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)
