"""Standalone mode: watch exporters' pressure levels directly, for single boxes and the demo.

It plays the engine alerts the remediator acts on, with the same meaning and the same
hysteresis as the generated rules: OomguardMemoryPressure (level >= 2 held `pressure_for`) lowers
the cap (OomguardFragmentationPressure, the same on the allocator_fragmentation series alone,
asks for a restart at a quiet moment), OomguardMemoryCritical (level 3 held `critical_for`)
drains, and each keeps firing for `keep_firing` after its condition clears (as the rules'
keep_firing_for on action alerts: recovery starts only when they resolve).
OomguardPressureBlind (the exporter reports the level as -1: it cannot judge the engine) holds
the engine at once and clears at once: blind is not healthy, so nothing is changed, re-admission
included. The alerts go through the same book, policy and safety limits as Alertmanager's. An
exporter that cannot be read, whatever the reason (unreachable, a malformed page), changes
nothing (hold, never guess): its alerts stay as they were until it answers again, and the other
exporters are read as usual.

Like the rules, it judges each *engine*, whatever the `reason` label of its level series says
(oomguard.actions.ActionAlert): the worst of its series, so a reason that changes while the level
stays up (a step-guard shrink's hold, then headroom_low again) neither restarts the `for` nor
resolves the alert. OomguardFragmentationPressure counts only the series whose reason is
allocator_fragmentation, and carries that reason: the remediator restarts such an engine at a
quiet moment instead of capping it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx

from oomguard.actions import ACTION_ALERTS, LEVEL, ActionAlert
from oomguard.exporter.scrape import Scraper
from oomguard.exporter.textparse import parse
from oomguard.remediator.config import StandaloneConfig
from oomguard.remediator.webhook import Alert, Webhook, normalise
from oomguard.thresholds import AlertThresholds

log = logging.getLogger("oomguard.remediator.standalone")

RuleKey = tuple[str, str, str, str]  # exporter instance, target, engine, alert name
EngineKey = tuple[str, str]  # target, engine
# The action alerts, as the rules define them (oomguard.actions.ACTION_ALERTS), by name.
RULES: dict[str, ActionAlert] = {a.name: a for a in ACTION_ALERTS}
DEFAULTS = AlertThresholds()  # the generated rules' durations


def durations(config: StandaloneConfig, alert: ActionAlert) -> tuple[float, float]:
    """(for, keep_firing_for) of `alert` in seconds: the rules' `for` field `x_for` is the
    config's `x_for_seconds` where it has one (else the rules' default), and its keep is the
    config's `keep_firing_seconds` if the rule keeps firing at all (else it clears at once)."""
    hold = None if alert.for_ is None else getattr(config, f"{alert.for_}_seconds", None)
    hold_s = alert.for_seconds(DEFAULTS) if hold is None else float(hold)
    return hold_s, config.keep_firing_seconds if alert.keep else 0.0


@dataclass
class _Rule:
    pending_since: float | None = None
    last_true: float | None = None
    started: datetime | None = None  # set while firing

    @property
    def idle(self) -> bool:
        """Neither pending nor firing: nothing to remember (a series gone for good is dropped)."""
        return self.pending_since is None and self.started is None


