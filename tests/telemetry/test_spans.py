"""Spans: names, the flat parent/child timeline, attributes per outcome, content capture."""

from __future__ import annotations

import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode
from prometheus_client import REGISTRY, CollectorRegistry

from turnrouter import DestinationResult, RouteDecision, RouterObserver
from turnrouter.events import (
    AcknowledgmentFinished,
    AdmissionFinished,
    AdmissionStarted,
    AnswerFinished,
    AnswerStarted,
    Clarification,
    Configured,
    DecisionFinished,
    FirstResponse,
    FocusChanged,
    ParticipantChanged,
    ReleaseFinished,
    ReleaseStarted,
    SilenceMeasured,
    TurnFinished,
    TurnStarted,
)
from turnrouter.telemetry import ATTR, CONTENT_CAPTURE_ENV, EVENT_FIRST_RESPONSE, Telemetry

from .conftest import Rig, make_request, make_turn, openmetrics_latest


def answer_turn(telemetry: RouterObserver, *, focus: str | None = None) -> None:
    """Drive one routed, admitted, answered turn through the observer seam."""
    turn = make_turn()
    obs = telemetry.turn_started(TurnStarted(turn, focus))
    request = make_request(turn)
    token = obs.decision_started(request)
    obs.decision_finished(token, DecisionFinished(request, RouteDecision(
        "weather", 0.9, {"weather": 0.9, "music": 0.2, "news": 0.1, "sport": 0.05},
        rationale="lexical: weather"), None))
    token = obs.admission_started(AdmissionStarted("weather", False))
    obs.admission_finished(token, AdmissionFinished("weather", False, "accept", None, False))
    token = obs.answer_started(AnswerStarted("weather", False))
    obs.first_response(token, FirstResponse("weather", 0.42))
    obs.silence(SilenceMeasured("weather", 0.45))
    obs.answer_finished(token, AnswerFinished(
        "weather", DestinationResult("focus", "It is sunny"), None, False))
    obs.focus_transition(FocusChanged("weather", "taken"))
    obs.finished(TurnFinished("focus", "weather", focus, "weather", 1, None))


def attrs(span: ReadableSpan) -> dict[str, object]:
    """A span's attributes as a plain dict."""
    return dict(span.attributes or {})


def parent_id(span: ReadableSpan) -> int | None:
    """The parent span id, if any."""
    return span.parent.span_id if span.parent is not None else None


def test_turn_is_child_of_callers_span_and_children_are_flat(rig: Rig) -> None:
    """The turn span nests under the caller's span; every other span is its direct child."""
    tracer = rig.tracer_provider.get_tracer("caller")
    with tracer.start_as_current_span("caller") as caller:
        answer_turn(rig.telemetry)
    turn = rig.span("turnrouter.turn")
    assert parent_id(turn) == caller.get_span_context().span_id
    children = [rig.span(name) for name in
                ("turnrouter.route", "turnrouter.admission", "invoke_agent weather")]
    for child in children:
        assert parent_id(child) == turn.context.span_id
        assert child.context.trace_id == turn.context.trace_id
        assert child.kind is SpanKind.INTERNAL
    assert turn.kind is SpanKind.INTERNAL
    assert rig.spans("caller")[0].context.trace_id == turn.context.trace_id


def test_tracer_is_named_turnrouter(rig: Rig) -> None:
    """Spans come from the instrumentation scope "turnrouter"."""
    answer_turn(rig.telemetry)
    scopes = {span.instrumentation_scope.name for span in rig.spans()
              if span.instrumentation_scope is not None}
    assert scopes == {"turnrouter"}


def test_turn_attributes_for_an_answered_turn(rig: Rig) -> None:
    """The turn span carries ids, outcome, route, focus and attempts."""
    answer_turn(rig.telemetry, focus="music")
    turn = attrs(rig.span("turnrouter.turn"))
    assert turn == {
        ATTR.PARTICIPANT_ID: "alice",
        ATTR.TURN_ID: "t1",
        ATTR.OUTCOME: "focus",
        ATTR.ROUTE: "weather",
        ATTR.FOCUS_BEFORE: "music",
        ATTR.FOCUS_AFTER: "weather",
        ATTR.ATTEMPTS: 1,
    }
    assert rig.span("turnrouter.turn").status.status_code is StatusCode.UNSET


