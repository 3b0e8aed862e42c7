"""Reading other exporters' /metrics: bounded fetch and tolerant, filtered parsing.

vLLM's /metrics is about 750 lines per engine, most of them histogram buckets that oomguard does
not need. Lines are filtered by metric name before they are parsed, which
keeps parsing cheap at short poll intervals: a regex finds the wanted sample lines (the scan runs in
C) and a strict line grammar reads them.

Upstream pages are untrusted input. A series that appears twice (same name, same label set, in
any label order) is a broken page, not two processes to add up: the first sample is kept, as
Prometheus keeps it, and each repeat is dropped and counted as `duplicate_series`.

An upstream's page keeps its shape from poll to poll (the same series in the same order, only
values move): `ShapedParser` reads a page of a shape it has learnt by its values alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

from oomguard.errors import CollectorError


@dataclass
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Parsed:
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)

    def get(self, name: str) -> list[Sample]:
        return self.samples.get(name, [])

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


_SAMPLE = re.compile(
    r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*$"
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_UNESCAPE = re.compile(r"\\(.)")
_FILTERS: dict[frozenset[str], re.Pattern[str]] = {}


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _labels(raw: str | None, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    if not raw:
        return labels
    pos = 0
    while pos < len(raw):
        m = _LABEL.match(raw, pos)
        if m is None:
            raise CollectorError("parse_error", f"bad labels in line {line[:120]!r}")
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return labels


# Parsed series by their text ("name{labels}", up to the space before the value): an engine's
# page repeats the same series poll after poll (only values move), and parsing them is most of a
# page's parse. A line whose series is known is split at its last space and only its value read
# (a line that does not split that way cleanly takes the full grammar). Bounded in entries and in
# the length of what is kept (pages are untrusted).
_Ident = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted label pairs): a series' identity
_SERIES: dict[str, tuple[str, dict[str, str], _Ident]] = {}
_SERIES_ENTRIES = 4096
_SERIES_LONGEST = 2048  # vLLM's cache_config_info: 800 characters


def _sample_line(line: str) -> tuple[str, dict[str, str], _Ident, float]:
    """A sample line by the full grammar: (name, labels, identity, value); raises parse_error.
    A line of the usual form (one space before the value, no timestamp) teaches _SERIES."""
    m = _SAMPLE.match(line)
    if m is None:
        raise CollectorError("parse_error", f"not a sample line: {line[:120]!r}")
    raw = m.group(3)
    try:
        if "_" in raw:  # Python's float() takes "1_000"; the exposition format does not
            raise ValueError(raw)
        value = float(raw)
    except ValueError:
        raise CollectorError("parse_error", f"bad value in line {line[:120]!r}") from None
    name = m.group(1)
    labels = _labels(m.group(2), line)
    ident = (name, tuple(sorted(labels.items())))
    series, _, last = line.rpartition(" ")
    if last == raw and len(series) <= _SERIES_LONGEST and m.start(3) == len(series) + 1:
        if len(_SERIES) >= _SERIES_ENTRIES:
            _SERIES.clear()
        _SERIES[series] = (name, labels, ident)
    return name, dict(labels), ident, value


def _line_filter(wanted: frozenset[str]) -> re.Pattern[str]:
    """One regex that finds the sample lines of the wanted names, so that the scan of a 750-line
    page runs in C and only a few dozen lines reach Python."""
    pattern = _FILTERS.get(wanted)
    if pattern is None:
        names = "|".join(re.escape(n) for n in sorted(wanted, key=len, reverse=True))
        pattern = re.compile(rf"^(?:{names})[{{ \t].*$", re.MULTILINE)
        _FILTERS[wanted] = pattern
    return pattern


_SUFFIXES = ("_total", "_sum", "_count", "_bucket", "_created", "_info")


def _family_candidates(name: str) -> tuple[str, ...]:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return (name, name[: -len(suffix)])
    return (name,)


# The sample names a caller wants: each name's candidate families in order of preference, and
# every family any of them may be in (worked out once per set of names)
_Plan = tuple[dict[str, tuple[str, ...]], set[str]]
_PLANS: dict[frozenset[str], _Plan] = {}


def _plan(wanted: frozenset[str]) -> _Plan:
    plan = _PLANS.get(wanted)
    if plan is None:
        if len(_PLANS) >= 64:  # callers use a few fixed sets; bounded all the same
            _PLANS.clear()
        candidates = {name: _family_candidates(name) for name in wanted}
        plan = _PLANS[wanted] = (candidates, {f for fs in candidates.values() for f in fs})
    return plan


def _blocks(text: str, families: set[str]) -> dict[str, str]:
    """The sample block (the lines after its first `# TYPE` line, up to the next line that
    starts with "#") of each of `families` that has one: the page split once at its TYPE lines
    (one pass in C), each piece's family name read from its head."""
    pieces = text.split("\n# TYPE ")
    if text.startswith("# TYPE "):
        pieces[0] = pieces[0][7:]
    else:
        pieces[0] = ""  # what comes before the first TYPE line belongs to no family
    out: dict[str, str] = {}
    for piece in pieces:
        space = piece.find(" ")
        if space < 0:
            continue
        family = piece[:space]
        if family in families and family not in out and "\n" not in family:
            start = piece.find("\n") + 1
            if start == 0:
                out[family] = ""  # a TYPE line that ends the page
                continue
            end = piece.find("\n#", start)
            out[family] = piece[start:] if end < 0 else piece[start:end]
    return out


