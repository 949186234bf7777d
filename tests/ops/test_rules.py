"""The rule file: names, guards, annotations and runbook sections the design requires."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from turnrouter.ops import ALERTS, RECORDING_RULES, RULES_FILE, RUNBOOK_URL, rule_groups

from .conftest import ROOT

REQUIRED_RECORDS = {
    "turnrouter:clarification_ratio:rate5m",
    "turnrouter:first_response_seconds:p95_5m",
    "turnrouter:silence_seconds:p95_5m",
    "turnrouter:acknowledgment_ratio:rate5m",
}
REQUIRED_ALERTS = {
    "TurnrouterHighClarificationRate", "TurnrouterSlowFirstResponse", "TurnrouterDeadAir",
    "TurnrouterAcknowledgmentOveruse", "TurnrouterFailures", "TurnrouterDecisionSlow",
    "TurnrouterSaturated",
}


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _rules_on_disk() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / RULES_FILE).read_text())
    return loaded


def test_required_recording_rules_exist() -> None:
    """The four recording rules of docs/telemetry.md are defined."""
    assert {rule.record for rule in RECORDING_RULES} >= REQUIRED_RECORDS


def test_required_alerts_exist() -> None:
    """Every alert of the design exists; the clarification alert has two severities."""
    assert {alert.alert for alert in ALERTS} == REQUIRED_ALERTS
    clarification = [a for a in ALERTS if a.alert == "TurnrouterHighClarificationRate"]
    assert sorted(a.severity for a in clarification) == ["critical", "warning"]
    warning, critical = sorted(clarification, key=lambda a: a.threshold)
    assert warning.severity == "warning" and critical.severity == "critical"


def test_recording_rules_aggregate_by_route_where_required() -> None:
    """First-response p95 and acknowledgment ratio keep the route label."""
    by_name = {rule.record: rule.expr for rule in RECORDING_RULES}
    assert "route" in by_name["turnrouter:first_response_seconds:p95_5m"]
    assert "route" in by_name["turnrouter:acknowledgment_ratio:rate5m"]


@pytest.mark.parametrize("rule", RECORDING_RULES, ids=lambda r: r.record)
def test_every_division_has_a_positive_denominator_guard(rule: Any) -> None:
    """Ratios divide by `(... > 0)`, so an idle router records nothing instead of NaN."""
    if "/" in rule.expr:
        denominator = rule.expr.split("/", 1)[1]
        assert re.search(r"> 0\)\s*$", denominator), rule.expr


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.alert}-{a.severity}")
def test_alert_has_for_severity_and_annotations(alert: Any) -> None:
    """Each alert has a hold time, a severity, a summary, a description and a runbook link."""
    rendered = alert.as_dict()
    assert re.fullmatch(r"\d+m", rendered["for"])
    assert rendered["labels"]["severity"] in {"warning", "critical"}
    annotations = rendered["annotations"]
    assert annotations["summary"] and annotations["description"]
    assert annotations["runbook_url"] == f"{RUNBOOK_URL}#{alert.anchor}"


def test_every_runbook_anchor_exists_in_docs_runbook() -> None:
    """Each alert's runbook_url anchor is a heading in docs/runbook.md."""
    text = (ROOT / "docs" / "runbook.md").read_text()
    anchors = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    assert RUNBOOK_URL.endswith("/docs/runbook.md")
    assert sorted({a.anchor for a in ALERTS} - anchors) == []
    for alert in REQUIRED_ALERTS:
        assert f"## {alert}" in text


def test_rule_file_on_disk_matches_rule_groups() -> None:
    """The checked-in rule file parses to exactly `rule_groups()`."""
    assert _rules_on_disk() == rule_groups()


def test_test_copy_overrides_interval_and_for() -> None:
    """The integration-test copy keeps every expression and shortens only timings."""
    fast = rule_groups(interval="1s", for_="2s")
    assert all(group["interval"] == "1s" for group in fast["groups"])
    alerts = [r for g in fast["groups"] for r in g["rules"] if "alert" in r]
    assert {r["for"] for r in alerts} == {"2s"}
    normal = rule_groups()
    assert [r["expr"] for g in fast["groups"] for r in g["rules"]] == [
        r["expr"] for g in normal["groups"] for r in g["rules"]]


def test_promtool_tests_cover_every_rule_and_alert() -> None:
    """The promtool unit tests evaluate every recorded series and every alert name."""
    tests = yaml.safe_load(
        (ROOT / "deploy/prometheus/tests/turnrouter.rules.test.yml").read_text())["tests"]
    exprs = {t["expr"] for case in tests for t in case.get("promql_expr_test", [])}
    alerts = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])}
    assert {rule.record for rule in RECORDING_RULES} <= exprs
    assert alerts >= REQUIRED_ALERTS
    firing = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])
              if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])
             if not t["exp_alerts"]}
    assert firing >= REQUIRED_ALERTS and quiet >= REQUIRED_ALERTS
