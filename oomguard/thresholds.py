"""Thresholds: the one definition of "how much is too much" for the exporter, alerts and dashboards.

Defaults come from field figures (docs/pressure.md cites them). Every value can be overridden in
the `pressure:` section of the exporter's YAML config; the alert generator reads the same model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

GIB = 1024**3


class PressureThresholds(BaseModel):
    """When a GPU or an engine is in danger of a CUDA out-of-memory error.

    The critical floor of free device memory is min(floor_bytes, floor_ratio x total): 2 GiB on an
    80 GB GPU, 8 % (about 1.9 GB) on a 24 GB card, 0.8 GB on a 10 GB MIG slice. Pressure and caution
    are multiples of that floor. KV-cache usage is deliberately not an input: near 100 % under load
    is how vLLM normally runs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    floor_bytes: int = Field(2 * GIB, gt=0, description="Critical free-memory floor, absolute.")
    floor_ratio: float = Field(
        0.08, gt=0, le=0.5, description="Critical free-memory floor as a share of device memory."
    )
    pressure_multiple: float = Field(2.0, ge=1, description="Level 2 below this many floors.")
    caution_multiple: float = Field(3.0, ge=1, description="Level 1 below this many floors.")
    preemption_pressure_ratio: float = Field(
        0.05, gt=0, description="Level 2 when preemptions exceed this share of finished requests."
    )
    preemption_caution_ratio: float = Field(
        0.01, gt=0, description="Level 1 when preemptions exceed this share of finished requests."
    )
    min_preemptions: int = Field(
        5, ge=1, description="Preemptions needed in the window before the ratio counts."
    )
    rate_window_seconds: float = Field(
        60.0, gt=0, description="Window over which the preemption ratio is computed."
    )
    event_hold_seconds: float = Field(
        120.0,
        ge=0,
        description="How long a new allocator OOM (level 3) or retry (level 2) holds the level.",
    )
    kv_budget_margin: float = Field(
        0.15, ge=0, description="Safety margin on the projected per-request KV budget."
    )

    @model_validator(mode="after")
    def _ordered(self) -> PressureThresholds:
        if self.caution_multiple < self.pressure_multiple:
            raise ValueError("caution_multiple must be >= pressure_multiple")
        if self.preemption_caution_ratio > self.preemption_pressure_ratio:
            raise ValueError("preemption_caution_ratio must be <= preemption_pressure_ratio")
        return self

    def floor_for(self, total_bytes: float) -> float:
        return min(float(self.floor_bytes), self.floor_ratio * total_bytes)


_DURATION = r"^([0-9]+(ms|s|m|h|d|w|y))+$"


class AlertThresholds(BaseModel):
    """Thresholds and timings of the generated alert rules (`oomguard generate --thresholds`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    runbook_url_base: str = Field(
        "https://oomguard.example/runbooks",
        description="Where your team publishes runbooks/; each alert links <base>/<Alert>.md.",
    )
    exporter_job: str = Field("oomguard-exporter", description="Prometheus job of the exporters.")
    kv_usage_high_ratio: float = Field(0.9, gt=0, le=1)
    kv_usage_high_for: str = Field("15m", pattern=_DURATION)
    preemption_ratio: float = Field(0.01, gt=0, description="Preemptions per finished request.")
    preemption_for: str = Field("5m", pattern=_DURATION)
    caution_for: str = Field("10m", pattern=_DURATION)
    pressure_for: str = Field("30s", pattern=_DURATION)
    critical_for: str = Field("0s", pattern=_DURATION)
    keep_firing_for: str = Field(
        "2m", pattern=_DURATION, description="Hysteresis on pressure and critical alerts."
    )
    fragmentation_growth_bytes: int = Field(2 * GIB, gt=0)
    leak_growth_bytes: int = Field(1 * GIB, gt=0)
    growth_window: str = Field("2h", pattern=_DURATION)
    queueing_waiting: int = Field(10, ge=1, description="Waiting requests that count as a queue.")
    engine_down_for: str = Field("1m", pattern=_DURATION)
    collector_down_for: str = Field("5m", pattern=_DURATION)
    stale_after_seconds: int = Field(30, gt=0)
