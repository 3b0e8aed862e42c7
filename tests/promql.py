"""PromQL helpers for tests: find metric names in expressions, check syntax with promtool."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import yaml

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_NAME = re.compile(
    r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[|\)|$|\s|\n|>|<|=|-|\+|/|\*|,| offset)"
)
KEYWORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "rate",
    "increase",
    "delta",
    "deriv",
    "resets",
    "changes",
    "clamp_min",
    "clamp_max",
    "histogram_quantile",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "time",
    "vector",
    "scalar",
    "topk",
    "bottomk",
    "abs",
    "le",
    "bool",
    "absent",
    "label_replace",
    "group",
    "last_over_time",
    "count_over_time",
    "timestamp",
}


def substitute_grafana(expr: str) -> str:
    """Make a Grafana panel query plain PromQL: variables become match-all regexes."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    return re.sub(r"\$(\w+)", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label names inside by()/on() are excluded)."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    names = set()
    for m in _NAME.finditer(text):
        name = m.group(1)
        follows = text[m.end() : m.end() + 1]
        if name in KEYWORDS or follows == "(":
            continue
        if re.fullmatch(r"[0-9].*|e[0-9]*", name) or name in {"m", "h", "s", "d"}:
            continue
        names.add(name)
    return names


def promtool_parses(exprs: list[str]) -> str:
    """Returns promtool's output; raises AssertionError when any expression does not parse."""
    rules = {
        "groups": [
            {
                "name": "check",
                "rules": [{"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exprs.yaml"
        path.write_text(yaml.safe_dump(rules))
        r = subprocess.run(
            ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout
