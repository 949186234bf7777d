"""Prometheus recording and alert rules, built as data from `METRICS`.

`rule_groups()` returns the rule file's content (a dict); `render_rules()` its YAML text,
which is checked in as `deploy/prometheus/rules/turnrouter.rules.yml` and wrapped in the
Kubernetes `PrometheusRule`. Thresholds are module constants so the dashboards draw the
same lines the alerts fire on.

Rules that keep the alerts trustworthy:

- one rule set for everyone: the shipped file carries the per-route overrides of
  `deploy/prometheus/overrides.demo.yml` (`RouteOverride`: another threshold, another
  traffic floor, or off for a route slow by design); regenerate with your own;
- every series is aggregated by the group labels (`GROUP_LABELS`: cluster, namespace,
  job, the mixins' `clusterLabel` convention; `rule_groups(group_labels=...)`), so two
  deployments whose Services share a name never merge;
- every alert is gated on enough traffic *in its own window*, as a count (turns,
  answers, acknowledgments or decisions), above what one participant can produce, and
  every window is 5 minutes (at least 4 scrapes at a 1-minute scrape interval);
- the clarification page fires for broad incidents only: the share of the distinct
  participants of the last minute whose latest turn was clarified (the
  `turnrouter_window_*participants` gauges: one loud client counts once), with at least
  `MIN_CLARIFIED_PARTICIPANTS` of them, confirmed by the 5-minute ratio over at least
  `MIN_TURNS` turns;
- every traffic alert requires its target up (`up`), so an alert whose source died clears
  instead of opening a late ticket (a replica's own alerts, by `instance`, that replica's
  `up`, not only its job's); `TurnrouterTargetDown` and `TurnrouterAbsent` page for
  the outage itself, and `TurnrouterWatchdog` always fires (a dead man's switch for the
  alerting pipeline).

Every ratio divides by a denominator filtered with `> 0`, so an idle router produces no
sample (not NaN or +Inf) and cannot page.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .._numbers import finite
from ..telemetry import NEEDLESS_WITHIN_SECONDS, metric

#: The `route` label of failures and turns no destination was involved in (decision
#: failures, unanswered turns): the job-wide alert's, not a route's.
_NONE_ROUTE = "none"

__all__ = [
    "ACK_OVERUSE_RATIO",
    "ALERTS",
    "CLARIFICATION_CONFIRM",
    "CLARIFICATION_CRITICAL",
    "CLARIFICATION_WARNING",
    "DEAD_AIR_SECONDS",
    "DECISION_SLOW_SECONDS",
    "FAILURE_RATIO",
    "GROUP_LABELS",
    "JOB_MATCHER",
    "MIN_CLARIFIED_PARTICIPANTS",
    "MIN_ROUTE_TURNS",
    "MIN_TURNS",
    "MIN_TURNS_1M",
    "OVERLOAD_STATE",
    "RECORDING_RULES",
    "ROUTE_FAILURE_RATIO",
    "RUNBOOK_URL",
    "SATURATION_LAG_SECONDS",
    "SLOW_FIRST_RESPONSE_SECONDS",
    "AlertRule",
    "RecordingRule",
    "RouteOverride",
    "check_group_labels",
    "load_overrides",
    "render_rules",
    "rule_groups",
]

#: Where `runbook_url` annotations point; each alert links to its own section.
RUNBOOK_URL = "https://github.com/turnrouter/turnrouter/blob/main/docs/runbook.md"

#: Labels every rule aggregates by (the mixins' `clusterLabel` convention): a label a
#: series lacks is simply absent from the result.
GROUP_LABELS: tuple[str, ...] = ("cluster", "namespace", "job")
#: The `up` series of turnrouter targets, for the availability alerts.
JOB_MATCHER = 'job=~"turnrouter.*"'
#: How long `TurnrouterJobDown` keeps firing for a job whose targets all vanished from
#: service discovery (their `up` series gone, not 0): past the 5-minute windows and the
#: 5-minute `keep_firing_for` of the warnings it holds, with room for a 1-minute scrape.
JOB_GONE_WINDOW = "15m"
#: Clarification ratio (clarifications / turns) of the ticket.
CLARIFICATION_WARNING = 0.10
#: The page: share of the last minute's distinct participants whose latest turn was
#: answered with a clarification question (a per-participant clarification ratio).
CLARIFICATION_CRITICAL = 0.25
#: The 5-minute ratio of turns that must confirm the page.
CLARIFICATION_CONFIRM = CLARIFICATION_WARNING
#: Least distinct participants clarified in the window for the page: one client, however
#: loud, never pages.
MIN_CLARIFIED_PARTICIPANTS = 3
#: Least turns (answers, acknowledgments, decisions) in a 5-minute window for any alert
#: of that window to fire: more than one participant can produce (about one turn per
#: 2 s, 150 in 5 minutes). Per-route alerts take another floor through `RouteOverride`.
MIN_TURNS = 150
#: Kept for deployments that read it: the floor of the former 1-minute clarification
#: window (no rule reads a 1-minute window any more: it never fires at a 1-minute scrape).
MIN_TURNS_1M = 30
#: Seconds: p95 from answer() to started() per route.
SLOW_FIRST_RESPONSE_SECONDS = 1.5
#: Seconds: p95 from admission to the first thing heard ("dead air" target).
DEAD_AIR_SECONDS = 2.0
#: Share of a route's scheduled acknowledgments that were needless (spoken, and the
#: answer started within `NEEDLESS_WITHIN_SECONDS` after), whatever triggered them: the
#: fallback delay or a prediction (with a short delay the predictive trigger claims
#: almost every acknowledgment, so a delay-triggered share never saw it: operator18 M1,
#: 0.19 at `--ack-delay 0.2` while 48% of the answered turns heard a needless one). A
#: delay tuned for at most 30% acknowledged turns (`turnrouter tune`'s default) stays
#: under it: a needless acknowledgment is an acknowledged turn.
ACK_OVERUSE_RATIO = 0.4
#: Failures per turn, per stage.
FAILURE_RATIO = 0.05
#: Failures per turn *of one route* (the turns that reached it: those it handled, and
#: those whose admission by it failed), per stage, above which `TurnrouterRouteFailing`
#: pages: the route is broken for the people who reach it, whatever its share of the
#: job's turns (a route with under `FAILURE_RATIO` of them, failing every answer, never
#: raised `TurnrouterFailures`). Far above the failures of a healthy route (a few in a
#: thousand in the demo), so its small windows do not page by chance.
ROUTE_FAILURE_RATIO = 0.25
#: Least turns that reached a route in 5 minutes for its failure page (`RouteOverride`
#: sets another per route): a route with a handful of turns does not page, one with about
#: one every 10 s does. One participant can reach it: the failures are the route's.
MIN_ROUTE_TURNS = 30
#: Seconds: p95 of a decision-service call.
DECISION_SLOW_SECONDS = 0.3
#: Seconds: p95 event-loop lag of one router process (the default
#: `OverloadPolicy.busy_lag_secs`: past it the router sheds new participants).
SATURATION_LAG_SECONDS = 0.1
#: Mean `turnrouter_overload_state` (0 ready, 1 busy, 2 shedding) over 5 minutes above
#: which the router warns it is overloaded: busy more than half the time (or shedding
#: more than a quarter). It follows the router's own `OverloadPolicy`, whatever its
#: thresholds, where `TurnrouterSaturated` keeps a fixed lag budget for every turn.
OVERLOAD_STATE = 0.5

Severity = Literal["warning", "critical", "none"]

#: Replaced by the group labels when a rule is rendered.
G = "__GROUP__"


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
NEEDLESS = _name("turnrouter_needless_acknowledgments_total")
INELIGIBLE = _name("turnrouter_ineligible_routes_total")
FIRST_RESPONSE_BUCKET = _name("turnrouter_first_response_seconds", "_bucket")
FIRST_RESPONSE_COUNT = _name("turnrouter_first_response_seconds", "_count")
SILENCE_BUCKET = _name("turnrouter_silence_seconds", "_bucket")
SILENCE_COUNT = _name("turnrouter_silence_seconds", "_count")
DECISION_BUCKET = _name("turnrouter_decision_duration_seconds", "_bucket")
DECISION_COUNT = _name("turnrouter_decision_duration_seconds", "_count")
LAG_BUCKET = _name("turnrouter_event_loop_lag_seconds", "_bucket")
SHED = _name("turnrouter_shed_turns_total")
WINDOW_PARTICIPANTS = _name("turnrouter_window_participants")
WINDOW_CLARIFIED = _name("turnrouter_window_clarified_participants")
IN_FLIGHT = _name("turnrouter_turns_in_flight")
OVERLOAD = _name("turnrouter_overload_state")


def _turn_rate(window: str) -> str:
    return f"sum by ({G}) (rate({TURNS}[{window}]))"


def _grouped(expr: str, labels: Sequence[str]) -> str:
    return expr.replace(G, ", ".join(labels))


def _ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator, 0 when traffic but no numerator, absent without traffic."""
    return f"(\n  {numerator}\n  or\n  {denominator} * 0\n)\n/\n({denominator} > 0)"


