"""Alertmanager webhook payloads (version "4"), parsed strictly where it matters.

A POST is a snapshot of one alert group. The group's own `status` can say "firing" while one of
its alerts is resolved, so only each alert's `status` counts. Unknown fields are ignored (newer
Alertmanagers add some). What oomguard needs is checked and refused with a message that names the
field: a remediator must never act on a half-understood payload.

Everything is normalised here, at the boundary, so nothing later can trip on it: times are aware
UTC at millisecond precision (webhooks carry nanoseconds, Alertmanager's /api/v2/alerts
milliseconds: the same episode must have one identity whichever way it arrived), strings are valid
UTF-8 text, and a start time far in the future is refused (it would never age out).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from oomguard.errors import OomguardError

MAX_BODY_BYTES = 1024 * 1024
MAX_ALERTS = 10_000
# Prometheus stamps startsAt from its own clock: allow for skew, refuse what could never age out
MAX_FUTURE = timedelta(hours=1)


class PayloadError(OomguardError):
    """The payload is not a usable Alertmanager webhook; the message says why (HTTP 400)."""


class BodyTooLarge(PayloadError):
    """The body is larger than the configured limit (HTTP 413)."""


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

    @cached_property
    def key(self) -> str:
        """The alert's identity: its fingerprint and its labels. Alertmanager derives the
        fingerprint from the labels, so a fingerprint that comes back with other labels (reused,
        forged, a hash collision) is another alert and can never move the first one."""
        digest = hashlib.sha256(json.dumps(sorted(self.labels.items())).encode()).hexdigest()
        return f"{self.fingerprint}/{digest[:16]}"

    @property
    def episode(self) -> str:
        return f"{self.fingerprint}@{self.starts_at.isoformat()}"

    @property
    def dedup_key(self) -> tuple[str, datetime, str]:
        """Retries and HA peers resend the same alert: one key, one decision."""
        return (self.key, self.starts_at, self.status)


@dataclass(frozen=True)
class Webhook:
    receiver: str
    group_key: str
    alerts: tuple[Alert, ...]
    truncated_alerts: int


def normalise(when: datetime) -> datetime:
    """Aware UTC, whole milliseconds: one identity for an episode whatever carried it."""
    when = when.astimezone(UTC)
    return when.replace(microsecond=when.microsecond // 1000 * 1000)


def time_field(value: Any, where: str) -> datetime | None:
    if not isinstance(value, str) or len(value) > 64:
        raise PayloadError(f"{where} must be an RFC 3339 time string, got {value!r:.80}")
    if value.startswith("0001-01-01"):
        return None  # Alertmanager's zero time: not set
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise PayloadError(f"{where} is not an RFC 3339 time: {value!r}") from None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise PayloadError(f"{where} has no time zone offset: {value!r}")
    try:
        return normalise(parsed)
    except OverflowError:  # "0001-01-01T00:30:00+01:00" and the like: before year 1 in UTC
        raise PayloadError(f"{where} is out of range: {value!r}") from None


def start_field(value: Any, where: str, now: datetime | None = None) -> datetime:
    """A startsAt: set, and not so far ahead that it could never be forgotten."""
    starts = time_field(value, where)
    if starts is None:
        raise PayloadError(f"{where} is not set")
    if starts - (now or datetime.now(UTC)) > MAX_FUTURE:
        raise PayloadError(f"{where} is more than {MAX_FUTURE} in the future: {value!r}")
    return starts


def text_field(value: Any, where: str) -> str:
    """A string that is valid Unicode text (JSON can smuggle in lone surrogates)."""
    if not isinstance(value, str):
        raise PayloadError(f"{where} must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PayloadError(f"{where} is not valid Unicode text") from None
    return value


def labels_field(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise PayloadError(f"{where} must be an object of string values")
    for k, v in value.items():
        text_field(k, f"{where} key")
        text_field(v, f"{where}.{k}")
    return value


def load_json(body: bytes) -> Any:
    """json.loads that refuses, with a PayloadError, what would otherwise raise something else:
    nesting deeper than the interpreter's recursion limit, integers past Python's digit limit."""
    try:
        return json.loads(body)
    except RecursionError:
        raise PayloadError("body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the int digit limit
        raise PayloadError(f"body is not JSON: {str(exc)[:200]}") from None


def parse(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> Webhook:
    """Parse a webhook body. Raises PayloadError (the receiver answers 400 and acts on nothing);
    BodyTooLarge (413) past `max_bytes`."""
    if len(body) > max_bytes:
        raise BodyTooLarge(f"body of {len(body)} bytes exceeds {max_bytes}")
    data = load_json(body)
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
        if not isinstance(fingerprint, str) or not fingerprint or len(fingerprint) > 128:
            raise PayloadError(f"{where}.fingerprint must be a non-empty string (<= 128 chars)")
        text_field(fingerprint, f"{where}.fingerprint")
        starts_at = start_field(raw.get("startsAt"), f"{where}.startsAt")
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
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0:
        raise PayloadError(f"truncatedAlerts must be a non-negative integer, got {truncated!r:.40}")
    return Webhook(
        receiver=text_field(data.get("receiver") or "", "receiver"),
        group_key=text_field(data.get("groupKey") or "", "groupKey"),
        alerts=tuple(alerts),
        truncated_alerts=truncated,
    )
