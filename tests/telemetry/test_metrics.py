"""Metrics: values per event, exemplars, gauges, failure de-duplication, shared registries."""

from __future__ import annotations

import gc
import math
import re
import sys
import threading
import time
from typing import get_args

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, Sampler, SamplingResult
from opentelemetry.trace import NonRecordingSpan, NoOpTracerProvider, SpanContext, TraceFlags
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest

from turnrouter import DestinationResult, RouteDecision, RouterObserver
from turnrouter.events import (
    AcknowledgmentFinished,
    AdmissionFinished,
    AdmissionStarted,
    AnswerFinished,
    AnswerStarted,
    Clarification,
    ClarificationReason,
    Configured,
    ContextPatchEvent,
    DecisionFinished,
    DefaultFallback,
    EstimateChanged,
    Failure,
    FocusChanged,
    Heard,
    ParticipantChanged,
    ReleaseFinished,
    ReleaseStarted,
    Rerouted,
    SilenceMeasured,
    TurnFinished,
    TurnStarted,
)
from turnrouter.telemetry import EXEMPLAR_INTERVAL_SECS, METRICS, Telemetry
from turnrouter.telemetry._families import Latency, families_for

from .conftest import Rig, make_request, make_turn, openmetrics_latest
from .test_spans import answer_turn


def test_answered_turn_metrics(rig: Rig) -> None:
    """One answered turn updates turn, decision, admission, first-response and silence."""
    answer_turn(rig.telemetry)
    value = rig.value
    assert value("turnrouter_turns_total", route="weather", outcome="focus") == 1
    assert value("turnrouter_turn_duration_seconds_count", route="weather", outcome="focus") == 1
    assert value("turnrouter_decision_duration_seconds_count") == 1
    assert value("turnrouter_admissions_total", route="weather", disposition="accept",
                 focused="false") == 1
    assert value("turnrouter_admission_duration_seconds_count", route="weather") == 1
    assert value("turnrouter_first_response_seconds_sum", route="weather") == 0.42
    assert value("turnrouter_first_response_seconds_bucket", route="weather", le="0.4") == 0
    assert value("turnrouter_first_response_seconds_bucket", route="weather", le="0.5") == 1
    assert value("turnrouter_silence_seconds_sum", route="weather") == 0.45
    assert value("turnrouter_focus_transitions_total", route="weather",
                 transition="taken") == 1
    assert value("turnrouter_turns_in_flight") == 0
    assert value("turnrouter_interruptions_total") == 0


def test_turn_without_destination_has_route_none(rig: Rig) -> None:
    """A turn no destination answered is labelled route="none"."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    obs.clarification(Clarification("no_eligible_route"))
    obs.finished(TurnFinished("clarify", None, None, None, 0, None))
    assert rig.value("turnrouter_turns_total", route="none", outcome="clarify") == 1
    assert rig.value("turnrouter_clarifications_total", reason="no_eligible_route") == 1


@pytest.mark.parametrize("reason", ["no_eligible_route", "low_confidence", "destination",
                                    "default_unavailable", "decision_failed", "policy"])
def test_clarification_reasons(rig: Rig, reason: str) -> None:
    """Every clarification reason of the contract is a label value."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    obs.clarification(Clarification(reason))  # type: ignore[arg-type]
    obs.finished(TurnFinished("clarify", None, None, None, 1, None))
    assert rig.value("turnrouter_clarifications_total", reason=reason) == 1


