"""The rule file: names, guards, annotations and runbook sections the design requires."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from turnrouter.ops import (
    ALERTS,
    DEMO_OVERRIDES,
    GROUP_LABELS,
    RECORDING_RULES,
    RULES_FILE,
    RUNBOOK_URL,
    RouteOverride,
    check_group_labels,
    generated_files,
    read_overrides,
    render_rules,
    rule_groups,
)

from .conftest import ROOT

REQUIRED_RECORDS = {
    "turnrouter:clarification_ratio:rate5m",
    "turnrouter:first_response_seconds:p95_5m",
    "turnrouter:silence_seconds:p95_5m",
    "turnrouter:acknowledgment_ratio:rate5m",
}
REQUIRED_ALERTS = {
    "TurnrouterHighClarificationRate", "TurnrouterSlowFirstResponse", "TurnrouterDeadAir",
    "TurnrouterAcknowledgmentOveruse", "TurnrouterFailures", "TurnrouterRouteFailing",
    "TurnrouterDecisionSlow",
    "TurnrouterSaturated", "TurnrouterOverloaded",
    "TurnrouterTargetDown", "TurnrouterAbsent", "TurnrouterWatchdog", "TurnrouterJobDown",
}
#: Alerts of traffic (not availability or the watchdog): gated on counts and on `up`.
TRAFFIC_ALERTS = [a for a in ALERTS if not a.raw]


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
    if alert.alert in ("TurnrouterWatchdog", "TurnrouterJobDown"):  # (at once)
        assert "for" not in rendered and rendered["labels"]["severity"] == "none"
    else:
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
    """The checked-in rule file parses to exactly `rule_groups()` with the shipped
    per-route overrides (one rule set for everyone)."""
    assert _rules_on_disk() == rule_groups(overrides=read_overrides(ROOT / DEMO_OVERRIDES))


def test_test_copy_overrides_interval_and_for() -> None:
    """The integration-test copy keeps every expression and shortens only timings."""
    fast = rule_groups(interval="1s", for_="2s")
    assert all(group["interval"] == "1s" for group in fast["groups"])
    alerts = [r for g in fast["groups"] for r in g["rules"] if "alert" in r]
    assert {r.get("for") for r in alerts} == {"2s", None}
    normal = rule_groups()
    assert [r["expr"] for g in fast["groups"] for r in g["rules"]] == [
        r["expr"] for g in normal["groups"] for r in g["rules"]]


def test_promtool_tests_cover_every_rule_and_alert() -> None:
    """The promtool unit tests evaluate every recorded series and every alert name, each
    alert both firing and quiet (in the rule tests, or in the ALERTS series of the
    scrape-interval scenarios)."""
    tests = []
    for path in sorted((ROOT / "deploy/prometheus/tests").glob("*.test.yml")):
        if path.name != "overrides.test.yml":
            tests += yaml.safe_load(path.read_text())["tests"]
    exprs = {t["expr"] for case in tests for t in case.get("promql_expr_test", [])}
    assert {rule.record for rule in RECORDING_RULES} <= exprs
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for t in case.get("alert_rule_test", []):
            (firing if t["exp_alerts"] else quiet).add(t["alertname"])
        for t in case.get("promql_expr_test", []):
            name = re.match(r'ALERTS\{alertname="(\w+)"', t["expr"])
            if name:
                (firing if t["exp_samples"] else quiet).add(name.group(1))
    assert firing >= REQUIRED_ALERTS
    assert quiet >= REQUIRED_ALERTS - {"TurnrouterWatchdog"}


def test_no_rule_reads_a_window_shorter_than_four_one_minute_scrapes() -> None:
    """Every range is at least 5 minutes: at a 1-minute scrape interval (Prometheus'
    default) a 1-minute rate has at most one sample and never fires."""
    text = (ROOT / RULES_FILE).read_text()
    windows = set(re.findall(r"\[(\d+)([smh])\]", text))
    assert ("5", "m") in windows
    assert min(int(n) * {"s": 1, "m": 60, "h": 3600}[unit] for n, unit in windows) >= 300


@pytest.mark.parametrize("alert", TRAFFIC_ALERTS, ids=lambda a: f"{a.alert}-{a.severity}")
def test_traffic_alerts_clear_when_their_target_is_down(alert: Any) -> None:
    """A dead router's 5-minute windows outlive it: every traffic alert requires a
    target of its group up, so none fires (or opens a late ticket) after the router died
    or its targets left service discovery (`up` gone, not 0)."""
    assert "\nand on (cluster, namespace, job)\nturnrouter:up:max > 0" in alert.expr


def _by_instance(alert: Any) -> bool:
    """The alert's signal is a recorded series kept by `instance` (one process's)."""
    (rule,) = [r for r in RECORDING_RULES if r.record == alert.signal]
    return bool(re.search(r"by \([^)]*\binstance\b", rule.expr))


@pytest.mark.parametrize("alert", TRAFFIC_ALERTS, ids=lambda a: f"{a.alert}-{a.severity}")
def test_a_replicas_own_alerts_clear_when_it_is_down(alert: Any) -> None:
    """An alert about one replica (its signal kept by instance) also requires that
    replica's own `up`: another replica keeps the job up, and at a 1-minute scrape a dead
    replica's Saturated fired from its stale window before TargetDown could inhibit it
    (operator18 M4). Job-wide alerts keep the job's gate alone."""
    gate = "\nand on (cluster, namespace, job, instance)\nup == 1"
    assert alert.expr.endswith(gate) == _by_instance(alert)
    assert {a.alert for a in TRAFFIC_ALERTS if _by_instance(a)} == {
        "TurnrouterSaturated", "TurnrouterOverloaded"}