class PressureWatcher:
    def __init__(
        self,
        config: StandaloneConfig,
        clock: Callable[[], float] = time.monotonic,
        client: httpx.Client | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.client = client
        self.timeout = 2.0  # a whole exporter page, head and body
        self._scrapers: dict[str, Scraper] = {}
        self._rules: dict[RuleKey, _Rule] = {}
        self._labels: dict[RuleKey, dict[str, str]] = {}
        self.errors: dict[str, str] = {}

    def _levels(self, url: str) -> dict[EngineKey, dict[str, float]]:
        """Each engine's level series, by (target, engine), then by reason, from one exporter
        page; a series given twice (a malformed page) counts at its worst."""
        if self.client is not None:  # a client given (tests)
            r = self.client.get(url)
            r.raise_for_status()
            text = r.text
        else:  # bounded in size and in time, head and body (a byte a second cannot hold it)
            scraper = self._scrapers.get(url)
            if scraper is None:
                scraper = self._scrapers[url] = Scraper(url, self.timeout)
            text, _ = scraper.get()
        levels: dict[EngineKey, dict[str, float]] = {}
        for s in parse(text, wanted={LEVEL}).get(LEVEL):
            engine = (s.labels.get("target", ""), s.labels.get("engine", "0"))
            series = levels.setdefault(engine, {})
            reason = s.labels.get("reason", "")
            series[reason] = max(series.get(reason, s.value), s.value)
        return levels

    def poll(self) -> Webhook:
        """One look at every exporter: the alerts firing and resolving now, as a webhook."""
        now = self.clock()
        alerts: list[Alert] = []
        for url in self.config.exporters:
            try:
                levels = self._levels(url)
            except Exception as exc:  # unreachable, malformed page (CollectorError), anything:
                # this exporter's engines are held; the other exporters are read as usual
                self.errors[url] = f"{type(exc).__name__}: {exc}"[:300]
                log.warning("standalone: cannot read %s (holding): %s", url, exc)
                continue
            self.errors.pop(url, None)
            instance = urlsplit(url).netloc
            seen: set[RuleKey] = set()
            for (target, engine), series in levels.items():
                for name, rule in RULES.items():
                    counted = [lv for reason, lv in series.items() if rule.counts(reason)]
                    if not counted:
                        continue  # no series it judges (another reason): as if gone
                    key = (instance, target, engine, name)
                    seen.add(key)
                    self._labels[key] = {
                        "alertname": name,
                        "instance": instance,
                        "target": target,
                        "engine": engine,
                        **rule.labels,
                        "severity": rule.severity,
                        "oomguard_action": rule.action,
                    }
                    alerts.extend(self._step(key, rule.condition(rule.worst(counted)), now))
            for key in [k for k in self._rules if k[0] == instance and k not in seen]:
                # no series of its engine that it judges (engine gone, or for the fragmentation
                # alert another reason now): its condition is false; once it has nothing
                # pending or firing it is forgotten
                alerts.extend(self._step(key, False, now))
                if self._rules[key].idle:
                    del self._rules[key]
                    self._labels.pop(key, None)
        return Webhook("standalone", "standalone", tuple(alerts), 0)

    def _step(self, key: RuleKey, true: bool, now: float) -> list[Alert]:
        rule = self._rules.setdefault(key, _Rule())
        hold, keep = durations(self.config, RULES[key[3]])
        if true:
            rule.last_true = now
            if rule.pending_since is None:
                rule.pending_since = now
            if rule.started is None and now - rule.pending_since >= hold:
                rule.started = normalise(datetime.now(UTC))
        else:
            rule.pending_since = None
            if (
                rule.started is not None
                and rule.last_true is not None
                and now - rule.last_true >= keep
            ):
                started, rule.started = rule.started, None
                return [self._alert(key, "resolved", started)]
        if rule.started is not None:
            return [self._alert(key, "firing", rule.started)]
        return []

    def _alert(self, key: RuleKey, status: str, started: datetime) -> Alert:
        labels = self._labels[key]  # one alert per engine and rule
        digest = hashlib.sha256(repr(sorted(labels.items())).encode()).hexdigest()[:16]
        ends = datetime.now(UTC) if status == "resolved" else None
        return Alert(digest, status, labels, started, ends)


# -- `oomguard remediator --check` in standalone mode -------------------------------------------
BUILD_INFO = "oomguard_exporter_build_info"  # on every page an oomguard exporter serves


class NotAnExporter(Exception):
    """The URL answers, but not with an oomguard exporter's /metrics (its message says how)."""


def check_exporter(url: str, timeout: float = 5.0) -> int:
    """Fetch `url` once, as the watch will; the number of engine levels it carries. Raises
    CollectorError when it cannot be read, NotAnExporter when it is not an oomguard exporter's
    /metrics: the exporter's HTML index (`http://host:9848`, no /metrics), another server's
    page. The watch itself would read such a page as "no engines" forever and never act."""

    scraper = Scraper(url, timeout)
    try:
        text, content_type = scraper.get()
    finally:
        scraper.close()
    hint = ""
    if not urlsplit(url).path.rstrip("/").endswith("/metrics"):
        hint = f": did you mean {url.rstrip('/')}/metrics?"
    if "html" in content_type.lower():
        raise NotAnExporter(f"{url} is an HTML page ({content_type}), not /metrics{hint}")
    found = parse(text, wanted={LEVEL, BUILD_INFO})
    if not found.get(BUILD_INFO):
        raise NotAnExporter(
            f"{url} answers, but not with an oomguard exporter's /metrics (no {BUILD_INFO}){hint}"
        )
    return len(found.get(LEVEL))
