"""Whole numbers written in input (ports, header values, labels, file contents)."""

from __future__ import annotations


def decimal(text: str) -> int | None:
    """The value of `text` when it is plain ASCII decimal digits, else None.

    `str.isdigit()` alone also accepts "²" (which `int()` refuses) and other scripts' digits
    (which `int()` reads), so input is held to 0-9.
    """
    if not (text.isascii() and text.isdigit()) or len(text) > MAX_DIGITS:
        return None  # past MAX_DIGITS, int() costs time (and past 4,300 digits it raises)
    return int(text)


# No whole number oomguard reads (a port, a count, bytes) comes near this many digits.
MAX_DIGITS = 100
