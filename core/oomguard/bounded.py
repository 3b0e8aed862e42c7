"""Bounded reading of untrusted input: every file and HTTP body oomguard reads goes through here.

A config, a token file, a hand-off or incident record, a dcgm-exporter dump, an engine's JSON
answer: anything can be there. One hostile or broken input must cost a bounded amount of time
and memory and end in one `InputError` that names the source and what was wrong; it must never
hang a command (a FIFO opened for reading waits for a writer forever), flood memory (a link to
/dev/zero, a 10 GB file), or raise something a caller does not expect (UnicodeDecodeError,
RecursionError from deep nesting, ValueError from a 5,000-digit integer, OverflowError later
from a 400-digit one).

What is checked, in the order a reader meets it:
- file type: only regular files are read (`is_directory`, `not_regular_file` for FIFOs, devices
  and sockets; a FIFO is opened non-blocking, so even the check cannot hang); links are
  followed unless the caller says not to (`symlink`): a Kubernetes Secret or ConfigMap mount
  is a chain of links, while a shared drop directory is not;
- size: at most `max_bytes` (`too_large`), checked before and while reading (a file may grow);
- deadline: reading stops after `timeout` seconds (`timeout`), for slow HTTP bodies;
- UTF-8: strict (`not_utf8`), including escaped lone surrogates in JSON strings, which would
  fail later when the text is encoded for /metrics or a log;
- syntax (`not_json`, `not_yaml`);
- nesting depth (`too_deep`) and total values (`too_many_values`, YAML aliases can expand a
  small file into billions of references);
- numbers: at most `max_digits` digits (`number_too_long`), finite (`not_finite`).

`InputError.reason` is a short, fixed label value (counted by collectors as an invalid-sample
reason); `str(InputError)` is one line for an operator: "<source>: <what was wrong>".
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import stat
import time
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from oomguard.errors import OomguardError

KIB = 1024
MIB = 1024 * KIB

# Every reason an InputError can carry (a bounded label set).
REASONS = (
    "not_found",
    "permission_denied",
    "is_directory",
    "not_regular_file",
    "symlink",
    "unreadable",
    "too_large",
    "timeout",
    "not_utf8",
    "not_json",
    "not_yaml",
    "too_deep",
    "too_many_values",
    "number_too_long",
    "not_finite",
    "not_token",
)


class InputError(OomguardError, ValueError):
    """Untrusted input refused. `source` names it (a path, a URL, a flag), `reason` is one of
    REASONS, and the message says what was wrong in one line: "<source>: <detail>".

    It is a ValueError too, so parsers that already turn ValueError into their own error keep
    working when they switch to this module.
    """

    def __init__(self, source: str, reason: str, detail: str) -> None:
        super().__init__(f"{source}: {detail}")
        self.source = source
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """What one input may cost. The defaults fit configuration files and small JSON answers."""

    max_bytes: int = 1 * MIB
    max_depth: int = 64  # real configs nest 3-6 levels; Python's json recurses out near 1000
    max_digits: int = 40  # 2**128 has 39 digits; HF's "1e30" sentinel integer has 31
    max_values: int | None = None  # None: max_bytes (a JSON value costs at least one byte)
    timeout: float = 10.0

    def with_(self, **changes: Any) -> Limits:
        return replace(self, **changes)

    @property
    def value_budget(self) -> int:
        return self.max_values if self.max_values is not None else max(self.max_bytes, 1024)


DEFAULT = Limits()
# A bearer token file: one line of text.
TOKEN = Limits(max_bytes=64 * KIB)


def check_token(value: str, source: str) -> str:
    """`value` as a bearer token an HTTP header can carry: visible ASCII only, no space, tab or
    line break. A token file holding a second line, a CR or a non-ASCII character made every
    request fail with an error that quoted the header, token included (in logs, the audit log,
    `oomguard status`), or raise UnicodeEncodeError. The message names the character's kind
    and position, never the value."""
    for i, c in enumerate(value, 1):
        if "!" <= c <= "~":
            continue
        if c in "\r\n":
            what = "a line break"
        elif c in " \t":
            what = "a space or tab"
        elif c.isascii() or not c.isprintable():
            what = "a control character"
        else:
            what = "a non-ASCII character"
        raise InputError(
            source,
            "not_token",
            f"holds {what} at character {i}: a bearer token is one line of visible ASCII",
        )
    return value


def _deadline(limits: Limits) -> float:
    return time.monotonic() + limits.timeout


# -- files --------------------------------------------------------------------------------------
def _size(n: int) -> str:
    return f"{n:,} bytes" if n < MIB else f"{n / MIB:,.1f} MiB"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _check_mode(source: str, mode: int) -> None:
    if stat.S_ISLNK(mode):
        raise InputError(source, "symlink", "is a symbolic link, which is not followed here")
    if stat.S_ISDIR(mode):
        raise InputError(source, "is_directory", "is a directory, expected a file")
    if not stat.S_ISREG(mode):
        raise InputError(source, "not_regular_file", f"is {_kind(mode)}, expected a regular file")


def _os_error(source: str, exc: OSError, follow_symlinks: bool) -> InputError:
    code = exc.errno
    if code == errno.ENOENT:
        return InputError(source, "not_found", "no such file")
    if code in (errno.EACCES, errno.EPERM):
        return InputError(source, "permission_denied", "permission denied")
    if code == errno.EISDIR:
        return InputError(source, "is_directory", "is a directory, expected a file")
    if code == errno.ELOOP and not follow_symlinks:
        return InputError(source, "symlink", "is a symbolic link, which is not followed here")
    if code == errno.ENXIO:  # a socket, or a FIFO opened for writing without a reader
        return InputError(source, "not_regular_file", "is a socket, expected a regular file")
    return InputError(source, "unreadable", f"cannot read: {exc.strerror or exc}")


def read_bytes(
    path: str | os.PathLike[str],
    limits: Limits = DEFAULT,
    *,
    follow_symlinks: bool = True,
    dir_fd: int | None = None,
    source: str | None = None,
) -> bytes:
    """At most `limits.max_bytes` of one regular file; never blocks on a FIFO, never opens a
    device for reading. `dir_fd`: `path` is relative to that open directory."""
    name = source or os.fsdecode(path)
    try:
        # Refuse what is not a regular file before opening it: opening a device can have an
        # effect of its own. fstat below closes the race with a swap after this check.
        _check_mode(name, os.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks).st_mode)
    except OSError as exc:
        raise _os_error(name, exc, follow_symlinks) from None
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise _os_error(name, exc, follow_symlinks) from None
    try:
        st = os.fstat(fd)
        _check_mode(name, st.st_mode)
        if st.st_size > limits.max_bytes:
            raise InputError(
                name,
                "too_large",
                f"is {_size(st.st_size)}, over the {_size(limits.max_bytes)} limit",
            )
        deadline = _deadline(limits)
        chunks: list[bytes] = []
        size = 0
        while size <= limits.max_bytes:  # it may grow after fstat: read one byte past the limit
            try:
                chunk = os.read(fd, min(limits.max_bytes + 1 - size, 1 * MIB))
            except OSError as exc:
                raise _os_error(name, exc, follow_symlinks) from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if time.monotonic() > deadline:
                raise InputError(name, "timeout", f"reading took over {limits.timeout:g} s")
        if size > limits.max_bytes:
            raise InputError(name, "too_large", f"is over the {_size(limits.max_bytes)} limit")
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode(data: bytes, source: str) -> str:
    """Strict UTF-8 (a leading byte-order mark is dropped)."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise InputError(
            source,
            "not_utf8",
            f"is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r})",
        ) from None