def test_route_span_attributes(rig: Rig) -> None:
    """The route span records choice, confidence, candidates, exclusions, margin, top 3."""
    turn = make_turn()
    obs = rig.telemetry.turn_started(TurnStarted(turn, None))
    request = make_request(turn, ("weather", "music", "news", "sport"), excluded=("home",))
    token = obs.decision_started(request)
    obs.decision_finished(token, DecisionFinished(request, RouteDecision(
        "weather", 0.75, {"weather": 0.9, "music": 0.2, "news": 0.1, "sport": 0.05}), None))
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
    route = attrs(rig.span("turnrouter.route"))
    assert route[ATTR.DECISION_CHOICE] == "weather"
    assert route[ATTR.DECISION_CONFIDENCE] == 0.75
    assert route[ATTR.DECISION_CANDIDATES] == ("weather", "music", "news", "sport")
    assert route[ATTR.DECISION_EXCLUDED] == ("home",)
    assert route[ATTR.DECISION_MARGIN] == pytest.approx(0.7)
    scores = {key: value for key, value in route.items()
              if key.startswith(ATTR.DECISION_SCORES_PREFIX)}
    assert scores == {"turnrouter.decision.scores.weather": 0.9,
                      "turnrouter.decision.scores.music": 0.2,
                      "turnrouter.decision.scores.news": 0.1}


def test_route_span_without_scores_has_no_margin(rig: Rig) -> None:
    """A bare decision records its choice and no score attributes."""
    turn = make_turn()
    obs = rig.telemetry.turn_started(TurnStarted(turn, None))
    request = make_request(turn)
    token = obs.decision_started(request)
    obs.decision_finished(token, DecisionFinished(request, RouteDecision("clarify"), None))
    obs.clarification(Clarification("low_confidence"))
    obs.finished(TurnFinished("clarify", None, None, None, 1, None))
    route = attrs(rig.span("turnrouter.route"))
    assert route[ATTR.DECISION_CHOICE] == "clarify"
    assert ATTR.DECISION_MARGIN not in route
    assert ATTR.DECISION_CONFIDENCE not in route
    turn_attrs = attrs(rig.span("turnrouter.turn"))
    assert turn_attrs[ATTR.OUTCOME] == "clarify"
    assert ATTR.ROUTE not in turn_attrs
    assert turn_attrs["turnrouter.clarification.reason"] == "low_confidence"


def test_decision_error_marks_route_span(rig: Rig) -> None:
    """A failed decision call sets status ERROR and error.type on the route span."""
    turn = make_turn()
    obs = rig.telemetry.turn_started(TurnStarted(turn, None))
    request = make_request(turn)
    token = obs.decision_started(request)
    obs.decision_finished(
        token, DecisionFinished(request, None, ConnectionError("classifier down")))
    obs.finished(TurnFinished("answer", "conversation", None, None, 1, None))
    route = rig.span("turnrouter.route")
    assert route.status.status_code is StatusCode.ERROR
    assert attrs(route)[ATTR.ERROR_TYPE] == "ConnectionError"
    assert rig.span("turnrouter.turn").status.status_code is StatusCode.UNSET