def test_reroute_fallback_and_focused_admission(rig: Rig) -> None:
    """Reroutes, default fallbacks and focused admissions are counted per route."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), "music"))
    token = obs.admission_started(AdmissionStarted("music", True))
    obs.admission_finished(token, AdmissionFinished("music", True, "release", None, False))
    obs.focus_transition(FocusChanged("music", "released"))
    obs.reroute(Rerouted("music"))
    token = obs.admission_started(AdmissionStarted("weather", False))
    obs.admission_finished(token, AdmissionFinished("weather", False, "decline", None, False))
    obs.reroute(Rerouted("weather"))
    obs.default_fallback(DefaultFallback("conversation"))
    token = obs.answer_started(AnswerStarted("conversation", True))
    obs.answer_finished(token, AnswerFinished("conversation", DestinationResult(), None, False))
    obs.finished(TurnFinished("answer", "conversation", "music", None, 3, None))
    value = rig.value
    assert value("turnrouter_admissions_total", route="music", disposition="release",
                 focused="true") == 1
    assert value("turnrouter_reroutes_total", route="music") == 1
    assert value("turnrouter_reroutes_total", route="weather") == 1
    assert value("turnrouter_default_fallbacks_total", route="conversation") == 1
    assert value("turnrouter_focus_transitions_total", route="music",
                 transition="released") == 1
    assert value("turnrouter_turns_total", route="conversation", outcome="answer") == 1


def test_failure_stages(rig: Rig) -> None:
    """Each failing stage is counted once, under its route (none without one)."""
    turn = make_turn()
    obs = rig.telemetry.turn_started(TurnStarted(turn, None))
    request = make_request(turn)
    token = obs.decision_started(request)
    obs.decision_finished(token, DecisionFinished(request, None, ConnectionError()))
    token = obs.admission_started(AdmissionStarted("weather", False))
    obs.admission_finished(token, AdmissionFinished("weather", False, "decline", None, True))
    token = obs.admission_started(AdmissionStarted("music", False))
    obs.admission_finished(token, AdmissionFinished("music", False, None, KeyError("x"), False))
    now = time.monotonic()
    obs.acknowledgment(AcknowledgmentFinished(
        "news", "failed", "delay", 0.8, None, now, now, "", RuntimeError()))
    token = obs.release_started(ReleaseStarted("news", "reroute"))
    obs.release_finished(token, ReleaseFinished("news", "reroute", RuntimeError()))
    token = obs.answer_started(AnswerStarted("conversation", True))
    error = RuntimeError("boom")
    obs.answer_finished(token, AnswerFinished("conversation", None, error, False))
    obs.finished(TurnFinished("failed", "conversation", None, None, 2, error))
    value = rig.value
    assert value("turnrouter_failures_total", route="none", stage="decision") == 1
    assert value("turnrouter_failures_total", route="weather", stage="admission") == 1
    assert value("turnrouter_failures_total", route="music", stage="admission") == 1
    assert value("turnrouter_failures_total", route="news", stage="acknowledgment") == 1
    assert value("turnrouter_failures_total", route="news", stage="release") == 1
    assert value("turnrouter_failures_total", route="conversation", stage="answer") == 1
    assert value("turnrouter_admissions_total", route="weather", disposition="timeout",
                 focused="false") == 1
    assert value("turnrouter_admissions_total", route="music", disposition="error",
                 focused="false") == 1
    assert value("turnrouter_acknowledgments_total", route="news", outcome="failed",
                 trigger="delay") == 1
    assert value("turnrouter_turns_total", route="conversation", outcome="failed") == 1


def test_failure_call_for_an_already_counted_error_is_not_double_counted(rig: Rig) -> None:
    """failure() for an error a stage callback already reported does not count it again."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    token = obs.answer_started(AnswerStarted("weather", False))
    error = RuntimeError("boom")
    obs.answer_finished(token, AnswerFinished("weather", None, error, False))
    obs.failure(Failure("weather", "answer", error))
    token = obs.admission_started(AdmissionStarted("music", False))
    obs.admission_finished(token, AdmissionFinished("music", False, "decline", None, True))
    obs.failure(Failure("music", "admission", TimeoutError()))
    obs.failure(Failure("weather", "answer", RuntimeError("another")))
    obs.finished(TurnFinished("failed", "weather", None, None, 1, error))
    assert rig.value("turnrouter_failures_total", route="weather", stage="answer") == 2
    assert rig.value("turnrouter_failures_total", route="music", stage="admission") == 1


