"""The plugin's numeric settings from vLLM's environment (OOMGUARD_* variables).

An unset or blank variable is the default; anything else must parse and lie in its range, or a
ValueError names the variable and the value (the plugin reports it at start and keeps the
default rather than take vLLM down)."""

from __future__ import annotations

import os


def env_float(name: str, default: float, low: float, high: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {raw!r}") from None
    if not low <= value <= high:  # also refuses nan
        raise ValueError(f"{name} must be between {low} and {high}, not {raw!r}")
    return value


def env_int(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {raw!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, not {raw!r}")
    return value
