"""Which labels a PromQL expression's series carry, worked out from the expression itself.

Used to check that a dashboard link or filter, an Alertmanager grouping or inhibition, or a
runbook's query names a label the series really have. The labels of a selected metric come from
the catalog (oomguard's own), from the vLLM fixture (vLLM's), from the recording rules (worked out
the same way), plus the labels a scrape adds on Kubernetes (`manifests.scrape_labels`) and the
cluster label. The expression is taken apart the way Prometheus evaluates it, for the forms the
rules and panels use: aggregations (`by`, `without`), binary operators with `on`/`ignoring`/
`group_left` (one-to-one arithmetic with `on (...)` keeps only those labels, as Prometheus does),
set operators, functions. `or` yields the labels both sides carry.
"""

from __future__ import annotations

import re
from functools import cache

from oomguard.alerts.rules import all_recording_rules
from oomguard.catalog import CATALOG
from oomguard.manifests import kubernetes as k8s
from oomguard.thresholds import AlertThresholds
from tests.conftest import VLLM_FIXTURE

T = AlertThresholds()
ANY = frozenset({"*"})  # ALERTS: whatever labels the alerts have

_AGGS = {"sum", "max", "min", "avg", "count", "group", "stddev", "stdvar"}
_KEEP_FIRST_ARG = {
    "rate",
    "irate",
    "increase",
    "delta",
    "idelta",
    "deriv",
    "resets",
    "changes",
    "abs",
    "ceil",
    "floor",
    "round",
    "clamp",
    "clamp_min",
    "clamp_max",
    "timestamp",
    "sort",
    "sort_desc",
    "last_over_time",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "sum_over_time",
    "count_over_time",
    "present_over_time",
    "quantile_over_time",
}
# lowest precedence first (Prometheus: or < and/unless < comparison < +,- < *,/,% < ^)
_LEVELS = (
    ("or",),
    ("and", "unless"),
    ("==", "!=", ">=", "<=", ">", "<"),
    ("+", "-"),
    ("*", "/", "%"),
    ("^",),
)
_WORD_OPS = {"or", "and", "unless"}
_MODIFIER = re.compile(
    r"\s*(?:bool\s*)?(?:(on|ignoring)\s*\(([^)]*)\))?\s*(?:(group_left|group_right)\s*(?:\(([^)]*)\))?)?"
)


def _names(text: str | None) -> set[str]:
    return {n.strip() for n in (text or "").split(",") if n.strip()}


def scrape(component: str) -> set[str]:
    """Labels a scrape adds to a component's series, on Kubernetes and on one box."""
    objects = {
        "exporter": k8s.exporter(T),
        "remediator": k8s.remediator(T),
        "vllm": k8s.vllm_example(T),
    }[component]
    return set(k8s.scrape_labels(objects, "pod-0")) | {"job", "instance", T.cluster_label}


@cache
def _vllm_labels() -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for line in VLLM_FIXTURE.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        inner = line.split("{", 1)[1].rsplit("}", 1)[0] if "{" in line else ""
        out.setdefault(name, set()).update(re.findall(r'(\w+)="', inner))
    return {k: frozenset(v) for k, v in out.items()}


@cache
def carried(metric: str) -> frozenset[str]:
    """The labels every series of `metric` carries (as scraped on Kubernetes)."""
    if metric in CATALOG:
        spec = CATALOG[metric]
        component = "remediator" if spec.component == "remediator" else "exporter"
        if spec.component == "plugin":
            component = "vllm"
        return frozenset(set(spec.labels) | scrape(component))
    vllm = _vllm_labels()
    if metric in vllm:
        return frozenset(vllm[metric] | scrape("vllm"))
    recorded = {r.record: r.expr for r in all_recording_rules(T)}
    if metric in recorded:
        return labels(recorded[metric])
    if metric == "up":
        return frozenset(scrape("exporter"))
    if metric == "ALERTS":
        return ANY
    if metric.startswith("kube_"):  # kube-state-metrics: resolved by its own table
        from tests.kube_state_metrics import KSM_LABELS

        return frozenset(KSM_LABELS[metric] | scrape("exporter"))
    if metric.startswith("alertmanager_"):
        return frozenset({"integration", "job", "instance", T.cluster_label})
    raise KeyError(f"no label set known for {metric!r}")


def _strip_outer(expr: str) -> str:
    expr = expr.strip()
    while expr.startswith("(") and _close(expr, 0) == len(expr) - 1:
        expr = expr[1:-1].strip()
    return expr


def _close(expr: str, start: int) -> int:
    """Index of the bracket closing the one at `start`."""
    opener = expr[start]
    closer = {"(": ")", "{": "}", "[": "]"}[opener]
    depth, i = 0, start
    while i < len(expr):
        c = expr[i]
        if c == '"':
            i = _string_end(expr, i) + 1
            continue
        if c == opener:
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced {opener} in {expr!r}")


def _string_end(expr: str, i: int) -> int:
    j = i + 1
    while expr[j] != '"':
        j += 2 if expr[j] == "\\" else 1
    return j


