"""Helpers for the remediator tests: webhook payloads, and engines that follow the plugin's
contract in memory (for fleets larger than this machine can run as real vLLM servers; the same
behaviour is checked against the real server in test_remediator_e2e.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from oomguard.remediator.actuator import ActuatorError, Target
from oomguard.remediator.config import RemediatorConfig

T0 = datetime(2026, 11, 29, 3, 0, tzinfo=UTC)
ACTIONS = {
    "OomguardMemoryPressure": "lower_cap",
    "OomguardFragmentationPressure": "lower_cap",
    "OomguardPreemptionRateHigh": "lower_cap",
    "OomguardMemoryCritical": "drain",
    "OomguardKVCacheUsageHigh": None,
}


def alert(
    name: str,
    target: str,
    status: str = "firing",
    start: int = 0,
    fingerprint: str | None = None,
    **labels: str,
) -> dict[str, Any]:
    all_labels = {"alertname": name, "target": target, "instance": "node-1:9840", "engine": "0"}
    action = ACTIONS.get(name)
    if action:
        all_labels["oomguard_action"] = action
    all_labels.update(labels)
    return {
        "status": status,
        "labels": all_labels,
        "annotations": {"summary": name},
        "startsAt": (T0 + timedelta(seconds=start)).isoformat().replace("+00:00", "Z"),
        "endsAt": (
            (T0 + timedelta(seconds=start + 60)).isoformat().replace("+00:00", "Z")
            if status == "resolved"
            else "0001-01-01T00:00:00Z"
        ),
        "generatorURL": "http://prometheus/graph",
        "fingerprint": fingerprint or f"{name}-{target}-{sorted(labels.items())}",
    }


def payload(*alerts: dict[str, Any], group: str = "{}:{}") -> bytes:
    statuses = {a["status"] for a in alerts}
    return json.dumps(
        {
            "version": "4",
            "groupKey": group,
            "truncatedAlerts": 0,
            "status": "firing" if "firing" in statuses else "resolved",
            "receiver": "remediator",
            "groupLabels": {},
            "commonLabels": {},
            "commonAnnotations": {},
            "externalURL": "http://alertmanager",
            "alerts": list(alerts),
        }
    ).encode()


@dataclass
class Engine:
    startup: int
    cap: int
    draining: bool = False
    since: float = 1e9  # seconds since the cap changed
    admitted: int = 0
    finished: int = 0
    preemptions: int = 0
    running: int = 0
    waiting: int = 0

    def changed(self) -> None:
        self.since, self.admitted, self.finished, self.preemptions = 0.0, 0, 0, 0


@dataclass
class Engines:
    """An in-memory fleet behind the Actuator interface, with the plugin's semantics: the cap
    is clamped to [1, startup], a change resets the since-change counters, writes are absolute."""

    engines: dict[str, Engine]
    down: set[str] = field(default_factory=set)  # neither read nor written
    refusing: set[str] = field(default_factory=set)  # read, but every write fails with a 5xx
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    drains_finish: bool = False

    @classmethod
    def of(cls, *names: str, startup: int = 100) -> Engines:
        return cls({n: Engine(startup, startup) for n in names})

    def _engine(self, target: Target) -> Engine:
        if target.name in self.down:
            raise ActuatorError("unreachable", f"{target.url}: connection refused")
        return self.engines[target.name]

    def state(self, target: Target) -> dict[str, Any]:
        e = self._engine(target)
        return {
            "startup_max_num_seqs": e.startup,
            "admission_cap": e.cap,
            "mode": "draining" if e.draining else "serving",
            "running": e.running,
            "waiting": e.waiting,
            "drained": e.draining and e.running == 0,
            "kv_cache_usage": 0.5,
            "since_cap_change": {
                "seconds": e.since,
                "admitted": e.admitted,
                "finished": e.finished,
                "preemptions": e.preemptions,
            },
        }

    def _writable(self, target: Target) -> Engine:
        if target.name in self.refusing:
            raise ActuatorError("http_status", f"{target.url}: HTTP 500")
        return self._engine(target)

    def set_cap(self, target: Target, cap: int) -> dict[str, Any]:
        e = self._writable(target)
        self.calls.append((target.name, "set_cap", cap))
        applied = max(1, min(cap, e.startup))
        if applied != e.cap:
            e.cap = applied
            e.changed()
        return {"admission_cap": applied, "state": self.state(target)}

    def drain(self, target: Target) -> dict[str, Any]:
        e = self._writable(target)
        e.draining = True
        if self.drains_finish:  # requests in flight finish and queued ones go to a peer at once
            e.running = e.waiting = 0
        self.calls.append((target.name, "drain", None))
        return self.state(target)

    def resume(self, target: Target) -> dict[str, Any]:
        self._writable(target).draining = False
        self.calls.append((target.name, "resume", None))
        return self.state(target)

    def serve(self, name: str, requests: int, seconds: float = 60.0) -> None:
        """Time passes and `requests` are admitted and finish cleanly."""
        e = self.engines[name]
        e.since += seconds
        e.admitted += requests
        e.finished += requests


def config(tmp_path: Any, *names: str, model: str = "llama", **overrides: Any) -> RemediatorConfig:
    data: dict[str, Any] = {
        "auth": {"allow_unauthenticated": True},
        "targets": [{"name": n, "url": f"http://127.0.0.1:1/{n}", "model": model} for n in names],
        "audit_log": str(tmp_path / "audit.jsonl"),
        "safety": {"cooldown_seconds": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return RemediatorConfig.model_validate(data)