_ACK_RATE = f"sum by ({G}, route) (rate({ACKS}[5m]))"


def _route_reached(function: str, window: str, by: str, matchers: str = "") -> str:
    """Turns that reached each route in `window` (`function`: rate or increase), by
    `by` (which must include route): the turns it handled (`turnrouter_turns_total`,
    any outcome) plus those whose admission by it failed (a timed-out or raising
    `admit()`: the turn went on to another route, or a clarification, and counts there
    too). Either part may be missing (a route whose every admission fails has no turns
    of its own), hence the `or`s. `matchers` are added to both selectors."""
    extra = f", {matchers}" if matchers else ""
    handled = (f'sum by ({by}) ({function}({TURNS}{{route!="{_NONE_ROUTE}"{extra}}}'
               f"[{window}]))")
    refused = (f'sum by ({by}) ({function}({FAILURES}{{route!="{_NONE_ROUTE}", '
               f'stage="admission"{extra}}}[{window}]))')
    return f"{handled}\n+ {refused}\nor\n{handled}\nor\n{refused}"


def _route_failure_ratio(window: str, by: str, matchers: str = "") -> str:
    """Failures per turn that reached the route, by `by` (route included) and stage,
    over `window`: what `TurnrouterRouteFailing` evaluates (and the dashboards draw)."""
    extra = f", {matchers}" if matchers else ""
    return (f'sum by ({by}, stage) (rate({FAILURES}{{route!="{_NONE_ROUTE}"{extra}}}'
            f"[{window}]))\n/ ignoring (stage) group_left ()\n"
            f"((\n{_route_reached('rate', window, by, matchers)}\n) > 0)")


