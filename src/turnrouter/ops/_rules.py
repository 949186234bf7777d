"""Prometheus recording and alert rules, built as data from `METRICS`.

`rule_groups()` returns the rule file's content (a dict); `render_rules()` its YAML text,
which is checked in as `deploy/prometheus/rules/turnrouter.rules.yml` and wrapped in the
Kubernetes `PrometheusRule`. Thresholds are module constants so the dashboards draw the
same lines the alerts fire on. Every ratio divides by a denominator filtered with `> 0`,
so an idle router produces no sample (not NaN or +Inf) and cannot page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..telemetry import metric

__all__ = [
    "ACK_OVERUSE_RATIO",
    "ALERTS",
    "CLARIFICATION_CRITICAL",
    "CLARIFICATION_WARNING",
    "DEAD_AIR_SECONDS",
    "DECISION_SLOW_SECONDS",
    "FAILURE_RATIO",
    "MIN_TURN_RATE",
    "RECORDING_RULES",
    "RUNBOOK_URL",
    "SLOW_FIRST_RESPONSE_SECONDS",
    "AlertRule",
    "RecordingRule",
    "render_rules",
    "rule_groups",
]

#: Where `runbook_url` annotations point; each alert links to its own section.
RUNBOOK_URL = "https://github.com/turnrouter/turnrouter/blob/main/docs/runbook.md"

#: Clarification ratio (clarifications / turns) thresholds.
CLARIFICATION_WARNING = 0.10
CLARIFICATION_CRITICAL = 0.25
#: Turns per second below which clarification and acknowledgment ratios do not page
#: (0.05/s = 15 turns in the 5 minute window: too few for a ratio to mean much).
MIN_TURN_RATE = 0.05
#: Seconds: p95 from answer() to started() per route.
SLOW_FIRST_RESPONSE_SECONDS = 1.5
#: Seconds: p95 from admission to the first thing heard ("dead air" target).
DEAD_AIR_SECONDS = 2.0
#: Share of scheduled acknowledgments that were emitted.
ACK_OVERUSE_RATIO = 0.5
#: Failures per turn, per stage.
FAILURE_RATIO = 0.05
#: Seconds: p95 of a decision-service call.
DECISION_SLOW_SECONDS = 0.3

Severity = Literal["warning", "critical"]


def _name(metric_name: str, suffix: str = "") -> str:
    """A series name, checked against `METRICS` when the rules are built."""
    spec = metric(metric_name)
    if suffix and spec.type != "histogram":
        raise ValueError(f"{metric_name} is not a histogram")
    return spec.name + suffix


TURNS = _name("turnrouter_turns_total")
CLARIFICATIONS = _name("turnrouter_clarifications_total")
FAILURES = _name("turnrouter_failures_total")
ACKS = _name("turnrouter_acknowledgments_total")
FIRST_RESPONSE_BUCKET = _name("turnrouter_first_response_seconds", "_bucket")
SILENCE_BUCKET = _name("turnrouter_silence_seconds", "_bucket")
DECISION_BUCKET = _name("turnrouter_decision_duration_seconds", "_bucket")

_TURN_RATE = f"sum by (job) (rate({TURNS}[5m]))"
_ACK_RATE = f"sum by (job, route) (rate({ACKS}[5m]))"


@dataclass(frozen=True, slots=True)
class RecordingRule:
    """A recording rule."""

    record: str
    expr: str

    def as_dict(self) -> dict[str, Any]:
        """The rule as it appears in a rule file."""
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True, slots=True)
class AlertRule:
    """An alert: `signal > threshold` (and `guard`, if any) held for `for_`."""

    alert: str
    signal: str
    threshold: float
    for_: str
    severity: Severity
    summary: str
    description: str
    anchor: str
    guard: str | None = None
    """An extra condition joined with `and` (a minimum traffic)."""
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def expr(self) -> str:
        """The alert expression."""
        expr = f"{self.signal} > {self.threshold:g}"
        return f"{expr}\nand\n{self.guard}" if self.guard else expr

    @property
    def runbook_url(self) -> str:
        """This alert's section of the default runbook."""
        return self.runbook_section(RUNBOOK_URL)

    def runbook_section(self, base: str) -> str:
        """This alert's section of the runbook at `base`."""
        return f"{base}#{self.anchor}"

    def as_dict(self, for_: str | None = None, runbook_url: str | None = None) -> dict[str, Any]:
        """The rule as it appears in a rule file (`for_` overrides the hold time,
        `runbook_url` the runbook's base address)."""
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": for_ or self.for_,
            "labels": {"severity": self.severity, **self.labels},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": self.runbook_section(runbook_url or RUNBOOK_URL),
            },
        }


RECORDING_RULES: tuple[RecordingRule, ...] = (
    RecordingRule("turnrouter:turns:rate5m", _TURN_RATE),
    RecordingRule(
        "turnrouter:clarification_ratio:rate5m",
        f"(\n  sum by (job) (rate({CLARIFICATIONS}[5m]))\n  or\n  {_TURN_RATE} * 0\n)\n"
        f"/\n({_TURN_RATE} > 0)",
    ),
    RecordingRule(
        "turnrouter:first_response_seconds:p95_5m",
        f"histogram_quantile(0.95, sum by (job, route, le) (rate({FIRST_RESPONSE_BUCKET}[5m])))",
    ),
    RecordingRule(
        "turnrouter:silence_seconds:p95_5m",
        f"histogram_quantile(0.95, sum by (job, le) (rate({SILENCE_BUCKET}[5m])))",
    ),
    RecordingRule(
        "turnrouter:acknowledgment_ratio:rate5m",
        f'(\n  sum by (job, route) (rate({ACKS}{{outcome="emitted"}}[5m]))\n  or\n'
        f"  {_ACK_RATE} * 0\n)\n/\n({_ACK_RATE} > 0)",
    ),
    RecordingRule(
        "turnrouter:decision_duration_seconds:p95_5m",
        f"histogram_quantile(0.95, sum by (job, le) (rate({DECISION_BUCKET}[5m])))",
    ),
    RecordingRule(
        "turnrouter:failure_ratio:rate5m",
        f"sum by (job, stage) (rate({FAILURES}[5m]))\n/ on (job) group_left ()\n"
        f"({_TURN_RATE} > 0)",
    ),
)

