"""Metric families and their rendering to the Prometheus exposition formats.

A snapshot is rendered once, when it is collected, and the bytes are served to every scrape.
The text renderer caches each series' `name{labels}` prefix across snapshots, since label sets
rarely change between polls: that is what makes rendering cheap enough to poll every 100 ms.
OpenMetrics (the same bytes as prometheus_client's) is rendered from the same families when
asked for, or before a snapshot is published when a scrape is expected to ask (poller.Forms).
gzip is made from the renderings' pieces, each large family's compressed blocks kept while its
text stays the same (PartsGzip).

Rendering never raises on a bad value: one sample that cannot be rendered (a value that is not a
number or overflows a float, a label value that is not a string, a wrong label count) is dropped
and counted in `dropped` by reason, so that one bad input cannot freeze every metric the exporter
serves. Each (metric, reason) is also logged once per process.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from oomguard.catalog import MetricSpec, spec

log = logging.getLogger("oomguard.exporter")

# What a sample's value or labels can raise on the way to text: counted, never propagated.
_BAD_SAMPLE = (TypeError, ValueError, OverflowError, AttributeError)


_warned: set[tuple[str, str]] = set()  # (metric, reason) already logged: bounded by the catalog


def _count_drop(dropped: Counter[str], reason: str, name: str, exc: BaseException) -> None:
    if (name, reason) not in _warned:  # once per process, not once per poll
        _warned.add((name, reason))
        log.warning("dropping a sample of %s that cannot be rendered (%s): %s", name, reason, exc)
    dropped[reason] += 1


class Family:
    """Samples of one catalogued metric, with label values in the catalog's label order."""

    __slots__ = ("samples", "spec", "width")

    def __init__(self, name: str) -> None:
        self.spec: MetricSpec = spec(name)
        self.width = len(self.spec.labels)  # label values per sample
        self.samples: list[tuple[tuple[str, ...], float]] = []

    def add(self, labels: tuple[str, ...], value: float) -> None:
        if len(labels) != len(self.spec.labels):
            raise ValueError(
                f"{self.spec.name}: expected labels {self.spec.labels}, got {len(labels)} values"
            )
        self.samples.append((labels, float(value)))


class FamilyBuilder:
    """Collects families by name so that several sources can add to the same metric.

    `dropped` counts samples refused by reason; pass a long-lived Counter to accumulate it
    across snapshots (it feeds a counter metric).
    """

    def __init__(self, dropped: Counter[str] | None = None) -> None:
        self._families: dict[str, Family] = {}
        self.dropped: Counter[str] = dropped if dropped is not None else Counter()

    def add(self, name: str, labels: tuple[str, ...], value: float | None) -> None:
        if value is None:
            return
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = Family(name)
        try:
            # Family.add inline (a node's render pass adds some 1,300 samples one at a time)
            if len(labels) != family.width:
                family.add(labels, value)  # raises its ValueError
            family.samples.append((labels, float(value)))
        except _BAD_SAMPLE as exc:
            _count_drop(self.dropped, "unrenderable", name, exc)

    def extend(self, name: str, samples: list[tuple[tuple[str, ...], float]]) -> None:
        """Add samples built by the caller itself, each with the spec's label count of strings
        and a float value: no per-sample checks (thousands of per-process series a poll)."""
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = Family(name)
        family.samples.extend(samples)

    def families(self) -> list[Family]:
        return list(self._families.values())


# A rendering in pieces: (family name, its body) or (None, a header or the end marker).
Parts = list[tuple[str | None, str]]


def join_parts(parts: Parts) -> bytes:
    return "".join([text for _, text in parts]).encode()


class PartsBytes:
    """The bytes of a rendering from its pieces, each large body encoded once while it stays the
    same str (the per-process family: most of a node's page, 2 MB at 10,000 series, rarely
    moves); the small pieces between them are joined and encoded together."""

    LARGE = 8192  # characters, as PartsGzip

    def __init__(self) -> None:
        # family name -> (body as last encoded, its bytes); bounded by the catalog. Read and
        # replaced whole: concurrent scrapes need no lock.
        self._bodies: dict[str, tuple[str, bytes]] = {}

    def join(self, parts: Parts) -> bytes:
        return b"".join(self.pieces(parts))

    def pieces(self, parts: Parts) -> list[bytes]:
        """The rendering's bytes in pieces (each large body's cached bytes, the small pieces
        between them joined): what `join` joins, for a caller that joins only when asked."""
        out: list[bytes] = []
        small: list[str] = []
        for name, text in parts:
            if name is None or len(text) < self.LARGE:
                small.append(text)
                continue
            cached = self._bodies.get(name)
            if cached is None or cached[0] is not text:
                cached = self._bodies[name] = (text, text.encode())
            if small:
                out.append("".join(small).encode())
                small = []
            out.append(cached[1])
        if small:
            out.append("".join(small).encode())
        return out


