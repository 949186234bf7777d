"""Every PromQL query in dashboards and rules selects only metrics defined in METRICS."""

from __future__ import annotations

import pytest

from turnrouter.ops import (
    ALERTS,
    RECORDING_RULES,
    dashboards,
    exposed_series_names,
    le_regex,
    le_value,
    metric_names,
    queries,
)

ALLOWED = exposed_series_names()
RECORDED = frozenset(rule.record for rule in RECORDING_RULES)


@pytest.mark.parametrize(("expr", "names"), [
    ("rate(a_total[5m])", {"a_total"}),
    ('sum by (job, le) (rate(h_bucket{route=~"$route", le="0.5"}[$__rate_interval]))',
     {"h_bucket"}),
    ("a / on (job) group_left () (b > 0)", {"a", "b"}),
    ("a / ignoring (le) group_left sum(b)", {"a", "b"}),
    ("histogram_quantile(0.95, sum without (pod) (rate(x_bucket[1m])))", {"x_bucket"}),
    ('clamp_min(a{x="}"} - b offset 5m, 0) and on() vector(1)', {"a", "b"}),
    ("turnrouter:clarification_ratio:rate5m > 0.1", {"turnrouter:clarification_ratio:rate5m"}),
    ("1 - 2e-3 * 1.5", set()),
])
def test_metric_names_finds_selected_metrics_only(expr: str, names: set[str]) -> None:
    """The lexer returns the metric names and skips labels, functions and keywords."""
    assert metric_names(expr) == names


def test_metric_names_rejects_unbalanced_input() -> None:
    """An unterminated matcher is an error, not a silent pass."""
    with pytest.raises(ValueError, match="missing"):
        metric_names('rate(a{job="x"[5m])')


def test_unknown_function_counts_as_a_metric_name() -> None:
    """A misspelt function shows up as an unknown name (so the checks below catch it)."""
    assert metric_names("rat(a[5m])") == {"rat", "a"}


def test_exposed_names_include_histogram_parts() -> None:
    """Histograms expose _bucket, _sum and _count; counters keep _total."""
    assert {"turnrouter_first_response_seconds_bucket", "turnrouter_turns_total",
            "turnrouter_first_response_seconds_count"} <= ALLOWED
    assert "turnrouter_first_response_seconds" not in ALLOWED


def test_le_values_match_prometheus_client() -> None:
    """Bucket bounds are written the way prometheus_client exposes them."""
    assert [le_value(b) for b in (0.05, 1.0, 10.0)] == ["0.05", "1.0", "10.0"]
    assert le_regex([0.5, 1.0]) == "0.5|1.0"


@pytest.mark.parametrize(
    ("where", "expr"),
    [pytest.param(w, e, id=f"{n}:{w}") for n, m in dashboards().items() for w, e in queries(m)])
def test_dashboard_query_references_only_metrics(where: str, expr: str) -> None:
    """Dashboard queries use only series exposed by METRICS (no recording rules)."""
    names = metric_names(expr)
    assert names, f"{where}: no metric in {expr!r}"
    assert names <= ALLOWED, f"{where}: unknown {sorted(names - ALLOWED)}"


@pytest.mark.parametrize("rule", RECORDING_RULES, ids=lambda r: r.record)
def test_recording_rule_references_only_metrics(rule: object) -> None:
    """Recording rules read only series exposed by METRICS."""
    names = metric_names(rule.expr)  # type: ignore[attr-defined]
    assert names and names <= ALLOWED, sorted(names - ALLOWED)


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.alert}-{a.severity}")
def test_alert_references_only_metrics_and_recorded_series(alert: object) -> None:
    """Alerts read METRICS series or series recorded by the rule file."""
    names = metric_names(alert.expr)  # type: ignore[attr-defined]
    assert names and names <= ALLOWED | RECORDED, sorted(names - ALLOWED - RECORDED)