def test_router_level_failures(rig: Rig) -> None:
    """Departure release failures and cleanup failures are counted outside turns."""
    telemetry = rig.telemetry
    error = RuntimeError("release failed")
    token = telemetry.release_started(ReleaseStarted("weather", "departure"))
    telemetry.release_finished(token, ReleaseFinished("weather", "departure", error))
    telemetry.failure(Failure("weather", "release", error))
    telemetry.failure(Failure(None, "cleanup", ValueError()))
    assert rig.value("turnrouter_failures_total", route="weather", stage="release") == 1
    assert rig.value("turnrouter_failures_total", route="none", stage="cleanup") == 1


def test_interrupted_turn_counts_interruption_not_failure(rig: Rig) -> None:
    """An interrupted answer counts an interruption and no answer failure."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    token = obs.answer_started(AnswerStarted("weather", False))
    obs.answer_finished(token, AnswerFinished("weather", None, None, True))
    obs.finished(TurnFinished("interrupted", "weather", None, None, 1, None))
    assert rig.value("turnrouter_interruptions_total") == 1
    assert rig.value("turnrouter_turns_total", route="weather", outcome="interrupted") == 1
    assert rig.value("turnrouter_failures_total", route="weather", stage="answer") is None


def test_in_flight_and_participant_gauges(rig: Rig) -> None:
    """Gauges follow turns and participants, and a repeated finished() is ignored."""
    telemetry = rig.telemetry
    telemetry.participant_added(ParticipantChanged("alice"))
    telemetry.participant_added(ParticipantChanged("bob"))
    first = telemetry.turn_started(TurnStarted(make_turn(), None))
    second = telemetry.turn_started(TurnStarted(make_turn(participant="bob"), None))
    assert rig.value("turnrouter_turns_in_flight") == 2
    second.finished(TurnFinished("answer", "weather", None, None, 1, None))
    first.finished(TurnFinished("answer", "weather", None, None, 1, None))
    first.finished(TurnFinished("answer", "weather", None, None, 1, None))
    assert rig.value("turnrouter_turns_in_flight") == 0
    assert rig.value("turnrouter_turns_total", route="weather", outcome="answer") == 2
    telemetry.participant_removed(ParticipantChanged("alice"))
    assert rig.value("turnrouter_active_participants") == 1


def test_configured_and_predicted_gauges(rig: Rig) -> None:
    """configured() publishes the delay (NaN when off); predictions are per route."""
    rig.telemetry.configured(Configured(("weather",), 0.8))
    assert rig.value("turnrouter_acknowledgment_delay_seconds") == 0.8
    rig.telemetry.predicted_first_response(EstimateChanged("weather", 1.25))
    assert rig.value("turnrouter_predicted_first_response_seconds", route="weather") == 1.25
    rig.telemetry.configured(Configured(("weather",), None))
    delay = rig.value("turnrouter_acknowledgment_delay_seconds")
    assert delay is not None
    assert math.isnan(delay)


def test_route_delay_gauge_follows_the_overrides(rig: Rig) -> None:
    """Each route's gauge holds the delay it runs with: its own, else the router-wide
    one; NaN for every route when acknowledgments are off."""
    rig.telemetry.configured(Configured(("weather", "banking"), 0.8, (("banking", 1.7),)))
    assert rig.value("turnrouter_acknowledgment_route_delay_seconds", route="banking") == 1.7
    assert rig.value("turnrouter_acknowledgment_route_delay_seconds", route="weather") == 0.8
    assert rig.value("turnrouter_acknowledgment_delay_seconds") == 0.8
    rig.telemetry.configured(Configured(("weather",), None))
    delay = rig.value("turnrouter_acknowledgment_route_delay_seconds", route="weather")
    assert delay is not None and math.isnan(delay)


def test_acknowledgment_counter_and_context_patches(rig: Rig) -> None:
    """Acknowledgments count by route, outcome and trigger; patches by strategy, outcome."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    now = time.monotonic()
    obs.acknowledgment(AcknowledgmentFinished(
        "weather", "emitted", "prediction", 0.8, 1.5, now, now, "ok", None))
    obs.acknowledgment(AcknowledgmentFinished(
        "weather", "suppressed", "delay", 0.8, None, now, now, "", None))
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
    rig.telemetry.context_patch(
        ContextPatchEvent("p1", "patch-1", "task-1", "append", "applied", False))
    assert rig.value("turnrouter_acknowledgments_total", route="weather", outcome="emitted",
                     trigger="prediction") == 1
    assert rig.value("turnrouter_acknowledgments_total", route="weather", outcome="suppressed",
                     trigger="delay") == 1
    assert rig.value("turnrouter_context_patches_total", strategy="append",
                     outcome="applied") == 1


