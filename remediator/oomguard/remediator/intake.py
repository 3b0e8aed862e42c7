"""Intake and routing: webhook payloads and Alertmanager's API -> the alert book, each alert
routed to the one allowlisted target its labels select.

Every payload is recorded in the audit log before it counts (a payload that cannot be recorded
is answered 5xx and retried by Alertmanager). Duplicates (retries, HA peers) are recognised by
their dedup key. An alert's route is computed once per alert key (its labels never change);
each target's firing alerts are derived from the book every pass, never kept in a counter
beside it that a reused fingerprint could drive out of step. A payload that says Alertmanager
left alerts out of it (`truncatedAlerts`) triggers an immediate resync from its API.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from oomguard.remediator.alertbook import AlertBook
from oomguard.remediator.audit import AuditLog
from oomguard.remediator.config import AlertmanagerSource
from oomguard.remediator.fleet import Fleet
from oomguard.remediator.targets import TargetConfig
from oomguard.remediator.webhook import (
    Alert,
    PayloadError,
    Webhook,
    labels_field,
    start_field,
    text_field,
)

log = logging.getLogger("oomguard.remediator")

SEEN_LIMIT = 20_000  # dedup keys remembered (FIFO): retries and HA copies come within minutes
PRUNE_EVERY = 60.0  # seconds between prunings of resolved alerts from the book


def select(alert: Alert, targets: Iterable[TargetConfig]) -> list[str]:
    """Names of the allowlisted targets whose selector labels the alert carries exactly."""
    labels = alert.labels
    return [t.name for t in targets if all(labels.get(k) == v for k, v in t.selector().items())]


def route(alert: Alert, targets: Iterable[TargetConfig]) -> tuple[str | None, str | None]:
    """(the one target the alert selects, None) or (None, why it selects none or several)."""
    return verdict(alert, select(alert, targets))


def verdict(alert: Alert, names: list[str]) -> tuple[str | None, str | None]:
    """`route`'s answer for the targets an alert selects."""
    if len(names) == 1:
        return names[0], None
    if not names:
        shown = {k: alert.labels.get(k, "") for k in ("target", "instance")}
        return None, f"no allowlisted target matches {shown}"
    return None, f"ambiguous: matches targets {', '.join(names)}"


@dataclass
class Receipt:
    alerts: int
    new: int
    duplicates: int
    ignored: dict[str, str]  # fingerprint -> why
    changed: bool
    targets: frozenset[str] = frozenset()  # the targets of the alerts applied


