"""How old a recorded moment is, without trusting the wall clock more than we must.

Durations inside one process use the monotonic clock. A moment read back from a file (the audit
log, the supervisor's restart record) is stamped with wall time and, beside it, the machine's
boot id and its CLOCK_BOOTTIME reading: on the same boot the boot-time difference gives its age
exactly, whatever the wall clock did since (NTP stepping it back or forward). From another boot
(another pod, a reboot) only the wall time is left; a wall time in the future (the clock stepped
back since) has an unknown age, and `age` says None rather than a negative number.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
FUTURE_TOLERANCE = 1.0  # seconds: wall clocks of two processes on one box may differ this much


def _read_boot_id() -> str:
    try:
        return _BOOT_ID_PATH.read_text(encoding="ascii").strip()[:64]
    except (OSError, ValueError):
        return ""  # not Linux, or /proc hidden: ages fall back to wall time


BOOT_ID = _read_boot_id()


def boottime() -> float:
    """Seconds since boot, counting suspend; never steps (CLOCK_BOOTTIME, else monotonic)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def stamp() -> dict[str, Any]:
    """What a record carries besides its wall `time` so that its age can be told later."""
    return {"boot": BOOT_ID, "uptime": round(boottime(), 6)} if BOOT_ID else {}


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond a float
        return None
    return number if math.isfinite(number) else None


def age(
    record: Mapping[str, Any],
    wall_now: float | None = None,
    uptime_now: float | None = None,
    boot: str | None = None,
) -> float | None:
    """Seconds since `record` (its `time`, `boot` and `uptime` fields) was written, or None when
    that cannot be told: no usable time, or a wall time in the future of another boot's."""
    boot = BOOT_ID if boot is None else boot
    uptime = _finite(record.get("uptime"))
    if boot and record.get("boot") == boot and uptime is not None:
        now = boottime() if uptime_now is None else uptime_now
        if 0 <= uptime <= now + FUTURE_TOLERANCE:
            return max(0.0, now - uptime)
    at = _finite(record.get("time"))
    if at is None:
        return None
    wall = time.time() if wall_now is None else wall_now
    if at > wall + FUTURE_TOLERANCE:
        return None  # the clock stepped back since: how long ago is unknown
    return max(0.0, wall - at)
