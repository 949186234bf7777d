"""Grafana dashboards as plain JSON models, built from `METRICS`.

No Grafana SDK: the dashboards are dicts in Grafana's dashboard JSON model (schema
version 39, Grafana 10.x/11.x), so generating them needs nothing beyond the standard
library and the output is stable byte for byte. Every series name goes through `_m()`,
which looks the metric up in `METRICS`, so a renamed metric fails here first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..telemetry import metric
from ._rules import (
    ACK_OVERUSE_RATIO,
    CLARIFICATION_CRITICAL,
    CLARIFICATION_WARNING,
    DEAD_AIR_SECONDS,
    DECISION_SLOW_SECONDS,
    FAILURE_RATIO,
    GROUP_LABELS,
    MIN_CLARIFIED_PARTICIPANTS,
    MIN_ROUTE_TURNS,
    OVERLOAD_STATE,
    ROUTE_FAILURE_RATIO,
    SATURATION_LAG_SECONDS,
    SLOW_FIRST_RESPONSE_SECONDS,
    RouteOverride,
    _promql_regex_literal,
    _route_failure_ratio,
    _route_reached,
    check_group_labels,
)
from ._tuning import (
    ALL_ROUTES,
    CONFIDENCE,
    EARLY_SECS,
    GENERATION_SECS,
    HYSTERESIS,
    candidates,
    recommended_delay_query,
    whatif_queries,
)

__all__ = ["DASHBOARDS", "dashboard_files", "dashboards", "queries", "render_dashboard"]

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
JOB = 'job=~"$job"'
#: Choices of the "which delay?" target variable (all-routes acknowledgment rate).
ACK_RATE_TARGETS = ("0.1", "0.2", "0.3", "0.4", "0.5")
ROUTE = 'route=~"$route"'
#: The alerts' window: panels that show an alerted ratio use it, not `$__rate_interval`.
ALERT_WINDOW = "5m"


def _m(name: str, suffix: str = "") -> str:
    spec = metric(name)
    if suffix and spec.type != "histogram":
        raise ValueError(f"{name} is not a histogram")
    return spec.name + suffix


def _sel(name: str, *matchers: str, suffix: str = "") -> str:
    return f"{_m(name, suffix)}{{{', '.join(matchers)}}}"


def _quantile(q: float, name: str, by: str, *matchers: str, window: str = RATE) -> str:
    """A quantile by `by`, only where the window holds observations (no NaN for a route
    or outcome without any: it shows as a gap)."""
    by_clause = f"{by}, le" if by else "le"
    return (f"histogram_quantile({q:g}, sum by ({by_clause}) "
            f"(rate({_sel(name, *matchers, suffix='_bucket')}[{window}])))\n"
            f"and on ({by}) (sum by ({by}) "
            f"(rate({_sel(name, *matchers, suffix='_count')}[{window}])) > 0)")


# --------------------------------------------------------------------------- building blocks

#: The per-route overrides the dashboards being built draw (set by `dashboards()`).
_OVERRIDES: list[tuple[RouteOverride, ...]] = [()]


def _route_threshold_targets(alert: str, count: str, default: float,
                             only: str = "") -> str:
    """Each route's `alert` threshold as a series (its override, or `default`), only for
    routes with traffic (`count`, a counter, `only` an extra matcher) in the alert's
    window; a route whose alert is disabled has none."""
    mine = {o.route: o for o in _OVERRIDES[0] if o.alert == alert}
    extra = f", {only}" if only else ""

    def line(matcher: str, threshold: float) -> str:
        return (f"(sum by (route) (rate({count}{{{JOB}, {ROUTE}{extra}{matcher}}}"
                f"[{ALERT_WINDOW}])) > 0) * 0 + {threshold:g}")

    if not mine:
        return line("", default)
    routes = "|".join(_promql_regex_literal(route) for route in sorted(mine))
    parts = [line(f', route!~"{routes}"', default)]
    parts += [line(f', route="{route}"', o.threshold if o.threshold is not None
                   else default)
              for route, o in sorted(mine.items()) if not o.disabled]
    return "\nor\n".join(parts)


def _slow_first_response_targets() -> str:
    """Each route's TurnrouterSlowFirstResponse threshold as a series."""
    return _route_threshold_targets(
        "TurnrouterSlowFirstResponse", _m("turnrouter_first_response_seconds", "_count"),
        SLOW_FIRST_RESPONSE_SECONDS)


def _static_line(alert: str) -> str:
    """How a panel draws `alert`'s default threshold as a fixed line: dashed, unless some
    route has its own threshold or none (the per-route series draw them then: a fixed
    line would sit under routes it does not apply to)."""
    return "off" if any(o.alert == alert for o in _OVERRIDES[0]) else "dashed"


def _thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute",
            "steps": [{"color": color, "value": value} for color, value in steps]}


def _target(expr: str, legend: str = "", *, ref: str = "A", exemplar: bool = False,
            instant: bool = False, fmt: str = "time_series") -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
        "exemplar": exemplar,
        "format": fmt,
    }


def _targets(*specs: tuple[str, str], exemplar: bool = False) -> list[dict[str, Any]]:
    """Range targets A, B, ...; latency quantiles always ask for exemplars."""
    return [_target(expr, legend, ref=chr(ord("A") + i),
                    exemplar=exemplar or "histogram_quantile" in expr)
            for i, (expr, legend) in enumerate(specs)]