class Intake:
    """The alert book and its routes. `on_change` asks for a reconcile pass; `on_truncated`
    for a resync from Alertmanager now."""

    def __init__(
        self,
        fleet: Fleet,
        audit: AuditLog,
        alertmanager: AlertmanagerSource | None,
        on_change: Callable[[], None],
        on_truncated: Callable[[], None],
    ) -> None:
        self.fleet = fleet
        self.audit = audit
        self.alertmanager = alertmanager
        self.on_change = on_change
        self.on_truncated = on_truncated
        self.book = AlertBook()
        self.lock = threading.Lock()  # the book, the routes and the dedup keys
        self._seen: OrderedDict[tuple[str, datetime, str], None] = OrderedDict()
        self._routes: dict[str, str | None] = {}  # alert key -> target (its labels are fixed)
        self.pruned_at = time.monotonic()

    def _route(self, alert: Alert) -> str | None:
        """Under the lock: the alert's target (cached by alert key: labels never change)."""
        if alert.key not in self._routes:
            self._routes[alert.key] = verdict(alert, self.fleet.select(alert.labels))[0]
        return self._routes[alert.key]

    def receive(self, webhook: Webhook, source: str = "webhook") -> Receipt:
        """Record a payload durably, then apply it. Raises OSError when the audit log cannot be
        written: the caller answers 5xx and Alertmanager retries; nothing was applied."""
        with self.lock:
            new = [a for a in webhook.alerts if a.dedup_key not in self._seen]
            routes = {a.key: verdict(a, self.fleet.select(a.labels)) for a in new}
            ignored = {a.fingerprint: why for a in new if (why := routes[a.key][1])}
            if new:
                self.audit.record(
                    "received",
                    result="ignored" if len(ignored) == len(new) else "accepted",
                    reason=f"{source} {webhook.group_key}".strip(),
                    after={
                        "firing": sorted(a.fingerprint for a in new if a.status == "firing"),
                        "resolved": sorted(a.fingerprint for a in new if a.status == "resolved"),
                        "ignored": ignored,
                        "duplicates": len(webhook.alerts) - len(new),
                    },
                    fingerprints=[a.fingerprint for a in new],
                )
            if webhook.truncated_alerts:
                # Alertmanager left alerts out of this payload: what is firing is only known
                # from its API, so read it now rather than at the next periodic resync
                self.audit.record(
                    "truncated",
                    result="resync",
                    reason=f"{source} {webhook.group_key}: {webhook.truncated_alerts} alerts "
                    "left out of the payload; resyncing from Alertmanager".strip(),
                )
            routable = []
            for a in new:  # selectors are evaluated once per alert, not once per pass
                name = routes[a.key][0]
                self._routes[a.key] = name
                if name is not None:
                    routable.append(a)
            changed = self.book.apply_all(routable)
            for a in new:
                self._seen[a.dedup_key] = None
            while len(self._seen) > SEEN_LIMIT:
                self._seen.popitem(last=False)
        for fp, why in ignored.items():
            log.warning("ignoring alert %r: %s", fp, why)
        if webhook.truncated_alerts:
            log.warning("%d alerts left out of a payload: resyncing", webhook.truncated_alerts)
            self.on_truncated()
        if changed:
            self.on_change()
        total = len(webhook.alerts)
        applied = frozenset(name for a in routable if (name := routes[a.key][0]))
        return Receipt(total, len(new), total - len(new), ignored, changed, applied)

    def resync(self) -> bool:
        """Rebuild the firing set from Alertmanager's API (at start and periodically). Raises
        httpx.HTTPError or ValueError when Alertmanager cannot be read; the book is kept."""
        source = self.alertmanager
        if source is None:
            return False
        as_of = time.monotonic()
        r = httpx.get(
            f"{source.url.rstrip('/')}/api/v2/alerts",
            params={
                "active": "true",
                "silenced": "false",
                "inhibited": "false",
                "receiver": f"^{re.escape(source.receiver)}$",
            },
            timeout=5.0,
        )
        r.raise_for_status()
        listed = _am_alerts(r.json())
        with self.lock:
            active = [a for a in listed if self._route(a) is not None]
            before = {a.fingerprint for a in self.book.current()}
            changed = self.book.sync(active, as_of)
            after = {a.fingerprint for a in self.book.current()}
        if changed:  # Alertmanager's own state, read again next time: noted, best-effort
            self.audit.try_record(
                "resynced",
                reason=f"alertmanager {source.url}",
                before=sorted(before),
                after=sorted(after),
                fingerprints=before ^ after,
            )
            self.on_change()
        return changed

    def firing_by_target(self) -> dict[str, list[Alert]]:
        """Each target's firing alerts, derived from the book (never a counter kept beside it,
        which a reused fingerprint could drive out of step)."""
        with self.lock:
            # only the targets with alerts (a pass costs what needs attention, not the fleet);
            # any other target reads as no alerts
            out: dict[str, list[Alert]] = defaultdict(list)
            for a in self.book.current():
                name = self._route(a)
                if name is not None:
                    out[name].append(a)
            if time.monotonic() - self.pruned_at > PRUNE_EVERY:
                self.book.prune(datetime.now(UTC))
                self.pruned_at = time.monotonic()
            if len(self._routes) > 2 * len(self.book) + 1000:  # forget resolved alerts' routes
                self._routes = {a.key: self._routes.get(a.key) for a in self.book.current()}
        return out

    def reroute(self) -> None:
        """Under the lock, after the allowlist changed: routes are computed again."""
        self._routes = {}

    def firing_count(self) -> int:
        with self.lock:
            return len(self.book)


def _am_alerts(body: Any) -> list[Alert]:
    """Alerts from Alertmanager's GET /api/v2/alerts; entries it cannot read are skipped."""
    if not isinstance(body, list):
        raise ValueError("Alertmanager /api/v2/alerts did not return a list")
    out = []
    for i, raw in enumerate(body):
        where = f"/api/v2/alerts[{i}]"
        try:
            if not isinstance(raw, dict) or (raw.get("status") or {}).get("state") != "active":
                continue
            labels = labels_field(raw.get("labels"), f"{where}.labels")
            starts = start_field(raw.get("startsAt"), f"{where}.startsAt")
            fingerprint = text_field(raw.get("fingerprint"), f"{where}.fingerprint")
            out.append(Alert(fingerprint, "firing", labels, starts, None))
        except (AttributeError, PayloadError) as exc:
            log.warning("skipping an alert Alertmanager listed that cannot be read: %s", exc)
    return out