EXEMPLAR = re.compile(
    r'^(?P<series>\S+) \S+ '
    r'# \{span_id="(?P<span>[0-9a-f]{16})",trace_id="(?P<trace>[0-9a-f]{32})"\}',
    re.MULTILINE,
)


def test_latency_histograms_carry_trace_exemplars(rig: Rig) -> None:
    """Latency histograms have exemplars pointing at the span of the measured operation."""
    answer_turn(rig.telemetry)
    found: dict[str, tuple[str, str]] = {}
    for match in EXEMPLAR.finditer(rig.openmetrics()):
        family = match["series"].split("_bucket")[0]
        found[family] = (match["trace"], match["span"])
    turn = rig.span("turnrouter.turn")
    trace_id = format(turn.context.trace_id, "032x")

    def span_id(name: str) -> str:
        return format(rig.span(name).context.span_id, "016x")

    assert found == {
        "turnrouter_turn_duration_seconds": (trace_id, span_id("turnrouter.turn")),
        "turnrouter_decision_duration_seconds": (trace_id, span_id("turnrouter.route")),
        "turnrouter_admission_duration_seconds": (trace_id, span_id("turnrouter.admission")),
        "turnrouter_first_response_seconds": (trace_id, span_id("invoke_agent weather")),
        "turnrouter_silence_seconds": (trace_id, span_id("turnrouter.turn")),
    }


class _RecordOnly(Sampler):
    """Records every span without sampling it (the SDK's RECORD_ONLY decision)."""

    def should_sample(self, *args: object, **kwargs: object) -> SamplingResult:
        return SamplingResult(Decision.RECORD_ONLY)

    def get_description(self) -> str:
        return "record only"


def test_exemplars_come_from_sampled_spans_only() -> None:
    """A recorded but unsampled turn (a RECORD_ONLY sampler: its trace is never exported)
    leaves no exemplar pointing at it; its observations are still counted."""
    registry = CollectorRegistry()
    telemetry = Telemetry(tracer_provider=TracerProvider(sampler=_RecordOnly()),
                          registry=registry)
    answer_turn(telemetry)
    exposition = openmetrics_latest(registry).decode()
    assert EXEMPLAR.findall(exposition) == []
    assert registry.get_sample_value(
        "turnrouter_first_response_seconds_count", {"route": "weather"}) == 1


def _bucket_exemplars(registry: CollectorRegistry, name: str = "turnrouter_silence_seconds",
                      ) -> dict[str, tuple[str, float]]:
    """`le` -> (trace id, value) of each bucket exemplar of one histogram family."""
    (family,) = [family for family in registry.collect() if family.name == name]
    return {sample.labels["le"]: (sample.exemplar.labels["trace_id"], sample.exemplar.value)
            for sample in family.samples if sample.exemplar is not None}


def _silent_turn(telemetry: RouterObserver, seconds: float, turn_id: str = "t1") -> None:
    """One turn whose participant heard `seconds` of silence (a traced observation, in
    RESPONSE_BUCKETS, whose exemplar points at the turn span)."""
    obs = telemetry.turn_started(TurnStarted(make_turn(turn_id=turn_id), None))
    obs.silence(SilenceMeasured("weather", seconds))
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))


def _turn_traces(rig: Rig) -> list[str]:
    """The trace ids of the turn spans, in end order."""
    return [format(span.context.trace_id, "032x") for span in rig.spans("turnrouter.turn")]


