"""Prometheus metric definitions as data: the single source of truth.

`Telemetry` registers exactly these families; `docs/telemetry.md`, the generated Grafana
dashboards and the Prometheus rules read (or are tested against) the same tuple, so a
renamed metric cannot silently break a panel or an alert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FAST_BUCKETS",
    "INELIGIBLE_REASONS",
    "LATENCY_BUCKETS",
    "METRICS",
    "NEEDLESS_WITHIN_SECONDS",
    "RESPONSE_BUCKETS",
    "MetricSpec",
    "MetricType",
    "metric",
    "metrics_markdown_table",
]

MetricType = Literal["counter", "gauge", "histogram"]

#: Seconds; whole turns (routing, admission, answer playback): tens of ms to seconds.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
)
#: Seconds; decisions, admissions and acknowledgment generation. The embedded decision
#: service, in-process admissions and a template acknowledger take microseconds, an LLM
#: classifier, a remote admit() or an acknowledgment LLM hundreds of ms: steps of at most
#: 1.5x from 10 us to 2 s (0.3 s is the alert threshold), so a quantile is within 10% at
#: either end (tests/ops/test_buckets.py) and an in-process p95 is not read inside the
#: first bucket; every bound of `LATENCY_BUCKETS` is one (up to 10 s: a slow LLM
#: decision is not lost in +Inf).
FAST_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000015, 0.00002, 0.00003, 0.00004,
    0.00005, 0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.0004, 0.0005, 0.00075, 0.001,
    0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
)
#: Seconds; first response and silence. Acknowledgment delays live between 0.1 and 1.5 s,
#: so the steps there are 50 ms (then 100 ms to 2 s): a quantile read from buckets lands
#: within 10% of the exact one (tests/ops/test_buckets.py checks it on the demo's
#: latencies), and every candidate delay of the tuning view, plus the generation time and
#: the needless window, falls on a bound (no interpolation in the what-if).
RESPONSE_BUCKETS: tuple[float, ...] = (
    *(round(0.05 * i, 2) for i in range(1, 31)),
    1.6, 1.7, 1.8, 1.9, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 7.5, 10.0,
)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One Prometheus metric family as exposed (counter names include `_total`)."""

    name: str
    """The family's name as exposed (counters end in `_total`)."""
    type: MetricType
    """`"counter"`, `"gauge"` or `"histogram"`."""
    documentation: str
    """The HELP text."""
    labels: tuple[str, ...] = ()
    """Label names, all low-cardinality (never participant, turn or trace ids)."""
    buckets: tuple[float, ...] | None = None
    """Histogram bucket upper bounds in seconds (`+Inf` is implicit); None otherwise."""


