"""Errors that carry a short machine-readable reason and a message for humans."""

from __future__ import annotations


class OomguardError(Exception):
    """Base class of oomguard's own errors."""


class ConfigError(OomguardError):
    """A configuration file or flag is wrong; the message says which and why."""


class CollectorError(OomguardError):
    """A collector could not read its source.

    `reason` is a short label value (e.g. "timeout", "parse_error", "library_not_found") counted
    in oomguard_exporter_collector_errors_total; the message is logged.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class BudgetError(OomguardError):
    """A model config cannot be turned into a memory budget (missing or unsupported fields)."""


class HandoffError(OomguardError):
    """An allocator hand-off file is malformed."""
