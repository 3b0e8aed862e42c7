"""Whole numbers written in input (ports, header values, labels, file contents)."""

from __future__ import annotations


def decimal(text: str) -> int | None:
    """The value of `text` when it is plain ASCII decimal digits, else None.

    `str.isdigit()` alone also accepts "²" (which `int()` refuses) and other scripts' digits
    (which `int()` reads), so input is held to 0-9.
    """
    return int(text) if text.isascii() and text.isdigit() else None