def test_a_bucket_keeps_its_exemplar_within_the_interval(rig: Rig) -> None:
    """Observations falling in one bucket within EXEMPLAR_INTERVAL_SECS of its exemplar
    leave it pointing at the first one; every observation is counted."""
    assert EXEMPLAR_INTERVAL_SECS == 1.0  # docs/telemetry.md: one per second
    _silent_turn(rig.telemetry, 0.42, "t1")
    _silent_turn(rig.telemetry, 0.43, "t2")
    first, _ = _turn_traces(rig)
    assert _bucket_exemplars(rig.registry) == {"0.45": (first, 0.42)}
    assert rig.value("turnrouter_silence_seconds_count", route="weather") == 2


def test_exemplar_limit_is_per_bucket(rig: Rig) -> None:
    """A recent exemplar in one bucket does not hold back another bucket's (tail included)."""
    for n, seconds in enumerate((0.1, 0.1000001, 42.0)):  # 0.1 is on a bound: le=0.1
        _silent_turn(rig.telemetry, seconds, f"t{n}")
    a, b, c = _turn_traces(rig)
    assert _bucket_exemplars(rig.registry) == {
        "0.1": (a, 0.1), "0.15": (b, 0.1000001), "+Inf": (c, 42.0)}


# The window's end needs a clock: Telemetry reads perf_counter() itself and has no clock
# seam, so only this test drives one histogram child with explicit times (unavoidable
# private names; a sleep would be the only public way).
_SHARDS: list[object] = []  # the probes' shards, kept alive for the test's reads


def _probe() -> tuple[CollectorRegistry, Latency]:
    """One turn-duration child (LATENCY_BUCKETS) on a fresh registry."""
    registry = CollectorRegistry()
    shard = families_for(registry)
    _SHARDS.append(shard)
    return registry, shard.turn_duration.get("weather", "answer")


def _span(trace: str, span_id: int) -> NonRecordingSpan:
    """A span whose context carries these ids (the exemplar's source)."""
    return NonRecordingSpan(SpanContext(int(trace, 16), span_id, is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))


def test_exemplars_are_limited_per_bucket_in_time() -> None:
    """A bucket keeps its exemplar for EXEMPLAR_INTERVAL_SECS, then takes the next one."""
    registry, latency = _probe()
    latency.observe_traced(0.42, 100.0, _span("a" * 32, 1))
    latency.observe_traced(0.43, 100.0 + EXEMPLAR_INTERVAL_SECS / 2, _span("b" * 32, 2))
    name = "turnrouter_turn_duration_seconds"
    assert _bucket_exemplars(registry, name) == {"0.5": ("a" * 32, 0.42)}
    latency.observe_traced(0.44, 100.0 + EXEMPLAR_INTERVAL_SECS, _span("c" * 32, 3))
    assert _bucket_exemplars(registry, name) == {"0.5": ("c" * 32, 0.44)}
    assert registry.get_sample_value(
        "turnrouter_turn_duration_seconds_count",
        {"route": "weather", "outcome": "answer"}) == 3


class _SmallIds(IdGenerator):
    """Trace id 10 and span id 255: ids whose hex needs leading zeros."""

    def generate_trace_id(self) -> int:
        return 10

    def generate_span_id(self) -> int:
        return 255


def test_exemplar_ids_are_zero_padded_hex() -> None:
    """Exemplar ids are the 32- and 16-digit hex Prometheus and Grafana expect."""
    registry = CollectorRegistry()
    provider = TracerProvider(sampler=ALWAYS_ON, id_generator=_SmallIds())
    _silent_turn(Telemetry(tracer_provider=provider, registry=registry), 0.2)
    (family,) = [family for family in registry.collect()
                 if family.name == "turnrouter_silence_seconds"]
    (exemplar,) = [sample.exemplar for sample in family.samples if sample.exemplar]
    assert exemplar.labels == {"trace_id": "0" * 31 + "a", "span_id": "00000000000000ff"}


def test_two_telemetry_objects_share_one_registry(rig: Rig) -> None:
    """Several routers' Telemetry on one registry share families instead of failing."""
    other = Telemetry(tracer_provider=rig.tracer_provider, registry=rig.registry)
    answer_turn(rig.telemetry)
    answer_turn(other)
    assert rig.value("turnrouter_turns_total", route="weather", outcome="focus") == 2