@dataclass(frozen=True, slots=True)
class RecordingRule:
    """A recording rule; `template` is its expression with the group labels left open."""

    record: str
    template: str

    @property
    def expr(self) -> str:
        """The expression, aggregated by the default `GROUP_LABELS`."""
        return _grouped(self.template, GROUP_LABELS)

    def as_dict(self, group_labels: Sequence[str] = GROUP_LABELS) -> dict[str, Any]:
        """The rule as it appears in a rule file, aggregated by `group_labels`."""
        return {"record": self.record, "expr": _grouped(self.template, group_labels)}


RECORDING_RULES: tuple[RecordingRule, ...] = (
    RecordingRule("turnrouter:turns:rate5m", _turn_rate("5m")),
    RecordingRule("turnrouter:turns:increase5m", f"sum by ({G}) (increase({TURNS}[5m]))"),
    RecordingRule(
        "turnrouter:clarification_ratio:rate5m",
        _ratio(f"sum by ({G}) (rate({CLARIFICATIONS}[5m]))", _turn_rate("5m"))),
    RecordingRule("turnrouter:window_participants:sum", f"sum by ({G}) ({WINDOW_PARTICIPANTS})"),
    RecordingRule("turnrouter:window_clarified_participants:sum",
                  f"sum by ({G}) ({WINDOW_CLARIFIED})"),
    RecordingRule(
        "turnrouter:clarified_participants:ratio",
        _ratio(f"sum by ({G}) ({WINDOW_CLARIFIED})",
               f"sum by ({G}) ({WINDOW_PARTICIPANTS})")),
    RecordingRule(
        "turnrouter:first_response_seconds:p95_5m",
        f"histogram_quantile(0.95, sum by ({G}, route, le) (rate({FIRST_RESPONSE_BUCKET}[5m])))",
    ),
    RecordingRule(
        "turnrouter:first_responses:increase5m",
        f"sum by ({G}, route) (increase({FIRST_RESPONSE_COUNT}[5m]))"),
    RecordingRule(
        "turnrouter:silence_seconds:p95_5m",
        f"histogram_quantile(0.95, sum by ({G}, le) (rate({SILENCE_BUCKET}[5m])))",
    ),
    RecordingRule(
        "turnrouter:silences:increase5m", f"sum by ({G}) (increase({SILENCE_COUNT}[5m]))"),
    RecordingRule(
        "turnrouter:acknowledgment_ratio:rate5m",
        _ratio(f'sum by ({G}, route) (rate({ACKS}{{outcome="emitted"}}[5m]))', _ACK_RATE)),
    RecordingRule(
        "turnrouter:delay_acknowledgment_ratio:rate5m",
        _ratio(f'sum by ({G}, route) (rate({ACKS}{{outcome="emitted", trigger="delay"}}[5m]))',
               _ACK_RATE)),
    RecordingRule(
        "turnrouter:acknowledgments:increase5m",
        f"sum by ({G}, route) (increase({ACKS}[5m]))"),
    # TurnrouterAcknowledgmentOveruse's signal: needless acknowledgments (any trigger)
    # per scheduled acknowledgment.
    RecordingRule(
        "turnrouter:needless_acknowledgment_share:rate5m",
        _ratio(f"sum by ({G}, route) (rate({NEEDLESS}[5m]))", _ACK_RATE)),
    RecordingRule(
        "turnrouter:needless_acknowledgment_ratio:rate5m",
        _ratio(f"sum by ({G}, route) (rate({NEEDLESS}[5m]))",
               f'sum by ({G}, route) (rate({ACKS}{{outcome="emitted"}}[5m]))')),
    RecordingRule(
        "turnrouter:ineligible_routes:rate5m",
        f"sum by ({G}, route, reason) (rate({INELIGIBLE}[5m]))"),
    RecordingRule(
        "turnrouter:decision_duration_seconds:p95_5m",
        f"histogram_quantile(0.95, sum by ({G}, le) (rate({DECISION_BUCKET}[5m])))",
    ),
    RecordingRule(
        "turnrouter:decisions:increase5m", f"sum by ({G}) (increase({DECISION_COUNT}[5m]))"),
    # Saturation is per process: by instance, so one saturated replica is not averaged away.
    RecordingRule(
        "turnrouter:event_loop_lag_seconds:p95_5m",
        f"histogram_quantile(0.95, sum by ({G}, instance, le) (rate({LAG_BUCKET}[5m])))",
    ),
    RecordingRule(
        "turnrouter:shed_turns:rate5m", f"sum by ({G}, instance) (rate({SHED}[5m]))"),
    # The share of the last 5 minutes the router spent busy (1) or shedding (2): what it
    # decided, with its own thresholds, so that sub-second flapping still counts. Read at
    # fixed 15 s steps (whatever the scrape interval), the minutes before the router
    # started counting as ready: an average of its samples alone made a warm-up burst of
    # two minutes right after a start the whole window, and warned. (The steps are
    # counted, not assumed: 21 in Prometheus 2, whose ranges include both ends, 20 in 3.)
    RecordingRule(
        "turnrouter:overload_state:avg5m",
        f"max by ({G}, instance) (sum_over_time({OVERLOAD}[5m:15s]))\n"
        f"/ on () group_left ()\n(count_over_time(vector(1)[5m:15s]) > 0)"),
    # TurnrouterRouteFailing's signal and traffic floor: per route, of the turns that
    # reached it (not of the job's: a small route failing every answer stays under the
    # job-wide ratio).
    RecordingRule("turnrouter:route_turns:increase5m",
                  _route_reached("increase", "5m", f"{G}, route")),
    RecordingRule("turnrouter:route_failure_ratio:rate5m",
                  _route_failure_ratio("5m", f"{G}, route")),
    RecordingRule(
        "turnrouter:failure_ratio:rate5m",
        f"sum by ({G}, stage) (rate({FAILURES}[5m]))\n/ on ({G}) group_left ()\n"
        f"({_turn_rate('5m')} > 0)",
    ),
    # 1 while a target of the group is scraped: every traffic alert requires it, so an
    # alert whose source died clears at once instead of lingering on stale windows.
    RecordingRule("turnrouter:up:max", f"max by ({G}) (up)"),
)

