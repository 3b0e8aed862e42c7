"""Durations and sizes as people write them, parsed in one place for every config file and flag.

Durations: `500ms`, `1s`, `2.5m`, `1h30m`, `1d` (ms, s, m, h, d, w; parts add up, as in
Prometheus). Sizes: `512B`, `24GB` (powers of 1000), `2GiB` (powers of 1024), and Kubernetes'
`2Gi`. A plain number is accepted only where the name of the setting says its unit: a config
key ending in `_seconds` or `_bytes`, a flag whose value is documented as SECONDS. Where nothing
says the unit (`--gpu-memory 80`: GB or GiB?), a plain number is refused with a suggestion: a
wrong guess there sizes a GPU 7 % too big.

The config loader (`oomguard.config.validate`) applies this to every key named `*_seconds` or
`*_bytes` in every section, so each component's settings take units without each model saying so.
"""

from __future__ import annotations

import argparse
import math
import re

# Long input is refused before any regular expression sees it (configs and flags are untrusted).
MAX_TEXT = 64
# The largest duration and size any setting takes. 64 characters of digits pass MAX_TEXT:
# `999...9w` (1e63 s) passed `remediator --check` and then crashed the start with an
# OverflowError (the scheduler's timedelta; a sleep or a socket timeout overflow too). Ten
# years and a pebibyte are far beyond every real setting and far within every limit below us.
MAX_SECONDS = 10 * 365 * 86400.0
MAX_BYTES = 2**50

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_DURATION_PART = re.compile(rf"({_NUMBER})\s*(ms|s|m|h|d|w)", re.IGNORECASE)
_DURATION = re.compile(rf"(?:{_NUMBER}\s*(?:ms|s|m|h|d|w)\s*)+", re.IGNORECASE)
_PLAIN = re.compile(_NUMBER)

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    # Kubernetes quantities: Ki, Mi, Gi, Ti are binary
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}
_SIZE = re.compile(rf"({_NUMBER})\s*([KMGT]i?B|[KMGT]i|B)", re.IGNORECASE)


def _text(value: object, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected {what}, got {type(value).__name__}")
    text = str(value).strip()
    if len(text) > MAX_TEXT:
        raise ValueError(f"expected {what}, got {len(text)} characters")
    return text


def parse_duration(value: str | float, *, plain: bool = True) -> float:
    """Seconds in `value`: '500ms' -> 0.5, '1h30m' -> 5400.0, '2' -> 2.0 (with `plain`).

    Raises ValueError naming the accepted forms."""
    text = _text(value, "a duration")
    if _PLAIN.fullmatch(text):
        if not plain:
            raise ValueError(f"duration {text!r} has no unit: write e.g. {text}s or {text}ms")
        seconds = float(text)
    elif _DURATION.fullmatch(text):
        seconds = sum(
            float(number) * _DURATION_UNITS[unit.lower()]
            for number, unit in _DURATION_PART.findall(text)
        )
    else:
        raise ValueError(
            f"not a duration: {text!r} (examples: 500ms, 30s, 2m, 1h30m; a plain number is seconds)"
        )
    return _bounded_duration(seconds, text)


def _bounded_duration(seconds: float, text: str) -> float:
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise ValueError(f"duration {text!r} is too large (at most {format_duration(MAX_SECONDS)})")
    return seconds


def _bounded_size(size: int, text: str) -> int:
    if size > MAX_BYTES:
        raise ValueError(f"size {text!r} is too large (at most {format_size(MAX_BYTES)})")
    return size


def parse_size(value: str | int | float, *, plain: bool = False) -> int:
    """Bytes in `value`: '2GiB' -> 2147483648, '24GB' -> 24000000000, '512' -> 512 (with
    `plain`, for a setting whose name says bytes). Raises ValueError naming the accepted forms."""
    text = _text(value, "a size")
    if _PLAIN.fullmatch(text):
        if not plain and float(text) != 0:  # zero is zero in every unit
            raise ValueError(
                f"size {text!r} has no unit: write it with one, e.g. {text}GiB, {text}GB or "
                f"{text}MiB"
            )
        return _bounded_size(int(float(text)), text)
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 24GB, 81559MiB, 2Gi)")
    return _bounded_size(int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]), text)


def format_duration(seconds: float) -> str:
    """The shortest exact spelling among ms, s, m, h: 0.5 -> '500ms', 600 -> '10m'."""
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and float(seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    if seconds < 1 and float(seconds * 1000).is_integer():
        return f"{int(seconds * 1000)}ms"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def format_size(size: float) -> str:
    """Binary units with up to two decimals: 2147483648 -> '2GiB', 1536 -> '1.5KiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f}".rstrip("0").rstrip(".") + unit
    return f"{int(size)}B"


# -- config keys --------------------------------------------------------------------------------
def config_value(key: str, value: object) -> object:
    """A config value with its unit applied when the key names one (`*_seconds`, `*_bytes`) and
    the value is text; a plain number there is held to the same bounds (MAX_SECONDS, MAX_BYTES);
    anything else unchanged (the model's own validation judges it)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            if key.endswith("_seconds"):
                _bounded_duration(float(value), str(value)[:20])
            elif key.endswith("_bytes"):
                _bounded_size(int(value), str(value)[:20])
        except OverflowError:  # an integer beyond a float
            raise ValueError(f"{str(value)[:20]}... is too large") from None
        return value  # the model judges its type
    if not isinstance(value, str):
        return value
    if key.endswith("_seconds"):
        return parse_duration(value)
    if key.endswith("_bytes"):
        return parse_size(value, plain=True)
    return value


# -- argparse types -----------------------------------------------------------------------------
def duration_arg(text: str) -> float:
    """argparse type for a flag documented as SECONDS: a plain number or a duration."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_arg(text: str) -> int:
    """argparse type for a SIZE flag: a unit is required."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