#: Seconds the answer may start after a spoken acknowledgment for that acknowledgment
#: to count as needless (the participant heard "one moment" and then, at once, the answer).
NEEDLESS_WITHIN_SECONDS = 0.5

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "turnrouter_turns_total", "counter",
        "Turns handled, by the route that answered (none if no destination did) and outcome.",
        ("route", "outcome"),
    ),
    MetricSpec(
        "turnrouter_clarifications_total", "counter",
        "Turns the router answered with a clarification question, by reason.",
        ("reason",),
    ),
    MetricSpec(
        "turnrouter_admissions_total", "counter",
        "admit() calls by route, disposition (accept, decline, clarify, release, timeout, "
        "error, interrupted) and whether the route held focus.",
        ("route", "disposition", "focused"),
    ),
    MetricSpec(
        "turnrouter_reroutes_total", "counter",
        "Turns routed again after a route declined or released.",
        ("route",),
    ),
    MetricSpec(
        "turnrouter_default_fallbacks_total", "counter",
        "Turns answered by the default destination without admission after declines.",
        ("route",),
    ),
    MetricSpec(
        "turnrouter_failures_total", "counter",
        "Failures by route (none if no destination was involved) and stage.",
        ("route", "stage"),
    ),
    MetricSpec(
        "turnrouter_interruptions_total", "counter",
        "Turns that ended interrupted.",
    ),
    MetricSpec(
        "turnrouter_focus_transitions_total", "counter",
        "Focus taken, released or lost (the owner ineligible, or the participant gone or "
        "the router stopped while it held focus), by route.",
        ("route", "transition"),
    ),
    MetricSpec(
        "turnrouter_turn_duration_seconds", "histogram",
        "Turn duration from start to finish, by route and outcome.",
        ("route", "outcome"), LATENCY_BUCKETS,
    ),
    MetricSpec(
        "turnrouter_decision_duration_seconds", "histogram",
        "Decision-service call duration.",
        (), FAST_BUCKETS,
    ),
    MetricSpec(
        "turnrouter_admission_duration_seconds", "histogram",
        "admit() call duration, by route.",
        ("route",), FAST_BUCKETS,
    ),
    MetricSpec(
        "turnrouter_first_response_seconds", "histogram",
        "Time from the start of answer() to the destination's started() signal (with "
        "report_heard, as the Pipecat and LiveKit adapters route, to its first audio "
        "heard; the timing predictor's samples still end at started()), by route.",
        ("route",), RESPONSE_BUCKETS,
    ),
    MetricSpec(
        "turnrouter_first_response_interrupted_seconds", "histogram",
        "Time from the start of answer() to the turn's interruption, for answers "
        "interrupted before started() (or, with report_heard, barged in on before heard), "
        "by route: censored first responses (the true one "
        "is longer), which turnrouter tune and the tuning dashboard count as the timing "
        "samples do.",
        ("route",), RESPONSE_BUCKETS,
    ),
    MetricSpec(
        "turnrouter_silence_seconds", "histogram",
        "Time from admission to the first thing the participant hears (admission "
        "preamble, acknowledgment or answer), by route; acknowledgments on or off.",
        ("route",), RESPONSE_BUCKETS,
    ),
    MetricSpec(
        "turnrouter_acknowledgments_total", "counter",
        "Scheduled acknowledgments by route, outcome (emitted, suppressed, failed) and "
        "trigger (prediction, delay).",
        ("route", "outcome", "trigger"),
    ),
    MetricSpec(
        "turnrouter_acknowledgment_delay_seconds", "gauge",
        "Configured fallback acknowledgment delay (NaN when acknowledgments are off).",
    ),
    MetricSpec(
        "turnrouter_acknowledgment_route_delay_seconds", "gauge",
        "The fallback acknowledgment delay each route runs with: its "
        "acknowledgment_route_delays entry, else the router-wide delay (NaN when "
        "acknowledgments are off), by route.",
        ("route",),
    ),
    MetricSpec(
        "turnrouter_predicted_first_response_seconds", "gauge",
        "The timing predictor's current first-response estimate, by route (checked at most "
        "once a second per route).",
        ("route",),
    ),
    MetricSpec(
        "turnrouter_context_patches_total", "counter",
        "Background context patches by strategy and outcome.",
        ("strategy", "outcome"),
    ),
    MetricSpec(
        "turnrouter_runtime_rejected_messages_total", "counter",
        "Inputs refused before the router handled them, by topic (a runtime topic's name, "
        "nats_input, nats_timing, nats_control, nats_presence, nats_state, pipecat) and "
        "reason (invalid, wrong_type, closed, oversized, unknown_subject, foreign_id, not_owned, "
        "overflow, coalesced, dropped, unverified, handover_aborted, unknown_route, "
        "out_of_range, over_share, fleet_share, outlier, unknown_publisher, invalid_snapshot, "
        "invalid_ending, superseded, expired).",
        ("topic", "reason"),
    ),
    MetricSpec(
        "turnrouter_limit_overflows_total", "counter",
        "Bounds that overflowed (something dropped or refused), by limit: history_exchanges, "
        "seeded_history, waiting_turns, participants, departed_participants, patch_bytes, "
        "pending_patches, snapshot_history, release_timeout, participant_window.",
        ("limit",),
    ),
    MetricSpec(
        "turnrouter_active_participants", "gauge",
        "Participants the router currently holds state for.",
    ),
    MetricSpec(
        "turnrouter_turns_in_flight", "gauge",
        "Turns currently being handled.",
    ),
    MetricSpec(
        "turnrouter_event_loop_lag_seconds", "histogram",
        "How late the router's event loop ran a timer, sampled every "
        "OverloadPolicy.sample_secs while turns run: saturation (see docs/limits.md).",
        (), FAST_BUCKETS,
    ),
    MetricSpec(
        "turnrouter_turn_wait_seconds", "gauge",
        "The longest time a turn waited (behind its participant's earlier turn) before its "
        "routing began, over the latest lag sample period.",
    ),
    MetricSpec(
        "turnrouter_overload_state", "gauge",
        "Admission control: 0 ready, 1 busy (new participants refused, readiness fails), "
        "2 shedding (new turns of admitted participants refused too).",
    ),
    MetricSpec(
        "turnrouter_shed_turns_total", "counter",
        "Turns refused for load (outcome busy), by reason: new_participant (busy), "
        "shedding, or turns_in_flight (`OverloadPolicy.max_turns_in_flight` reached).",
        ("reason",),
    ),
    MetricSpec(
        "turnrouter_window_participants", "gauge",
        "Distinct participants with a turn in the last 60 s (a sliding window of at most "
        "10000 ids per thread; the denominator of the broad-clarification page).",
    ),
    MetricSpec(
        "turnrouter_window_clarified_participants", "gauge",
        "Distinct participants of turnrouter_window_participants whose latest turn was "
        "answered with a clarification question: one loud client counts once.",
    ),
    MetricSpec(
        "turnrouter_ineligible_routes_total", "counter",
        "Candidate routes skipped as ineligible when a turn was routed, by route and "
        "reason (unavailable, capacity, policy, not_candidate).",
        ("route", "reason"),
    ),
    MetricSpec(
        "turnrouter_needless_acknowledgments_total", "counter",
        "Spoken acknowledgments followed by the answer's start within "
        f"{NEEDLESS_WITHIN_SECONDS:g} s (heard, but the answer was right behind), by route "
        "and trigger (prediction: an early acknowledgment that turned out needless; delay).",
        ("route", "trigger"),
    ),
    MetricSpec(
        "turnrouter_acknowledgment_generation_seconds", "histogram",
        "Time to generate an acknowledgment (the acknowledgment LLM's call, or a template's "
        "microseconds), by route.",
        ("route",), FAST_BUCKETS,
    ),
)

#: Reasons `turnrouter_ineligible_routes_total` accepts (anything else is `other`).
INELIGIBLE_REASONS = frozenset({"unavailable", "capacity", "policy", "not_candidate"})

_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def metric(name: str) -> MetricSpec:
    """Return the definition of the metric exposed as `name` (KeyError if unknown)."""
    return _BY_NAME[name]


def _format_bucket(bound: float) -> str:
    return f"{bound:g}"


def metrics_markdown_table() -> str:
    """Render `METRICS` as the Markdown table used in `docs/telemetry.md`."""
    rows = [
        "| metric | type | labels | buckets (seconds) | description |",
        "|---|---|---|---|---|",
    ]
    for spec in METRICS:
        labels = ", ".join(spec.labels) if spec.labels else "—"
        buckets = " ".join(map(_format_bucket, spec.buckets)) if spec.buckets else "—"
        rows.append(
            f"| `{spec.name}` | {spec.type} | {labels} | {buckets} | {spec.documentation} |"
        )
    return "\n".join(rows) + "\n"
