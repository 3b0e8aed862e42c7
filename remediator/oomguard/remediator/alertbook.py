"""The alerts firing now, from webhook snapshots: the level the remediator reconciles toward.

Idempotent and order-safe, because Alertmanager retries, HA peers send duplicates, and
deliveries can arrive out of order. Each alert (its `key`: fingerprint and labels) has episodes
identified by their `startsAt`. An episode fires until a `resolved` for it (or for a later
episode) arrives; a `resolved` for an older episode never clears a newer one, and a replayed
`firing` of an episode that already ended does not bring it back. So whatever the order or
repetition of the same deliveries, the book ends in the same state: an alert fires exactly when
its latest `firing` episode is newer than its latest `resolved` one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime, timedelta

from oomguard.remediator.webhook import Alert


class AlertBook:
    def __init__(self) -> None:
        self._firing: dict[str, Alert] = {}  # alert key -> its firing episode
        self._resolved: dict[str, datetime] = {}  # alert key -> latest resolved startsAt
        self._learned: dict[str, float] = {}  # alert key -> when its firing episode arrived

    def apply(self, alert: Alert) -> bool:
        """Record one alert from a webhook; True when the set of firing alerts changed."""
        key = alert.key
        if alert.status == "firing":
            ended = self._resolved.get(key)
            if ended is not None and alert.starts_at <= ended:
                return False  # a late copy of an episode that already resolved
            current = self._firing.get(key)
            if current is not None and current.starts_at >= alert.starts_at:
                return False  # already known (a duplicate), or an older episode
            self._firing[key] = alert
            self._learned[key] = time.monotonic()
            return True
        ended = self._resolved.get(key)
        if ended is None or alert.starts_at > ended:
            self._resolved[key] = alert.starts_at
        current = self._firing.get(key)
        if current is not None and current.starts_at <= alert.starts_at:
            del self._firing[key]
            self._learned.pop(key, None)
            return True
        return False

    def apply_all(self, alerts: Iterable[Alert]) -> bool:
        changed = False
        for alert in alerts:
            changed |= self.apply(alert)
        return changed

    def sync(self, active: Iterable[Alert], as_of: float) -> bool:
        """Reconcile with Alertmanager's list of active alerts, fetched at monotonic `as_of`.

        Active alerts are applied as firing. An alert the book has as firing but Alertmanager no
        longer lists has resolved (a lost `resolved` webhook must not pin a cap down forever),
        unless its episode reached the book after the list was fetched.
        """
        active = list(active)
        changed = self.apply_all(active)
        listed = {a.key for a in active}
        for key, alert in list(self._firing.items()):
            if key not in listed and self._learned.get(key, 0.0) < as_of:
                changed |= self.apply(
                    Alert(alert.fingerprint, "resolved", alert.labels, alert.starts_at, None)
                )
        return changed

    def current(self) -> list[Alert]:
        """The firing alerts, unordered (cheap: the reconcile loop reads this every pass)."""
        return list(self._firing.values())

    def __len__(self) -> int:
        return len(self._firing)

    def firing(self) -> list[Alert]:
        return sorted(self._firing.values(), key=lambda a: (a.name, a.key))

    def prune(
        self, now: datetime, keep: timedelta = timedelta(hours=24), most: int = 50_000
    ) -> int:
        """Forget resolutions more than `keep` away from `now` (either side: a start time in the
        future must age out too), and beyond the `most` recent (bounded memory); how many."""
        old = [key for key, ended in self._resolved.items() if abs(now - ended) > keep]
        if len(self._resolved) - len(old) > most:
            by_age = sorted(self._resolved, key=self._resolved.__getitem__)
            old = list(set(old) | set(by_age[: len(self._resolved) - most]))
        for key in old:
            del self._resolved[key]
        return len(old)
