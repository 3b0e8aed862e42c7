"""Alertmanager webhook payloads (version "4"), parsed strictly where it matters.

A POST is a snapshot of one alert group. The group's own `status` can say "firing" while one of
its alerts is resolved, so only each alert's `status` counts. Unknown fields are ignored (newer
Alertmanagers add some). What oomguard needs is checked and refused with a message that names the
field: a remediator must never act on a half-understood payload.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from oomguard.errors import OomguardError

MAX_BODY_BYTES = 1024 * 1024
MAX_ALERTS = 10_000


class PayloadError(OomguardError):
    """The payload is not a usable Alertmanager webhook; the message says why (HTTP 400)."""


@dataclass(frozen=True)
class Alert:
    fingerprint: str
    status: str  # "firing" | "resolved"
    labels: Mapping[str, str]
    starts_at: datetime
    ends_at: datetime | None  # None while firing ("0001-01-01T00:00:00Z")

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def dedup_key(self) -> tuple[str, datetime, str]:
        """Retries and HA peers resend the same alert: one key, one decision."""
        return (self.fingerprint, self.starts_at, self.status)


@dataclass(frozen=True)
class Webhook:
    receiver: str
    group_key: str
    alerts: tuple[Alert, ...]
    truncated_alerts: int


def time_field(value: Any, where: str) -> datetime | None:
    if not isinstance(value, str):
        raise PayloadError(f"{where} must be an RFC 3339 time string, got {value!r}")
    if value.startswith("0001-01-01"):
        return None  # Alertmanager's zero time: not set
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise PayloadError(f"{where} is not an RFC 3339 time: {value!r}") from None


def labels_field(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise PayloadError(f"{where} must be an object of string values")
    return value


def parse(body: bytes) -> Webhook:
    """Parse a webhook body. Raises PayloadError (the receiver answers 400 and acts on nothing)."""
    if len(body) > MAX_BODY_BYTES:
        raise PayloadError(f"body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PayloadError(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PayloadError("body must be a JSON object")
    if str(data.get("version", "")) != "4":
        raise PayloadError(f'unsupported webhook version {data.get("version")!r}; expected "4"')
    raw_alerts = data.get("alerts")
    if not isinstance(raw_alerts, list):
        raise PayloadError("alerts must be a list")
    if len(raw_alerts) > MAX_ALERTS:
        raise PayloadError(f"{len(raw_alerts)} alerts exceed the limit of {MAX_ALERTS}")
    alerts = []
    for i, raw in enumerate(raw_alerts):
        where = f"alerts[{i}]"
        if not isinstance(raw, dict):
            raise PayloadError(f"{where} must be an object")
        status = raw.get("status")
        if status not in ("firing", "resolved"):
            raise PayloadError(f"{where}.status must be firing or resolved, got {status!r}")
        labels = labels_field(raw.get("labels"), f"{where}.labels")
        if not labels.get("alertname"):
            raise PayloadError(f"{where}.labels has no alertname")
        fingerprint = raw.get("fingerprint")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise PayloadError(f"{where}.fingerprint must be a non-empty string")
        starts_at = time_field(raw.get("startsAt"), f"{where}.startsAt")
        if starts_at is None:
            raise PayloadError(f"{where}.startsAt is not set")
        alerts.append(
            Alert(
                fingerprint,
                status,
                labels,
                starts_at,
                time_field(raw.get("endsAt", "0001-01-01T00:00:00Z"), f"{where}.endsAt"),
            )
        )
    truncated = data.get("truncatedAlerts", 0)
    return Webhook(
        receiver=str(data.get("receiver", "")),
        group_key=str(data.get("groupKey", "")),
        alerts=tuple(alerts),
        truncated_alerts=truncated if isinstance(truncated, int) else 0,
    )