def read_token(path: str | os.PathLike[str], *, source: str | None = None) -> str:
    """A token file's token (surrounding whitespace dropped; empty when there is none),
    checked by `check_token`."""
    name = source or os.fsdecode(path)
    return check_token(read_text(path, TOKEN, source=name).strip(), name)


def read_text(
    path: str | os.PathLike[str],
    limits: Limits = DEFAULT,
    *,
    follow_symlinks: bool = True,
    dir_fd: int | None = None,
    source: str | None = None,
) -> str:
    name = source or os.fsdecode(path)
    raw = read_bytes(path, limits, follow_symlinks=follow_symlinks, dir_fd=dir_fd, source=name)
    return decode(raw, name)


# -- HTTP bodies and other streams --------------------------------------------------------------
class _Body:
    def __init__(self, source: str, limits: Limits) -> None:
        self.source, self.limits = source, limits
        self.deadline = _deadline(limits)
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limits.max_bytes:
            raise InputError(self.source, "too_large", f"sent over {_size(self.limits.max_bytes)}")
        if time.monotonic() > self.deadline:
            raise InputError(self.source, "timeout", f"sending took over {self.limits.timeout:g} s")
        self.chunks.append(chunk)

    def data(self) -> bytes:
        return b"".join(self.chunks)


def collect(chunks: Iterable[bytes], source: str, limits: Limits = DEFAULT) -> bytes:
    """A body read chunk by chunk (httpx's `Response.iter_bytes()`), bounded in size and time.
    The time is checked between chunks: give the transport its own read timeout as well."""
    body = _Body(source, limits)
    for chunk in chunks:
        body.add(chunk)
    return body.data()


