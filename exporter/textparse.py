"""Reading other exporters' /metrics: bounded fetch and tolerant, filtered parsing.

vLLM's /metrics is about 750 lines per engine, most of them histogram buckets that oomguard does
not need. Lines are filtered by metric name before they reach prometheus_client's parser, which
keeps parsing cheap at short poll intervals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families

from oomguard.errors import CollectorError

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_SUFFIXES = ("_total", "_sum", "_count", "_created", "_bucket", "_info")


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


def fetch_text(
    client: httpx.Client, url: str, timeout: float, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[str, str]:
    """GET a /metrics page; returns (text, content type). Raises CollectorError."""
    headers = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1"}
    try:
        with client.stream("GET", url, timeout=timeout, headers=headers) as response:
            if response.status_code != 200:
                raise CollectorError("http_status", f"{url} answered HTTP {response.status_code}")
            chunks: list[bytes] = []
            size = 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise CollectorError("too_large", f"{url} sent more than {max_bytes} bytes")
                chunks.append(chunk)
            content_type = response.headers.get("content-type", "")
    except httpx.TimeoutException as exc:
        raise CollectorError("timeout", f"{url} did not answer within {timeout}s") from exc
    except httpx.HTTPError as exc:
        raise CollectorError("unreachable", f"{url}: {exc.__class__.__name__}: {exc}") from exc
    try:
        return b"".join(chunks).decode("utf-8"), content_type
    except UnicodeDecodeError as exc:
        raise CollectorError("parse_error", f"{url} sent text that is not UTF-8") from exc


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _wanted_line(line: str, wanted: set[str]) -> bool:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return (
            len(parts) >= 3
            and parts[1] in ("HELP", "TYPE")
            and (parts[2] in wanted or _base(parts[2]) in wanted)
        )
    end = len(line)
    for stop in ("{", " "):
        i = line.find(stop)
        if i != -1 and i < end:
            end = i
    name = line[:end]
    return name in wanted or _base(name) in wanted


def parse(text: str, wanted: Iterable[str] | None = None, openmetrics: bool = False) -> Parsed:
    """Parse exposition text into samples by sample name; NaN and ±Inf values are dropped.

    `wanted` names families or samples to keep (e.g. "vllm:num_preemptions_total"); None keeps
    all. Raises CollectorError("parse_error") when the text is not valid exposition format.
    """
    if not openmetrics and wanted is not None:
        keep = set(wanted)
        lines = [ln for ln in text.splitlines() if ln.strip() and _wanted_line(ln, keep)]
        text = "\n".join(lines) + "\n"
    elif openmetrics and not text.rstrip().endswith("# EOF"):
        raise CollectorError("parse_error", "OpenMetrics text without '# EOF' (truncated?)")
    out = Parsed()
    keep_all = wanted is None
    keep_names = set(wanted or ())
    try:
        families = openmetrics_families(text) if openmetrics else text_families(text)
        for family in families:
            for s in family.samples:
                if not keep_all and s.name not in keep_names and family.name not in keep_names:
                    continue
                if math.isnan(s.value) or math.isinf(s.value):
                    out.drop("nan")
                    continue
                out.samples.setdefault(s.name, []).append(Sample(s.name, dict(s.labels), s.value))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise CollectorError("parse_error", f"not valid exposition text: {exc}") from exc
    return out


def is_openmetrics(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/openmetrics-text"
