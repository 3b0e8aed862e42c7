"""vLLM engines, from each vLLM server's own /metrics.

One collector per configured endpoint (`target`). A server with data parallelism reports several
engines (`engine` label); each becomes its own EngineReading. In Prometheus multiprocess mode
(several API servers) series may carry a `pid` label: counters are summed over it, gauges take the
largest value, since every process reports the same engine.

`vllm:cache_config_info` carries the KV pool's size as label strings, which PromQL cannot do
arithmetic on: oomguard turns them into numeric gauges.

Only the samples read are asked for (`name[]` parameters, at `filtered_url`): a vLLM page is a
twentieth of its size without the histograms' buckets. An upstream that does not serve the
filtered page (an answer other than 200, or one without vLLM series) is asked at the configured
URL from then on; one that ignores the parameters sends the whole page, parsed as before.

The page is untrusted: a repeated series is dropped by the parser (never added twice), and a
negative counter or count, a KV usage outside 0-1, or a cache figure out of range (blocks or
block size not positive, `gpu_memory_utilization` outside (0, 1]) is dropped and counted in the
reading's `invalid` by reason.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from oomguard.errors import CollectorError
from oomguard.exporter.collectors.base import Reading
from oomguard.exporter.render import FamilyBuilder
from oomguard.exporter.scrape import DEFAULT_MAX_BYTES, Scraper
from oomguard.exporter.textparse import Parsed, ShapedParser, ShapePlan, is_openmetrics
from oomguard.vllm_seam import (  # vLLM's metric names, by vLLM version (vllm_seam)
    CACHE_CONFIG,
    FINISHED,
    GENERATION_HIST,
    GENERATION_TOKENS,
    KV_USAGE,
    KV_USAGE_LEGACY,
    PREEMPTIONS,
    PROMPT_HIST,
    PROMPT_TOKENS,
    RUNNING,
    WAITING,
)

WANTED = (
    KV_USAGE,
    KV_USAGE_LEGACY,
    RUNNING,
    WAITING,
    PREEMPTIONS,
    FINISHED,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    CACHE_CONFIG,
    f"{PROMPT_HIST}_sum",
    f"{PROMPT_HIST}_count",
    f"{GENERATION_HIST}_sum",
    f"{GENERATION_HIST}_count",
)


def filtered_url(url: str) -> str:
    """Where a vLLM server honours name[] parameters. vLLM (0.33) serves its registry twice:
    `/metrics` exactly through prometheus-fastapi-instrumentator's handler, which ignores them,
    and `/metrics/...` through prometheus_client's make_asgi_app, which honours them (the same
    registry, the same text). A URL of another path is asked as it is."""
    parts = urlsplit(url)
    if parts.path == "/metrics":
        return urlunsplit(parts._replace(path="/metrics/"))
    return url


@dataclass
class EngineReading:
    model_name: str
    engine: str
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    finished: dict[str, float] = field(default_factory=dict)
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    kv_blocks: float | None = None
    block_size: float | None = None
    kv_capacity_tokens: float | None = None
    gpu_memory_utilization: float | None = None
    prompt_sum: float | None = None
    prompt_count: float | None = None
    generation_sum: float | None = None
    generation_count: float | None = None

    @property
    def finished_total(self) -> float | None:
        return sum(self.finished.values()) if self.finished else None

    def labels(self, target: str) -> tuple[str, str, str]:
        return (target, self.model_name, self.engine)


@dataclass
class VllmReading(Reading):
    engines: list[EngineReading] = field(default_factory=list)


def _number(
    labels: dict[str, str], key: str, invalid: Counter[str], upper: float = 2.0**63
) -> float | None:
    """A cache_config_info label as a number in (0, upper]; "None" or absent is None."""
    raw = labels.get(key)
    if raw is None or raw in ("", "None"):
        return None
    try:
        value = float(raw)
    except ValueError:
        invalid["not_a_number"] += 1
        return None
    if not 0.0 < value <= upper:  # also refuses NaN
        invalid["out_of_range"] += 1
        return None
    return value


def _apply_cache_config(e: EngineReading, labels: dict[str, str], invalid: Counter[str]) -> None:
    e.kv_blocks = _number(labels, "num_gpu_blocks", invalid)
    e.block_size = _number(labels, "block_size", invalid)
    e.kv_capacity_tokens = _number(labels, "kv_cache_size_tokens", invalid)
    if e.kv_capacity_tokens is None and e.kv_blocks and e.block_size:
        e.kv_capacity_tokens = e.kv_blocks * e.block_size
    e.gpu_memory_utilization = _number(labels, "gpu_memory_utilization", invalid, upper=1.0)


_MAX, _SUM, _FINISHED = 0, 1, 2  # what a _Recipe step does with its value
_GAUGES = ((RUNNING, "running"), (WAITING, "waiting"))
_COUNTERS = (
    (PREEMPTIONS, "preemptions"),
    (PROMPT_TOKENS, "prompt_tokens"),
    (GENERATION_TOKENS, "generation_tokens"),
    (f"{PROMPT_HIST}_sum", "prompt_sum"),
    (f"{PROMPT_HIST}_count", "prompt_count"),
    (f"{GENERATION_HIST}_sum", "generation_sum"),
    (f"{GENERATION_HIST}_count", "generation_count"),
)
_CACHE_ATTRS = ("kv_blocks", "block_size", "kv_capacity_tokens", "gpu_memory_utilization")
_Folds = tuple[tuple[str, tuple[int, ...]], ...]  # (attribute or reason, positions of its values)


class _Recipe:
    """VllmCollector.reading_from compiled for one page shape (a ShapedParser plan): which
    engine each sample belongs to and what its value does there, worked out once per shape
    rather than sample by sample on every poll (a DP=2 page: ~85 us of Samples and lookups
    before, 16 pages a poll at node scale). Steps run in reading_from's order, with its
    arithmetic, so the result is the same to the bit.

    Only a page whose read values are all finite and not negative is read this way: a NaN or a
    negative sample is dropped by parse() or reading_from, and what is dropped changes which
    engines there are; such a page (never a healthy vLLM's) returns None and takes
    reading_from itself."""

    def __init__(self, plan: ShapePlan) -> None:
        samples = dict(plan)  # sample name -> [(labels, value index)]
        keys: dict[tuple[str, str], int] = {}  # engine (model_name, engine) -> its number

        def engine_of(labels: dict[str, str]) -> int:
            return keys.setdefault(
                (labels.get("model_name", ""), labels.get("engine", "0")), len(keys)
            )

        steps: list[tuple[int, int, int, str]] = []  # (value index, engine, what, attr/reason)
        for labels, at in samples.get(KV_USAGE, ()):
            steps.append((at, engine_of(labels), _MAX, "kv_usage"))
        current = {engine_of(labels) for labels, _ in samples.get(KV_USAGE, ())}
        for labels, at in samples.get(KV_USAGE_LEGACY, ()):
            if (n := engine_of(labels)) not in current:  # only where the current one is absent
                steps.append((at, n, _MAX, "kv_usage"))
        for name, attr in _GAUGES:
            steps += [(at, engine_of(labels), _MAX, attr) for labels, at in samples.get(name, ())]
        for name, attr in _COUNTERS:
            steps += [(at, engine_of(labels), _SUM, attr) for labels, at in samples.get(name, ())]
        for labels, at in samples.get(FINISHED, ()):
            steps.append((at, engine_of(labels), _FINISHED, labels.get("finished_reason", "")))
        # cache_config_info's figures are its labels: applied once here, copied on each read
        scratch: dict[int, EngineReading] = {}
        self.invalid: Counter[str] = Counter()
        config_at: list[int] = []
        for labels, at in samples.get(CACHE_CONFIG, ()):
            index = labels.get("engine", "0")
            for n in [n for key, n in keys.items() if key[1] == index] or [engine_of(labels)]:
                e = scratch.setdefault(n, EngineReading("", ""))
                _apply_cache_config(e, labels, self.invalid)
            config_at.append(at)  # not read, but a NaN would drop the sample: checked
        self.keys = list(keys)
        self.steps = steps
        # each engine's cache figures, given to its EngineReading as it is made (no step
        # touches them: the same as applying them after the steps, as reading_from does)
        self.figures = [
            {a: getattr(scratch[n], a) for a in _CACHE_ATTRS} if n in scratch else {}
            for n in range(len(keys))
        ]
        self.read_at = sorted({at for at, *_ in steps} | set(config_at))
        self.order = sorted(range(len(self.keys)), key=lambda n: self.keys[n])
        # the steps by engine and attribute (reason), each a run of positions in read_at, in
        # step order: an attribute's fold depends on its own values only, so each is folded
        # apart, in one pass, with the same arithmetic (no getattr/setattr per step)
        position = {at: i for i, at in enumerate(self.read_at)}
        self.folds: list[tuple[_Folds, _Folds, _Folds]] = []
        for n in range(len(self.keys)):
            by: tuple[dict[str, list[int]], ...] = ({}, {}, {})  # _MAX, _SUM, _FINISHED
            for at, m, what, attr in steps:
                if m == n:
                    by[what].setdefault(attr, []).append(position[at])
            maxes, sums, finished = (tuple((a, tuple(ps)) for a, ps in d.items()) for d in by)
            self.folds.append((maxes, sums, finished))

    def read(self, values: list[str]) -> VllmReading | None:
        raws = [values[at] for at in self.read_at]
        if "_" in " ".join(raws):  # as parse() reads a value: Python's float() takes "1_0"
            return None
        try:
            read = list(map(float, raws))
        except ValueError:
            return None
        # a finite sum has no NaN or infinity in it (a sum that overflows is refused too)
        total = sum(read)
        if not (total == total and total < math.inf and (not read or min(read) >= 0.0)):
            return None  # NaN, infinite or negative: reading_from says what is dropped
        if not self.keys:
            return None  # no engine: reading_from's no_data
        engines = []
        for (model, index), figures, (maxes, sums, finished) in zip(
            self.keys, self.figures, self.folds, strict=True
        ):
            fields = dict(figures)
            for attr, positions in maxes:  # reading_from: the first, then max(current, value)
                value = read[positions[0]]
                for p in positions[1:]:
                    value = max(value, read[p])
                fields[attr] = value
            for attr, positions in sums:  # reading_from: (current or 0.0) + value, in order
                value = 0.0
                for p in positions:
                    value = value + read[p]
                fields[attr] = value
            done: dict[str, float] = {}
            for reason, positions in finished:
                value = 0.0
                for p in positions:
                    value = value + read[p]
                done[reason] = value
            engines.append(EngineReading(model_name=model, engine=index, finished=done, **fields))
        reading = VllmReading()
        if self.invalid:
            reading.invalid.update(self.invalid)
        for e in engines:
            if e.kv_usage is not None and not 0.0 <= e.kv_usage <= 1.0:
                reading.invalid["out_of_range"] += 1
                e.kv_usage = None
        reading.engines = [engines[n] for n in self.order]
        return reading


class VllmCollector:
    name = "vllm"

    def __init__(
        self,
        target: str,
        url: str,
        timeout: float = 2.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.max_bytes = max_bytes
        self.target = target
        self.url = url
        self.timeout = timeout
        self._scraper = Scraper(
            url, timeout, max_bytes, names=WANTED, filtered_url=filtered_url(url)
        )
        self._parser = ShapedParser(WANTED)  # this server's page, read by its shape
        self._recipe: tuple[ShapePlan, _Recipe] | None = None  # for the parser's current plan

    def close(self) -> None:
        self._scraper.close()

    def collect(self) -> VllmReading:
        try:
            return self._collect()
        except CollectorError as exc:
            # a filtered answer that is not a vLLM page (a server whose /metrics/ is something
            # else): the configured URL from now on, asked at once
            if exc.reason not in ("no_data", "parse_error") or not self._scraper.filtered:
                raise
            self._scraper.unfilter(f"its filtered answer did not read ({exc.reason})")
            return self._collect()

    def _collect(self) -> VllmReading:
        text, content_type = self._scraper.get()
        return self.read(text, content_type)

    def read(self, text: str, content_type: str = "") -> VllmReading:
        """The reading of one page: by its shape's recipe when the page is of a learnt shape
        (poll after poll), else parsed and read sample by sample. Raises CollectorError."""
        openmetrics = is_openmetrics(content_type)
        shaped = None if openmetrics else self._parser.shaped(text)
        if shaped is not None:
            plan, values = shaped
            if self._recipe is None or self._recipe[0] is not plan:
                self._recipe = (plan, _Recipe(plan))
            reading = self._recipe[1].read(values)
            if reading is not None:
                return reading
        return self.reading_from(self._parser.parse(text, openmetrics=openmetrics))

    @staticmethod
    def reading_from(parsed: Parsed) -> VllmReading:
        reading = VllmReading()
        reading.invalid.update(parsed.dropped)
        engines: dict[tuple[str, str], EngineReading] = {}

        def engine_of(labels: dict[str, str]) -> EngineReading:
            key = (labels.get("model_name", ""), labels.get("engine", "0"))
            if key not in engines:
                engines[key] = EngineReading(model_name=key[0], engine=key[1])
            return engines[key]

        def gauge(name: str, attr: str) -> None:
            for s in parsed.get(name):
                if s.value < 0:  # request counts and KV usage are never negative
                    reading.invalid["negative"] += 1
                    continue
                e = engine_of(s.labels)
                current = getattr(e, attr)
                setattr(e, attr, s.value if current is None else max(current, s.value))

        def counter(name: str, attr: str) -> None:
            for s in parsed.get(name):
                if s.value < 0:
                    reading.invalid["negative"] += 1
                    continue
                e = engine_of(s.labels)
                setattr(e, attr, (getattr(e, attr) or 0.0) + s.value)

        gauge(KV_USAGE, "kv_usage")
        # the legacy gauge counts only for engines that do not report the current one
        current = {id(engine_of(s.labels)) for s in parsed.get(KV_USAGE)}
        for s in parsed.get(KV_USAGE_LEGACY):
            if s.value < 0:
                reading.invalid["negative"] += 1
                continue
            e = engine_of(s.labels)
            if id(e) not in current:
                e.kv_usage = s.value if e.kv_usage is None else max(e.kv_usage, s.value)
        gauge(RUNNING, "running")
        gauge(WAITING, "waiting")
        counter(PREEMPTIONS, "preemptions")
        counter(PROMPT_TOKENS, "prompt_tokens")
        counter(GENERATION_TOKENS, "generation_tokens")
        counter(f"{PROMPT_HIST}_sum", "prompt_sum")
        counter(f"{PROMPT_HIST}_count", "prompt_count")
        counter(f"{GENERATION_HIST}_sum", "generation_sum")
        counter(f"{GENERATION_HIST}_count", "generation_count")
        for s in parsed.get(FINISHED):
            if s.value < 0:
                reading.invalid["negative"] += 1
                continue
            e = engine_of(s.labels)
            reason = s.labels.get("finished_reason", "")
            e.finished[reason] = e.finished.get(reason, 0.0) + s.value
        # cache_config_info has no model_name label: it belongs to every model on that engine.
        for s in parsed.get(CACHE_CONFIG):
            index = s.labels.get("engine", "0")
            for e in [x for x in engines.values() if x.engine == index] or [engine_of(s.labels)]:
                _apply_cache_config(e, s.labels, reading.invalid)
        for e in engines.values():
            if e.kv_usage is not None and not 0.0 <= e.kv_usage <= 1.0:
                reading.invalid["out_of_range"] += 1
                e.kv_usage = None
        if not engines:
            raise CollectorError(
                "no_data", "no vllm: series in the response (is --disable-log-stats set?)"
            )
        reading.engines = sorted(engines.values(), key=lambda e: (e.model_name, e.engine))
        return reading

    def families(self, reading: VllmReading, out: FamilyBuilder) -> None:
        for e in reading.engines:
            labels = e.labels(self.target)
            out.add("oomguard_vllm_kv_cache_usage_ratio", labels, e.kv_usage)
            out.add("oomguard_vllm_requests_running", labels, e.running)
            out.add("oomguard_vllm_requests_waiting", labels, e.waiting)
            out.add("oomguard_vllm_preemptions_total", labels, e.preemptions)
            out.add("oomguard_vllm_prompt_tokens_total", labels, e.prompt_tokens)
            out.add("oomguard_vllm_generation_tokens_total", labels, e.generation_tokens)
            out.add("oomguard_vllm_kv_cache_blocks", labels, e.kv_blocks)
            out.add("oomguard_vllm_kv_cache_block_size_tokens", labels, e.block_size)
            out.add("oomguard_vllm_kv_cache_capacity_tokens", labels, e.kv_capacity_tokens)
            out.add("oomguard_vllm_gpu_memory_utilization_ratio", labels, e.gpu_memory_utilization)
            for reason, value in sorted(e.finished.items()):
                out.add("oomguard_vllm_requests_finished_total", (*labels, reason), value)