def test_admission_span_attributes(rig: Rig) -> None:
    """Admission spans record route, disposition, focus, and timeouts as errors."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), "weather"))
    token = obs.admission_started(AdmissionStarted("weather", True))
    obs.admission_finished(token, AdmissionFinished("weather", True, "decline", None, False))
    token = obs.admission_started(AdmissionStarted("music", False))
    obs.admission_finished(token, AdmissionFinished("music", False, "decline", None, True))
    obs.finished(TurnFinished("clarify", None, "weather", "weather", 2, None))
    first, second = rig.spans("turnrouter.admission")
    assert attrs(first) == {ATTR.ROUTE: "weather", ATTR.ADMISSION_FOCUSED: True,
                            ATTR.ADMISSION_DISPOSITION: "decline"}
    assert attrs(second)[ATTR.ADMISSION_DISPOSITION] == "timeout"
    assert attrs(second)[ATTR.ADMISSION_TIMED_OUT] is True
    assert second.status.status_code is StatusCode.ERROR
    assert attrs(second)[ATTR.ERROR_TYPE] == "timeout"


def test_invoke_agent_span(rig: Rig) -> None:
    """invoke_agent carries GenAI attributes, the first-response event and disposition."""
    answer_turn(rig.telemetry)
    span = rig.span("invoke_agent weather")
    assert attrs(span) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "weather",
        ATTR.FALLBACK: False,
        ATTR.FIRST_RESPONSE_SECONDS: 0.42,
        ATTR.RESULT_DISPOSITION: "focus",
    }
    (event,) = span.events
    assert event.name == EVENT_FIRST_RESPONSE
    assert dict(event.attributes or {}) == {ATTR.FIRST_RESPONSE_SECONDS: 0.42}


def test_invoke_agent_span_is_current_during_answer(rig: Rig) -> None:
    """The agent's own spans nest under invoke_agent; the caller's context is restored."""
    tracer = rig.tracer_provider.get_tracer("caller")
    with tracer.start_as_current_span("caller") as caller:
        obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
        in_turn = trace.get_current_span()
        token = obs.answer_started(AnswerStarted("weather", True))
        with tracer.start_as_current_span("agent work"):
            pass
        obs.answer_finished(token, AnswerFinished("weather", DestinationResult(), None, False))
        after_answer = trace.get_current_span()
        obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
        assert trace.get_current_span() is caller
    turn = rig.span("turnrouter.turn")
    assert in_turn.get_span_context().span_id == turn.context.span_id
    assert after_answer.get_span_context().span_id == turn.context.span_id
    invoke = rig.span("invoke_agent weather")
    assert parent_id(rig.span("agent work")) == invoke.context.span_id
    assert attrs(invoke)[ATTR.FALLBACK] is True


def test_failed_answer_marks_invoke_and_turn(rig: Rig) -> None:
    """An answer that raises sets ERROR and error.type on invoke_agent and the turn."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    token = obs.answer_started(AnswerStarted("weather", False))
    error = RuntimeError("agent crashed")
    obs.answer_finished(token, AnswerFinished("weather", None, error, False))
    obs.finished(TurnFinished("failed", "weather", None, None, 1, error))
    for name in ("invoke_agent weather", "turnrouter.turn"):
        span = rig.span(name)
        assert span.status.status_code is StatusCode.ERROR
        assert attrs(span)[ATTR.ERROR_TYPE] == "RuntimeError"
    assert attrs(rig.span("turnrouter.turn"))[ATTR.OUTCOME] == "failed"


def test_interrupted_turn_is_marked_not_failed(rig: Rig) -> None:
    """An interrupted turn says so and is not an error."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    token = obs.answer_started(AnswerStarted("weather", False))
    obs.answer_finished(token, AnswerFinished("weather", None, None, True))
    obs.finished(TurnFinished("interrupted", "weather", None, None, 1, None))
    for name in ("invoke_agent weather", "turnrouter.turn"):
        span = rig.span(name)
        assert attrs(span)[ATTR.INTERRUPTED] is True
        assert span.status.status_code is StatusCode.UNSET
    assert attrs(rig.span("turnrouter.turn"))[ATTR.OUTCOME] == "interrupted"


def test_unfinished_answer_is_closed_with_the_turn(rig: Rig) -> None:
    """If answer_finished never came, finished() closes invoke_agent and restores context."""
    with rig.tracer_provider.get_tracer("caller").start_as_current_span("caller") as caller:
        obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
        obs.answer_started(AnswerStarted("weather", False))
        obs.finished(TurnFinished("interrupted", "weather", None, None, 1, None))
        assert trace.get_current_span() is caller
    assert attrs(rig.span("invoke_agent weather"))[ATTR.INTERRUPTED] is True


def test_release_spans_in_and_outside_turns(rig: Rig) -> None:
    """Releases in a turn are its children; departures nest under the caller's span."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), "music"))
    token = obs.release_started(ReleaseStarted("music", "focus_taken"))
    obs.release_finished(token, ReleaseFinished("music", "focus_taken", ValueError("bad")))
    obs.finished(TurnFinished("answer", "weather", "music", "weather", 1, None))
    with rig.tracer_provider.get_tracer("caller").start_as_current_span("departure") as departure:
        token = rig.telemetry.release_started(ReleaseStarted("weather", "departure"))
        rig.telemetry.release_finished(token, ReleaseFinished("weather", "departure", None))
    in_turn, outside = rig.spans("turnrouter.release")
    assert parent_id(in_turn) == rig.span("turnrouter.turn").context.span_id
    assert attrs(in_turn)[ATTR.RELEASE_REASON] == "focus_taken"
    assert attrs(in_turn)[ATTR.ERROR_TYPE] == "ValueError"
    assert in_turn.status.status_code is StatusCode.ERROR
    assert parent_id(outside) == departure.get_span_context().span_id
    assert attrs(outside) == {ATTR.ROUTE: "weather", ATTR.RELEASE_REASON: "departure"}