async def acollect(chunks: AsyncIterable[bytes], source: str, limits: Limits = DEFAULT) -> bytes:
    """`collect` for an async stream (httpx's `Response.aiter_bytes()`)."""
    body = _Body(source, limits)
    async for chunk in chunks:
        body.add(chunk)
    return body.data()


# -- structure ----------------------------------------------------------------------------------
def _digits(text: str) -> int:
    return sum(c.isdigit() for c in text)


def _over(token: str, max_digits: int) -> bool:
    """Whether a number token has more than max_digits digits (a short one cannot: no count)."""
    return len(token) > max_digits and _digits(token) > max_digits


_CONTAINERS = (dict, list, tuple)


def check_tree(
    value: Any, source: str, limits: Limits = DEFAULT, *, scalars: bool = True, ints: bool = False
) -> Any:
    """Refuse a parsed document that nests too deep or holds too many values (counting every
    reference: YAML aliases); with `scalars`, also an integer over `max_digits` digits, a
    non-finite float, or a string that cannot be encoded as UTF-8; with `ints` alone, only such
    an integer. Iterative, level by level: no recursion to run out of, and one pass over the
    values."""
    budget = limits.value_budget
    max_int = 10**limits.max_digits
    seen = 1
    level = [value] if type(value) in _CONTAINERS else []
    if (scalars or (ints and type(value) is int)) and not level:
        _check_scalar(value, source, limits, max_int)
    depth = 0
    while level:
        depth += 1
        if depth > limits.max_depth:
            raise InputError(source, "too_deep", f"nests deeper than {limits.max_depth} levels")
        below: list[Any] = []
        for item in level:
            children: Any = item
            if type(item) is dict:
                children = item.values()
                if scalars:
                    for key in item:
                        _check_scalar(key, source, limits, max_int)
            seen += len(children)
            if seen > budget:
                raise InputError(
                    source, "too_many_values", f"holds over {budget:,} values (aliases expanded)"
                )
            for child in children:
                kind = type(child)
                if kind is dict or kind is list or kind is tuple:
                    below.append(child)
                elif scalars:
                    _check_scalar(child, source, limits, max_int)
                elif ints and kind is int and not -max_int < child < max_int:
                    _check_scalar(child, source, limits, max_int)  # raises number_too_long
        level = below
    return value


def _check_scalar(value: Any, source: str, limits: Limits, max_int: int) -> None:
    kind = type(value)
    if kind is str:
        if not value.isascii():
            _check_str(value, source)
    elif kind is int:
        if not -max_int < value < max_int:
            raise InputError(
                source, "number_too_long", f"an integer is over {limits.max_digits} digits"
            )
    elif kind is float and not math.isfinite(value):
        raise InputError(source, "not_finite", f"a number is not finite ({value})")


def _check_str(text: str, source: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            source, "not_utf8", "a string holds a lone surrogate (not encodable as UTF-8)"
        ) from None


# -- JSON ---------------------------------------------------------------------------------------
class _Refused(Exception):
    """Raised from json's number hooks; carried out of json.loads and turned into InputError."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _checked_float(limits: Limits, token: str) -> float:
    """parse_json's float hook (both parses): a number of at most max_digits digits, finite."""
    if _over(token, limits.max_digits):
        raise _Refused(
            "number_too_long", f"a number has {_digits(token):,} digits, over {limits.max_digits}"
        )
    number = float(token)
    if not math.isfinite(number):
        raise _Refused("not_finite", f"a number is out of range ({token[:20]})")
    return number


def _no_constant(token: str) -> float:
    """parse_json's constant hook (both parses): NaN and Infinity are not JSON."""
    raise _Refused("not_finite", f"{token} is not JSON")


@functools.lru_cache(maxsize=32)  # a few Limits in a process (module constants)
def _quick_decoder(limits: Limits) -> json.JSONDecoder:
    """parse_json's first try: integers read by json's C scanner, floats and constants by the
    hooks of the exact parse (below). An allocator report holds some 15 integers, each a call
    into Python with the integer hook (about half of its parse), and json.loads with hooks makes
    a decoder on every call. An integer is read by C as the hook reads it (int(token)), and a
    JSON integer has no leading zeros, so one of more than max_digits digits is one outside
    +-10**max_digits, which check_tree(ints=True) refuses. Whatever this refuses (or json
    raises) is parsed again the exact way, which says why in its own words: what is accepted
    here is accepted there, as the same document. One decoder serves every thread, as
    json.loads's own default one does."""
    return json.JSONDecoder(
        parse_float=functools.partial(_checked_float, limits), parse_constant=_no_constant
    )