def _timeseries(title: str, description: str, targets: list[dict[str, Any]], *,
                unit: str, thresholds: dict[str, Any] | None = None, stack: bool = False,
                min_: float | None = 0, max_: float | None = None,
                draw: str = "off") -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
            "showPoints": "never", "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": draw},
        },
        "thresholds": thresholds or _thresholds(("green", None)),
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    # A count drawn beside ratios or durations ("..., right axis" in its legend): on an
    # axis of its own, in plain numbers (114 participants read as 11400 % beside the
    # clarification ratios, flattening them).
    overrides = [{"matcher": {"id": "byFrameRefID", "options": target["refId"]},
                  "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                 {"id": "unit", "value": "short"}]}
                 for target in targets if "right axis" in target.get("legendFormat", "")]
    return {
        "type": "timeseries", "title": title, "description": description,
        "datasource": DATASOURCE, "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                       "calcs": ["mean", "max", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def _stat(title: str, description: str, expr: str, *, unit: str,
          thresholds: dict[str, Any] | None = None, instant: bool = False) -> dict[str, Any]:
    return {
        "type": "stat", "title": title, "description": description,
        "datasource": DATASOURCE, "targets": [_target(expr, title, instant=instant)],
        "fieldConfig": {"defaults": {
            "unit": unit, "color": {"mode": "thresholds"},
            "thresholds": thresholds or _thresholds(("green", None)),
        }, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto",
                    "justifyMode": "auto", "orientation": "auto"},
    }


def _row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def _layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assign ids and grid positions: rows span the width, stats are 6 wide, others 12."""
    x = y = 0
    row_height = 0
    for panel_id, panel in enumerate(panels, start=1):
        panel["id"] = panel_id
        width = panel.pop("_w", 24 if panel["type"] == "row" else
                          6 if panel["type"] == "stat" else 12)
        height = 1 if panel["type"] == "row" else 4 if panel["type"] == "stat" else 8
        if panel["type"] == "row" or x + width > 24:
            x, y = 0, y + row_height
            row_height = 0
        panel["gridPos"] = {"h": height, "w": width, "x": x, "y": y}
        x += width
        row_height = max(row_height, height)
        if panel["type"] == "row":
            x, y, row_height = 0, y + height, 0
    return panels


def _variables() -> list[dict[str, Any]]:
    turns = _m("turnrouter_turns_total")
    return [
        {
            "name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0, "refresh": 1,
            "regex": "", "options": [], "includeAll": False, "multi": False,
        },
        {
            "name": "job", "label": "Job", "type": "query", "datasource": DATASOURCE,
            "definition": f"label_values({turns}, job)",
            "query": {"query": f"label_values({turns}, job)",
                      "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "current": {}, "hide": 0, "refresh": 2, "regex": "", "sort": 1, "options": [],
            "includeAll": True, "multi": True, "allValue": ".*",
        },
        {
            "name": "route", "label": "Route", "type": "query", "datasource": DATASOURCE,
            "definition": f"label_values({turns}{{{JOB}}}, route)",
            "query": {"query": f"label_values({turns}{{{JOB}}}, route)",
                      "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "current": {}, "hide": 0, "refresh": 2, "regex": "", "sort": 1, "options": [],
            "includeAll": True, "multi": True, "allValue": ".*",
        },
    ]


def _ack_rate_variable() -> dict[str, Any]:
    options = [{"text": f"{float(v):.0%}", "value": v, "selected": v == "0.3"}
               for v in ACK_RATE_TARGETS]
    return {
        "name": "max_ack_rate", "label": "Target acknowledgment rate", "type": "custom",
        "query": ",".join(ACK_RATE_TARGETS), "current": {"text": "30%", "value": "0.3"},
        "options": options, "hide": 0, "includeAll": False, "multi": False,
    }


def _dashboard(uid: str, title: str, description: str,
               panels: list[dict[str, Any]],
               extra_variables: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["turnrouter", "generated"],
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "links": [{"title": "turnrouter dashboards", "type": "dashboards",
                   "tags": ["turnrouter"], "asDropdown": True}],
        "templating": {"list": [*_variables(), *(extra_variables or [])]},
        "panels": _layout(panels),
    }


# --------------------------------------------------------------------------- overview


def overview() -> dict[str, Any]:
    """The "turnrouter overview" dashboard."""
    turns = _m("turnrouter_turns_total")
    clarifications = _m("turnrouter_clarifications_total")
    # The alerts' own windows (5 minutes) and sums, per job as the alerts are, so the
    # panels show what they fire on also with several jobs selected (operator15: "All"
    # drew 10% under the page's line while one job paged at 68%).
    clar_ratio = (
        f"sum by (job) (rate({clarifications}{{{JOB}}}[{ALERT_WINDOW}]))\n/\n"
        f"(sum by (job) (rate({turns}{{{JOB}}}[{ALERT_WINDOW}])) > 0)"
    )
    clarified_share = (
        f"sum by (job) ({_sel('turnrouter_window_clarified_participants', JOB)})\n/\n"
        f"(sum by (job) ({_sel('turnrouter_window_participants', JOB)}) > 0)")
    panels: list[dict[str, Any]] = [
        _row("Traffic"),
        _stat("Turns / s", "Turns handled per second, all routes.",
              f"sum(rate({_sel('turnrouter_turns_total', JOB, ROUTE)}[{RATE}]))", unit="ops"),
        _stat("Clarification ratio (5m)", "Clarifications per turn over 5 minutes (the "
              "ticket's ratio, TurnrouterHighClarificationRate warning, orange past it; "
              "the page reads the share of participants instead); the highest job's.",
              f"max({clar_ratio})", unit="percentunit",
              thresholds=_thresholds(("green", None), ("orange", CLARIFICATION_WARNING))),
        _stat("Active participants", "Participants the router holds state for.",
              f"sum({_sel('turnrouter_active_participants', JOB)})", unit="short"),
        _stat("Turns in flight", "Turns being handled right now.",
              f"sum({_sel('turnrouter_turns_in_flight', JOB)})", unit="short"),
        _timeseries(
            "Turns by route and outcome", "Turns per second by answering route and outcome "
            "(route `none`: no destination answered).",
            _targets((f"sum by (route, outcome) (rate("
                      f"{_sel('turnrouter_turns_total', JOB, ROUTE)}[{RATE}]))",
                      "{{route}} {{outcome}}")),
            unit="ops", stack=True),
        _timeseries(
            "Clarification ratio", "Clarifications per turn over 5 minutes (the ticket fires "
            f"above {CLARIFICATION_WARNING:.0%}), by reason, and the page's signal: the share "
            "of the last minute's distinct participants whose latest turn was clarified "
            f"(TurnrouterHighClarificationRate critical above {CLARIFICATION_CRITICAL:.0%}, "
            f"with at least {MIN_CLARIFIED_PARTICIPANTS} of them: one loud client counts "
            "once).",
            _targets((clar_ratio, "{{job}} clarification ratio (turns, 5m)"),
                     (f"sum by (job, reason) (rate("
                      f"{_sel('turnrouter_clarifications_total', JOB)}"
                      f"[{ALERT_WINDOW}]))\n/ ignoring (reason) group_left ()\n"
                      f"(sum by (job) (rate({turns}{{{JOB}}}[{ALERT_WINDOW}])) > 0)",
                      "{{job}} {{reason}}"),
                     (clarified_share, "{{job}} participants clarified (page)"),
                     (f"sum by (job) ({_sel('turnrouter_window_clarified_participants', JOB)})",
                      "{{job}} participants clarified (count, right axis)")),
            unit="percentunit", draw="dashed",
            thresholds=_thresholds(("green", None), ("orange", CLARIFICATION_WARNING),
                                   ("red", CLARIFICATION_CRITICAL))),
        _row("Routing"),
        _timeseries(
            "Reroutes and default fallbacks", "Turns routed again after a route declined or "
            "released, and turns the default answered without admission.",
            _targets((f"sum by (route) (rate({_sel('turnrouter_reroutes_total', JOB, ROUTE)}"
                      f"[{RATE}]))", "reroute after {{route}}"),
                     (f"sum by (route) (rate("
                      f"{_sel('turnrouter_default_fallbacks_total', JOB, ROUTE)}[{RATE}]))",
                      "fallback to {{route}}")),
            unit="ops"),
        _timeseries(
            "Admissions by disposition", "admit() results per second by route, disposition "
            "and focus.",
            _targets((f"sum by (route, disposition, focused) (rate("
                      f"{_sel('turnrouter_admissions_total', JOB, ROUTE)}[{RATE}]))",
                      "{{route}} {{disposition}} focused={{focused}}")),
            unit="ops", stack=True),
        _timeseries(
            "Ineligible routes by reason", "Candidate routes skipped as ineligible per "
            "second, by route and reason (unavailable, capacity, policy, not_candidate): "
            "the destination status behind `no_eligible_route` clarifications and "
            "reroutes. Empty until the router records "
            "turnrouter_ineligible_routes_total.",
            _targets((f"sum by (route, reason) (rate("
                      f"{_sel('turnrouter_ineligible_routes_total', JOB, ROUTE)}[{RATE}]))",
                      "{{route}} {{reason}}")),
            unit="ops", stack=True),
        _timeseries(
            "Failures by stage", "Failures per turn by stage over 5 minutes, as "
            f"TurnrouterFailures computes it (it fires above {FAILURE_RATIO:.0%} of turns per "
            "stage, the dashed line), and interrupted turns per turn.",
            _targets((f"sum by (job, stage) (rate({_sel('turnrouter_failures_total', JOB)}"
                      f"[{ALERT_WINDOW}]))\n/ ignoring (stage) group_left ()\n"
                      f"(sum by (job) (rate({turns}{{{JOB}}}[{ALERT_WINDOW}])) > 0)",
                      "{{job}} {{stage}}"),
                     (f"sum by (job) (rate({_sel('turnrouter_interruptions_total', JOB)}"
                      f"[{ALERT_WINDOW}]))\n/\n"
                      f"(sum by (job) (rate({turns}{{{JOB}}}[{ALERT_WINDOW}])) > 0)",
                      "{{job}} interrupted")),
            unit="percentunit", stack=False, draw="dashed",
            thresholds=_thresholds(("green", None), ("red", FAILURE_RATIO))),
        _timeseries(
            "Failures by route", "Failures per turn of each route, by job, route and stage, "
            "over 5 minutes: of the turns that reached the route (those it handled, and "
            "those whose admission by it failed), not of the job's, as "
            f"TurnrouterRouteFailing computes it (it pages above {ROUTE_FAILURE_RATIO:.0%} "
            f"with at least {MIN_ROUTE_TURNS} such turns in 5 minutes; each route's own "
            "threshold, per-route overrides included, is drawn as `alert threshold "
            "{route}`). The turns that reached each route are drawn on the right axis: a "
            "route under the floor does not page, whatever its ratio.",
            [_target(_route_failure_ratio(ALERT_WINDOW, "job, route", f"{JOB}, {ROUTE}"),
                     "{{job}} {{route}} {{stage}} (TurnrouterRouteFailing)"),
             # (Not for route `none`: its failures are the job's, never a route's page.)
             _target(_route_threshold_targets("TurnrouterRouteFailing", turns,
                                              ROUTE_FAILURE_RATIO, 'route!="none"'),
                     "alert threshold {{route}}", ref="B"),
             _target(_route_reached("increase", ALERT_WINDOW, "job, route",
                                    f"{JOB}, {ROUTE}"),
                     "{{job}} {{route}} turns in 5m (right axis)", ref="C")],
            unit="percentunit", draw=_static_line("TurnrouterRouteFailing"),
            thresholds=_thresholds(("green", None), ("red", ROUTE_FAILURE_RATIO))),
        _timeseries(
            "Focus transitions", "Focus taken, released or lost per second, by route.",
            _targets((f"sum by (route, transition) (rate("
                      f"{_sel('turnrouter_focus_transitions_total', JOB, ROUTE)}[{RATE}]))",
                      "{{route}} {{transition}}")),
            unit="ops"),
        _row("Latency"),
        _timeseries(
            "Decision latency", "Decision-service call duration quantiles (exemplars link "
            f"to the `turnrouter.route` span). TurnrouterDecisionSlow: p95 above "
            f"{DECISION_SLOW_SECONDS:g}s.",
            _targets(*((_quantile(q, "turnrouter_decision_duration_seconds", "", JOB),
                        f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99)), exemplar=True),
            unit="s", draw="dashed",
            thresholds=_thresholds(("green", None), ("red", DECISION_SLOW_SECONDS))),
        _timeseries(
            "Admission latency", "admit() duration p95 by route (exemplars link to the "
            "`turnrouter.admission` span).",
            _targets((_quantile(0.95, "turnrouter_admission_duration_seconds", "route",
                                JOB, ROUTE), "p95 {{route}}"), exemplar=True),
            unit="s"),
        _timeseries(
            "Turn duration", "Turn duration p95 by route and outcome (exemplars link to the "
            "turn span).",
            _targets((_quantile(0.95, "turnrouter_turn_duration_seconds", "route, outcome",
                                JOB, ROUTE), "p95 {{route}} {{outcome}}"), exemplar=True),
            unit="s"),
        _timeseries(
            "First response p95 by route", "Time from answer() to started() (exemplars link "
            "to the `invoke_agent` span), and each route's TurnrouterSlowFirstResponse "
            f"threshold as `alert threshold {{route}}` (the default "
            f"{SLOW_FIRST_RESPONSE_SECONDS:g}s or the route's own override; also a fixed "
            "dashed line when no route has its own). What the alert evaluates, each job's "
            "p95 per route over 5 minutes, is drawn as `{job} {route} p95 5m`: the `p95 "
            "{route}` series merge the selected jobs over the rate interval.",
            [*_targets((_quantile(0.95, "turnrouter_first_response_seconds", "route", JOB,
                                  ROUTE), "p95 {{route}}"), exemplar=True),
             _target(_slow_first_response_targets(), "alert threshold {{route}}", ref="B"),
             _target(_quantile(0.95, "turnrouter_first_response_seconds", "job, route", JOB,
                               ROUTE, window=ALERT_WINDOW),
                     "{{job}} {{route}} p95 5m (TurnrouterSlowFirstResponse)", ref="C",
                     exemplar=True)],
            unit="s", draw=_static_line("TurnrouterSlowFirstResponse"),
            thresholds=_thresholds(("green", None), ("red", SLOW_FIRST_RESPONSE_SECONDS))),
        _row("Load and context"),
        _timeseries(
            "Participants and turns in flight", "Participants with router state, and turns "
            "being handled.",
            _targets((f"sum({_sel('turnrouter_active_participants', JOB)})", "participants"),
                     (f"sum({_sel('turnrouter_turns_in_flight', JOB)})", "turns in flight")),
            unit="short"),
        _timeseries(
            "Saturation", "Event-loop lag p95 per instance (TurnrouterSaturated above "
            f"{SATURATION_LAG_SECONDS:g}s: the dashed line), the longest wait before "
            "routing, the turns shed per second by reason (docs/limits.md, Overload); on the "
            "right axis, the admission state (0 ready, 1 busy: new participants refused, 2 "
            "shedding) and its 5-minute mean, TurnrouterOverloaded's signal (above "
            f"{OVERLOAD_STATE:g}).",
            _targets((_quantile(0.95, "turnrouter_event_loop_lag_seconds", "instance", JOB),
                      "lag p95 {{instance}}"),
                     (f"max by (instance) ({_sel('turnrouter_turn_wait_seconds', JOB)})",
                      "longest wait {{instance}}"),
                     (f"max by (instance) ({_sel('turnrouter_overload_state', JOB)})",
                      "state {{instance}} (right axis)"),
                     (f"sum by (reason) (rate({_sel('turnrouter_shed_turns_total', JOB)}"
                      f"[{RATE}]))", "shed {{reason}} /s"),
                     (f"max by (instance) (avg_over_time("
                      f"{_sel('turnrouter_overload_state', JOB)}[{ALERT_WINDOW}]))",
                      "state, 5m mean {{instance}} (right axis)")),
            unit="short", draw="dashed",
            thresholds=_thresholds(("green", None), ("red", SATURATION_LAG_SECONDS))),
        _timeseries(
            "Context patches", "Background context patches per second by strategy and "
            "outcome.",
            _targets((f"sum by (strategy, outcome) (rate("
                      f"{_sel('turnrouter_context_patches_total', JOB)}[{RATE}]))",
                      "{{strategy}} {{outcome}}")),
            unit="ops"),
        _timeseries(
            "Rejected runtime messages", "Runtime messages the router's subscriber rejected "
            "per second, by topic and reason (invalid, wrong_type, closed). On a NATS "
            "fleet, nats_timing over_share and fleet_share are normal: a replica that "
            "measures few turns of a route itself refuses most of its peers' samples of "
            "it (docs/distributed.md, \"Trust\"); an attack shows as the other reasons.",
            _targets((f"sum by (topic, reason) (rate("
                      f"{_sel('turnrouter_runtime_rejected_messages_total', JOB)}[{RATE}]))",
                      "{{topic}} {{reason}}")),
            unit="ops"),
        _timeseries(
            "Limit overflows", "Bounds that overflowed per second, by limit (something was "
            "dropped or refused; see docs/limits.md).",
            _targets((f"sum by (limit) (rate("
                      f"{_sel('turnrouter_limit_overflows_total', JOB)}[{RATE}]))",
                      "{{limit}}")),
            unit="ops"),
    ]
    return _dashboard(
        "turnrouter-overview", "turnrouter overview",
        "Traffic, routing, failures, latency and load of turnrouter (generated from "
        "turnrouter.telemetry.METRICS; do not edit, run `python -m turnrouter.ops`).",
        panels)


# --------------------------------------------------------------------------- acknowledgments


def acknowledgment_tuning() -> dict[str, Any]:
    """The "turnrouter acknowledgment tuning" dashboard."""
    first = metric("turnrouter_first_response_seconds")
    assert first.buckets is not None
    bucket = _sel(first.name, JOB, ROUTE, suffix="_bucket")
    count = _sel(first.name, JOB, ROUTE, suffix="_count")
    acks = _m("turnrouter_acknowledgments_total")
    delay = f"max({_sel('turnrouter_acknowledgment_delay_seconds', JOB)})"
    # The delay each route runs with (its acknowledgment_route_delays entry, else the
    # router-wide one).
    route_delay = (f"max by (route) "
                   f"({_sel('turnrouter_acknowledgment_route_delay_seconds', JOB, ROUTE)})")
    emitted = _sel(acks, JOB, ROUTE, 'outcome="emitted"')
    needless = _sel("turnrouter_needless_acknowledgments_total", JOB, ROUTE)
    scheduled = _sel(acks, JOB, ROUTE)
    predicted = _sel("turnrouter_predicted_first_response_seconds", JOB, ROUTE)
    heatmap: dict[str, Any] = {
        "type": "heatmap", "title": "First response heatmap: $route",
        "description": "Distribution of first-response time (answer() to started()) for "
                       "one route per panel; exemplars link to the `invoke_agent` span.",
        "datasource": DATASOURCE, "repeat": "route", "repeatDirection": "h", "maxPerRow": 3,
        "targets": [_target(
            f"sum by (le) (increase({bucket}[{RATE}]))", "{{le}}", exemplar=True,
            fmt="heatmap")],
        "fieldConfig": {"defaults": {"unit": "s"}, "overrides": []},
        "options": {
            "calculate": False, "cellGap": 1, "yAxis": {"unit": "s", "axisPlacement": "left"},
            "rowsFrame": {"layout": "auto"},
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5,
                      "fill": "dark-orange", "scale": "exponential", "reverse": False},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
            "legend": {"show": True},
            "filterValues": {"le": 1e-9},
        },
        "_w": 24,
    }
    matchers = f"{JOB}, {ROUTE}"
    whatif = whatif_queries(matchers, "$__range")
    chosen = candidates()
    # 1 on the (delay, route) rows of each route's own delay, and on the all-routes row of
    # the router-wide one.
    marker = "\nor\n".join(
        f'label_replace((abs({route_delay} - {c.delay:g}) < 0.025) * 0 + 1, "delay", '
        f'"{c.delay:g}", "__name__", ".*")\nor\n'
        f'label_replace(label_replace((abs({delay} - {c.delay:g}) < 0.025) * 0 + 1, '
        f'"delay", "{c.delay:g}", "__name__", ".*"), "route", "{ALL_ROUTES}", "__name__", '
        '".*")' for c in chosen)
    # One row per (delay, route) the other columns have (the all-routes row included),
    # so the marker is a column of those rows, never a row of its own.
    turns = f"sum by (route) (increase({count}[$__range]))"
    skeleton = "\nor\n".join(
        f'label_replace(({turns} > 0) * 0, "delay", "{c.delay:g}", "__name__", ".*")\nor\n'
        f'label_replace(label_replace((sum({turns}) > 0) * 0, "delay", "{c.delay:g}", '
        f'"__name__", ".*"), "route", "{ALL_ROUTES}", "__name__", ".*")' for c in chosen)
    current = (f"(\n{skeleton}\n) + on (delay, route)\n(\n{marker}\n)\n"
               f"or\n(\n{skeleton}\n)")
    table_targets = [
        _target(whatif["ack"], "", ref="A", instant=True, fmt="table"),
        _target(whatif["ack_all"], "", ref="B", instant=True, fmt="table"),
        _target(whatif["needless"], "", ref="C", instant=True, fmt="table"),
        _target(whatif["needless_all"], "", ref="D", instant=True, fmt="table"),
        _target(whatif["silence_p95"], "", ref="E", instant=True, fmt="table"),
        _target(current, "", ref="F", instant=True, fmt="table"),
        _target(whatif["early"], "", ref="G", instant=True, fmt="table"),
        _target(whatif["ack_fixed"], "", ref="H", instant=True, fmt="table"),
        _target(whatif["ack_fixed_all"], "", ref="I", instant=True, fmt="table"),
        _target(whatif["needless_fixed"], "", ref="J", instant=True, fmt="table"),
        _target(whatif["needless_fixed_all"], "", ref="K", instant=True, fmt="table"),
        _target(whatif["silence_p95_fixed"], "", ref="L", instant=True, fmt="table"),
    ]
    which_delay: dict[str, Any] = {
        "type": "table", "title": "Which delay? What-if per candidate delay and route",
        "description": "For each candidate acknowledgment delay (rows) and route, over the "
                       "dashboard's time range, under the predictive policy (what the "
                       "router does with its default timing predictor) and, beside it, the "
                       "fixed delay alone: the share of turns that would hear an "
                       "acknowledgment, the share whose acknowledgment would be needless "
                       "(the answer started within 0.5 s of it), and the p95 silence. "
                       f"Modelled: acknowledgment generation takes {GENERATION_SECS:g} s "
                       "(see the measured time below). `early` = 1: the route is "
                       "acknowledged early by prediction, heard at "
                       f"{EARLY_SECS:g} s (or when its text is ready). APPROXIMATION: a "
                       "histogram has no turn order, so the trigger is evaluated once on "
                       "the route's distribution over the range (confidence "
                       f"{CONFIDENCE:g}, hysteresis {HYSTERESIS:g}): no warm-up, regime "
                       "changes or feature classes; `turnrouter tune --samples` replays "
                       "recorded samples through the real trigger instead. "
                       f"Route {ALL_ROUTES}: all routes, weighted by turns (the delay is "
                       "router-wide). `current` = 1 marks the delay each route runs with "
                       "(its acknowledgment_route_delays entry, else the router-wide one; "
                       f"on {ALL_ROUTES}: the router-wide one). Turns interrupted before a "
                       "response are slow turns whose answer never came: the ack rates "
                       "count them as `turnrouter tune` does, to first order (ack rate = "
                       "1 - answered by the time heard / turns not interrupted by then; "
                       "it can read low by the share interrupted before then times the "
                       "share answered: on the demo within 1 point over all routes, 4 for "
                       "the most interrupted route); needless, p95 silence "
                       "and `early` read the answered turns only (the dashboard's size "
                       "limit leaves no room for more). `turnrouter tune --prometheus` "
                       "computes them all by Kaplan-Meier.",
        "datasource": DATASOURCE, "targets": table_targets,
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True},
                "indexByName": {"delay": 0, "route": 1, "Value #G": 2, "Value #A": 3,
                                "Value #B": 3, "Value #C": 4, "Value #D": 4,
                                "Value #E": 5, "Value #H": 6, "Value #I": 6,
                                "Value #J": 7, "Value #K": 7, "Value #L": 8,
                                "Value #F": 9},
                "renameByName": {"Value #A": "ack rate", "Value #B": "ack rate",
                                 "Value #C": "needless", "Value #D": "needless",
                                 "Value #E": "p95 silence", "Value #F": "current",
                                 "Value #G": "early",
                                 "Value #H": "fixed: ack rate", "Value #I": "fixed: ack rate",
                                 "Value #J": "fixed: needless",
                                 "Value #K": "fixed: needless",
                                 "Value #L": "fixed: p95 silence"}}},
            {"id": "sortBy", "options": {"sort": [{"field": "delay"}]}},
        ],
        "fieldConfig": {"defaults": {
            "unit": "percentunit", "decimals": 1,
            "noValue": "No first responses in the time range for these routes (or the "
                       "routers export no turnrouter_first_response_seconds, or, for the "
                       "ack rates, no turnrouter_first_response_interrupted_seconds: "
                       "routers older than the dashboard): widen the range or check the "
                       "job and route variables."},
            "overrides": [
            *({"matcher": {"id": "byName", "options": name},
               "properties": [{"id": "unit", "value": "s"}, {"id": "decimals", "value": 2}]}
              for name in ("p95 silence", "fixed: p95 silence")),
            *({"matcher": {"id": "byName", "options": name},
               "properties": [{"id": "unit", "value": "none"}, {"id": "decimals", "value": 0}]}
              for name in ("current", "early")),
        ]},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "_w": 24,
    }
    recommended = _stat(
        "Recommended delay", "The shortest candidate delay whose all-routes acknowledgment "
        "rate over the time range, under the predictive policy (approximated, see the "
        "table; turns interrupted before a response counted as there), is within the "
        "target ($max_ack_rate), as `turnrouter tune --max-ack-rate` recommends.",
        recommended_delay_query(matchers, "$__range", "$max_ack_rate"), unit="s",
        instant=True)
    configured = _stat("Configured delay", "The fallback acknowledgment delay each route "
                       "runs with now: its acknowledgment_route_delays entry, else the "
                       "router-wide acknowledgment_delay_secs.", route_delay, unit="s")
    configured["targets"][0]["legendFormat"] = "{{route}}"
    generation = _sel("turnrouter_acknowledgment_generation_seconds", JOB, ROUTE,
                      suffix="_bucket")
    panels: list[dict[str, Any]] = [
        _row("First response"),
        _timeseries(
            "First response quantiles", "p50, p90 and p95 of the time from answer() to "
            "started(), by route (exemplars link to the `invoke_agent` span), and each "
            "route's TurnrouterSlowFirstResponse threshold (per-route overrides included).",
            [*_targets(*((_quantile(q, first.name, "route", JOB, ROUTE),
                          f"p{round(q * 100)} {{{{route}}}}") for q in (0.5, 0.9, 0.95)),
                       exemplar=True),
             _target(_slow_first_response_targets(), "alert threshold {{route}}", ref="D")],
            unit="s", draw=_static_line("TurnrouterSlowFirstResponse"),
            thresholds=_thresholds(("green", None), ("red", SLOW_FIRST_RESPONSE_SECONDS))),
        _timeseries(
            "Predicted vs observed first response", "The timing predictor's current estimate "
            "against the observed mean and p50 first response, by route; the gap is the "
            "prediction error.",
            _targets(
                (f"max by (route) ({predicted})", "predicted {{route}}"),
                (f"sum by (route) (rate({_sel(first.name, JOB, ROUTE, suffix='_sum')}[{RATE}]))"
                 f"\n/\n(sum by (route) (rate({count}[{RATE}])) > 0)", "observed mean {{route}}"),
                (_quantile(0.5, first.name, "route", JOB, ROUTE), "observed p50 {{route}}"),
            ),
            unit="s"),
        heatmap,
        _row("Silence and acknowledgments"),
        _timeseries(
            "Silence p95 vs configured delay", "p95 of the time from admission to the first "
            "thing the participant hears, by route, against the acknowledgment delay each "
            "route runs with (`delay {route}`: its acknowledgment_route_delays entry, else "
            "the router-wide delay), and what TurnrouterDeadAir evaluates against the "
            f"dashed line ({DEAD_AIR_SECONDS:g}s): each job's p95 over all its routes and 5 "
            "minutes (a route slow by design may sit above the line while its job is "
            "healthy). Exemplars link to the turn span.",
            [_target(_quantile(0.95, "turnrouter_silence_seconds", "route", JOB, ROUTE),
                     "silence p95 {{route}}", exemplar=True),
             _target(route_delay, "delay {{route}}", ref="B"),
             _target(_quantile(0.95, "turnrouter_silence_seconds", "job", JOB,
                               window=ALERT_WINDOW),
                     "{{job}} silence p95, all routes, 5m (TurnrouterDeadAir)", ref="C",
                     exemplar=True)],
            unit="s", draw="dashed",
            thresholds=_thresholds(("green", None), ("red", DEAD_AIR_SECONDS))),
        _timeseries(
            "Acknowledgments: emitted vs suppressed", "Scheduled acknowledgments per second "
            "by outcome and trigger: emitted (spoken), suppressed (the answer started "
            "first) or failed.",
            _targets((f"sum by (outcome, trigger) (rate({_sel(acks, JOB, ROUTE)}[{RATE}]))",
                      "{{outcome}} ({{trigger}})")),
            unit="ops", stack=True),
        _timeseries(
            "Acknowledgment ratio by route", "Share of scheduled acknowledgments that were "
            "needless (spoken, and the answer started within 0.5 s after), whatever "
            "triggered them, by job and route, over 5 minutes: the alerted ratio "
            f"(TurnrouterAcknowledgmentOveruse above {ACK_OVERUSE_RATIO:.0%}; each route's "
            "own threshold, per-route overrides included, is drawn as `alert threshold "
            "{route}`, none for a route whose alert is disabled). All spoken ones are drawn "
            "beside it for reference.",
            _targets((f"sum by (job, route) (rate({needless}[{ALERT_WINDOW}]))\n/\n"
                      f"(sum by (job, route) (rate({scheduled}[{ALERT_WINDOW}])) > 0)",
                      "{{job}} {{route}} (alerted: needless)"),
                     (f"sum by (job, route) (rate({emitted}[{ALERT_WINDOW}]))\n/\n"
                      f"(sum by (job, route) (rate({scheduled}[{ALERT_WINDOW}])) > 0)",
                      "{{job}} {{route}} (all spoken)"),
                     (_route_threshold_targets("TurnrouterAcknowledgmentOveruse", acks,
                                               ACK_OVERUSE_RATIO),
                      "alert threshold {{route}}")),
            unit="percentunit", draw=_static_line("TurnrouterAcknowledgmentOveruse"), max_=1,
            thresholds=_thresholds(("green", None), ("red", ACK_OVERUSE_RATIO))),
        _timeseries(
            "Needless acknowledgments per turn", "Needless acknowledgments (spoken, and the "
            "answer started within 0.5 s) per turn, by route and trigger, over 5 minutes: "
            "the same per-turn share as the `needless` column of *Which delay?* "
            "(`prediction`: early acknowledgments that turned out needless; `delay`: the "
            "fallback delay's).",
            _targets((f"sum by (route, trigger) (rate("
                      f"{_sel('turnrouter_needless_acknowledgments_total', JOB, ROUTE)}"
                      f"[{ALERT_WINDOW}]))\n/ on (route) group_left ()\n"
                      f"(sum by (route) (rate({count}[{ALERT_WINDOW}])) > 0)",
                      "{{route}} ({{trigger}})")),
            unit="percentunit", max_=1),
        _timeseries(
            "Acknowledgment generation time", "p50 and p95 of the acknowledgment LLM's "
            "generation time, against the value the what-if models "
            f"({GENERATION_SECS:g} s, the dashed line; exemplars link to the turn). Far "
            "below the line (a template acknowledger's milliseconds), *Which delay?* "
            "overstates what a delay costs: pass the measured time to `turnrouter tune "
            "--generation-secs` (docs/operations.md, \"The what-if\").",
            [_target(f"histogram_quantile(0.5, sum by (le) (rate({generation}[{RATE}])))",
                     "p50", ref="A", exemplar=True),
             _target(f"histogram_quantile(0.95, sum by (le) (rate({generation}[{RATE}])))",
                     "p95", ref="B", exemplar=True)],
            unit="s", draw="dashed",
            thresholds=_thresholds(("green", None), ("orange", GENERATION_SECS))),
        _row("Which delay?"),
        configured,
        recommended,
        which_delay,
    ]
    return _dashboard(
        "turnrouter-acknowledgment-tuning", "turnrouter acknowledgment tuning",
        "First-response latency, silence and acknowledgments: choose the acknowledgment "
        "delay (generated from turnrouter.telemetry.METRICS; do not edit, run "
        "`python -m turnrouter.ops`).",
        panels, [_ack_rate_variable()])


# --------------------------------------------------------------------------- files

#: File name (under `dashboards/`) -> builder.
DASHBOARDS = {
    "turnrouter-overview.json": overview,
    "turnrouter-acknowledgment-tuning.json": acknowledgment_tuning,
}


def _group_variable(label: str, before: Sequence[str]) -> dict[str, Any]:
    turns = _m("turnrouter_turns_total")
    matchers = ", ".join(f'{name}=~"${name}"' for name in before)
    series = f"{turns}{{{matchers}}}" if matchers else turns
    return {
        "name": label, "label": label.replace("_", " ").capitalize(), "type": "query",
        "datasource": DATASOURCE,
        "definition": f"label_values({series}, {label})",
        "query": {"query": f"label_values({series}, {label})",
                  "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "current": {}, "hide": 0, "refresh": 2, "regex": "", "sort": 1, "options": [],
        "includeAll": True, "multi": True, "allValue": ".*",
    }


def _regroup(value: Any, matchers: str) -> Any:
    """`value` with every `job=~"$job"` matcher replaced by the group labels' matchers."""
    if isinstance(value, str):
        return value.replace(JOB, matchers)
    if isinstance(value, list):
        return [_regroup(item, matchers) for item in value]
    if isinstance(value, dict):
        return {key: _regroup(item, matchers) for key, item in value.items()}
    return value


def _with_group_labels(model: dict[str, Any], labels: Sequence[str]) -> dict[str, Any]:
    """The dashboard filtered on every group label (a variable each, chained in order:
    cluster, then namespace, then job), as the alerts aggregate by them."""
    matchers = ", ".join(f'{label}=~"${label}"' for label in labels)
    variables = model["templating"]["list"]
    out = _regroup(model, matchers)
    chained = [_group_variable(label, labels[:index]) for index, label in enumerate(labels)]
    at = next(i for i, v in enumerate(variables) if v["name"] == "job")
    out["templating"]["list"][at:at + 1] = chained
    return out  # type: ignore[no-any-return]


def dashboards(group_labels: Sequence[str] = GROUP_LABELS,
               overrides: Sequence[RouteOverride] = ()) -> dict[str, dict[str, Any]]:
    """Every dashboard, by file name, filtered on `group_labels` (default cluster,
    namespace, job: the labels the alerts aggregate by), drawing the per-route alert
    `overrides` the rules were generated with."""
    labels = check_group_labels(group_labels)
    _OVERRIDES[0] = tuple(overrides)
    try:
        return {name: _with_group_labels(build(), labels)
                for name, build in DASHBOARDS.items()}
    finally:
        _OVERRIDES[0] = ()


def render_dashboard(model: dict[str, Any]) -> str:
    """The checked-in text of a dashboard: sorted-key-free, indented JSON + newline."""
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


def dashboard_files(group_labels: Sequence[str] = GROUP_LABELS,
                    overrides: Sequence[RouteOverride] = ()) -> dict[str, str]:
    """File name -> text, as checked in under `dashboards/`."""
    return {name: render_dashboard(model)
            for name, model in dashboards(group_labels, overrides).items()}


def _walk_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in panels:
        out.append(panel)
        out.extend(_walk_panels(panel.get("panels", [])))
    return out


def queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """Every PromQL query of a dashboard as (where, expr): panel targets and the
    `label_values(...)` selectors of query variables."""
    found: list[tuple[str, str]] = []
    for panel in _walk_panels(model["panels"]):
        for target in panel.get("targets", []):
            found.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    for variable in model["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = query.removeprefix("label_values(").rsplit(",", 1)[0]
            found.append((f"variable {variable['name']}", inner))
    return found