def test_acknowledgment_span_timing_and_attributes(rig: Rig) -> None:
    """The acknowledgment span spans its monotonic start and end, as a child of the turn."""
    obs = rig.telemetry.turn_started(TurnStarted(make_turn(), None))
    now = time.monotonic()
    before_ns = time.time_ns()
    obs.acknowledgment(AcknowledgmentFinished(
        "weather", "emitted", "prediction", 0.8, 1.4, now - 0.5, now - 0.2,
        "Let me check the forecast.", None, 0.92))
    obs.acknowledgment(AcknowledgmentFinished(
        "weather", "failed", "delay", 0.8, None, now - 0.1, now, "", TimeoutError()))
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
    emitted, failed = rig.spans("turnrouter.acknowledgment")
    assert parent_id(emitted) == rig.span("turnrouter.turn").context.span_id
    assert emitted.start_time is not None
    assert emitted.end_time is not None
    assert emitted.end_time - emitted.start_time == pytest.approx(0.3e9, abs=5e6)
    assert emitted.start_time == pytest.approx(before_ns - 0.5e9, abs=50e6)
    assert attrs(emitted) == {
        ATTR.ROUTE: "weather", ATTR.ACK_OUTCOME: "emitted", ATTR.ACK_TRIGGER: "prediction",
        ATTR.ACK_DELAY_SECONDS: 0.8, ATTR.ACK_PREDICTED_SECONDS: 1.4,
        ATTR.ACK_PROBABILITY_LATE: 0.92,
    }
    assert failed.status.status_code is StatusCode.ERROR
    assert attrs(failed)[ATTR.ERROR_TYPE] == "TimeoutError"
    assert ATTR.ACK_PREDICTED_SECONDS not in attrs(failed)
    assert ATTR.ACK_PROBABILITY_LATE not in attrs(failed)


CONTENT_KEYS = {ATTR.QUERY, ATTR.DECISION_RATIONALE, ATTR.GEN_AI_INPUT_MESSAGES,
                ATTR.GEN_AI_OUTPUT_MESSAGES, ATTR.ACK_TEXT}


def content_turn(telemetry: RouterObserver) -> None:
    """A turn whose every step carries text."""
    answer_turn(telemetry)
    obs = telemetry.turn_started(TurnStarted(make_turn("play some jazz", turn_id="t2"), None))
    now = time.monotonic()
    obs.acknowledgment(AcknowledgmentFinished(
        "music", "emitted", "delay", 0.8, None, now, now, "One moment.", None))
    obs.finished(TurnFinished("answer", "music", None, None, 1, None))


def test_no_content_captured_by_default(rig: Rig) -> None:
    """Without content capture no span carries query, answer, rationale or ack text."""
    content_turn(rig.telemetry)
    assert not rig.telemetry.capture_content
    for span in rig.spans():
        assert not CONTENT_KEYS & set(attrs(span)), span.name
        text = repr(attrs(span)) + repr([event.attributes for event in span.events])
        for secret in ("sunny", "lexical: weather", "jazz", "One moment", "what's"):
            assert secret not in text, (span.name, secret)


def test_decision_source_is_recorded_without_content(rig: Rig) -> None:
    """The rationale's source prefix (not its text) tells policy from classifier choices."""
    content_turn(rig.telemetry)
    route = attrs(rig.span("turnrouter.route"))
    assert route[ATTR.DECISION_SOURCE] == "lexical"
    assert ATTR.DECISION_RATIONALE not in route


@pytest.mark.parametrize(("rationale", "source"), [
    ("policy: key=p1 -> billing", "policy"), ("classifier: route: weather", "classifier"),
    ("alice: wants to know about rain", "_OTHER"), ("no prefix at all", None),
    (": empty head", None), ("x" * 40 + ": long head", None)])
