"""Every dashboard query and rule against a real Prometheus scraping real router runs."""

from __future__ import annotations

import math
import re
import time
from typing import Any

import pytest

from turnrouter.ops import (
    ALERTS,
    CLARIFICATION_WARNING,
    RECORDING_RULES,
    candidates,
    dashboards,
    queries,
)
from turnrouter.telemetry import METRICS

from .conftest import CLARIFY_JOB, NORMAL_JOB, Stack
from .prom import Prometheus, eventually

pytestmark = pytest.mark.integration

#: Grafana's variables as a dashboard user with every job and route selected sends them.
GRAFANA_VARIABLES = {
    "$__rate_interval": "30s",
    "$__range": "5m",
    "$__interval": "5s",
    "$cluster": ".*",
    "$namespace": ".*",
    "$job": ".*",
    "$route": ".*",
    "$max_ack_rate": "0.5",
}
#: Histograms whose observations carry trace exemplars (docs/telemetry.md).
# Every per-turn histogram carries exemplars; the event-loop lag is sampled by the
# router's own timer, outside any trace, so it has none.
EXEMPLAR_HISTOGRAMS = [spec.name for spec in METRICS if spec.type == "histogram"
                       and spec.name != "turnrouter_event_loop_lag_seconds"]
DATA_TIMEOUT = 60.0


def substitute(expr: str) -> str:
    """Replace Grafana's variables as Grafana would before sending the query."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def finite_values(response: dict[str, Any]) -> list[float]:
    """The finite sample values of an instant-query vector result."""
    assert response["status"] == "success", response
    return [float(sample["value"][1]) for sample in response["data"]["result"]
            if math.isfinite(float(sample["value"][1]))]


def wait_for_values(prometheus: Prometheus, expr: str, what: str,
                    timeout: float = DATA_TIMEOUT) -> dict[str, Any]:
    """Poll until `expr` parses and returns at least one finite sample."""
    def probe() -> dict[str, Any] | None:
        response = prometheus.query(expr)
        if response["status"] != "success":
            raise AssertionError(f"{what}: Prometheus rejected {expr!r}: {response}")
        return response if finite_values(response) else None
    return eventually(probe, timeout=timeout, what=f"{what} to return data: {expr}")


DASHBOARD_QUERIES = [
    pytest.param(where, expr, id=f"{name.removesuffix('.json')}:{where}")
    for name, model in dashboards().items() for where, expr in queries(model)
]


def test_both_targets_are_scraped(stack: Stack) -> None:
    """Both metrics sources are up and scraped."""
    for job in (NORMAL_JOB, CLARIFY_JOB):
        values = finite_values(stack.prometheus.query(f'up{{job="{job}"}}'))
        assert values == [1.0]


@pytest.mark.parametrize(("where", "expr"), DASHBOARD_QUERIES)
def test_dashboard_query_returns_data(stack: Stack, where: str, expr: str) -> None:
    """The dashboard query parses and returns finite samples from real runs."""
    wait_for_values(stack.prometheus, substitute(expr), where)


def test_which_delay_table_has_every_candidate_and_route(stack: Stack) -> None:
    """The what-if table's acknowledgment rate: one row per candidate delay and route,
    each a share in [0, 1], plus the all-routes rows."""
    (model,) = [m for m in dashboards().values() if m["uid"] == "turnrouter-acknowledgment-tuning"]
    (panel,) = [p for p in model["panels"]
                if p["title"] == "Which delay? What-if per candidate delay and route"]
    by_ref = {t["refId"]: t["expr"] for t in panel["targets"]}
    delays = {f"{c.delay:g}" for c in candidates()}
    response = wait_for_values(stack.prometheus, substitute(by_ref["A"]), "what-if per route")
    rows = [(s["metric"]["route"], s["metric"]["delay"], float(s["value"][1]))
            for s in response["data"]["result"]]
    assert {delay for _, delay, _ in rows} == delays
    outside = [row for row in rows if math.isfinite(row[2]) and not 0.0 <= row[2] <= 1.0]
    assert not outside, f"rates outside [0, 1]: {outside}"
    overall = wait_for_values(stack.prometheus, substitute(by_ref["B"]), "what-if, all routes")
    assert {s["metric"]["route"] for s in overall["data"]["result"]} == {"(all)"}
    assert {s["metric"]["delay"] for s in overall["data"]["result"]} == delays


@pytest.mark.parametrize("rule", RECORDING_RULES, ids=lambda rule: rule.record)
def test_recording_rule_expression_returns_data(stack: Stack, rule: Any) -> None:
    """The recording rule's expression returns data, and the server records it."""
    wait_for_values(stack.prometheus, rule.expr, rule.record)
    wait_for_values(stack.prometheus, rule.record, f"recorded {rule.record}")


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.alert}-{a.severity}")
def test_alert_expression_parses_and_its_signal_returns_data(stack: Stack, alert: Any) -> None:
    """The alert expression parses; the value it compares returns data (availability
    alerts return data only when a target is down or absent; the watchdog always does)."""
    response = stack.prometheus.query(alert.expr)
    assert response["status"] == "success", response
    if alert.raw and alert.alert != "TurnrouterWatchdog":
        return
    wait_for_values(stack.prometheus, alert.signal, alert.alert)