def test_the_page_is_gated_on_distinct_participants() -> None:
    """The clarification page reads the participants' window, with a floor of distinct
    clarified participants: one client, however loud, never pages."""
    (page,) = [a for a in ALERTS if a.alert == "TurnrouterHighClarificationRate"
               and a.severity == "critical"]
    assert page.signal == "turnrouter:clarified_participants:ratio"
    assert page.volume == "turnrouter:window_clarified_participants:sum"
    assert page.min_turns >= 2


def test_group_labels_are_configurable() -> None:
    """Every aggregation and join follows the group labels (the mixins' clusterLabel)."""
    text = render_rules(group_labels=("k8s_cluster", "job"))
    assert "cluster, namespace" not in text
    assert "by (k8s_cluster, job, route)" in text
    assert "on (k8s_cluster, job)" in text
    assert GROUP_LABELS == ("cluster", "namespace", "job")
    assert "by (cluster, namespace, job)" in (ROOT / RULES_FILE).read_text()


def test_the_nats_fleet_files_follow_the_group_labels_too() -> None:
    """The fleet's alerts and dashboard aggregate and filter by the group labels, as the
    main ones: they grouped by `job` alone, so two fleets whose worker Services share a
    name merged, and a healthy one hid one missing half its partitions (ops11)."""
    files = generated_files(group_labels=("k8s_cluster", "job"))
    rules = files["deploy/prometheus/rules-nats/turnrouter-nats.rules.yml"]
    assert "by (job)" not in rules and "on (job)" not in rules
    assert "max by (k8s_cluster, job) (turnrouter_nats_partitions)" in rules
    assert "min by (k8s_cluster, job, instance) (turnrouter_nats_serving)" in rules
    assert "max by (k8s_cluster, job)" in files["deploy/k8s/nats/prometheusrule-nats.yaml"]
    fleet = json.loads(files["deploy/k8s/nats/turnrouter-fleet.json"])
    names = [v["name"] for v in fleet["templating"]["list"]]
    assert names[:3] == ["datasource", "k8s_cluster", "job"]
    exprs = [t["expr"] for panel in fleet["panels"] for t in panel.get("targets", [])]
    assert exprs and all('k8s_cluster=~"$k8s_cluster"' in expr for expr in exprs)
    shipped = (ROOT / "deploy/prometheus/rules-nats/turnrouter-nats.rules.yml").read_text()
    assert "by (cluster, namespace, job)" in shipped


@pytest.mark.parametrize("labels", [(), ("cluster",), ("job", "job"), ("job", "route"),
                                    ("job", "bad-name"), ("job", "__name__"),
                                    (*tuple(f"l{i}" for i in range(9)), "job")])
def test_bad_group_labels_are_refused(labels: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="group label"):
        check_group_labels(labels)


@pytest.mark.parametrize("content", [
    pytest.param(rule_groups(), id="generated"),
    pytest.param(_rules_on_disk(), id="shipped"),
    pytest.param(rule_groups(overrides=[RouteOverride("travel", "TurnrouterSlowFirstResponse",
                                                      threshold=4.0)]), id="overrides"),
])
def test_every_alert_reads_recordings_of_its_own_group_evaluated_before_it(
        content: dict[str, Any]) -> None:
    """An alert reading a recording rule of another group sees it up to one evaluation
    interval late (groups evaluate at different offsets): every recorded series an alert
    reads is recorded earlier in the alert's own group."""
    recorded_in = {rule["record"]: group["name"] for group in content["groups"]
                   for rule in group["rules"] if "record" in rule}
    checked = 0
    for group in content["groups"]:
        earlier: set[str] = set()
        for rule in group["rules"]:
            if "record" in rule:
                earlier.add(rule["record"])
                continue
            for name in re.findall(r"turnrouter:[A-Za-z0-9_:]+", rule["expr"]):
                assert name in recorded_in, (rule["alert"], name)
                assert name in earlier, (
                    f"{rule['alert']} reads {name}, recorded in {recorded_in[name]!r}, "
                    f"not before it in {group['name']!r}")
                checked += 1
    assert checked >= len(TRAFFIC_ALERTS) * 2


def test_absent_names_a_worker_that_never_got_ready() -> None:
    """A `turnrouter worker` exposes only its turnrouter_nats_* families until it is
    ready: TurnrouterAbsent's description says so instead of only "wrong port or path"
    (operator18 L4)."""
    (absent,) = [a for a in ALERTS if a.alert == "TurnrouterAbsent"]
    assert "turnrouter worker" in absent.description
    assert "reach NATS" in absent.description and "/ready" in absent.description