def test_a_decision_source_is_a_known_word_never_user_text(
        rig: Rig, rationale: str, source: str | None) -> None:
    """With content capture off the source names a built-in service or is `_OTHER`: a
    custom service's rationale may begin with user text (before, "alice" was exported
    as the source)."""
    turn = make_turn()
    obs = rig.telemetry.turn_started(TurnStarted(turn, None))
    request = make_request(turn)
    token = obs.decision_started(request)
    obs.decision_finished(token, DecisionFinished(
        request, RouteDecision("weather", rationale=rationale), None))
    obs.finished(TurnFinished("clarify", None, None, None, 1, None))
    route = attrs(rig.span("turnrouter.route"))
    assert route.get(ATTR.DECISION_SOURCE) == source
    assert "alice" not in repr(route)


def test_content_captured_when_enabled(capture_rig: Rig) -> None:
    """With content capture the query, answer, rationale and ack text are recorded."""
    content_turn(capture_rig.telemetry)
    turns = capture_rig.spans("turnrouter.turn")
    assert attrs(turns[0])[ATTR.QUERY] == "what's the weather"
    route = attrs(capture_rig.span("turnrouter.route"))
    assert route[ATTR.DECISION_RATIONALE] == "lexical: weather"
    invoke = attrs(capture_rig.span("invoke_agent weather"))
    assert "what's the weather" in str(invoke[ATTR.GEN_AI_INPUT_MESSAGES])
    assert "It is sunny" in str(invoke[ATTR.GEN_AI_OUTPUT_MESSAGES])
    ack = attrs(capture_rig.span("turnrouter.acknowledgment"))
    assert ack[ATTR.ACK_TEXT] == "One moment."