# -- gzip from cached pieces --------------------------------------------------------------------
# CRC-32 arithmetic (zlib's crc32_combine): the CRC of A+B from crc(A), crc(B) and len(B), so
# that a piece that did not change is neither compressed nor checksummed again.
_CRC_POLY = 0xEDB88320


def _crc_multiply(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reflected, as zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _crc_powers() -> list[int]:
    powers, p = [], 1 << 30  # x^1
    for _ in range(32):
        powers.append(p)  # x^(2^k)
        p = _crc_multiply(p, p)
    return powers


_X2N = _crc_powers()


def _crc_shift(length: int) -> int:
    """x^(8 * length) modulo the polynomial: what crc(A) is multiplied by when B follows."""
    p, k = 1 << 31, 3  # x^0; a byte is 2^3 bits
    while length:
        if length & 1:
            p = _crc_multiply(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32_combine(crc_a: int, crc_b: int, shift_b: int) -> int:
    """crc32(A + B) from crc32(A), crc32(B) and _crc_shift(len(B))."""
    return _crc_multiply(shift_b, crc_a) ^ crc_b


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x04\xff"  # deflate, no name, no mtime; fast
GZIP_LEVEL = 1


class PartsGzip:
    """gzip of a rendering made from its pieces, each large body compressed once while it stays
    the same (the per-process family, most of a node's page, rarely moves), and so is each run
    of small pieces that did not change since the last rendering (the small families that hold
    still, with the headers between them: most of the rest of the page, while a few families'
    values move every poll).

    One gzip member, one deflate stream: the changed pieces go through one compressor; before a
    cached piece's blocks it is flushed with Z_FULL_FLUSH, which aligns its output to a byte and
    forgets its window, so no later block refers back into data it did not see, and each cached
    piece was compressed alone (its blocks refer only to itself). The CRC is combined from the
    pieces' CRCs. The result inflates to exactly the joined pieces.
    """

    LARGE = 8192  # characters: smaller bodies are cheaper to recompress than to splice
    RUN = 2048  # characters: a shorter run of unchanged pieces is compressed with the rest

    def __init__(self, level: int = GZIP_LEVEL) -> None:
        self.level = level
        # family name -> (body as last compressed, its deflate blocks, crc, bytes, crc shift);
        # bounded by the catalog. Read and replaced whole: concurrent scrapes need no lock.
        self._bodies: dict[str, tuple[str, bytes, int, int, int]] = {}
        # the last rendering's small bodies (family name -> text: what "unchanged" is against)
        # and its runs of unchanged pieces (their texts -> blocks, crc, bytes, crc shift);
        # replaced whole by each compress: only the last rendering's are kept
        self._small: dict[str, str] = {}
        self._runs: dict[tuple[str, ...], tuple[bytes, int, int, int]] = {}

    def _alone(self, data: bytes) -> bytes:
        alone = zlib.compressobj(self.level, zlib.DEFLATED, -zlib.MAX_WBITS)
        return alone.compress(data) + alone.flush(zlib.Z_FULL_FLUSH)

    def compress(self, parts: Parts) -> bytes:
        out = [_GZIP_HEADER]
        deflate = zlib.compressobj(self.level, zlib.DEFLATED, -zlib.MAX_WBITS)
        crc = size = 0
        last_small, small = self._small, {}
        last_runs, runs = self._runs, {}
        run: list[str] = []  # unchanged small pieces, in a row
        run_chars = 0

        def stream(texts: list[str]) -> None:
            nonlocal crc, size
            data = "".join(texts).encode()
            out.append(deflate.compress(data))
            crc = zlib.crc32(data, crc)
            size += len(data)

        def splice(blocks: bytes, piece_crc: int, piece_size: int, shift: int) -> None:
            nonlocal crc, size
            out.append(deflate.flush(zlib.Z_FULL_FLUSH))
            out.append(blocks)
            crc = crc32_combine(crc, piece_crc, shift)
            size += piece_size

        def end_run() -> None:
            nonlocal run, run_chars
            if run_chars < self.RUN:
                stream(run)
            else:
                key = tuple(run)
                cached = last_runs.get(key)
                if cached is None:
                    data = "".join(run).encode()
                    cached = (self._alone(data), zlib.crc32(data), len(data), _crc_shift(len(data)))
                runs[key] = cached
                splice(*cached)
            run, run_chars = [], 0

        for name, text in parts:
            if name is None or len(text) < self.LARGE:
                if name is not None:
                    small[name] = text
                    if last_small.get(name) is not text:  # changed (or new): compressed anew
                        if run:
                            end_run()
                        stream([text])
                        continue
                run.append(text)  # a header, or a body as the last rendering had it
                run_chars += len(text)
                continue
            if run:
                end_run()
            cached = self._bodies.get(name)
            if cached is None or cached[0] is not text:
                data = text.encode()
                cached = (
                    text,
                    self._alone(data),
                    zlib.crc32(data),
                    len(data),
                    _crc_shift(len(data)),
                )
                self._bodies[name] = cached
            splice(*cached[1:])
        if run:
            end_run()
        self._small, self._runs = small, runs
        out.append(deflate.flush(zlib.Z_FINISH))
        out.append(struct.pack("<II", crc, size & 0xFFFFFFFF))
        return b"".join(out)


_INF, _NINF = float("inf"), float("-inf")

# The zeros of a family's samples as rendered: (index, negative) of each. A body cache hit needs
# the samples equal (==, blind to a zero's sign) and each of these zeros of the same sign.
_Zeros = tuple[tuple[int, bool], ...]


def _zeros(samples: list[tuple[tuple[str, ...], float]]) -> _Zeros | None:
    """Where the samples' zeros are, with their signs; None when a value is not a float (such
    a family is not cached)."""
    try:
        return tuple((i, math.copysign(1.0, v) < 0) for i, (_, v) in enumerate(samples) if v == 0.0)
    except _BAD_SAMPLE:
        return None


def _same_zeros(samples: list[tuple[tuple[str, ...], float]], zeros: _Zeros) -> bool:
    """Whether each zero of the last rendering is a zero of the same sign in `samples` (which
    compare equal to that rendering's: the zeros are in the same places)."""
    copysign = math.copysign
    return all((copysign(1.0, samples[i][1]) < 0) == negative for i, negative in zeros)


def format_value(value: float) -> str:
    """Exposition value: Python's shortest repr parses identically in Prometheus (Go's
    ParseFloat); only the special values need their Prometheus spelling."""
    if value != value:
        return "NaN"
    if value == _INF:
        return "+Inf"
    if value == _NINF:
        return "-Inf"
    return repr(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class TextRenderer:
    """Renders families to the text format 0.0.4, caching between calls: each series' prefix,
    and each family's text while its samples stay equal to the last render's.

    Most of a node's series hold still between polls (a process's memory, a GPU's identity,
    an engine's KV pool), so at thousands of per-process series most families render to what
    they rendered last time: comparing a family's samples with the last ones (in C) costs a
    fraction of formatting them again. Since 0.0 == -0.0 yet they print differently, a family
    with zeros is kept with the sign of each (its zeros' places, few: an engine's queue, a
    counter of OOMs, a pressure level) and reused only while each zero keeps its sign; one with
    a sample that could not be rendered is always rendered afresh, so that every render counts
    its drops.
    """

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, max_cached_series: int = 200_000) -> None:
        self._prefixes: dict[tuple[str, tuple[str, ...]], str] = {}
        self._headers: dict[str, str] = {}
        # family name -> (its samples as last rendered, their text); bounded by the catalog
        self._bodies: dict[str, tuple[list[tuple[tuple[str, ...], float]], str, _Zeros]] = {}
        self._max = max_cached_series
        self.dropped: Counter[str] = Counter()  # samples refused, over the renderer's life

    def _prefix(self, spec: MetricSpec, labels: tuple[str, ...]) -> str:
        key = (spec.name, labels)
        prefix = self._prefixes.get(key)
        if prefix is None:
            if len(self._prefixes) >= self._max:
                # Label churn (short-lived PIDs) must not grow memory without bound.
                self._prefixes.clear()
            pairs = ",".join(
                f'{n}="{_escape_label(v)}"' for n, v in zip(spec.labels, labels, strict=True) if v
            )
            prefix = f"{spec.name}{{{pairs}}} " if pairs else f"{spec.name} "
            self._prefixes[key] = prefix
        return prefix

    def _header(self, spec: MetricSpec) -> str:
        header = self._headers.get(spec.name)
        if header is None:
            header = (
                f"# HELP {spec.name} {_escape_help(spec.help)}\n# TYPE {spec.name} {spec.type}\n"
            )
            self._headers[spec.name] = header
        return header

    def render(self, families: Iterable[Family]) -> bytes:
        return join_parts(self.render_parts(families))

    def render_parts(self, families: Iterable[Family]) -> Parts:
        """The text as pieces: each family's header (key None) and body (key its name; the
        same str object while the family renders the same, for PartsGzip's cache)."""
        parts: Parts = []
        for family in families:
            if not family.samples:
                continue
            name = family.spec.name
            last = self._bodies.get(name)
            if (
                last is not None
                and last[0] == family.samples
                and _same_zeros(family.samples, last[2])
            ):
                body = last[1]  # the same samples: the same text
            else:
                self._bodies.pop(name, None)
                try:
                    body, zero = self._body(family)
                    zeros = _zeros(family.samples) if zero else ()
                    if zeros is not None:
                        self._bodies[name] = (list(family.samples), body, zeros)
                except _BAD_SAMPLE:
                    # Rare: a sample added around FamilyBuilder's checks. Redo the family one
                    # sample at a time and drop only the bad ones.
                    body = self._body_checked(family)
            if body:
                parts.append((None, self._header(family.spec)))
                parts.append((name, body))
        return parts

    def _body(self, family: Family) -> tuple[str, bool]:
        """The family's text, and whether any value is zero (either sign)."""
        parts: list[str] = []
        prefix = self._prefix
        fam_spec = family.spec
        name = fam_spec.name
        prefixes = self._prefixes
        append = parts.append
        zero = False
        for labels, value in family.samples:
            append(prefixes.get((name, labels)) or prefix(fam_spec, labels))
            append(format_value(value))
            append("\n")
            if value == 0.0:
                zero = True
        return "".join(parts), zero

    def _body_checked(self, family: Family) -> str:
        parts: list[str] = []
        for labels, value in family.samples:
            try:
                line = f"{self._prefix(family.spec, labels)}{format_value(float(value))}\n"
            except _BAD_SAMPLE as exc:
                _count_drop(self.dropped, "unrenderable", family.spec.name, exc)
                continue
            parts.append(line)
        return "".join(parts)


class _FamiliesCollector:
    def __init__(self, families: Iterable[Family]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            s = family.spec
            if s.type == "counter":
                base = s.name[: -len("_total")] if s.name.endswith("_total") else s.name
                metric: CounterMetricFamily | GaugeMetricFamily = CounterMetricFamily(
                    base, s.help, labels=s.labels
                )
            else:
                metric = GaugeMetricFamily(s.name, s.help, labels=s.labels)
            for labels, value in family.samples:
                if not all(isinstance(v, str) for v in labels):
                    continue  # the text renderer counts these; this path is on demand only
                if s.type == "counter" and (math.isnan(value) or value < 0):
                    continue
                metric.add_metric(list(labels), value)
            yield metric


OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _escape_openmetrics(value: str) -> str:
    # OpenMetrics escapes the quote in HELP text too (prometheus_client's ALLOWUTF8 escaping)
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class OpenMetricsRenderer:
    """OpenMetrics 1.0.0 text, byte for byte what prometheus_client's generate_latest makes of
    the same families (_FamiliesCollector), with the text renderer's caches.

    Prometheus 2.x asks for OpenMetrics first, so this is the form a real scrape gets. Through
    prometheus_client it took half a second at 10,000 series on every new snapshot. The same
    rules: HELP and TYPE for every family (an empty one too), a counter under its base name with
    `_total` samples, labels sorted by name, empty label values kept, values as Go prints them
    (floatToGoString), a counter's NaN or negative sample and a sample whose labels are not all
    strings left out; `# EOF` at the end. A value that is not a number is dropped and counted
    (prometheus_client raised, failing the scrape).
    """

    def __init__(self) -> None:
        self._prefixes: dict[tuple[str, tuple[str, ...]], str] = {}
        self._headers: dict[str, str] = {}
        self._bodies: dict[str, tuple[list[tuple[tuple[str, ...], float]], str, _Zeros]] = {}
        self._lock = threading.Lock()  # scrapes render concurrently; the caches are shared
        self.dropped: Counter[str] = Counter()

    def render(self, families: Iterable[Family]) -> bytes:
        return join_parts(self.render_parts(families))

    def render_parts(self, families: Iterable[Family]) -> Parts:
        """As TextRenderer.render_parts: headers (key None), bodies (key the family's name)."""
        with self._lock:
            parts: Parts = []
            for family in families:
                parts.append((None, self._header(family.spec)))
                if family.samples:
                    parts.append((family.spec.name, self._cached_body(family)))
            parts.append((None, "# EOF\n"))
            return parts

    def _header(self, spec: MetricSpec) -> str:
        header = self._headers.get(spec.name)
        if header is None:
            name = _base_name(spec)
            header = f"# HELP {name} {_escape_openmetrics(spec.help)}\n# TYPE {name} {spec.type}\n"
            self._headers[spec.name] = header
        return header

    def _cached_body(self, family: Family) -> str:
        name = family.spec.name
        last = self._bodies.get(name)
        if last is not None and last[0] == family.samples and _same_zeros(family.samples, last[2]):
            return last[1]  # the same samples, zeros of the same signs: the same text
        self._bodies.pop(name, None)
        body, cacheable, zero = self._body(family)
        zeros = _zeros(family.samples) if cacheable and zero else ()
        if cacheable and zeros is not None:
            self._bodies[name] = (list(family.samples), body, zeros)
        return body

    def _body(self, family: Family) -> tuple[str, bool, bool]:
        """The family's text, whether it may be reused (no value dropped), and whether any
        value is zero (either sign)."""
        spec = family.spec
        counter = spec.type == "counter"
        name = spec.name
        prefixes = self._prefixes
        parts: list[str] = []
        append = parts.append
        cacheable = True
        zero = False
        for labels, value in family.samples:
            try:
                prefix = prefixes.get((name, labels))  # kept: its labels were all strings
            except TypeError:  # a label that cannot be hashed: not a string either
                prefix = None
            if prefix is None:
                if not all(isinstance(v, str) for v in labels):
                    continue  # left out, as prometheus_client does (the text renderer counts them)
                prefix = self._prefix(spec, labels)
            try:
                number = float(value)
            except _BAD_SAMPLE as exc:
                _count_drop(self.dropped, "unrenderable", spec.name, exc)
                cacheable = False
                continue
            if counter and (number != number or number < 0):
                continue
            if number == 0.0:
                zero = True  # 0.0 == -0.0, which prints differently: _zeros
            append(prefix)
            append(go_float(number))
            append("\n")
        return "".join(parts), cacheable, zero

    def _prefix(self, spec: MetricSpec, labels: tuple[str, ...]) -> str:
        key = (spec.name, labels)
        prefix = self._prefixes.get(key)
        if prefix is None:
            if len(self._prefixes) >= 200_000:
                self._prefixes.clear()  # label churn (short-lived PIDs) must not grow memory
            sample = _base_name(spec) + "_total" if spec.type == "counter" else spec.name
            pairs = ",".join(
                f'{n}="{_escape_openmetrics(v)}"'
                for n, v in sorted(zip(spec.labels, labels, strict=False))  # as add_metric
            )
            prefix = f"{sample}{{{pairs}}} " if pairs else f"{sample} "
            self._prefixes[key] = prefix
        return prefix


def go_float(d: float) -> str:
    """prometheus_client's floatToGoString of a float (OpenMetrics values as Go prints them),
    without its float() of the argument (the caller's is one already)."""
    if d != d:
        return "NaN"
    if d == _INF:
        return "+Inf"
    if d == _NINF:
        return "-Inf"
    s = repr(d)
    if d > 0:
        dot = s.find(".")
        if dot > 6:  # Go switches to exponents sooner than Python
            mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
            return f"{mantissa}e+{dot - 1:02d}"
    return s


def _base_name(spec: MetricSpec) -> str:
    if spec.type == "counter" and spec.name.endswith("_total"):
        return spec.name[: -len("_total")]
    return spec.name


_OPENMETRICS = OpenMetricsRenderer()  # one per process: its caches serve every snapshot


def render_openmetrics(families: Iterable[Family]) -> bytes:
    return _OPENMETRICS.render(families)


def render_openmetrics_parts(families: Iterable[Family]) -> Parts:
    return _OPENMETRICS.render_parts(families)


def render_openmetrics_reference(families: Iterable[Family]) -> bytes:
    """prometheus_client's own rendering of the same families (what render_openmetrics matches;
    the tests and the benchmark compare the two)."""
    return openmetrics_latest(_FamiliesCollector(families))
