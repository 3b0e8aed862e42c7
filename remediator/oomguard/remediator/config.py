"""The remediator's configuration: where it listens, who may call it, which engines it may touch.

Secrets are never in the file itself: tokens and passwords come from files (Kubernetes Secrets
mounted as files, or /etc/oomguard/... on one box), re-read when they change, so rotation needs no
restart.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from oomguard import bounded
from oomguard.config import load_yaml, validate
from oomguard.errors import ConfigError
from oomguard.remediator.attention import AttentionConfig
from oomguard.remediator.audit import check_path
from oomguard.remediator.discovery import DiscoveryConfig
from oomguard.remediator.flags import FlagLimits
from oomguard.remediator.leader import LeaderElectionConfig
from oomguard.remediator.policy import PolicyConfig
from oomguard.remediator.router import RouterConfig
from oomguard.remediator.safety import SafetyConfig
from oomguard.remediator.targets import TargetConfig
from oomguard.thresholds import AlertThresholds
from oomguard.units import parse_duration

log = logging.getLogger("oomguard.remediator")


def read_secret(path: str | os.PathLike[str], token: bool = True) -> str | None:
    """A secret file's text, stripped (None when empty), read through the bounded reader: one
    regular file of at most 64 KiB of UTF-8 (a FIFO never blocks); with `token` (a bearer
    token, not a password) one line of visible ASCII, as a header carries it. Raises
    bounded.InputError (a ValueError) naming the file and what is wrong, never its content."""
    if token:
        return bounded.read_token(path) or None
    return bounded.read_text(path, bounded.TOKEN).strip() or None


def is_loopback(listen: str) -> bool:
    """Whether HOST:PORT binds only this machine (127.0.0.0/8, ::1, localhost; an empty host is
    the remediator's 127.0.0.1 default). 0.0.0.0, :: and any other name reach the network."""
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class SecretFile:
    """A secret read from a file, re-read when the file's mtime changes (rotation).

    A file that cannot be read, or whose content cannot be a secret (not UTF-8, too large, not
    a regular file), keeps the last good value (rotation in progress must not lock everybody
    out) and is logged once per change; with no good value yet, `get` is None and every request
    is refused (401), never answered with a server error."""

    def __init__(self, path: str, token: bool = True) -> None:
        self.path = Path(path)
        self.token = token  # a bearer token (read_secret), else a password
        self._mtime: float | None = None
        self._value: str | None = None
        self.error: str | None = None

    def get(self) -> str | None:
        try:
            mtime = self.path.stat().st_mtime
            if mtime != self._mtime:
                self._mtime = mtime
                self._value = read_secret(self.path, self.token)
                self.error = None
        except (OSError, ValueError) as exc:
            message = str(exc) if isinstance(exc, ValueError) else f"{self.path}: {exc}"
            if message != self.error:
                log.error("secret file %s (keeping the last good value)", message)
            self.error = message
        return self._value


class BasicAuth(BaseModel):
    model_config = ConfigDict(extra="forbid")
    username: str = Field(min_length=1)
    password_file: str


class AuthConfig(BaseModel):
    """How Alertmanager (and operators) authenticate: its `http_config` bearer or basic auth."""

    model_config = ConfigDict(extra="forbid")

    bearer_token_file: str | None = None
    basic: BasicAuth | None = None
    allow_unauthenticated: bool = Field(
        False, description="Only for a remediator bound to 127.0.0.1 on a single box or a demo."
    )

    @model_validator(mode="after")
    def _some_auth(self) -> AuthConfig:
        if not (self.bearer_token_file or self.basic or self.allow_unauthenticated):
            raise ValueError(
                "set bearer_token_file or basic (or allow_unauthenticated: true for a "
                "loopback-only remediator)"
            )
        return self


class AlertmanagerSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(pattern=r"^https?://")
    receiver: str = Field("remediator", description="Only alerts routed to this receiver count.")
    resync_seconds: float = Field(
        60.0, ge=0, description="Re-read the firing alerts this often (0: only at start)."
    )


_RULES = AlertThresholds()


class StandaloneConfig(BaseModel):
    """Watch exporters' pressure levels directly (single boxes, the demo): no Alertmanager."""

    model_config = ConfigDict(extra="forbid")

    exporters: list[Annotated[str, Field(pattern=r"^https?://\S+$")]] = Field(
        min_length=1,
        description="Exporter /metrics URLs, e.g. http://127.0.0.1:9848/metrics (`--check` and "
        "the start fetch each once and refuse what is not an oomguard exporter's /metrics).",
    )
    interval_seconds: float = Field(1.0, gt=0)
    # defaults: the generated rules' (oomguard.actions.ACTION_ALERTS at AlertThresholds' defaults)
    pressure_for_seconds: float = Field(
        parse_duration(_RULES.pressure_for), ge=0, description="Level 2 held this long acts."
    )
    critical_for_seconds: float = Field(
        parse_duration(_RULES.critical_for), ge=0, description="Level 3 held this long acts."
    )
    keep_firing_seconds: float = Field(
        parse_duration(_RULES.action_keep_firing_for),
        ge=0,
        description="Hysteresis after a condition clears (the rules' keep_firing_for on action "
        "alerts; recovery starts only when the alert resolves).",
    )


class RemediatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen: str = Field("127.0.0.1:9849", pattern=r"^[^:]*:[0-9]+$")
    auth: AuthConfig
    targets: list[TargetConfig] = Field(
        default_factory=list, description="The static allowlist (with discovery: added to it)."
    )
    discovery: DiscoveryConfig | None = Field(None, description="Targets from Kubernetes pods.")
    routers: list[RouterConfig] = Field(
        default_factory=list, description="Routers targets may name (the allowlist of their URLs)."
    )
    leader_election: LeaderElectionConfig | None = Field(
        None, description="Replicas elect one active remediator on a Lease (Kubernetes)."
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    flags: FlagLimits = Field(default_factory=FlagLimits)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    audit_log: str = "/var/lib/oomguard/remediator-audit.jsonl"
    audit_max_bytes: int = Field(
        32 * 1024 * 1024,
        ge=64 * 1024,
        description="Rotate the audit log at this size; the new file starts with what the "
        "safety limits need (a start reads at most about this much).",
    )
    audit_backups: int = Field(
        10, ge=0, le=1000, description="Rotated audit logs kept: <audit_log>.1 (newest) to .N."
    )
    reconcile_seconds: float = Field(1.0, gt=0, description="Level-triggered pass interval.")
    actuation_timeout_seconds: float = Field(3.0, gt=0)
    actuation_attempts: int = Field(3, ge=1)
    max_body_bytes: int = Field(1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    max_connections: int = Field(
        256, ge=1, le=65536, description="HTTP connections at once; more are answered 503."
    )
    request_timeout_seconds: float = Field(
        10.0, gt=0, description="A request must arrive whole this soon; slower clients are cut."
    )
    unhealthy_after_failed_passes: int = Field(
        3, ge=1, description="/healthz answers 503 after this many failed passes in a row."
    )
    dry_run: bool = False
    alertmanager: AlertmanagerSource | None = None
    standalone: StandaloneConfig | None = None
    mode: Literal["alertmanager", "standalone"] = "alertmanager"

    @model_validator(mode="after")
    def _consistent(self) -> RemediatorConfig:
        if not self.targets and self.discovery is None:
            raise ValueError("targets: list at least one (or configure discovery)")
        names = [t.name for t in self.targets]
        dupes = sorted(n for n, k in Counter(names).items() if k > 1)  # linear: fleets are big
        if dupes:
            raise ValueError(f"target names must be unique: {', '.join(dupes)}")
        known = {r.name for r in self.routers}
        unknown = sorted({t.router.name for t in self.targets if t.router} - known)
        if unknown:
            raise ValueError(f"targets name routers not in routers: {', '.join(unknown)}")
        if self.mode == "standalone" and self.standalone is None:
            raise ValueError("mode standalone needs a standalone: section")
        if self.auth.allow_unauthenticated and not is_loopback(self.listen):
            # anyone who reaches the port could drain, pause or restart engines
            raise ValueError(
                f"auth.allow_unauthenticated is only for a remediator bound to loopback "
                f"(127.0.0.1), not {self.listen}: set auth.bearer_token_file or auth.basic"
            )
        return self

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "127.0.0.1", int(port)


def load(path: str | os.PathLike[str]) -> RemediatorConfig:
    config = validate(RemediatorConfig, load_yaml(path), str(path))
    for target in config.targets:
        if target.token_file and not Path(target.token_file).is_file():
            raise ConfigError(f"targets.{target.name}.token_file: {target.token_file} not found")
        if target.token_file:
            try:
                read_secret(target.token_file)
            except ValueError as exc:
                raise ConfigError(f"targets.{target.name}.token_file {exc}") from None
    check_path(Path(config.audit_log))
    return config