@pytest.mark.parametrize("value", ["true", "TRUE", " True "])
def test_content_capture_from_environment(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true switches capture on."""
    monkeypatch.setenv(CONTENT_CAPTURE_ENV, value)
    assert Telemetry(NoOpTracerProvider(), CollectorRegistry()).capture_content


def test_content_capture_env_other_values_stay_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other value of the environment switch leaves capture off."""
    monkeypatch.setenv(CONTENT_CAPTURE_ENV, "1")
    assert not Telemetry(NoOpTracerProvider(), CollectorRegistry()).capture_content


def test_noop_provider_makes_no_spans_but_counts(rig: Rig) -> None:
    """A no-op tracer provider skips span work; metrics are still recorded."""
    telemetry = Telemetry(tracer_provider=NoOpTracerProvider(), registry=rig.registry)
    before = trace.get_current_span()
    obs = telemetry.turn_started(TurnStarted(make_turn(), None))
    assert trace.get_current_span() is before
    answer_turn(telemetry)
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
    assert rig.spans() == []
    assert rig.value("turnrouter_turns_total", route="weather", outcome="answer") == 1


def test_global_provider_followed_when_installed_later(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tracer_provider=None uses the global provider, picking up an SDK installed later."""
    telemetry = Telemetry(registry=rig.registry)
    answer_turn(telemetry)  # global provider is the API's no-op proxy
    assert rig.spans() == []
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: rig.tracer_provider)
    answer_turn(telemetry)
    assert len(rig.spans("turnrouter.turn")) == 1


def test_unsampled_turn_records_nothing_but_propagates() -> None:
    """An unsampled turn creates no child spans, no exemplars, yet stays current."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    telemetry = Telemetry(tracer_provider=provider, registry=registry)
    obs = telemetry.turn_started(TurnStarted(make_turn(), None))
    current = trace.get_current_span()
    assert current.get_span_context().is_valid
    assert not current.is_recording()
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
    answer_turn(telemetry)
    provider.shutdown()
    assert exporter.get_finished_spans() == ()
    assert registry.get_sample_value(
        "turnrouter_turns_total", {"route": "weather", "outcome": "focus"}) == 1
    assert b"trace_id" not in openmetrics_latest(registry)


def test_disabled_records_nothing(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Telemetry.disabled() is a do-nothing observer: no spans, no registry writes."""
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: rig.tracer_provider)
    disabled = Telemetry.disabled()
    assert isinstance(disabled, RouterObserver)
    assert not isinstance(disabled, Telemetry)
    assert disabled.enabled is False
    before = REGISTRY.get_sample_value(
        "turnrouter_turns_total", {"route": "weather", "outcome": "focus"})
    disabled.configured(Configured(("weather",), 1.0))
    disabled.participant_added(ParticipantChanged("alice"))
    answer_turn(disabled)
    assert rig.spans() == []
    assert REGISTRY.get_sample_value(
        "turnrouter_turns_total", {"route": "weather", "outcome": "focus"}) == before


def test_route_and_admission_spans_are_current_during_their_calls(rig: Rig) -> None:
    """A classifier's and an admit()'s own spans nest under the route / admission span."""
    tracer = rig.tracer_provider.get_tracer("caller")
    with tracer.start_as_current_span("caller") as caller:
        turn = make_turn()
        obs = rig.telemetry.turn_started(TurnStarted(turn, None))
        request = make_request(turn)
        token = obs.decision_started(request)
        with tracer.start_as_current_span("classifier"):
            pass
        obs.decision_finished(token, DecisionFinished(request, RouteDecision("weather"), None))
        after_decision = trace.get_current_span()
        token = obs.admission_started(AdmissionStarted("weather", False))
        with tracer.start_as_current_span("admit check"):
            pass
        obs.admission_finished(token, AdmissionFinished("weather", False, "accept", None, False))
        after_admission = trace.get_current_span()
        obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
        assert trace.get_current_span() is caller
    turn_id = rig.span("turnrouter.turn").context.span_id
    assert after_decision.get_span_context().span_id == turn_id
    assert after_admission.get_span_context().span_id == turn_id
    route = rig.span("turnrouter.route")
    admission = rig.span("turnrouter.admission")
    assert parent_id(route) == turn_id
    assert parent_id(admission) == turn_id
    assert parent_id(rig.span("classifier")) == route.context.span_id
    assert parent_id(rig.span("admit check")) == admission.context.span_id


def test_unfinished_decision_is_closed_with_the_turn(rig: Rig) -> None:
    """A decision call cancelled before decision_finished: finished() closes its span."""
    with rig.tracer_provider.get_tracer("caller").start_as_current_span("caller") as caller:
        turn = make_turn()
        obs = rig.telemetry.turn_started(TurnStarted(turn, None))
        obs.decision_started(make_request(turn))
        obs.finished(TurnFinished("interrupted", None, None, None, 1, None))
        assert trace.get_current_span() is caller
    route = rig.span("turnrouter.route")
    assert attrs(route)[ATTR.INTERRUPTED] is True
    assert parent_id(route) == rig.span("turnrouter.turn").context.span_id


def test_metrics_only_turn_tokens_are_start_times(rig: Rig) -> None:
    """Without a tracer a turn allocates no span bookkeeping, yet times every stage."""
    telemetry = Telemetry(tracer_provider=NoOpTracerProvider(), registry=rig.registry)
    turn = make_turn()
    obs = telemetry.turn_started(TurnStarted(turn, None))
    request = make_request(turn)
    token = obs.decision_started(request)
    assert isinstance(token, float)
    obs.decision_finished(token, DecisionFinished(request, RouteDecision("weather"), None))
    token = obs.admission_started(AdmissionStarted("weather", False))
    obs.admission_finished(token, AdmissionFinished("weather", False, "accept", None, False))
    assert obs.answer_started(AnswerStarted("weather", False)) is None
    obs.finished(TurnFinished("answer", "weather", None, None, 1, None))
    assert rig.value("turnrouter_decision_duration_seconds_count") == 1
    assert rig.value("turnrouter_admission_duration_seconds_count", route="weather") == 1
    assert rig.value("turnrouter_turns_total", route="weather", outcome="answer") == 1


@pytest.mark.parametrize("capture", [False, True])
def test_configured_routes_answer_spans_match_unconfigured_ones(capture: bool) -> None:
    """A configured route's `invoke_agent` span (its name and start attributes made once
    at configuration) carries what an unconfigured route's does, turn after turn; with
    content capture, each turn's own query is added without touching the shared ones."""
    spans: dict[bool, list[tuple[str, dict[str, object]]]] = {}
    for configured in (False, True):
        rig = Rig(capture_content=capture)
        if configured:
            rig.telemetry.configured(Configured(("weather", "music"), None))
        answer_turn(rig.telemetry)
        answer_turn(rig.telemetry)
        spans[configured] = [(span.name, attrs(span)) for span in rig.spans()
                             if span.name.startswith("invoke_agent")]
        rig.close()
    assert spans[True] == spans[False]
    assert [name for name, _ in spans[True]] == ["invoke_agent weather"] * 2
    for _, attributes in spans[True]:
        assert attributes[ATTR.GEN_AI_AGENT_NAME] == "weather"
        assert attributes[ATTR.FALLBACK] is False
        assert (ATTR.GEN_AI_INPUT_MESSAGES in attributes) is capture
