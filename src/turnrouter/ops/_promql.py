"""A small PromQL lexer: which metric names does a query select?

Good enough for the queries turnrouter generates (and for hand-written ones in the same
style); a real Prometheus server parses every one of them in the integration tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.utils import floatToGoString

from ..telemetry import METRICS, MetricSpec

__all__ = [
    "HISTOGRAM_SUFFIXES",
    "exposed_series_names",
    "le_regex",
    "le_value",
    "metric_names",
]

#: Series a prometheus_client histogram family exposes, by suffix.
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp",
    "clamp_max", "clamp_min", "count_over_time", "day_of_month", "day_of_week", "delta",
    "deriv", "exp", "floor", "histogram_quantile", "holt_winters", "hour", "idelta",
    "increase", "irate", "label_join", "label_replace", "last_over_time", "ln", "log10",
    "log2", "max_over_time", "min_over_time", "minute", "month", "predict_linear",
    "present_over_time", "quantile_over_time", "rate", "resets", "round", "scalar", "sgn",
    "sort", "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time",
    "time", "timestamp", "vector", "year",
    # aggregations
    "avg", "bottomk", "count", "count_values", "group", "max", "min", "quantile", "stddev",
    "stdvar", "sum", "topk",
    # Grafana variable-query helpers
    "label_values", "metrics", "query_result",
})
_KEYWORDS = frozenset({
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan",
})
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left",
                                  "group_right"})
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(?:0[xX][0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")
_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def _skip_string(expr: str, i: int) -> int:
    quote = expr[i]
    i += 1
    while i < len(expr) and expr[i] != quote:
        i += 2 if expr[i] == "\\" and quote != "`" else 1
    if i >= len(expr):
        raise ValueError(f"unterminated string in {expr!r}")
    return i + 1


def _skip_until(expr: str, i: int, close: str) -> int:
    """Skip a `{...}` or `[...]` block (strings inside may contain the closer)."""
    while i < len(expr) and expr[i] != close:
        i = _skip_string(expr, i) if expr[i] in "\"'`" else i + 1
    if i >= len(expr):
        raise ValueError(f"missing {close!r} in {expr!r}")
    return i + 1


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label names, functions, keywords
    and Grafana `$variables` excluded). Raises ValueError on unbalanced input."""
    names: set[str] = set()
    expr = _VARIABLE.sub("1", expr)
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
        elif char == "{":
            i = _skip_until(expr, i + 1, "}")
        elif char == "[":
            i = _skip_until(expr, i + 1, "]")
        elif char == "#":
            newline = expr.find("\n", i)
            i = len(expr) if newline < 0 else newline
        elif char.isdigit() or (char == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
            match = _NUMBER.match(expr, i)
            assert match is not None
            i = match.end()
            while i < len(expr) and expr[i].isalnum():  # durations such as 5m, 1h30m
                i += 1
        elif (match := _IDENT.match(expr, i)) is not None:
            word = match.group()
            i = match.end()
            lowered = word.lower()
            if lowered in _LABEL_LIST_KEYWORDS:
                while i < len(expr) and expr[i].isspace():
                    i += 1
                if expr[i:i + 1] == "(":  # a label list, not an expression
                    i = _skip_until(expr, i + 1, ")")
                continue
            if lowered in _KEYWORDS or word in _FUNCTIONS:
                continue
            names.add(word)
        else:
            i += 1
    return names


def _series(specs: Iterable[MetricSpec]) -> frozenset[str]:
    out: set[str] = set()
    for spec in specs:
        if spec.type == "histogram":
            out.update(spec.name + suffix for suffix in HISTOGRAM_SUFFIXES)
        else:
            out.add(spec.name)
    return frozenset(out)


def exposed_series_names() -> frozenset[str]:
    """Every series name the `METRICS` families expose (histograms as their parts): what
    rules and dashboards may read."""
    return _series(METRICS)


def le_value(bound: float) -> str:
    """The `le` label value prometheus_client exposes for a bucket bound (`1.0`, `0.05`)."""
    value: str = floatToGoString(bound)  # type: ignore[no-untyped-call]
    return value


def le_regex(bounds: Iterable[float]) -> str:
    """A label regex matching these bucket bounds' `le` values.

    Dots are left unescaped (a backslash would need escaping again inside a PromQL
    string); `.` also matches itself, and no other `le` value of the family matches."""
    return "|".join(le_value(bound) for bound in bounds)
