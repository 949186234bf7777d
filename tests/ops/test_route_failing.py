"""TurnrouterRouteFailing: a route broken for the people who reach it pages, whatever its
share of the job's turns (a route with under 5% of them, failing every answer, never
raised the job-wide TurnrouterFailures: measured, a route with 4.3 to 5% of the turns
paged and then resolved while still broken).

Its promtool tests are in deploy/prometheus/tests/turnrouter.rules.test.yml (a small
route failing, a route under the floor, a route whose every admission fails, the job
quiet) and in the scrape-interval scenarios (tests/ops/scenarios.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from turnrouter.ops import (
    ALERTS,
    DEMO_OVERRIDES,
    FAILURE_RATIO,
    MIN_ROUTE_TURNS,
    ROUTE_FAILURE_RATIO,
    RouteOverride,
    dashboards,
    read_overrides,
    render_rules,
    rule_groups,
)

from ..integration.prom import Alertmanager, eventually
from .conftest import DEPLOY, ROOT, require_binary

ALERT = "TurnrouterRouteFailing"
(ROUTE_ALERT,) = [a for a in ALERTS if a.alert == ALERT]
CONFIG = DEPLOY / "alertmanager/alertmanager.yml"
TESTS = DEPLOY / "prometheus/tests/turnrouter.rules.test.yml"


def _expr(overrides: tuple[RouteOverride, ...] = ()) -> str:
    (rule,) = [r for g in rule_groups(overrides=overrides)["groups"] for r in g["rules"]
               if r.get("alert") == ALERT]
    expr: str = rule["expr"]
    return expr


def test_the_route_alert_pages_per_route_on_its_own_floor() -> None:
    """A page, per route and stage, on the route's own turns (not the job's), above a
    threshold far over the job-wide one, with a floor of turns that reached the route."""
    assert ROUTE_ALERT.severity == "critical" and ROUTE_ALERT.per_route
    assert ROUTE_ALERT.for_ == "5m"
    assert ROUTE_ALERT.threshold == ROUTE_FAILURE_RATIO > FAILURE_RATIO
    assert ROUTE_ALERT.min_turns == MIN_ROUTE_TURNS >= 30
    expr = _expr()
    assert f"turnrouter:route_failure_ratio:rate5m > {ROUTE_FAILURE_RATIO:g}" in expr
    assert f"turnrouter:route_turns:increase5m >= {MIN_ROUTE_TURNS}" in expr
    assert "and on (cluster, namespace, job, route)" in expr
    assert "turnrouter:up:max > 0" in expr


def test_its_ratio_divides_by_the_turns_that_reached_the_route() -> None:
    """Failures per route and stage over the route's turns plus its failed admissions
    (a route whose every admit() fails handles no turn of its own), routes only (a
    decision failure, route `none`, is the job's)."""
    records = {r["record"]: r["expr"] for g in rule_groups()["groups"] for r in g["rules"]
               if "record" in r}
    ratio = records["turnrouter:route_failure_ratio:rate5m"]
    assert ratio.startswith("sum by (cluster, namespace, job, route, stage) (rate("
                            'turnrouter_failures_total{route!="none"}[5m]))')
    assert "/ ignoring (stage) group_left ()" in ratio
    reached = records["turnrouter:route_turns:increase5m"]
    for expr in (ratio, reached):
        assert 'turnrouter_turns_total{route!="none"}' in expr
        assert 'turnrouter_failures_total{route!="none", stage="admission"}' in expr
        assert "turnrouter:" not in expr.split("\n", 1)[1]  # raw series only


def test_a_route_override_gives_a_route_its_own_threshold_and_floor() -> None:
    """Like every per-route alert: a route may page at its own ratio and floor, or never."""
    expr = _expr((RouteOverride("meta", ALERT, threshold=0.5, min_turns=10),
                  RouteOverride("travel", ALERT, disabled=True)))
    assert 'turnrouter:route_failure_ratio:rate5m{route!~"meta|travel"} > 0.25' in expr
    assert 'turnrouter:route_failure_ratio:rate5m{route="meta"} > 0.5' in expr
    assert 'turnrouter:route_turns:increase5m{route="meta"} >= 10' in expr
    assert 'route="travel"' not in expr


def test_overridden_routes_draw_their_own_threshold_on_the_panel() -> None:
    """The *Failures by route* panel draws each route's threshold as a series (with an
    override, no fixed line that would apply to some routes only)."""
    models = dashboards(overrides=(RouteOverride("meta", ALERT, threshold=0.5),))
    (panel,) = [p for m in models.values() for p in m["panels"]
                if p["title"] == "Failures by route"]
    (line,) = [t for t in panel["targets"] if t["legendFormat"] == "alert threshold {{route}}"]
    assert 'route="meta"' in line["expr"] and "* 0 + 0.5" in line["expr"]
    assert 'route!="none"' in line["expr"]  # the job's failures: no route's line
    assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "off"


def test_the_unit_tests_fail_without_the_route_alert(tmp_path: Path) -> None:
    """With the job-wide ratio in its place the small route's test fails: the unit tests
    test the gap this alert closes."""
    rules = render_rules(overrides=read_overrides(ROOT / DEMO_OVERRIDES))
    assert "turnrouter:route_failure_ratio:rate5m > 0.25" in rules
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules/turnrouter.rules.yml").write_text(rules.replace(
        "turnrouter:route_failure_ratio:rate5m > 0.25",
        "turnrouter:route_failure_ratio:rate5m * 0 + on (cluster, namespace, job) "
        "group_left () max by (cluster, namespace, job) (turnrouter:failure_ratio:rate5m) "
        "> 0.05"))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / TESTS.name).write_text(TESTS.read_text())
    result = subprocess.run([require_binary("promtool"), "test", "rules",
                             str(tmp_path / "tests" / TESTS.name)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert ALERT in result.stdout + result.stderr


def _inhibit_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = yaml.safe_load(CONFIG.read_text())["inhibit_rules"]
    return rules


def test_the_job_wide_page_holds_the_route_pages_of_its_stage() -> None:
    """One incident, one page: TurnrouterFailures holds TurnrouterRouteFailing of the
    same group and stage (not another stage's); the route's page holds its own latency
    and acknowledgment tickets (not other routes')."""
    (held,) = [r for r in _inhibit_rules()
               if r["target_matchers"] == [f'alertname="{ALERT}"']]
    assert held["source_matchers"] == ['alertname="TurnrouterFailures"']
    assert held["equal"] == ["cluster", "namespace", "job", "stage"]
    (holds,) = [r for r in _inhibit_rules() if r["source_matchers"] == [f'alertname="{ALERT}"']]
    assert holds["equal"] == ["cluster", "namespace", "job", "route"]
    assert 'severity="warning"' in holds["target_matchers"]


@pytest.mark.integration
def test_a_real_alertmanager_holds_what_the_rules_say(tmp_path: Path) -> None:
    """The shipped configuration in a real Alertmanager: with job turnrouter failing at
    stage answer, its meta answer page is suppressed, its adm admission page is not;
    job other (no job-wide page) pages for meta, which holds meta's slow-route ticket
    but not weather's."""
    alertmanager = Alertmanager(require_binary("prometheus-alertmanager"), tmp_path,
                                CONFIG.read_text())
    try:
        alertmanager.wait_ready()
        job = {"job": "turnrouter"}

        def route(name: str, stage: str, **where: str) -> dict[str, Any]:
            return {"labels": {**job, **where, "alertname": ALERT, "severity": "critical",
                               "route": name, "stage": stage}}

        def slow(name: str) -> dict[str, Any]:
            return {"labels": {"job": "other", "alertname": "TurnrouterSlowFirstResponse",
                               "severity": "warning", "route": name}}

        alertmanager.post([
            {"labels": {**job, "alertname": "TurnrouterFailures", "severity": "critical",
                        "stage": "answer"}},
            route("meta", "answer"), route("adm", "admission"),
            route("meta", "answer", job="other"), slow("meta"), slow("weather")])

        def key(alert: dict[str, Any]) -> tuple[str, str, str, str]:
            labels = alert["labels"]
            return (labels["alertname"], labels["job"], labels.get("route", ""),
                    labels.get("stage", ""))

        def settled() -> dict[tuple[str, str, str, str], str] | None:
            states = {key(a): a["status"]["state"] for a in alertmanager.alerts()}
            held = [(ALERT, "turnrouter", "meta", "answer"),
                    ("TurnrouterSlowFirstResponse", "other", "meta", "")]
            if len(states) < 6 or "unprocessed" in states.values() \
                    or any(states.get(k) != "suppressed" for k in held):
                return None  # not all processed yet
            return states

        states = eventually(settled, timeout=60, what="the route page inhibited")
        assert states == {
            ("TurnrouterFailures", "turnrouter", "", "answer"): "active",
            (ALERT, "turnrouter", "meta", "answer"): "suppressed",
            (ALERT, "turnrouter", "adm", "admission"): "active",
            (ALERT, "other", "meta", "answer"): "active",
            ("TurnrouterSlowFirstResponse", "other", "meta", ""): "suppressed",
            ("TurnrouterSlowFirstResponse", "other", "weather", ""): "active",
        }
    finally:
        alertmanager.stop()
