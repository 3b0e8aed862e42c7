"""GPU memory from dcgm-exporter, for clusters that already run it instead of giving NVML to us.

dcgm-exporter reports framebuffer fields in MiB; oomguard converts them to bytes. Rules that keep
the numbers honest:
- the node name is the exporter's own (`--hostname`, `$NODE_NAME`, config), never dcgm's
  `Hostname`/`hostname` label: on the GPU Operator that label holds the dcgm-exporter pod's name;
- `--use-old-namespace` labels are read like the current ones: `uuid` as `UUID`, `pod_name`,
  `pod_namespace`, `container_name` as `pod`, `namespace`, `container`;
- a GPU is keyed by its UUID (by its index when no UUID label exists), so two GPUs never merge;
- MIG series (GPU_I_ID set) are instances of their own; they are never added up into the parent;
- with per-pod GPU sharing a device has a device-level series plus one per pod: the device value
  comes from the series without pod labels (or, where every series carries pod labels, from the
  largest one, since they repeat the device value), and pod series are exported separately,
  never summed;
- blank sentinels (DCGM's "no value" markers, 2**31-16 and up for 32-bit fields, 2**47 and up
  for doubles, 2**63-16 and up for 64-bit fields) are treated as missing;
- XIDs: `DCGM_FI_DEV_XID_ERRORS` is the last code (a code, not a count); dcgm-exporter's XID
  collector, `DCGM_EXP_XID_ERRORS_COUNT{xid, window_size_in_ms}`, counts each XID over its
  window: served per XID as oomguard_gpu_xid_errors, and kept (`recent_xids`) for the incident
  classifier, which calls an incident with an XID and no allocator OOM "not an OOM" (type 6).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oomguard import bounded
from oomguard.digits import decimal
from oomguard.errors import CollectorError
from oomguard.exporter.collectors.base import GpuIdentity, GpuMemory, GpuReading
from oomguard.exporter.render import FamilyBuilder
from oomguard.exporter.scrape import DEFAULT_MAX_BYTES, Scraper
from oomguard.exporter.textparse import Sample, is_openmetrics, parse
from oomguard.forensics.incidents import Xid

MIB = 1024 * 1024
_BLANK_INT32 = 2**31 - 16

FB_FIELDS = {
    "DCGM_FI_DEV_FB_TOTAL": "total",
    "DCGM_FI_DEV_FB_USED": "used",
    "DCGM_FI_DEV_FB_FREE": "free",
    "DCGM_FI_DEV_FB_RESERVED": "reserved",
}
XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"
XID_COUNT = "DCGM_EXP_XID_ERRORS_COUNT"
WANTED = (*FB_FIELDS, XID_FIELD, XID_COUNT)
MAX_XID = 1023  # XID codes are small integers; anything else is not one
RECENT_XIDS = 256  # kept for the incident classifier


def _read_file(path: str, max_bytes: int, timeout: float = 2.0) -> str:
    """A dcgm-exporter output file, bounded like a scrape (oomguard.bounded). Symlinks are
    followed (a mounted ConfigMap is one), but a FIFO or device never blocks or floods the
    collector: the reason (`not_found`, `not_regular_file`, `is_directory`, `too_large`,
    `not_utf8`...) is the collector error's."""
    try:
        return bounded.read_text(path, bounded.Limits(max_bytes=max_bytes, timeout=timeout))
    except bounded.InputError as exc:
        raise CollectorError(exc.reason, str(exc)) from None


def is_blank(value: float) -> bool:
    # Every DCGM blank sentinel is at least 2**31-16; no MiB figure or XID code gets there.
    return value >= _BLANK_INT32


def _xid_code(labels: dict[str, str]) -> int | None:
    code = labels.get("xid", "")
    value = decimal(code)
    return value if value is not None and 0 < value <= MAX_XID else None


def xids_from_text(text: str, timestamp: float, openmetrics: bool = False) -> list[Xid]:
    """The XIDs counted in a dcgm-exporter output's last window (non-zero counts only)."""
    out = []
    for s in parse(text, (XID_COUNT,), openmetrics=openmetrics).get(XID_COUNT):
        code = _xid_code(s.labels)
        if code is not None and 0 < s.value < _BLANK_INT32:
            uuid = s.labels.get("UUID") or s.labels.get("uuid", "")
            out.append(Xid(timestamp, uuid, code, int(s.value)))
    return out


def _identity(labels: dict[str, str], hostname: str) -> GpuIdentity:
    return GpuIdentity(
        gpu=labels.get("gpu", ""),
        uuid=labels.get("UUID") or labels.get("uuid", ""),
        pci_bus_id=labels.get("pci_bus_id", ""),
        device=labels.get("device", ""),
        model_name=labels.get("modelName", ""),
        hostname=hostname,
        gpu_instance_id=labels.get("GPU_I_ID", ""),
        gpu_instance_profile=labels.get("GPU_I_PROFILE", ""),
    )


def _pod(labels: dict[str, str]) -> tuple[str, str, str] | None:
    """(namespace, pod, container) of a pod-mapped series, in either label namespace."""
    pod = labels.get("pod") or labels.get("pod_name")
    if not pod:
        return None
    namespace = labels.get("namespace") or labels.get("pod_namespace", "")
    container = labels.get("container") or labels.get("container_name", "")
    return namespace, pod, container