_ROUTE_NAME = re.compile(r"[^\x00-\x1f\x7f\"\\]{1,100}")
_REGEX_SPECIAL = re.compile(r"([.+*?()|\[\]{}^$])")


def _promql_regex_literal(text: str) -> str:
    """`text` as a literal inside a PromQL (RE2) regex in a double-quoted string."""
    return _REGEX_SPECIAL.sub(r"\\\\\1", text)


@dataclass(frozen=True, slots=True)
class RouteOverride:
    """One route's own setting for one route-labelled alert.

    `threshold` replaces the alert's threshold for this route (None: keep it),
    `min_turns` its traffic floor (None: keep it); `disabled=True` means the alert
    never fires for this route (a route slow by design, acknowledged by design).
    """

    route: str
    alert: str
    threshold: float | None = None
    min_turns: int | None = None
    disabled: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.route, str) or not _ROUTE_NAME.fullmatch(self.route):
            raise ValueError(f"override route must be 1-100 printable characters without "
                             f"quotes or backslashes, got {self.route!r}")
        per_route = {a.alert for a in ALERTS if a.per_route}
        if not isinstance(self.alert, str) or self.alert not in per_route:
            raise ValueError(f"override alert must be one of {sorted(per_route)}, "
                             f"got {self.alert!r}")
        if self.threshold is not None and (
                not finite(self.threshold) or self.threshold < 0):
            raise ValueError(f"override threshold must be a finite number >= 0, "
                             f"got {self.threshold!r}")
        if self.min_turns is not None and (
                isinstance(self.min_turns, bool) or not isinstance(self.min_turns, int)
                or not 1 <= self.min_turns <= 10**9):
            # 0 would drop the traffic floor: one unlucky turn could raise the alert.
            raise ValueError(f"override min_turns must be an integer in [1, 1e9], "
                             f"got {self.min_turns!r}")
        if self.threshold is None and self.min_turns is None and not self.disabled:
            raise ValueError("override changes nothing: give threshold, min_turns or "
                             "disabled: true")