def _top_level(expr: str) -> list[tuple[int, str]]:
    """(position, operator) of the binary operators outside any bracket or string."""
    out: list[tuple[int, str]] = []
    depth, i = 0, 0
    prev_operand = False  # a '-' right after an operator is a sign, not a subtraction
    while i < len(expr):
        c = expr[i]
        if c == '"':
            i = _string_end(expr, i) + 1
            prev_operand = True
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            prev_operand = True
        elif depth == 0:
            two = expr[i : i + 2]
            word = re.match(r"(or|and|unless)\b", expr[i:])
            if word and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
                out.append((i, word.group(1)))
                i += len(word.group(1))
                prev_operand = False
                continue
            if two in ("==", "!=", ">=", "<="):
                out.append((i, two))
                i += 2
                prev_operand = False
                continue
            if c in "><+*/%^" or (c == "-" and prev_operand):
                out.append((i, c))
                prev_operand = False
                i += 1
                continue
            if not c.isspace():
                prev_operand = True
        i += 1
    return out


def labels(expr: str, best: bool = False) -> frozenset[str]:
    """The labels the series of `expr` carry: every series (`or` yields what both sides carry),
    or with `best` the most a series can carry (`or` yields the union: an alert that carries
    a label wherever it is known, as a page carries its engine's model)."""
    expr = _strip_outer(expr)
    ops = _top_level(expr)
    for level in _LEVELS:
        at = [(i, op) for i, op in ops if op in level]
        if at:
            i, op = at[-1]  # left-associative: split at the last one
            left = expr[:i]
            rest = expr[i + len(op) :]
            mod = _MODIFIER.match(rest)
            assert mod is not None
            right = rest[mod.end() :]
            on_kind, on_labels, group, extra = mod.groups()
            lhs, rhs = labels(left, best), labels(right, best)
            if op == "or":
                if ANY in (lhs, rhs):
                    return lhs if rhs == ANY else rhs
                return lhs | rhs if best else lhs & rhs
            if op in ("and", "unless"):
                return lhs
            if group == "group_left":
                return lhs | _names(extra)
            if group == "group_right":
                return rhs | _names(extra)
            if not lhs:  # a scalar on the left: the vector's labels
                return rhs
            if not rhs:
                return lhs
            if on_kind == "on":
                return frozenset(_names(on_labels))
            if on_kind == "ignoring":
                return lhs - _names(on_labels)
            return lhs
    return _term(expr, best)


def _term(expr: str, best: bool = False) -> frozenset[str]:
    if re.fullmatch(r"-?[0-9.eE+]+", expr) or expr.startswith("time()"):
        return frozenset()
    m = re.match(r"(\w+)\s*(by|without)?\s*(?:\(([^)]*)\))?\s*\(", expr)
    if m and m.group(1) in _AGGS | {"topk", "bottomk", "quantile"}:
        name, clause, clause_labels = m.groups()
        body_start = m.end() - 1
        body = expr[body_start + 1 : _close(expr, body_start)]
        tail = expr[_close(expr, body_start) + 1 :].strip()
        tail_clause = re.match(r"(by|without)\s*\(([^)]*)\)", tail)
        if tail_clause:
            clause, clause_labels = tail_clause.groups()
        if name in ("topk", "bottomk", "quantile"):
            inner = labels(body.split(",", 1)[1], best)
            if not clause:
                return inner
        else:
            inner = labels(body, best)
        if clause == "by":
            return frozenset(_names(clause_labels))
        if clause == "without":
            return inner - _names(clause_labels)
        return frozenset()
    m = re.match(r"(\w+)\s*\(", expr)
    if m and not expr[: m.end()].startswith(("{",)):
        name = m.group(1)
        start = m.end() - 1
        body = expr[start + 1 : _close(expr, start)]
        if name == "vector" or name == "scalar":
            return frozenset()
        if name == "histogram_quantile":
            return labels(body.split(",", 1)[1], best) - {"le"}
        if name == "label_replace":
            args = body.split(",")
            return labels(args[0], best) | {args[1].strip().strip('"')}
        if name == "absent":
            return frozenset(re.findall(r'(\w+)="', body))
        if name in _KEEP_FIRST_ARG:
            first = body
            if name in ("clamp", "clamp_min", "clamp_max", "quantile_over_time"):
                first = body.rsplit(",", 1)[0] if name != "quantile_over_time" else body
                if name == "quantile_over_time":
                    first = body.split(",", 1)[1]
            return labels(first, best)
        raise ValueError(f"function {name} not modelled in {expr!r}")
    m = re.match(r"([a-zA-Z_:][\w:]*)", expr)
    if m:
        return carried(m.group(1))
    raise ValueError(f"cannot read the labels of {expr!r}")


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: matcher text}) of every vector selector in the expression."""
    out = []
    for m in re.finditer(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        matchers = dict(re.findall(r'(\w+)\s*(?:=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")', m.group(2)))
        out.append((m.group(1), matchers))
    return out