def _wanted_lines(text: str, wanted: frozenset[str]) -> list[str]:
    """Sample lines of the wanted names. Exposition text groups a family's samples under its
    `# TYPE` line, so only the wanted families' blocks are split into lines; names without a
    TYPE line fall back to one regex scan of the whole page."""
    plan, families = _plan(wanted)
    blocks = _blocks(text, families)
    by_block: dict[str, set[str]] = {}
    untyped: set[str] = set()
    for name, candidates in plan.items():
        for family in candidates:
            if family in blocks:
                by_block.setdefault(family, set()).add(name)
                break
        else:
            if name in text:  # absent names (the legacy KV gauge, say) cost one find
                untyped.add(name)
    lines: list[str] = []
    for family, names in by_block.items():
        prefixes = tuple(n + c for n in names for c in ("{", " ", "\t"))
        lines.extend([ln for ln in blocks[family].splitlines() if ln.startswith(prefixes)])
    if untyped:
        lines.extend(_line_filter(frozenset(untyped)).findall(text))
    return lines


def parse(text: str, wanted: Iterable[str] | None = None, openmetrics: bool = False) -> Parsed:
    """Parse exposition text into samples by sample name; NaN and +-Inf values are dropped.

    `wanted` lists the sample names to keep (e.g. "vllm:num_preemptions_total",
    "vllm:request_prompt_tokens_sum"); None keeps all. The text format 0.0.4 is read line by
    line with a strict sample grammar; OpenMetrics goes through prometheus_client's parser.
    Raises CollectorError("parse_error") when a line is not valid exposition format.
    """
    out = Parsed()
    if openmetrics:
        return _parse_openmetrics(text, None if wanted is None else set(wanted), out)
    if wanted is None:
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    else:
        lines = _wanted_lines(text, frozenset(wanted))
    seen: set[_Ident] = set()
    samples = out.samples
    for line in lines:
        series, _, raw = line.rpartition(" ")
        known = _SERIES.get(series)
        value = None
        if known is not None and raw.strip() == raw and "_" not in raw:
            # the series text is known good: the line is valid iff its value is one token
            # (try, not contextlib.suppress: its object and calls were a tenth of a page's parse)
            try:
                value = float(raw)
            except ValueError:
                value = None  # the full grammar says what is wrong
        if value is None or known is None:
            name, labels, ident, value = _sample_line(line)
        else:
            name, labels, ident = known[0], dict(known[1]), known[2]
        if value != value or value in (math.inf, -math.inf):
            out.drop("nan")
            continue
        # _keep, inline (a few dozen lines a page, 16 pages a poll at node scale)
        if ident in seen:
            out.drop("duplicate_series")
            continue
        seen.add(ident)
        kept = samples.get(name)
        if kept is None:
            samples[name] = [Sample(name, labels, value)]
        else:
            kept.append(Sample(name, labels, value))
    return out