@dataclass(frozen=True, slots=True)
class AlertRule:
    """An alert: `signal > threshold` while `volume >= min_turns` (and `confirm`, if
    any) and its target is not down, held for `for_`. `per_route` alerts take
    `RouteOverride`s. With `raw=True`, `signal` is the whole expression (availability
    and watchdog alerts: no threshold, no traffic floor)."""

    alert: str
    signal: str
    threshold: float
    for_: str
    severity: Severity
    summary: str
    description: str
    anchor: str
    volume: str
    """A recorded count of the signal's traffic in its window, same labels as `signal`."""
    min_turns: int = MIN_TURNS
    per_route: bool = False
    confirm: str | None = None
    """An extra condition joined with `and` (the clarification critical's long window)."""
    keep_firing_for: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    raw: bool = False
    per_instance: bool = False
    """The signal is one process's (by `instance`): also gated on that instance's own
    `up`, not only its job's (another replica keeps the job up)."""

    def _on(self) -> str:
        return f"on ({G}, route)" if self.per_route else f"on ({G})"

    def _branch(self, matcher: str, threshold: float, min_turns: int) -> str:
        selector = f"{{{matcher}}}" if matcher else ""
        lines = [f"{self.signal}{selector} > {threshold:g}",
                 f"and {self._on()}",
                 f"{self.volume}{selector} >= {min_turns:d}"]
        if self.confirm:
            lines += [f"and on ({G})", self.confirm]
        # A dead target's windows linger for minutes: its alerts clear at once instead,
        # also once its targets left service discovery (`up` gone, not 0).
        lines += [f"and on ({G})", "turnrouter:up:max > 0"]
        if self.per_instance:
            # One replica's windows outlive it too, while the others keep its job up: at
            # a 1-minute scrape a dead replica's warning fired from them before
            # TurnrouterTargetDown (which inhibits it) could.
            lines += [f"and on ({G}, instance)", "up == 1"]
        return "\n".join(lines)

    def expression(self, overrides: Sequence[RouteOverride] = (),
                   group_labels: Sequence[str] = GROUP_LABELS) -> str:
        """The alert expression, with this alert's `overrides` applied, aggregated by
        `group_labels`."""
        return _grouped(self._expression(overrides), group_labels)

    def _expression(self, overrides: Sequence[RouteOverride]) -> str:
        if self.raw:
            return self.signal
        mine = {o.route: o for o in overrides if o.alert == self.alert}
        if not mine:
            return self._branch("", self.threshold, self.min_turns)
        routes = "|".join(_promql_regex_literal(route) for route in sorted(mine))
        branches = [self._branch(f'route!~"{routes}"', self.threshold, self.min_turns)]
        for route, override in sorted(mine.items()):
            if override.disabled:
                continue
            threshold = self.threshold if override.threshold is None else override.threshold
            floor = self.min_turns if override.min_turns is None else override.min_turns
            branches.append(self._branch(f'route="{route}"', threshold, floor))
        return "\nor\n".join(f"(\n{branch}\n)" for branch in branches)

    @property
    def expr(self) -> str:
        """The alert expression without overrides."""
        return self.expression()

    @property
    def runbook_url(self) -> str:
        """This alert's section of the default runbook."""
        return self.runbook_section(RUNBOOK_URL)

    def runbook_section(self, base: str) -> str:
        """This alert's section of the runbook at `base`."""
        return f"{base}#{self.anchor}"

    def as_dict(self, for_: str | None = None, runbook_url: str | None = None,
                overrides: Sequence[RouteOverride] = (),
                group_labels: Sequence[str] = GROUP_LABELS) -> dict[str, Any]:
        """The rule as it appears in a rule file (`for_` overrides the hold time,
        `runbook_url` the runbook's base address)."""
        rule: dict[str, Any] = {
            "alert": self.alert,
            "expr": self.expression(overrides, group_labels),
        }
        if self.for_ != "0s":
            rule["for"] = for_ or self.for_
        if self.keep_firing_for:
            rule["keep_firing_for"] = for_ or self.keep_firing_for
        rule["labels"] = {"severity": self.severity, **self.labels}
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": self.runbook_section(runbook_url or RUNBOOK_URL),
        }
        return rule


_PCT = "{{ $value | humanizePercentage }}"
_SECS = "{{ $value | humanizeDuration }}"