def parse_json(data: bytes | str, source: str, limits: Limits = DEFAULT) -> Any:
    """One JSON document, with every check of this module (size, UTF-8, depth, numbers)."""
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise InputError(source, "too_large", f"is over the {_size(limits.max_bytes)} limit")
    text = decode(data, source) if isinstance(data, bytes) else data

    def parse_int(token: str) -> int:
        if _over(token, limits.max_digits):
            raise _Refused(
                "number_too_long",
                f"an integer has {_digits(token):,} digits, over {limits.max_digits}",
            )
        return int(token)

    # Numbers were checked by the hooks; a string can only hold a lone surrogate when the text
    # escapes one ("\\udc80") or came in as str: the walk checks scalars only then.
    surrogates = isinstance(data, str) or "\\ud" in text or "\\uD" in text
    if not text.startswith("\ufeff"):  # json.loads refuses a BOM in a str: its words, below
        try:
            doc = _quick_decoder(limits).decode(text)
            return check_tree(doc, source, limits, scalars=surrogates, ints=True)
        except (ValueError, RecursionError, _Refused):  # InputError, JSONDecodeError included
            pass  # refused: parsed again below, which says why in its own words
    try:
        doc = json.loads(
            text,
            parse_int=parse_int,
            parse_float=functools.partial(_checked_float, limits),
            parse_constant=_no_constant,
        )
    except _Refused as exc:
        raise InputError(source, exc.reason, exc.detail) from None
    except RecursionError:
        raise InputError(
            source, "too_deep", f"nests deeper than {limits.max_depth} levels"
        ) from None
    except json.JSONDecodeError as exc:
        raise InputError(
            source, "not_json", f"is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ValueError as exc:  # anything else json refuses
        raise InputError(source, "not_json", f"is not JSON: {str(exc)[:120]}") from None
    return check_tree(doc, source, limits, scalars=surrogates)


def read_json(
    path: str | os.PathLike[str],
    limits: Limits = DEFAULT,
    *,
    follow_symlinks: bool = True,
    dir_fd: int | None = None,
    source: str | None = None,
) -> Any:
    name = source or os.fsdecode(path)
    raw = read_bytes(path, limits, follow_symlinks=follow_symlinks, dir_fd=dir_fd, source=name)
    return parse_json(raw, name, limits)


# -- YAML ---------------------------------------------------------------------------------------
def parse_yaml(data: bytes | str, source: str, limits: Limits = DEFAULT) -> Any:
    """One YAML document (safe_load), with every check of this module."""
    import yaml

    text = decode(data, source) if isinstance(data, bytes) else data
    if len(text) > limits.max_bytes:
        raise InputError(source, "too_large", f"is over the {_size(limits.max_bytes)} limit")
    # libyaml (CSafeLoader) is several times faster and stops nesting at 1,000 levels itself
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        doc = yaml.load(text, Loader=loader)  # a safe loader: plain data only
    except RecursionError:
        raise InputError(
            source, "too_deep", f"nests deeper than {limits.max_depth} levels"
        ) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1} column {where.column + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if "nesting depth" in problem:  # libyaml's own limit
            raise InputError(
                source, "too_deep", f"nests deeper than {limits.max_depth} levels"
            ) from None
        raise InputError(source, "not_yaml", f"is not valid YAML: {problem}{at}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # PyYAML's constructors call int() (past Python's digit limit: ValueError) and
        # datetime() (a 13th month: ValueError) without wrapping what they raise.
        if "digits" in str(exc):
            raise InputError(
                source, "number_too_long", f"an integer is over {limits.max_digits} digits"
            ) from None
        raise InputError(source, "not_yaml", f"is not valid YAML: {str(exc)[:120]}") from None
    return check_tree(doc, source, limits)


def read_yaml(
    path: str | os.PathLike[str],
    limits: Limits = DEFAULT,
    *,
    follow_symlinks: bool = True,
    source: str | None = None,
) -> Any:
    name = source or os.fsdecode(path)
    return parse_yaml(
        read_bytes(path, limits, follow_symlinks=follow_symlinks, source=name), name, limits
    )