def test_default_registry_can_be_shared() -> None:
    """Telemetry() twice on prometheus_client's default registry does not raise."""
    first, second = Telemetry(), Telemetry()
    assert first.registry is REGISTRY
    assert second.registry is REGISTRY
    assert REGISTRY.get_sample_value("turnrouter_turns_in_flight") is not None


def test_registration_conflict_leaves_registry_unchanged() -> None:
    """A registry that already holds one of the names is left as it was."""
    from prometheus_client import Counter

    registry = CollectorRegistry()
    Counter("turnrouter_silence_seconds", "squatter", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Telemetry(registry=registry)
    names = {family.name for family in registry.collect()}
    assert names == {"turnrouter_silence_seconds"}


FORBIDDEN_LABELS = {"participant", "participant_id", "turn", "turn_id", "trace", "trace_id",
                    "span_id", "query", "user"}


def test_no_high_cardinality_labels(rig: Rig) -> None:
    """No metric is labelled by participant, turn or trace."""
    answer_turn(rig.telemetry)
    for spec in METRICS:
        assert not FORBIDDEN_LABELS & set(spec.labels), spec.name
    for family in rig.registry.collect():
        for sample in family.samples:
            assert not FORBIDDEN_LABELS & set(sample.labels), sample
            assert "alice" not in sample.labels.values()


def test_boolean_labels_are_true_false(rig: Rig) -> None:
    """The focused label takes the values "true" and "false"."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), "weather"))
    for focused in (True, False):
        token = obs.admission_started(AdmissionStarted("weather", focused))
        obs.admission_finished(token, AdmissionFinished("weather", focused, "accept", None, False))
    obs.finished(TurnFinished("answer", "weather", "weather", "weather", 1, None))
    values = {sample.labels["focused"] for family in rig.registry.collect()
              if family.name == "turnrouter_admissions" for sample in family.samples
              if "focused" in sample.labels}
    assert values == {"true", "false"}


def test_decision_only_counts_duration(rig: Rig) -> None:
    """A decision without scores still observes decision latency."""
    turn = make_turn()
    obs = rig.telemetry.turn_started(TurnStarted(turn, None))
    request = make_request(turn)
    token = obs.decision_started(request)
    obs.decision_finished(token, DecisionFinished(request, RouteDecision("weather"), None))
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
    assert rig.value("turnrouter_decision_duration_seconds_count") == 1


def _heard(telemetry: Telemetry, route: str, first: float, silence: float | None) -> None:
    telemetry.heard(Heard(route, first, silence))


def test_exposition_matches_prometheus_client_classes() -> None:
    """Counters and histograms expose exactly the series prometheus_client's own would."""
    ours, reference = CollectorRegistry(), CollectorRegistry()
    telemetry = Telemetry(tracer_provider=NoOpTracerProvider(), registry=ours)
    spec = {s.name: s for s in METRICS}
    first = spec["turnrouter_first_response_seconds"]
    histogram = Histogram(first.name, first.documentation, first.labels,
                          registry=reference, buckets=first.buckets or ())
    rerouted = spec["turnrouter_reroutes_total"]
    counter = Counter(rerouted.name, rerouted.documentation, rerouted.labels,
                      registry=reference)
    observer = telemetry.turn_started(TurnStarted(make_turn(), None))
    for route, seconds in (("weather", 0.05), ("weather", 0.25), ("music", 12.0),
                           ("weather", 0.0), ("music", 0.051)):
        _heard(telemetry, route, seconds, None)
        histogram.labels(route).observe(seconds)
        observer.reroute(Rerouted(route))
        counter.labels(route).inc()
    observer.finished(TurnFinished("answer", "weather", None, None, 1, None))

    def series(registry: CollectorRegistry, name: str) -> list[tuple[str, str, float]]:
        (family,) = [f for f in registry.collect() if f.name == name]
        return sorted((s.name, repr(sorted(s.labels.items())), s.value)
                      for s in family.samples if not s.name.endswith("_created"))

    for name in ("turnrouter_first_response_seconds", "turnrouter_reroutes"):
        assert series(ours, name) == series(reference, name)
    created = [s for f in ours.collect() for s in f.samples if s.name.endswith("_created")]
    assert created and all(abs(s.value - time.time()) < 3600 for s in created)


def test_counts_of_a_collected_telemetry_stay_in_the_registry() -> None:
    """A Telemetry that is garbage-collected leaves its counts behind (counters never drop)."""
    registry = CollectorRegistry()
    telemetry = Telemetry(tracer_provider=NoOpTracerProvider(), registry=registry)
    answer_turn(telemetry)
    _heard(telemetry, "weather", 0.3, 0.2)
    del telemetry
    gc.collect()
    labels = {"route": "weather", "outcome": "focus"}
    assert registry.get_sample_value("turnrouter_turns_total", labels) == 1
    assert registry.get_sample_value("turnrouter_first_response_seconds_count",
                                     {"route": "weather"}) == 2
    assert registry.get_sample_value("turnrouter_interruptions_total") == 0
    answer_turn(Telemetry(tracer_provider=NoOpTracerProvider(), registry=registry))
    assert registry.get_sample_value("turnrouter_turns_total", labels) == 2


@pytest.mark.parametrize("shared", [True, False], ids=["one-telemetry", "one-per-thread"])
def test_threads_recording_at_once_lose_no_update(shared: bool) -> None:
    """Threads recording through one Telemetry or one each, one registry: every count
    arrives, with scrapes meanwhile."""
    registry = CollectorRegistry()
    # 600 each: thousands of thread switches inside the recording at this switch
    # interval (1,500 took 2 min of a loaded CI machine, mostly scraping the children).
    per_thread, threads = 600, 4
    start = threading.Barrier(threads + 1)
    common = Telemetry(tracer_provider=NoOpTracerProvider(), registry=registry)

    def work() -> None:
        telemetry = common if shared else Telemetry(
            tracer_provider=NoOpTracerProvider(), registry=registry)
        start.wait(timeout=30)
        for index in range(per_thread):
            observer = telemetry.turn_started(TurnStarted(make_turn(), None))
            observer.reroute(Rerouted("weather"))
            # The threads create the same new child at once (a race unless each thread
            # has its own children).
            observer.reroute(Rerouted(f"route-{index}"))
            observer.finished(TurnFinished("answer", "weather", None, None, 1, None))
            _heard(telemetry, "weather", 0.1, None)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often enough to make races show
    try:
        for worker in workers:
            worker.start()
        start.wait(timeout=30)
        while any(worker.is_alive() for worker in workers):  # scrape while they count
            generate_latest(registry)
            workers[0].join(timeout=0.05)
        for worker in workers:
            worker.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    total = per_thread * threads
    assert registry.get_sample_value("turnrouter_reroutes_total", {"route": "weather"}) == total
    assert all(registry.get_sample_value("turnrouter_reroutes_total", {"route": f"route-{i}"})
               == threads for i in range(per_thread))
    assert registry.get_sample_value(
        "turnrouter_turns_total", {"route": "weather", "outcome": "answer"}) == total
    assert registry.get_sample_value("turnrouter_first_response_seconds_count",
                                     {"route": "weather"}) == total
    assert registry.get_sample_value("turnrouter_turns_in_flight") == 0


def test_low_cardinality_reason_series_exist_at_zero_before_any_turn() -> None:
    """Every clarification and shed reason is exposed at 0 from the first scrape, so a
    reason's first increment shows in `rate()` one scrape later, not two."""
    registry = CollectorRegistry()
    Telemetry(registry=registry)
    reasons = get_args(ClarificationReason)
    assert len(reasons) >= 6
    for reason in reasons:
        assert registry.get_sample_value(
            "turnrouter_clarifications_total", {"reason": reason}) == 0.0, reason
    for reason in ("new_participant", "shedding", "turns_in_flight"):
        assert registry.get_sample_value(
            "turnrouter_shed_turns_total", {"reason": reason}) == 0.0, reason