ALERTS: tuple[AlertRule, ...] = (
    AlertRule(
        "TurnrouterHighClarificationRate", "turnrouter:clarification_ratio:rate5m",
        CLARIFICATION_WARNING, "10m", "warning",
        "Job {{ $labels.job }} asks participants to clarify too often",
        f"{_PCT} of turns ended in a clarification question over the last 5 minutes "
        f"(warning above {CLARIFICATION_WARNING:.0%}, at least {MIN_TURNS} turns).",
        "turnrouterhighclarificationrate",
        volume="turnrouter:turns:increase5m",
    ),
    AlertRule(
        "TurnrouterHighClarificationRate", "turnrouter:clarified_participants:ratio",
        CLARIFICATION_CRITICAL, "1m", "critical",
        "Job {{ $labels.job }} asks many participants to clarify",
        f"{_PCT} of the participants of the last minute had their latest turn answered with "
        f"a clarification question (page above {CLARIFICATION_CRITICAL:.0%}, at least "
        f"{MIN_CLARIFIED_PARTICIPANTS} participants, confirmed by the 5-minute ratio of turns "
        f"above {CLARIFICATION_CONFIRM:.0%} over at least {MIN_TURNS} turns): a broad "
        "incident, not one loud client.",
        "turnrouterhighclarificationrate",
        volume="turnrouter:window_clarified_participants:sum",
        min_turns=MIN_CLARIFIED_PARTICIPANTS,
        confirm=f"turnrouter:clarification_ratio:rate5m > {CLARIFICATION_CONFIRM:g}\n"
                f"and on ({G})\nturnrouter:turns:increase5m >= {MIN_TURNS:d}",
    ),
    AlertRule(
        "TurnrouterSlowFirstResponse", "turnrouter:first_response_seconds:p95_5m",
        SLOW_FIRST_RESPONSE_SECONDS, "10m", "warning",
        "Route {{ $labels.route }} of {{ $labels.job }} is slow to start answering",
        f"p95 time from answer() to started() is {_SECS} "
        f"(default target {SLOW_FIRST_RESPONSE_SECONDS:g}s; routes may have their own).",
        "turnrouterslowfirstresponse",
        volume="turnrouter:first_responses:increase5m", per_route=True, keep_firing_for="5m",
    ),
    AlertRule(
        "TurnrouterDeadAir", "turnrouter:silence_seconds:p95_5m",
        DEAD_AIR_SECONDS, "5m", "critical",
        "Participants of {{ $labels.job }} hear nothing for too long",
        f"p95 silence from admission to the first acknowledgment or answer is {_SECS} "
        f"(target {DEAD_AIR_SECONDS:g}s).",
        "turnrouterdeadair",
        volume="turnrouter:silences:increase5m",
    ),
    AlertRule(
        "TurnrouterAcknowledgmentOveruse", "turnrouter:needless_acknowledgment_share:rate5m",
        ACK_OVERUSE_RATIO, "15m", "warning",
        "Route {{ $labels.route }} of {{ $labels.job }} says needless acknowledgments",
        f"{_PCT} of scheduled acknowledgments were needless: spoken, and the answer "
        f"started within {NEEDLESS_WITHIN_SECONDS:g}s after (default threshold "
        f"{ACK_OVERUSE_RATIO:.0%}), whether the fallback delay or a prediction triggered "
        "them: the delay is probably too short for this route.",
        "turnrouteracknowledgmentoveruse",
        volume="turnrouter:acknowledgments:increase5m", per_route=True, keep_firing_for="5m",
    ),
    AlertRule(
        "TurnrouterFailures", "turnrouter:failure_ratio:rate5m",
        FAILURE_RATIO, "5m", "critical",
        "Job {{ $labels.job }} fails at stage {{ $labels.stage }}",
        f"{_PCT} failures per turn at stage {{{{ $labels.stage }}}} "
        f"(threshold {FAILURE_RATIO:.0%}).",
        "turnrouterfailures",
        volume="turnrouter:turns:increase5m",
    ),
    AlertRule(
        "TurnrouterRouteFailing", "turnrouter:route_failure_ratio:rate5m",
        ROUTE_FAILURE_RATIO, "5m", "critical",
        "Route {{ $labels.route }} of {{ $labels.job }} fails at stage {{ $labels.stage }}",
        f"{_PCT} of the turns that reached route {{{{ $labels.route }}}} failed at stage "
        f"{{{{ $labels.stage }}}} over the last 5 minutes (default threshold "
        f"{ROUTE_FAILURE_RATIO:.0%}, at least {MIN_ROUTE_TURNS} turns of the route): it is "
        "broken for the people who reach it, whatever its share of the job's turns.",
        "turnrouterroutefailing",
        volume="turnrouter:route_turns:increase5m", min_turns=MIN_ROUTE_TURNS,
        per_route=True,
    ),
    AlertRule(
        "TurnrouterDecisionSlow", "turnrouter:decision_duration_seconds:p95_5m",
        DECISION_SLOW_SECONDS, "10m", "warning",
        "The decision service of {{ $labels.job }} is slow",
        f"p95 decision-service call duration is {_SECS} "
        f"(target {DECISION_SLOW_SECONDS:g}s); every routed turn waits for it.",
        "turnrouterdecisionslow",
        volume="turnrouter:decisions:increase5m",
    ),
    AlertRule(
        "TurnrouterSaturated", "turnrouter:event_loop_lag_seconds:p95_5m",
        SATURATION_LAG_SECONDS, "5m", "warning",
        "Router {{ $labels.instance }} of {{ $labels.job }} is saturated",
        f"p95 event-loop lag is {_SECS} (threshold {SATURATION_LAG_SECONDS:g}s): turns wait "
        "for the loop, the router refuses new participants (readiness fails) and may shed "
        "turns (turnrouter_shed_turns_total). Add replicas or find what blocks the loop.",
        "turnroutersaturated",
        volume="turnrouter:turns:increase5m", per_instance=True,
    ),
    AlertRule(
        "TurnrouterOverloaded", "turnrouter:overload_state:avg5m",
        OVERLOAD_STATE, "3m", "warning",
        "Router {{ $labels.instance }} of {{ $labels.job }} is overloaded",
        f"The router's mean overload state over 5 minutes is {{{{ $value | printf \"%.2f\" }}}} "
        f"(0 ready, 1 busy, 2 shedding; warning above {OVERLOAD_STATE:g}): by its own "
        "thresholds it refuses new participants (readiness fails) and may shed turns "
        "(turnrouter_shed_turns_total). Add replicas or find what blocks the loop.",
        "turnrouteroverloaded",
        volume="turnrouter:turns:increase5m", per_instance=True,
    ),
    AlertRule(
        "TurnrouterTargetDown", f"up{{{JOB_MATCHER}}} == 0", 0.0, "1m", "critical",
        "Target {{ $labels.instance }} of {{ $labels.job }} is down",
        "Prometheus cannot scrape this router: it is down or unreachable, and its other "
        "alerts cannot be trusted (Alertmanager inhibits them while this fires).",
        "turnroutertargetdown", volume="", raw=True,
    ),
    AlertRule(
        "TurnrouterJobDown",
        f"group by ({G}) (max_over_time(up{{{JOB_MATCHER}}}[{JOB_GONE_WINDOW}]))\n"
        f"unless on ({G})\n(up{{{JOB_MATCHER}}} == 1)", 0.0, "0s", "none",
        "No router of {{ $labels.job }} is up",
        f"No target of this job up: each failed its last scrape, or they all vanished "
        f"from service discovery within {JOB_GONE_WINDOW} (pods deleted, a deployment "
        "scaled to zero). Notifies nobody (the `silent` "
        "receiver): while it fires Alertmanager holds the job's warnings, whose "
        "windows outlive the routers (one kept firing by keep_firing_for would "
        "otherwise open a ticket once the alert inhibiting it cleared at the death). "
        "TurnrouterTargetDown pages for the outage.",
        "turnrouterjobdown", volume="", raw=True,
    ),
    AlertRule(
        "TurnrouterAbsent",
        f"absent(up{{{JOB_MATCHER}}})\nor\n(up{{{JOB_MATCHER}}} == 1 unless on ({G}, instance) "
        f"{IN_FLIGHT})",
        0.0, "5m", "critical",
        "turnrouter metrics are absent",
        f"No turnrouter target is known to Prometheus ({JOB_MATCHER}), or a scraped target "
        "exposes no turnrouter metrics (wrong port or path, telemetry off), or a "
        "`turnrouter worker` that never got ready: it exposes only its turnrouter_nats_* "
        "families until then (still in its --app factory, or unable to reach NATS; its "
        "/ready and log say which).",
        "turnrouterabsent", volume="", raw=True,
    ),
    AlertRule(
        "TurnrouterWatchdog", "vector(1)", 0.0, "0s", "none",
        "The turnrouter alerting pipeline is alive",
        "Always firing: a dead man's switch. Alertmanager routes it to the `watchdog` "
        "receiver every few minutes; when those notifications stop, Prometheus, its rules "
        "or Alertmanager are broken.",
        "turnrouterwatchdog", volume="", raw=True,
    ),
)