def test_server_loaded_every_rule_healthy(stack: Stack) -> None:
    """The server loaded every rule, and each evaluates without error."""
    def all_evaluated() -> list[dict[str, Any]] | None:
        groups = stack.prometheus.api("rules")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if all(rule.get("lastEvaluation", "").startswith("20") and
                            not rule["lastEvaluation"].startswith("0001")
                            for rule in rules) else None
    rules = eventually(all_evaluated, timeout=30, what="every rule to be evaluated")
    names = sorted(rule["name"] for rule in rules)
    expected = sorted([r.record for r in RECORDING_RULES] + [a.alert for a in ALERTS])
    assert names == expected
    assert [rule for rule in rules if rule["health"] != "ok"] == []


def _clarification_alerts(prometheus: Prometheus) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = prometheus.api("alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == "TurnrouterHighClarificationRate"]


def test_clarification_heavy_run_fires_high_clarification_rate(stack: Stack) -> None:
    """The clarify-heavy job fires the critical clarification alert; the normal job does not."""
    def firing() -> list[dict[str, Any]] | None:
        found = [a for a in _clarification_alerts(stack.prometheus)
                 if a["state"] == "firing" and a["labels"]["job"] == CLARIFY_JOB
                 and a["labels"]["severity"] == "critical"]
        return found or None
    (alert,) = eventually(firing, timeout=DATA_TIMEOUT, what="the clarification alert")
    assert alert["annotations"]["runbook_url"].endswith("#turnrouterhighclarificationrate")
    assert re.fullmatch(r"\d+(\.\d+)?% of the participants .*",
                        alert["annotations"]["description"])
    normal = [a for a in _clarification_alerts(stack.prometheus)
              if a["labels"]["job"] == NORMAL_JOB]
    assert normal == []


def test_normal_run_stays_below_the_warning_threshold(stack: Stack) -> None:
    """The normal job's clarification ratio is measured and below the warning threshold."""
    response = wait_for_values(
        stack.prometheus, f'turnrouter:clarification_ratio:rate5m{{job="{NORMAL_JOB}"}}',
        "normal clarification ratio")
    (ratio,) = finite_values(response)
    assert 0.0 <= ratio < CLARIFICATION_WARNING


@pytest.mark.parametrize("histogram", EXEMPLAR_HISTOGRAMS)
def test_exemplars_are_stored(stack: Stack, histogram: str) -> None:
    """Prometheus stored trace exemplars for the latency histogram."""
    def stored() -> list[dict[str, Any]] | None:
        now = time.time()
        response = stack.prometheus.api(
            "query_exemplars", query=f"{histogram}_bucket", start=str(now - 600),
            end=str(now + 60))
        assert response["status"] == "success", response
        exemplars = [e for series in response["data"] for e in series["exemplars"]]
        return exemplars or None
    exemplars = eventually(stored, timeout=DATA_TIMEOUT, what=f"exemplars of {histogram}")
    for exemplar in exemplars:
        assert re.fullmatch(r"[0-9a-f]{32}", exemplar["labels"]["trace_id"])
        assert re.fullmatch(r"[0-9a-f]{16}", exemplar["labels"]["span_id"])
