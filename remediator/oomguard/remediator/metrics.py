"""The remediator's own /metrics, under the names reserved in core/oomguard/catalog.py.

A handful of series per target, so prometheus_client's own registry and exposition are the right
tool here (the exporter renders its own text only because it serves hundreds of series a second).
"""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from oomguard.catalog import spec

if TYPE_CHECKING:
    from oomguard.remediator.audit import AuditLog

MODES = ("serving", "capped", "draining", "readmitting", "restarting", "held")
WEBHOOK_OUTCOMES = ("accepted", "duplicate", "invalid", "unauthorized", "too_large", "error")
SKIP_REASONS = ("not_utf8", "not_json", "too_deep", "not_object", "no_event", "too_long")


def _help(name: str) -> str:
    return spec(name).help


class RemediatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._modes: dict[str, str] = {}  # target -> the mode last published
        self._targets: dict[str, tuple[int | None, int | None, int]] = {}
        r = self.registry
        # prometheus_client appends `_total` to counters itself
        self.actions = Counter(
            "oomguard_remediator_actions",
            _help("oomguard_remediator_actions_total"),
            ("target", "action", "result"),
            registry=r,
        )
        self.cap = Gauge(
            "oomguard_remediator_admission_cap",
            _help("oomguard_remediator_admission_cap"),
            ("target",),
            registry=r,
        )
        self.startup = Gauge(
            "oomguard_remediator_startup_max_num_seqs",
            _help("oomguard_remediator_startup_max_num_seqs"),
            ("target",),
            registry=r,
        )
        self.mode = Gauge(
            "oomguard_remediator_target_mode",
            _help("oomguard_remediator_target_mode"),
            ("target", "mode"),
            registry=r,
        )
        self.stage = Gauge(
            "oomguard_remediator_readmission_stage",
            _help("oomguard_remediator_readmission_stage"),
            ("target",),
            registry=r,
        )
        self.webhooks = Counter(
            "oomguard_remediator_webhook_requests",
            _help("oomguard_remediator_webhook_requests_total"),
            ("outcome",),
            registry=r,
        )
        self.reconcile_errors = Counter(
            "oomguard_remediator_reconcile_errors",
            _help("oomguard_remediator_reconcile_errors_total"),
            ("target",),
            registry=r,
        )
        self.safety_limited = Counter(
            "oomguard_remediator_safety_limited",
            _help("oomguard_remediator_safety_limited_total"),
            ("target", "limit"),
            registry=r,
        )
        self.paused = Gauge(
            "oomguard_remediator_paused", _help("oomguard_remediator_paused"), registry=r
        )
        self.pass_failures = Counter(
            "oomguard_remediator_pass_failures",
            _help("oomguard_remediator_pass_failures_total"),
            registry=r,
        )
        self.last_pass = Gauge(
            "oomguard_remediator_last_pass_timestamp_seconds",
            _help("oomguard_remediator_last_pass_timestamp_seconds"),
            registry=r,
        )
        self.pass_duration = Gauge(
            "oomguard_remediator_pass_duration_seconds",
            _help("oomguard_remediator_pass_duration_seconds"),
            registry=r,
        )
        self.engines_read = Gauge(
            "oomguard_remediator_engines_read",
            _help("oomguard_remediator_engines_read"),
            registry=r,
        )
        self.reads = Counter(
            "oomguard_remediator_engine_reads",
            _help("oomguard_remediator_engine_reads_total"),
            registry=r,
        )
        self.resync_period = Gauge(
            "oomguard_remediator_resync_period_seconds",
            _help("oomguard_remediator_resync_period_seconds"),
            registry=r,
        )
        self.targets = Gauge(
            "oomguard_remediator_targets",
            _help("oomguard_remediator_targets"),
            ("state",),
            registry=r,
        )
        self.discovered = Gauge(
            "oomguard_remediator_targets_discovered",
            _help("oomguard_remediator_targets_discovered"),
            registry=r,
        )
        self.leader = Gauge(
            "oomguard_remediator_leader", _help("oomguard_remediator_leader"), registry=r
        )
        self.leader.set(1)  # one replica on one box leads; leader.py says otherwise on a cluster
        self.thread_restarts = Counter(
            "oomguard_remediator_thread_restarts",
            _help("oomguard_remediator_thread_restarts_total"),
            ("thread",),
            registry=r,
        )
        self.audit_skipped = Gauge(
            "oomguard_remediator_audit_skipped_lines",
            _help("oomguard_remediator_audit_skipped_lines"),
            ("reason",),
            registry=r,
        )
        for reason in SKIP_REASONS:
            self.audit_skipped.labels(reason)
        self._audit = _AuditCollector()
        r.register(self._audit)
        for outcome in WEBHOOK_OUTCOMES:  # present at 0 from the start, so rate() works
            self.webhooks.labels(outcome)

    def died(self, thread: str) -> None:
        """A supervised thread died (and is being restarted): supervised.Supervised.on_death."""
        self.thread_restarts.labels(thread).inc()

    def watch_audit(self, audit: AuditLog) -> None:
        """Export the audit log's health (writable, failed appends) as it is at each scrape."""
        self._audit.audit = audit

    def audit_replayed(self, skipped: Tally[str]) -> None:
        """The lines the last replay of the audit log skipped, by reason."""
        for reason in {*SKIP_REASONS, *skipped}:
            self.audit_skipped.labels(reason).set(skipped.get(reason, 0))

    def set_mode(self, target: str, mode: str) -> None:
        # on change only: every read engine's mode is published each pass, and six labelled
        # series per engine cost more than the read itself in a fleet of thousands
        if self._modes.get(target) == mode:
            return
        self._modes[target] = mode
        for m in MODES:
            self.mode.labels(target, m).set(1 if m == mode else 0)

    def set_target(self, target: str, cap: int | None, startup: int | None, stage: int) -> None:
        """A target's admission cap, startup max_num_seqs and re-admission stage (on change)."""
        values = (cap, startup, stage)
        if self._targets.get(target) == values:
            return
        self._targets[target] = values
        if cap is not None:
            self.cap.labels(target).set(cap)
        if startup is not None:
            self.startup.labels(target).set(startup)
        self.stage.labels(target).set(stage)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the series of targets no longer on the allowlist (discovery removed them)."""
        keep = set(keep)
        for target in [t for t in {*self._modes, *self._targets} if t not in keep]:
            for m in MODES:
                with contextlib.suppress(KeyError):
                    self.mode.remove(target, m)
            for gauge in (self.cap, self.startup, self.stage):
                with contextlib.suppress(KeyError):
                    gauge.remove(target)
            self._modes.pop(target, None)
            self._targets.pop(target, None)

    def observe_pass(
        self, seconds: float, read: int, targets: int, quiet: int, resync_period: float
    ) -> None:
        self.pass_duration.set(seconds)
        self.resync_period.set(resync_period)
        self.engines_read.set(read)
        self.reads.inc(read)
        self.targets.labels("quiet").set(quiet)
        self.targets.labels("attention").set(targets - quiet)


class _AuditCollector(Collector):
    """Read at scrape time: the audit log keeps its own counts (it has no metrics of its own)."""

    def __init__(self) -> None:
        self.audit: AuditLog | None = None

    def collect(self) -> Iterator[Metric]:
        audit = self.audit
        writable = GaugeMetricFamily(
            "oomguard_remediator_audit_writable", _help("oomguard_remediator_audit_writable")
        )
        errors = CounterMetricFamily(
            "oomguard_remediator_audit_write_errors",
            _help("oomguard_remediator_audit_write_errors_total"),
        )
        writable.add_metric([], 1 if audit is None or audit.writable else 0)
        errors.add_metric([], audit.write_errors if audit is not None else 0)
        yield writable
        yield errors

    def describe(self) -> Iterator[Metric]:
        return iter(())