_PCT = "{{ $value | humanizePercentage }}"
_SECS = "{{ $value | humanizeDuration }}"

ALERTS: tuple[AlertRule, ...] = (
    AlertRule(
        "TurnrouterHighClarificationRate", "turnrouter:clarification_ratio:rate5m",
        CLARIFICATION_WARNING, "10m", "warning",
        "turnrouter {{ $labels.job }} asks participants to clarify too often",
        f"{_PCT} of turns ended in a clarification question over the last 5 minutes "
        f"(warning above {CLARIFICATION_WARNING:.0%}).",
        "turnrouterhighclarificationrate",
        guard=f"on (job) {_TURN_RATE} >= {MIN_TURN_RATE:g}",
    ),
    AlertRule(
        "TurnrouterHighClarificationRate", "turnrouter:clarification_ratio:rate5m",
        CLARIFICATION_CRITICAL, "5m", "critical",
        "turnrouter {{ $labels.job }} asks participants to clarify too often",
        f"{_PCT} of turns ended in a clarification question over the last 5 minutes "
        f"(critical above {CLARIFICATION_CRITICAL:.0%}).",
        "turnrouterhighclarificationrate",
        guard=f"on (job) {_TURN_RATE} >= {MIN_TURN_RATE:g}",
    ),
    AlertRule(
        "TurnrouterSlowFirstResponse", "turnrouter:first_response_seconds:p95_5m",
        SLOW_FIRST_RESPONSE_SECONDS, "10m", "warning",
        "Route {{ $labels.route }} of {{ $labels.job }} is slow to start answering",
        f"p95 time from answer() to started() is {_SECS} "
        f"(target {SLOW_FIRST_RESPONSE_SECONDS:g}s).",
        "turnrouterslowfirstresponse",
    ),
    AlertRule(
        "TurnrouterDeadAir", "turnrouter:silence_seconds:p95_5m",
        DEAD_AIR_SECONDS, "5m", "critical",
        "Participants of {{ $labels.job }} hear nothing for too long",
        f"p95 silence from admission to the first acknowledgment or answer is {_SECS} "
        f"(target {DEAD_AIR_SECONDS:g}s).",
        "turnrouterdeadair",
    ),
    AlertRule(
        "TurnrouterAcknowledgmentOveruse", "turnrouter:acknowledgment_ratio:rate5m",
        ACK_OVERUSE_RATIO, "15m", "warning",
        "Route {{ $labels.route }} of {{ $labels.job }} acknowledges most turns",
        f"{_PCT} of scheduled acknowledgments were spoken (above {ACK_OVERUSE_RATIO:.0%}): "
        "the acknowledgment delay is probably too short for this route.",
        "turnrouteracknowledgmentoveruse",
        guard=f"on (job, route) {_ACK_RATE} >= {MIN_TURN_RATE:g}",
    ),
    AlertRule(
        "TurnrouterFailures", "turnrouter:failure_ratio:rate5m",
        FAILURE_RATIO, "5m", "critical",
        "turnrouter {{ $labels.job }} fails at stage {{ $labels.stage }}",
        f"{_PCT} failures per turn at stage {{{{ $labels.stage }}}} "
        f"(threshold {FAILURE_RATIO:.0%}).",
        "turnrouterfailures",
    ),
    AlertRule(
        "TurnrouterDecisionSlow", "turnrouter:decision_duration_seconds:p95_5m",
        DECISION_SLOW_SECONDS, "10m", "warning",
        "The decision service of {{ $labels.job }} is slow",
        f"p95 decision-service call duration is {_SECS} "
        f"(target {DECISION_SLOW_SECONDS:g}s); every routed turn waits for it.",
        "turnrouterdecisionslow",
    ),
)


def rule_groups(
    *, interval: str | None = None, for_: str | None = None, runbook_url: str | None = None,
) -> dict[str, Any]:
    """The rule file's content. `interval` and `for_` override the evaluation interval
    and every alert's hold time (for tests against a real server); `runbook_url` the
    base address the alerts link to (your own copy of `docs/runbook.md`)."""
    groups: list[dict[str, Any]] = []
    for name, rules in (
        ("turnrouter.recording", [rule.as_dict() for rule in RECORDING_RULES]),
        ("turnrouter.alerts", [alert.as_dict(for_, runbook_url) for alert in ALERTS]),
    ):
        group: dict[str, Any] = {"name": name}
        if interval is not None:
            group["interval"] = interval
        group["rules"] = rules
        groups.append(group)
    return {"groups": groups}


HEADER = (
    "# Generated by `python -m turnrouter.ops` from turnrouter.telemetry.METRICS and\n"
    "# src/turnrouter/ops/_rules.py. Do not edit by hand.\n"
)


def render_rules(**overrides: str | None) -> str:
    """The rule file as YAML text (needs PyYAML, a dev dependency)."""
    from ._yaml import dump

    return HEADER + dump(rule_groups(**overrides))