# A page split at its sample lines' values: [text before the line, the line up to its value
# (its last space included), the value, ...], joined again the page. Comment lines and lines
# without a space stay whole in the text between.
_VALUES = re.compile(r"(?m)^([^#\n][^\n]* )(\S+)$")
# A page's samples by name as parse() gives them, each by its labels and its value's index
ShapePlan = list[tuple[str, list[tuple[dict[str, str], int]]]]


class ShapedParser:
    """parse() for one upstream, poll after poll. Its page keeps its shape: the text outside the
    sample values (comments, series, their order) is what it was, only values move (~250 us of
    CPU per vLLM page parsed line by line, 16 pages a poll at node scale). A shape seen on two
    polls in a row is learnt as a plan (each sample: its name, labels, and which value is its),
    and a page of that shape is then read by its values alone, checked as parse() checks them.

    Exact by construction: a page of another shape, a value the plan cannot take (not a number,
    one with "_"), and a shape whose plan did not reproduce parse() on the page it was learnt
    from (a repeated series, a line with a timestamp: see _learn) take parse() itself."""

    def __init__(self, wanted: Iterable[str]) -> None:
        self.wanted = frozenset(wanted)
        # The last page's shape (its _VALUES split less the values), its plan once learnt (None:
        # not yet, or it has none), and whether learning was tried: one tuple, replaced whole,
        # so that a plan is never read with another shape's pages.
        self._state: tuple[list[str], list[str], ShapePlan | None, bool] | None = None
        # shaped()'s walk of the learnt state: (that state, each sample line's text before its
        # value with the text before it, the text after the last value)
        self._walk: tuple[object, list[str], str] | None = None

    @property
    def _plan(self) -> ShapePlan | None:
        return None if self._state is None else self._state[2]

    def shaped(self, text: str) -> tuple[ShapePlan, list[str]] | None:
        """The learnt plan of this page's shape and the page's values, unread (what _apply
        reads), for a caller that reads the values by the plan itself; None when the page is
        of another shape or its shape has no plan (parse() it: that is how a shape is learnt)."""
        state = self._state
        if state is None or state[2] is None:
            return None
        walk = self._walk
        if walk is None or walk[0] is not state:
            heads, series = state[0], state[1]
            prefixes = [h + s for h, s in zip(heads[:-1], series, strict=True)]
            walk = self._walk = (state, prefixes, heads[-1])
        _, prefixes, tail = walk
        # The page walked along its shape rather than split by _VALUES (a regex over every
        # line: ~18 us of a vLLM page's ~25): each sample line's text up to its value is found
        # where it should be, the value runs to the line's end, and what follows the last one
        # is the shape's tail. The regex decides line by line (`^...$`), so a page whose lines
        # outside the values are the shape's, and whose values are each one run of non-space
        # characters (as `\S+$` takes them), is split by it into this shape and these values;
        # any other page is not of this shape, and neither answer takes it.
        values: list[str] = []
        append = values.append
        startswith, find = text.startswith, text.find
        pos = 0
        for prefix in prefixes:
            if not startswith(prefix, pos):
                return None
            pos += len(prefix)
            end = find("\n", pos)
            if end < 0:
                end = len(text)
            append(text[pos:end])
            pos = end
        if len(text) - pos != len(tail) or not startswith(tail, pos):
            return None
        if " ".join(values).split() != values:  # each value non-empty, without whitespace
            return None
        return state[2], values

    def parse(self, text: str, openmetrics: bool = False) -> Parsed:
        if openmetrics:
            return parse(text, self.wanted, openmetrics=True)
        pieces = _VALUES.split(text)
        state = self._state
        if state is None or pieces[0::3] != state[0] or pieces[1::3] != state[1]:
            out = parse(text, self.wanted)  # raises on a bad page: the shape is not kept
            self._state = (pieces[0::3], pieces[1::3], None, False)
            return out
        heads, series, plan, learnt = state
        if plan is not None:
            read = _apply(plan, pieces[2::3])
            if read is not None:
                return read
        out = parse(text, self.wanted)
        if not learnt:  # the second page of this shape
            self._state = (heads, series, _learn(pieces, self.wanted, out), True)
        return out


