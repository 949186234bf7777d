"""A small PromQL lexer: which metric names does a query select?

Good enough for the queries turnrouter generates (and for hand-written ones in the same
style); a real Prometheus server parses every one of them in the integration tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client.utils import floatToGoString

from ..telemetry import METRICS, MetricSpec

__all__ = [
    "HISTOGRAM_SUFFIXES",
    "Selector",
    "exposed_series_names",
    "grouping_labels",
    "le_regex",
    "le_value",
    "metric_names",
    "selectors",
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
        elif (skipped := _skip_literal(expr, i)) is not None:
            i = skipped
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


class Selector(NamedTuple):
    """One vector selector of a query: the metric name and its label matchers, each
    `(label, operator, value)` (operator `=`, `!=`, `=~` or `!~`; value unquoted)."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]


_MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*")
_LABEL_LIST = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _matchers(expr: str, i: int) -> tuple[tuple[tuple[str, str, str], ...], int]:
    """Parse the matchers of a `{...}` block whose `{` is at `i - 1`; return them and
    the index after `}`."""
    end = _skip_until(expr, i, "}")
    found: list[tuple[str, str, str]] = []
    while i < end - 1:
        match = _MATCHER.match(expr, i)
        if match is None:
            raise ValueError(f"unreadable label matcher at {expr[i:i + 40]!r} in {expr!r}")
        i = match.end()
        if i >= end - 1 or expr[i] not in "\"'`":
            raise ValueError(f"label matcher without a quoted value in {expr!r}")
        close = _skip_string(expr, i)
        found.append((match.group(1), match.group(2), expr[i + 1:close - 1]))
        i = close
        while i < end - 1 and (expr[i].isspace() or expr[i] == ","):
            i += 1
    return tuple(found), end


def _scan(expr: str) -> tuple[list[Selector], set[str]]:
    """The selectors of `expr` and the labels its `by`/`without`/`on`/`ignoring`/
    `group_left`/`group_right` lists name (the same walk as `metric_names`)."""
    found: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
        elif char == "$" and (variable := _VARIABLE.match(expr, i)) is not None:
            i = variable.end()
        elif char == "{":
            bare, i = _matchers(expr, i + 1)
            found.append(Selector("", bare))
        elif char == "[":
            i = _skip_until(expr, i + 1, "]")
        elif (skipped := _skip_literal(expr, i)) is not None:
            i = skipped
        elif (match := _IDENT.match(expr, i)) is not None:
            word = match.group()
            i = match.end()
            lowered = word.lower()
            j = i
            while j < len(expr) and expr[j].isspace():
                j += 1
            if lowered in _LABEL_LIST_KEYWORDS:
                if expr[j:j + 1] == "(":
                    i = _skip_until(expr, j + 1, ")")
                    grouping.update(_LABEL_LIST.findall(expr, j + 1, i - 1))
                continue
            if lowered in _KEYWORDS or word in _FUNCTIONS:
                continue
            matchers: tuple[tuple[str, str, str], ...] = ()
            if expr[j:j + 1] == "{":
                matchers, i = _matchers(expr, j + 1)
            found.append(Selector(word, matchers))
        else:
            i += 1
    return found, grouping


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of a PromQL expression, in order, with its label matchers
    (Grafana `$variables` outside strings are skipped; inside a matcher's value they are
    kept as written). Raises ValueError on unbalanced or unreadable input."""
    return _scan(expr)[0]


def grouping_labels(expr: str) -> set[str]:
    """The label names of an expression's `by`, `without`, `on`, `ignoring`,
    `group_left` and `group_right` lists."""
    return _scan(expr)[1]


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


def _skip_literal(expr: str, i: int) -> int | None:
    """Past a comment or a number (durations such as 5m, 1h30m included) at `i`; None
    when neither starts there."""
    char = expr[i]
    if char == "#":
        newline = expr.find("\n", i)
        return len(expr) if newline < 0 else newline
    if char.isdigit() or (char == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
        match = _NUMBER.match(expr, i)
        assert match is not None
        i = match.end()
        while i < len(expr) and expr[i].isalnum():
            i += 1
        return i
    return None
