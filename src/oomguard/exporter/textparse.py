"""Reading other exporters' /metrics: bounded fetch and tolerant, filtered parsing.

vLLM's /metrics is about 750 lines per engine, most of them histogram buckets that oomguard does
not need. Lines are filtered by metric name before they are parsed, which
keeps parsing cheap at short poll intervals: a regex finds the wanted sample lines (the scan runs in
C) and a strict line grammar reads them.

Upstream pages are untrusted input. A series that appears twice (same name, same label set, in
any label order) is a broken page, not two processes to add up: the first sample is kept, as
Prometheus keeps it, and each repeat is dropped and counted as `duplicate_series`.
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


# Parsed label sets by their raw text: an engine's page repeats the same label sets poll after
# poll (only values move), and parsing them is most of a page's parse. Bounded in entries and in
# the length of what is kept (pages are untrusted).
_LABEL_CACHE: dict[str, tuple[dict[str, str], tuple[tuple[str, str], ...]]] = {}
_LABEL_CACHE_ENTRIES = 2048
_LABEL_CACHE_LONGEST = 2048  # vLLM's cache_config_info: 800 characters


def _labels_and_key(
    raw: str | None, line: str
) -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
    """A sample's labels (a new dict: the caller's to keep) and its sorted (name, value) key."""
    if not raw:
        return {}, ()
    hit = _LABEL_CACHE.get(raw)
    if hit is None:
        labels = _labels(raw, line)
        hit = (labels, tuple(sorted(labels.items())))
        if len(raw) <= _LABEL_CACHE_LONGEST:
            if len(_LABEL_CACHE) >= _LABEL_CACHE_ENTRIES:
                _LABEL_CACHE.clear()
            _LABEL_CACHE[raw] = hit
    return dict(hit[0]), hit[1]


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


def _type_lines(text: str) -> dict[str, int]:
    """Where each family's first `# TYPE` line starts: one pass of str.find over the page (a
    find per wanted name was a pass each)."""
    out: dict[str, int] = {}
    i = text.find("# TYPE ")
    while i >= 0:
        if i == 0 or text[i - 1] == "\n":
            end = text.find("\n", i)
            name, sep, _ = text[i + 7 : end if end >= 0 else len(text)].partition(" ")
            if sep and name not in out:
                out[name] = i
        i = text.find("# TYPE ", i + 7)
    return out


def _wanted_lines(text: str, wanted: frozenset[str]) -> list[str]:
    """Sample lines of the wanted names. Exposition text groups a family's samples under its
    `# TYPE` line, so each wanted family is found with str.find and only its block is split;
    names without a TYPE line fall back to one regex scan of the whole page."""
    by_block: dict[int, tuple[int, set[str]]] = {}
    untyped: set[str] = set()
    types = _type_lines(text)
    for name in wanted:
        for family in _family_candidates(name):
            i = types.get(family, -1)
            if i >= 0:
                start = text.find("\n", i) + 1
                end = text.find("\n#", start)
                _, names = by_block.setdefault(start, (end if end >= 0 else len(text), set()))
                names.add(name)
                break
        else:
            if name in text:  # absent names (the legacy KV gauge, say) cost one find
                untyped.add(name)
    lines: list[str] = []
    for start, (end, names) in sorted(by_block.items()):
        prefixes = tuple(n + c for n in names for c in ("{", " ", "\t"))
        lines.extend(ln for ln in text[start:end].splitlines() if ln.startswith(prefixes))
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
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for line in lines:
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
        if math.isnan(value) or math.isinf(value):
            out.drop("nan")
            continue
        name = m.group(1)
        labels, key = _labels_and_key(m.group(2), line)
        _keep(out, seen, Sample(name, labels, value), key)
    return out


def _keep(
    out: Parsed,
    seen: set[tuple[str, tuple[tuple[str, str], ...]]],
    s: Sample,
    label_key: tuple[tuple[str, str], ...] | None = None,
) -> None:
    key = (s.name, tuple(sorted(s.labels.items())) if label_key is None else label_key)
    if key in seen:
        out.drop("duplicate_series")
        return
    seen.add(key)
    out.samples.setdefault(s.name, []).append(s)


def _parse_openmetrics(text: str, keep: set[str] | None, out: Parsed) -> Parsed:
    if not text.rstrip().endswith("# EOF"):
        raise CollectorError("parse_error", "OpenMetrics text without '# EOF' (truncated?)")
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
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
