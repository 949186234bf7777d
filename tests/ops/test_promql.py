"""Every PromQL query in dashboards and rules selects only metrics defined in METRICS,
with the labels and label values the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from turnrouter.ops import (
    ALERTS,
    RECORDING_RULES,
    Selector,
    dashboards,
    exposed_series_names,
    grouping_labels,
    le_regex,
    le_value,
    metric_names,
    queries,
    selectors,
)
from turnrouter.telemetry import METRICS, MetricSpec

from .conftest import DEPLOY, ROOT

#: `up` is Prometheus' own series of every target (the availability alerts read it).
ALLOWED = exposed_series_names() | {"up"}
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
    """Alerts read METRICS series or series recorded by the rule file (the watchdog,
    `vector(1)`, reads none)."""
    names = metric_names(alert.expr)  # type: ignore[attr-defined]
    if alert.alert == "TurnrouterWatchdog":  # type: ignore[attr-defined]
        assert names == set()
        return
    assert names and names <= ALLOWED | RECORDED, sorted(names - ALLOWED - RECORDED)


# -- labels: every checked-in panel, rule and promtool input series ------------------

#: Added by Prometheus at scrape time (job, instance) or by the deployment's target
#: labels (cluster, namespace: the group labels the rules aggregate by).
TARGET_LABELS = frozenset({"job", "instance", "cluster", "namespace"})


def _label_values() -> dict[tuple[str, str], frozenset[str]]:
    """(metric, label) -> the values the code emits, where that set is closed."""
    from typing import get_args

    from turnrouter import MergeStrategy
    from turnrouter.events import (
        AcknowledgmentOutcome,
        AcknowledgmentTrigger,
        ClarificationReason,
        FailureStage,
        FocusTransition,
        PatchOutcome,
        TurnOutcome,
    )
    from turnrouter.telemetry import INELIGIBLE_REASONS

    def of(literal: object) -> frozenset[str]:
        return frozenset(get_args(literal))

    admission = frozenset({"accept", "decline", "clarify", "release", "timeout", "error",
                           "interrupted"})
    values = {
        ("turnrouter_turns_total", "outcome"): of(TurnOutcome),
        ("turnrouter_turn_duration_seconds", "outcome"): of(TurnOutcome),
        ("turnrouter_clarifications_total", "reason"): of(ClarificationReason),
        ("turnrouter_admissions_total", "disposition"): admission,
        ("turnrouter_admissions_total", "focused"): frozenset({"true", "false"}),
        ("turnrouter_failures_total", "stage"): of(FailureStage),
        ("turnrouter_focus_transitions_total", "transition"): of(FocusTransition),
        ("turnrouter_acknowledgments_total", "outcome"): of(AcknowledgmentOutcome),
        ("turnrouter_acknowledgments_total", "trigger"): of(AcknowledgmentTrigger),
        ("turnrouter_needless_acknowledgments_total", "trigger"): of(AcknowledgmentTrigger),
        ("turnrouter_context_patches_total", "strategy"): frozenset(
            strategy.value for strategy in MergeStrategy),
        ("turnrouter_context_patches_total", "outcome"): of(PatchOutcome),
        ("turnrouter_ineligible_routes_total", "reason"): INELIGIBLE_REASONS | {"other"},
    }
    for spec in METRICS:
        if spec.buckets is not None:
            values[(spec.name, "le")] = frozenset(
                [*(le_value(bound) for bound in spec.buckets), "+Inf"])
    return values


LABEL_VALUES = _label_values()


def _family(series: str) -> MetricSpec | None:
    """The METRICS family exposing `series` (a histogram's `_bucket`/`_sum`/`_count`)."""
    for spec in METRICS:
        if series == spec.name or (spec.type == "histogram" and series in {
                spec.name + suffix for suffix in ("_bucket", "_sum", "_count")}):
            return spec
    return None


def _labels_of(series: str) -> frozenset[str] | None:
    """Labels a METRICS series carries (with the target labels); None if not ours."""
    spec = _family(series)
    if spec is None:
        return None
    le = {"le"} if series.endswith("_bucket") and spec.type == "histogram" else set()
    return frozenset(spec.labels) | TARGET_LABELS | le


def _literal_alternatives(operator: str, value: str) -> list[str] | None:
    """The literal values a matcher names, or None when it is a pattern or a variable."""
    if "$" in value:
        return None
    if operator in ("=", "!="):
        return [value]
    if re.fullmatch(r"[\w.+]+(\|[\w.+]+)*", value):
        return value.split("|")
    return None


def _label_problems(expr: str, recorded: dict[str, frozenset[str]]) -> list[str]:
    """What in `expr` names a label (or label value) the exported series do not have."""
    problems: list[str] = []
    available: set[str] = set(TARGET_LABELS)
    foreign = False
    for selector in selectors(expr):
        if not selector.name:
            continue
        labels = recorded.get(selector.name) or _labels_of(selector.name)
        if labels is None:  # the NATS runtime's families (tests/nats checks their names)
            foreign = True
            continue
        available |= labels
        spec = _family(selector.name)
        for label, operator, value in selector.matchers:
            if label not in labels:
                problems.append(f"{selector.name} has no label {label!r}")
                continue
            known = LABEL_VALUES.get((spec.name, label)) if spec else None
            literals = _literal_alternatives(operator, value)
            if known is not None and literals is not None:
                problems.extend(f"{selector.name}{{{label}={literal!r}}} is never exported"
                                for literal in literals if literal not in known)
    # label_replace(v, "dst", "replacement", "src", "regex") adds `dst`.
    available |= set(re.findall(
        r"""["']([A-Za-z_]\w*)["'],\s*["'][^"']*["'],\s*["'][^"']*["'],\s*["'][^"']*["']\s*\)""",
        expr))
    if not foreign:
        problems.extend(f"groups by {label!r}, which no selected series has"
                        for label in sorted(grouping_labels(expr) - available))
    return problems


def _rule_files() -> list[Path]:
    return sorted(DEPLOY.glob("prometheus/rules*/*.yml"))


def _rules() -> list[tuple[str, dict[str, Any]]]:
    """Every rule of every checked-in rule file and PrometheusRule, with where it is."""
    import yaml

    found: list[tuple[str, dict[str, Any]]] = []
    for path in _rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            found.extend((f"{path.relative_to(ROOT)}", rule) for rule in group["rules"])
    for path in DEPLOY.glob("k8s/**/prometheusrule*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for group in doc["spec"]["groups"]:
                found.extend((f"{path.relative_to(ROOT)}", rule) for rule in group["rules"])
    return found


RULES = _rules()


def _recorded() -> dict[str, frozenset[str]]:
    """Recorded series -> the labels their rules keep (`by` lists; job and instance)."""
    out: dict[str, frozenset[str]] = {}
    for _, rule in RULES:
        if "record" in rule:
            out[rule["record"]] = out.get(rule["record"], frozenset()) | frozenset(
                grouping_labels(rule["expr"])) | TARGET_LABELS | frozenset(
                rule.get("labels", {}))
    return out


RECORDED_LABELS = _recorded()


def _checked_in_dashboards() -> list[tuple[str, dict[str, Any]]]:
    """Every checked-in Grafana dashboard: dashboards/, the fleet's, the ConfigMap's."""
    import yaml

    found = [(str(path.relative_to(ROOT)), json.loads(path.read_text()))
             for path in sorted([*(ROOT / "dashboards").glob("*.json"),
                                 *DEPLOY.glob("k8s/**/*.json")])]
    for path in DEPLOY.glob("k8s/**/dashboards-configmap.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            found.extend((f"{path.relative_to(ROOT)}:{key}", json.loads(text))
                         for key, text in doc["data"].items())
    return found


DASHBOARD_QUERIES = [(f"{file}:{where}", expr) for file, model in _checked_in_dashboards()
                     for where, expr in queries(model)]


def test_every_checked_in_artefact_is_found() -> None:
    """The label checks below read every dashboard and rule file that ships."""
    files = {where.split(":")[0] for where, _ in DASHBOARD_QUERIES}
    assert {"dashboards/turnrouter-overview.json",
            "dashboards/turnrouter-acknowledgment-tuning.json",
            "deploy/k8s/nats/turnrouter-fleet.json",
            "deploy/k8s/base/dashboards-configmap.yaml"} <= files
    rule_files = {where for where, _ in RULES}
    assert {"deploy/prometheus/rules/turnrouter.rules.yml",
            "deploy/k8s/base/prometheusrule.yaml",
            "deploy/prometheus/rules-nats/turnrouter-nats.rules.yml",
            "deploy/k8s/nats/prometheusrule-nats.yaml"} <= rule_files
    assert {record for record in RECORDED_LABELS} == {rule.record for rule in RECORDING_RULES}


@pytest.mark.parametrize(("where", "expr"), [
    pytest.param(where, expr, id=where) for where, expr in DASHBOARD_QUERIES])
def test_dashboard_query_uses_only_exported_labels(where: str, expr: str) -> None:
    """Each panel and variable of every shipped dashboard matches and groups by labels
    (and label values) the code exports."""
    assert _label_problems(expr, {}) == [], f"{where}: {expr}"


@pytest.mark.parametrize(("where", "rule"), [
    pytest.param(where, rule, id=f"{where}:{rule.get('record') or rule.get('alert')}")
    for where, rule in RULES])
def test_rule_uses_only_exported_labels(where: str, rule: dict[str, Any]) -> None:
    """Each recording rule and alert of every shipped rule file matches and groups by
    labels (and label values) the code exports or the recording rules keep."""
    assert _label_problems(rule["expr"], RECORDED_LABELS) == [], f"{where}: {rule['expr']}"


def _input_series() -> list[tuple[str, str]]:
    import yaml

    found: list[tuple[str, str]] = []
    for path in sorted(DEPLOY.glob("prometheus/tests*/*.yml")):
        for test in yaml.safe_load(path.read_text())["tests"]:
            found.extend((f"{path.relative_to(ROOT)}:{test['name']}", series["series"])
                         for series in test.get("input_series", []))
    return found


@pytest.mark.parametrize(("where", "series"), [
    pytest.param(where, series, id=f"{where}:{series}") for where, series in _input_series()])
def test_promtool_input_series_look_like_the_exposition(where: str, series: str) -> None:
    """The promtool tests feed the rules turnrouter series with exactly the labels the
    code exports (all of them, plus job/instance) and values it can emit: a rule tested
    on a series shape that never occurs proves nothing."""
    (selector,) = selectors(series)
    expected = _labels_of(selector.name)
    if expected is None:
        return  # the NATS runtime's families (tests/nats checks those)
    labels = {label for label, _, _ in selector.matchers}
    missing = (expected - TARGET_LABELS) - labels
    assert labels - expected == set(), where
    assert missing == frozenset(), where
    assert _label_problems(series, {}) == [], where


def test_selectors_read_matchers_and_grouping_lists() -> None:
    """selectors() gives each selector's matchers (variables kept); grouping_labels()
    the by/on lists' labels."""
    expr = ('sum by (job, le) (rate(h_bucket{route=~"$route", le="0.5"}[$__rate_interval]))'
            ' / on (job) group_left () (b{x="}"} > $max)')
    assert selectors(expr) == [
        Selector("h_bucket", (("route", "=~", "$route"), ("le", "=", "0.5"))),
        Selector("b", (("x", "=", "}"),))]
    assert grouping_labels(expr) == {"job", "le"}
    with pytest.raises(ValueError, match="matcher"):
        selectors("a{route}")


def test_label_check_reports_unknown_labels_and_values() -> None:
    """The label check catches a label a family lacks, a value never emitted, a bucket
    bound that does not exist and a grouping label no series has."""
    problems = _label_problems(
        'sum by (stage) (rate(turnrouter_turns_total{outcome="answered", pod="p"}[5m]))'
        ' + sum(rate(turnrouter_silence_seconds_bucket{le=~"0.5|0.33"}[5m]))', {})
    assert problems == [
        "turnrouter_turns_total{outcome='answered'} is never exported",
        "turnrouter_turns_total has no label 'pod'",
        "turnrouter_silence_seconds_bucket{le='0.33'} is never exported",
        "groups by 'stage', which no selected series has",
    ]