def load_overrides(data: object) -> tuple[RouteOverride, ...]:
    """Overrides from parsed YAML/JSON: `{"overrides": [{"route": ..., "alert": ...,
    "threshold" | "min_turns" | "disabled": ...}, ...]}` (ValueError naming the entry)."""
    if not isinstance(data, Mapping) or set(data) - {"overrides"}:
        raise ValueError("overrides must be a mapping with one key, 'overrides'")
    entries = data.get("overrides") or []
    if not isinstance(entries, list) or len(entries) > 1000:
        raise ValueError("'overrides' must be a list of at most 1000 entries")
    out: list[RouteOverride] = []
    seen: set[tuple[str, str]] = set()
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"overrides[{index}] must be a mapping")
        unknown = set(entry) - {"route", "alert", "threshold", "min_turns", "disabled"}
        if unknown:
            shown = ", ".join(repr(str(key)[:40]) for key in sorted(map(str, unknown))[:5])
            more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
            raise ValueError(f"overrides[{index}]: unknown keys {shown}{more}")
        disabled = entry.get("disabled", False)
        if not isinstance(disabled, bool):
            raise ValueError(f"overrides[{index}]: 'disabled' must be true or false")
        try:
            override = RouteOverride(entry.get("route"), entry.get("alert"),  # type: ignore[arg-type]
                                     entry.get("threshold"), entry.get("min_turns"), disabled)
        except ValueError as exc:
            raise ValueError(f"overrides[{index}]: {exc}") from exc
        key = (override.route, override.alert)
        if key in seen:
            raise ValueError(f"overrides[{index}]: a second override of {key[1]} for "
                             f"route {key[0]!r}")
        seen.add(key)
        out.append(override)
    return tuple(out)