@dataclass
class _Fields:
    identity: GpuIdentity
    device: dict[str, float] = field(default_factory=dict)  # series without pod labels
    pod_max: dict[str, float] = field(default_factory=dict)  # largest pod-labelled value


class DcgmCollector:
    name = "dcgm"

    def __init__(
        self,
        hostname: str,
        url: str | None = None,
        file: str | None = None,
        timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if bool(url) == bool(file):
            raise ValueError("dcgm collector needs exactly one of url or file")
        self.url, self.file = url, file
        self.target = url or file or ""
        self.hostname = hostname
        self.timeout = timeout
        self._scraper = Scraper(url, timeout) if url else None
        self._clock = clock
        # the last sighting of each (GPU, XID); `recent_xids` is replaced whole, never mutated,
        # so the incidents collector's thread reads it safely
        self._sightings: dict[tuple[str, int], Xid] = {}
        self.recent_xids: tuple[Xid, ...] = ()

    def close(self) -> None:
        if self._scraper is not None:
            self._scraper.close()

    def _read_text(self) -> tuple[str, bool]:
        if self.file:
            return _read_file(self.file, DEFAULT_MAX_BYTES, self.timeout), False
        assert self._scraper is not None
        text, content_type = self._scraper.get()
        return text, is_openmetrics(content_type)

    def collect(self) -> GpuReading:
        text, openmetrics = self._read_text()
        parsed = parse(text, WANTED, openmetrics=openmetrics)
        reading = GpuReading()
        reading.invalid.update(parsed.dropped)
        per_gpu: dict[tuple[str, str], _Fields] = {}
        for metric, key in FB_FIELDS.items():
            for s in parsed.get(metric):
                if not self._valid(s, reading):
                    continue
                identity = _identity(s.labels, self.hostname)
                fields = per_gpu.setdefault(identity.key, _Fields(identity))
                pod = _pod(s.labels)
                if pod is None:
                    if key in fields.device:
                        # Two device series for one GPU that differ only in labels we do not
                        # key on (driver version, hostname): keep the first, never overwrite.
                        reading.invalid["duplicate_gpu_series"] += 1
                        continue
                    fields.device[key] = s.value * MIB
                    fields.identity = identity  # prefer the device series' labels
                else:
                    fields.pod_max[key] = max(fields.pod_max.get(key, 0.0), s.value * MIB)
                    if key == "used":
                        reading.pods.append((identity, *pod, s.value * MIB))
        for fields in per_gpu.values():
            values = {**fields.pod_max, **fields.device}
            used, free, reserved = values.get("used"), values.get("free"), values.get("reserved")
            total = values.get("total")
            if total is None and used is not None and free is not None:
                total = used + free + (reserved or 0.0)
            reading.gpus.append(GpuMemory(fields.identity, total, used, free, reserved))
        seen_xid: set[tuple[str, str]] = set()
        for s in parsed.get(XID_FIELD):
            if not self._valid(s, reading):
                continue
            identity = _identity(s.labels, self.hostname)
            if identity.key not in seen_xid:  # pod-mapped duplicates repeat the device's value
                seen_xid.add(identity.key)
                reading.last_xid.append((identity, s.value))
        seen_count: set[tuple[tuple[str, str], int]] = set()
        now = self._clock()
        for s in parsed.get(XID_COUNT):
            code = _xid_code(s.labels)
            if code is None:
                reading.invalid["bad_xid"] += 1
                continue
            if not self._valid(s, reading):
                continue
            identity = _identity(s.labels, self.hostname)
            if (identity.key, code) in seen_count:  # pod-mapped duplicates
                continue
            seen_count.add((identity.key, code))
            reading.xid_counts.append((identity, code, s.value))
            if s.value > 0:
                sighting = (identity.uuid, code)
                self._sightings.pop(sighting, None)  # re-inserted last: the dict stays time-ordered
                self._sightings[sighting] = Xid(now, identity.uuid, code, int(s.value))
                while len(self._sightings) > RECENT_XIDS:
                    del self._sightings[next(iter(self._sightings))]
                self.recent_xids = tuple(self._sightings.values())
        if not reading.gpus:
            raise CollectorError(
                "no_data", "no DCGM_FI_DEV_FB_* series in the dcgm-exporter output"
            )
        return reading

    @staticmethod
    def _valid(s: Sample, reading: GpuReading) -> bool:
        if is_blank(s.value):
            reading.invalid["blank_sentinel"] += 1
            return False
        if s.value < 0:
            reading.invalid["negative"] += 1
            return False
        return True

    def families(self, reading: GpuReading, out: FamilyBuilder) -> None:
        for identity, namespace, pod, container, used in reading.pods:
            out.add(
                "oomguard_gpu_pod_memory_used_bytes",
                (*identity.labels(), namespace, pod, container),
                used,
            )
        for identity, code in reading.last_xid:
            out.add("oomguard_gpu_last_xid", identity.labels(), code)
        for identity, code, count in reading.xid_counts:
            out.add("oomguard_gpu_xid_errors", (*identity.labels(), str(code)), count)