def _apply(plan: ShapePlan, values: list[str]) -> Parsed | None:
    """The plan's samples with these values, or None where parse() must say (a bad value)."""
    out = Parsed()
    samples = out.samples
    for name, entries in plan:
        kept = []
        for labels, at in entries:
            raw = values[at]
            if "_" in raw:
                return None
            try:
                value = float(raw)
            except ValueError:
                return None
            if value != value or value in (math.inf, -math.inf):
                out.drop("nan")
                continue
            kept.append(Sample(name, labels.copy(), value))
        if kept:
            samples[name] = kept
    return out


def _learn(pieces: list[str], wanted: frozenset[str], parsed: Parsed) -> ShapePlan | None:
    """The plan of this page's shape, or None. The page is parsed twice with its values replaced
    by their indices, then by their indices plus their number: a sample whose value moves by
    exactly that number takes its value from that index; any other (a value that is part of
    the shape, as a line with a timestamp has) means no plan. A shape with a repeated series or
    a NaN has none either (parse() drops a repeat only while its first is not NaN), and a plan
    is kept only if it reproduces `parsed`, parse()'s reading of this very page."""
    count = len(pieces) // 3
    readings = []
    for offset in (0, count):
        indexed = list(pieces)
        indexed[2::3] = [str(i + offset) for i in range(count)]
        try:
            reading = parse("".join(indexed), wanted)
        except CollectorError:
            return None
        if reading.dropped:
            return None
        readings.append(reading)
    first, second = readings
    plan: ShapePlan = []
    for name, samples in first.samples.items():
        moved = second.samples.get(name, [])
        if len(moved) != len(samples):
            return None
        entries = []
        for a, b in zip(samples, moved, strict=True):
            at = int(a.value)
            if a.labels != b.labels or a.value != at or b.value != at + count or at >= count:
                return None
            entries.append((a.labels, at))
        plan.append((name, entries))
    if _apply(plan, pieces[2::3]) != parsed:
        return None
    return plan


def _keep(out: Parsed, seen: set[_Ident], s: Sample, key: _Ident | None = None) -> None:
    """Keeps `s` unless its series (`key`, when the caller has it) was already kept."""
    if key is None:
        key = (s.name, tuple(sorted(s.labels.items())))
    if key in seen:
        out.drop("duplicate_series")
        return
    seen.add(key)
    out.samples.setdefault(s.name, []).append(s)


def _parse_openmetrics(text: str, keep: set[str] | None, out: Parsed) -> Parsed:
    if not text.rstrip().endswith("# EOF"):
        raise CollectorError("parse_error", "OpenMetrics text without '# EOF' (truncated?)")
    seen: set[_Ident] = set()
    try:
        for family in openmetrics_families(text):
            for s in family.samples:
                if keep is not None and s.name not in keep:
                    continue
                if math.isnan(s.value) or math.isinf(s.value):
                    out.drop("nan")
                    continue
                _keep(out, seen, Sample(s.name, dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise CollectorError("parse_error", f"not valid OpenMetrics text: {exc}") from exc
    return out


def is_openmetrics(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/openmetrics-text"
