"""OOM incidents on this node, by type: the incident directory, classified (incidents.py).

The vLLM plugin's out-of-memory observer and the `oomguard serve` supervisor write incident
records into one directory (by default `<allocator dir>/incidents`). This collector reads them
as untrusted input (refused files are counted as invalid samples, by reason), joins and
classifies them, and serves `oomguard_incidents_total{Hostname, target, engine, type}`: how many
incidents of each type the directory holds, and `oomguard_requests_lost_total{Hostname, target,
model_name, engine}`: the requests the engines held when they died of an OOM (`crash_losses`).
`type` is one of incidents.TYPE_NAMES, so the label
stays bounded whatever the files say; `target` and `engine` come from the observer's record.

XIDs from dcgm-exporter (when the dcgm collector runs) reach the classifier through
`xid_source`, so a crash with an XID on its GPU and no allocator OOM counts as `not_oom`.

The directory is re-classified only when its listing changes (names, sizes, modification times)
or new XIDs arrive, and a file is parsed once while it does not change: a poll every second
costs one directory scan, and a flood of hostile files is read once, not every second.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.base import Reading
from oomguard.exporter.render import FamilyBuilder
from oomguard.forensics.incidents import Thresholds, Xid, incidents
from oomguard.forensics.reader import IncidentDirError, ParseCache, load
from oomguard.incident_records import OomRecord

# OOM records of one engine this close together are one death: every rank of a tensor-parallel
# engine records the same step, and a worker may record a retried allocation before it dies.
SAME_DEATH_SECONDS = 30.0


@dataclass
class IncidentReading(Reading):
    by_type: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # target, engine, type
    lost: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # target, model, engine


def crash_losses(ooms: Sequence[OomRecord]) -> Counter[tuple[str, str, str]]:
    """Requests lost per (target, model_name, engine): for each death, the most any of its
    records says the engine held (a record without the count, from an older plugin, adds 0)."""
    lost: Counter[tuple[str, str, str]] = Counter()
    last: dict[tuple[str, str], tuple[float, int]] = {}  # engine -> (time, counted so far)
    for r in sorted(ooms, key=lambda r: r.timestamp):
        engine = (r.target, r.engine)
        key = (r.target, r.model_name, r.engine)
        held = r.in_flight or 0
        seen = last.get(engine)
        if seen is not None and r.timestamp - seen[0] <= SAME_DEATH_SECONDS:
            if held > seen[1]:  # the same death, told better by another rank
                lost[key] += held - seen[1]
                last[engine] = (seen[0], held)
            continue
        lost[key] += held
        last[engine] = (r.timestamp, held)
    return lost


def _listing(directory: str) -> tuple[tuple[str, int, int], ...] | None:
    """What changes when a record is added, replaced or removed; None: no directory."""
    try:
        with os.scandir(directory) as it:
            rows = []
            for entry in it:
                if entry.name.startswith(("oom-", "exit-")):
                    st = entry.stat(follow_symlinks=False)
                    rows.append((entry.name, st.st_mtime_ns, st.st_size))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CollectorError("unreadable_directory", f"cannot list {directory}: {exc}") from exc
    return tuple(sorted(rows))


class IncidentCollector:
    name = "incidents"
    target = ""

    def __init__(
        self,
        directory: str,
        hostname: str,
        xid_source: Callable[[], Sequence[Xid]] | None = None,
        thresholds: Thresholds | None = None,
        timeout: float = 5.0,
    ) -> None:
        self.directory = directory
        self.hostname = hostname
        self.xid_source = xid_source
        self.thresholds = thresholds or Thresholds()
        self.timeout = timeout
        self._key: object = object()
        self._cached = IncidentReading()
        self._parsed: ParseCache = {}  # each file is parsed once while it does not change

    def collect(self) -> IncidentReading:
        xids = tuple(self.xid_source()) if self.xid_source else ()
        listing = _listing(self.directory)
        key = (listing, xids)
        if key == self._key:
            return self._cached
        reading = IncidentReading()
        if listing is not None:
            try:
                loaded = load(self.directory, cache=self._parsed)
            except IncidentDirError as exc:
                raise CollectorError(exc.reason, str(exc)) from exc
            reading.invalid.update(loaded.invalid)
            for found in incidents(loaded, xids, self.thresholds):
                reading.by_type[(found.target, found.engine, found.type)] += 1
            reading.lost = crash_losses(loaded.ooms)
        self._key, self._cached = key, reading
        return reading

    def families(self, reading: IncidentReading, out: FamilyBuilder) -> None:
        for (target, engine, kind), count in sorted(reading.by_type.items()):
            out.add("oomguard_incidents_total", (self.hostname, target, engine, kind), count)
        for (target, model, engine), count in sorted(reading.lost.items()):
            if count:  # a record without the count (an older plugin) is no series
                out.add(
                    "oomguard_requests_lost_total", (self.hostname, target, model, engine), count
                )