def rule_groups(
    *, interval: str | None = None, for_: str | None = None, runbook_url: str | None = None,
    overrides: Iterable[RouteOverride] = (), group_labels: Sequence[str] = GROUP_LABELS,
) -> dict[str, Any]:
    """The rule file's content. `interval` and `for_` override the evaluation interval
    and every alert's hold time (for tests against a real server); `runbook_url` the
    base address the alerts link to (your own copy of `docs/runbook.md`); `overrides`
    per-route thresholds of route-labelled alerts; `group_labels` the labels every rule
    aggregates by (default cluster, namespace, job)."""
    labels = check_group_labels(group_labels)
    chosen = tuple(overrides)
    # The recording rules an alert reads evaluate in the alerts' group, before them
    # (rules of a group run in order): in another group, evaluated at another offset,
    # an alert would see them up to one interval late. The others (dashboards') keep
    # their own group.
    alerts = [alert.as_dict(for_, runbook_url, chosen, labels) for alert in ALERTS]
    read = {name for alert in alerts for name in _RECORDED.findall(alert["expr"])}
    inputs = [rule.as_dict(labels) for rule in RECORDING_RULES if rule.record in read]
    others = [rule.as_dict(labels) for rule in RECORDING_RULES if rule.record not in read]
    groups: list[dict[str, Any]] = []
    for name, rules in (
        ("turnrouter.recording", others),
        ("turnrouter.alerts", inputs + alerts),
    ):
        group: dict[str, Any] = {"name": name}
        if interval is not None:
            group["interval"] = interval
        group["rules"] = rules
        groups.append(group)
    return {"groups": groups}


_RECORDED = re.compile(r"turnrouter:[A-Za-z0-9_:]+")
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_group_labels(labels: Sequence[str]) -> tuple[str, ...]:
    """`labels` as a tuple, checked: 1-8 distinct Prometheus label names including `job`,
    not `route`, `le` or `instance` (ValueError naming the bad one)."""
    if isinstance(labels, str):
        labels = [part.strip() for part in labels.split(",")]
    out = tuple(labels)
    if not 1 <= len(out) <= 8 or len(set(out)) != len(out):
        raise ValueError(f"group labels must be 1 to 8 distinct names, got {out!r}"[:200])
    for label in out:
        if not isinstance(label, str) or not _LABEL_NAME.fullmatch(label) \
                or label.startswith("__"):
            raise ValueError(f"group label {str(label)[:80]!r} is not a label name")
        if label in {"route", "le", "instance", "stage", "reason"}:
            raise ValueError(f"group label {label!r} is one the rules already use")
    if "job" not in out:
        raise ValueError("group labels must include 'job'")
    return out


HEADER = (
    "# Generated by `python -m turnrouter.ops` from turnrouter.telemetry.METRICS and\n"
    "# src/turnrouter/ops/_rules.py. Do not edit by hand.\n"
)


def render_rules(*, interval: str | None = None, for_: str | None = None,
                 runbook_url: str | None = None,
                 overrides: Iterable[RouteOverride] = (),
                 group_labels: Sequence[str] = GROUP_LABELS) -> str:
    """The rule file as YAML text (needs PyYAML, a dev dependency)."""
    from ._yaml import dump

    return HEADER + dump(rule_groups(interval=interval, for_=for_, runbook_url=runbook_url,
                                     overrides=overrides, group_labels=group_labels))

