"""The engines the remediator may act on: one allowlisted target (`TargetConfig`) and how it is
restarted. Read from the config file's `targets` (config.py) and made from pods by discovery
(discovery.py); both import this module, which imports neither."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from oomguard.remediator.router import RouterRef


class SupervisorRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://", description="`oomguard serve` API of the engine.")
    token_file: str | None = None


class KubernetesRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    kind: Literal["Deployment", "StatefulSet"] = "Deployment"
    name: str = Field(pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
    container: str = Field("vllm", description="The vLLM container in the pod template.")


class RestartConfig(BaseModel):
    """How this engine is restarted with new flags: one backend."""

    model_config = ConfigDict(extra="forbid")

    supervisor: SupervisorRef | None = None
    kubernetes: KubernetesRef | None = None
    drain_timeout_seconds: float = Field(120.0, gt=0)
    ready_timeout_seconds: float = Field(900.0, gt=0, description="Model reload included.")

    @model_validator(mode="after")
    def _one_backend(self) -> RestartConfig:
        if (self.supervisor is None) == (self.kubernetes is None):
            raise ValueError("set exactly one of supervisor or kubernetes")
        return self


class TargetConfig(BaseModel):
    """An engine on the allowlist. Alerts select it by labels; they never carry its address."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str = Field(pattern=r"^https?://", description="The vLLM server's base URL.")
    model: str = Field("", description="Engines with the same model share a disruption budget.")
    token_file: str | None = Field(None, description="The plugin's bearer token.")
    match: dict[str, str] = Field(
        default_factory=dict,
        description="Alert labels that select this target; default {target: <name>}.",
    )
    restart: RestartConfig | None = Field(
        None, description="Restart with adjusted flags (absent: `restart` alerts cap instead)."
    )
    router: RouterRef | None = Field(
        None, description="Out of this router's rotation before a drain (remediator/router.py)."
    )

    def selector(self) -> dict[str, str]:
        return self.match or {"target": self.name}
