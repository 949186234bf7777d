"""Per-turn observers: the metrics of every turn, and the spans of a sampled one.

`TurnMetrics` counts and times an untraced turn (no-op tracer, or not sampled);
`TracedTurn` adds the turn's spans. Both receive the router's frozen events.
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Callable, Mapping
from contextvars import Token
from operator import attrgetter
from time import perf_counter
from types import MappingProxyType
from typing import NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from .._contracts import CLARIFY, AgentTurn, DestinationResult, RouteDecision, RouteRequest
from .._observer import (
    AcknowledgmentFinished,
    AcknowledgmentGenerated,
    AdmissionFinished,
    AdmissionStarted,
    AnswerAfterAcknowledgment,
    AnswerFinished,
    AnswerStarted,
    Clarification,
    DecisionFinished,
    DefaultFallback,
    Failure,
    FirstResponse,
    FocusChanged,
    ReleaseFinished,
    ReleaseStarted,
    Rerouted,
    RouteIneligible,
    SilenceMeasured,
    TurnFinished,
    TurnObserver,
    TurnOutcome,
    TurnStarted,
)
from ._families import NONE_LABEL, Families
from ._metrics import INELIGIBLE_REASONS, NEEDLESS_WITHIN_SECONDS
from ._spans import (
    ATTR,
    EVENT_DEFAULT_FALLBACK,
    EVENT_FAILURE,
    EVENT_FIRST_RESPONSE,
    EVENT_FOCUS,
    EVENT_REROUTE,
    SPAN_ACKNOWLEDGMENT,
    SPAN_ADMISSION,
    SPAN_INVOKE_AGENT_PREFIX,
    SPAN_RELEASE,
    SPAN_ROUTE,
    TOP_SCORES,
)

__all__ = [
    "Attributes", "InvokeSpans", "Op", "TraceSettings", "TracedTurn", "TurnMetrics", "error_type",
    "invoke_span", "set_error",
]

INTERNAL = SpanKind.INTERNAL
ERROR_STATUS = Status(StatusCode.ERROR)
_NONE = NONE_LABEL

Attributes = dict[str, AttributeValue]

_attach_context, _detach_context = otel_context.attach, otel_context.detach
_in_context = trace.set_span_in_context
_name_of = attrgetter("name")

#: A route's `invoke_agent` span name and start attributes, by (route, fallback).
InvokeSpans = dict[tuple[str, bool], tuple[str, Mapping[str, AttributeValue]]]


class TraceSettings(NamedTuple):
    """What every traced turn of one `Telemetry` shares (made once per tracer)."""

    tracer: Tracer
    #: `tracer.start_span`, bound once rather than on every turn.
    start_span: Callable[..., Span]
    capture: bool
    #: The configured routes' `invoke_span()`s (filled by `Telemetry.configured`).
    invoke: InvokeSpans


def invoke_span(route: str, fallback: bool) -> tuple[str, Mapping[str, AttributeValue]]:
    """The `invoke_agent {route}` span's name and start attributes (no content),
    read-only: made once per configured route (`Telemetry.configured`), not per turn;
    the SDK copies what it keeps."""
    return SPAN_INVOKE_AGENT_PREFIX + route, MappingProxyType({
        ATTR.GEN_AI_OPERATION_NAME: "invoke_agent",
        ATTR.GEN_AI_AGENT_NAME: route,
        ATTR.FALLBACK: fallback,
    })


def error_type(error: BaseException) -> str:
    return type(error).__qualname__


def set_error(span: Span, error_type: str) -> None:
    span.set_status(ERROR_STATUS)
    span.set_attribute(ATTR.ERROR_TYPE, error_type)


def _admission_label(disposition: str | None, error: BaseException | None,
                     timed_out: bool) -> str:
    """The disposition label; an `admit()` that did not return is timeout, error or
    (cancelled) interrupted."""
    if timed_out:
        return "timeout"
    if error is not None:
        return "error"
    return "interrupted" if disposition is None else disposition


def _decision_attributes(
    decision: RouteDecision, names: tuple[str, ...], capture: bool
) -> Attributes:
    """The route span's decision attributes. Only candidates' names (`names`) become
    attribute names or values: a decision service cannot mint attribute keys (or leak
    content) through its choice or score keys; dropped score keys are counted instead."""
    choice = decision.choice
    attributes: Attributes = {
        ATTR.DECISION_CHOICE: choice if choice == CLARIFY or choice in names else "_OTHER"}
    if decision.confidence is not None:
        attributes[ATTR.DECISION_CONFIDENCE] = decision.confidence
    scores: Mapping[str, float] = decision.scores
    if scores and any(route not in names for route in scores):
        kept = {route: score for route, score in scores.items() if route in names}
        attributes[ATTR.DECISION_DROPPED_SCORES] = len(scores) - len(kept)
        scores = kept
    if scores:
        top = heapq.nlargest(max(TOP_SCORES, 2), scores.items(), key=lambda item: item[1])
        for route, score in top[:TOP_SCORES]:
            attributes[ATTR.DECISION_SCORES_PREFIX + route] = score
        if len(top) >= 2:
            attributes[ATTR.DECISION_MARGIN] = top[0][1] - top[1][1]
    rationale = decision.rationale
    if rationale:
        source = _decision_source(rationale)
        if source:
            attributes[ATTR.DECISION_SOURCE] = source
        if capture:
            attributes[ATTR.DECISION_RATIONALE] = rationale
    return attributes


#: The sources the built-in decision services name in their rationale's prefix.
DECISION_SOURCES = frozenset(("classifier", "lexical", "policy"))


def _decision_source(rationale: str) -> str:
    """The rationale's `source:` prefix when a built-in service's ("policy",
    "classifier", "lexical"), "_OTHER" for any other prefix, "" without one.

    Recorded with content capture off, so telemetry tells a policy's choice from a
    classifier's: only a known word, since a custom service's rationale may start with
    user text ("alice: ...")."""
    head, sep, _ = rationale[:33].partition(":")
    if not sep or not head:
        return ""
    return head if head in DECISION_SOURCES else "_OTHER"


def _messages(role: str, text: str, **extra: str) -> str:
    """A GenAI semantic-conventions message list with one text part, as JSON."""
    return json.dumps(
        [{"role": role, "parts": [{"type": "text", "content": text}], **extra}],
        ensure_ascii=False,
    )


class Op:
    """The token of a traced operation: its span, start time and, while the span is the
    current span, the context token that restores the previous one."""

    __slots__ = ("context_token", "first_response", "span", "t0")

    def __init__(
        self, span: Span, t0: float, context_token: Token[Context] | None = None
    ) -> None:
        self.span = span
        self.t0 = t0
        self.context_token = context_token
        self.first_response: float | None = None




class TurnMetrics(TurnObserver):
    """The metrics of one turn that is not traced (no-op provider, or not sampled).

    Tokens are `perf_counter()` start times or None, so a call allocates nothing but the
    float; `_token` restores the caller's context when an unsampled turn made its
    non-recording span current (to propagate the trace context).
    """

    __slots__ = ("_done", "_failed", "_fam", "_participant", "_t0", "_token")

    def __init__(self, families: Families, token: Token[Context] | None,
                 participant: str = "") -> None:
        self._fam = families
        self._participant = participant
        self._token = token
        self._failed: list[tuple[str | None, str, BaseException | None]] | None = None
        self._done = False
        self._t0 = perf_counter()

    def _count_failure(self, route: str | None, stage: str, error: BaseException | None) -> None:
        self._fam.failures.get(route or _NONE, stage).inc()
        if self._failed is None:
            self._failed = []
        self._failed.append((route, stage, error))

    def _counts_failure(self, route: str | None, stage: str, error: BaseException) -> bool:
        """Count a failure unless a stage callback already counted it; True if counted."""
        failed = self._failed
        if failed:
            for index, (seen_route, seen_stage, seen) in enumerate(failed):
                if seen is error or (
                    seen is None and seen_stage == stage and seen_route == route
                ):
                    del failed[index]
                    return False
        self._fam.failures.get(route or _NONE, stage).inc()
        return True

    def _finish_metrics(
        self, outcome: str, route: str | None, span: Span | None
    ) -> None:
        fam = self._fam
        counter, duration = fam.turn_children(route or _NONE, outcome)
        counter.inc()
        now = perf_counter()
        if span is None:
            duration.observe(now - self._t0)
        else:
            duration.observe_traced(now - self._t0, now, span)
        fam.turns_ended += 1
        if fam.in_flight is not None:  # multiprocess mode
            fam.in_flight.dec()
        if outcome == "interrupted":
            fam.interruptions.inc()

    # -- decision and admission

    def decision_started(self, request: RouteRequest) -> object:
        """Note the start time."""
        return perf_counter()

    def decision_finished(self, token: object, event: DecisionFinished) -> None:
        """Record the decision's duration; count a failure at stage `decision` on error."""
        if isinstance(token, float):
            self._fam.decision_duration.observe(perf_counter() - token)
        if event.error is not None:
            self._count_failure(None, "decision", event.error)

    def admission_started(self, event: AdmissionStarted) -> object:
        """Note the start time."""
        return perf_counter()

    def admission_finished(self, token: object, event: AdmissionFinished) -> None:
        """Count the admission by disposition (timeout, error, interrupted if it did not
        return) and record its duration."""
        route, error, timed_out = event.route, event.error, event.timed_out
        counter, duration = self._fam.admission_children(
            route, _admission_label(event.disposition, error, timed_out), event.focused)
        counter.inc()
        if isinstance(token, float):
            duration.observe(perf_counter() - token)
        if error is not None or timed_out:
            self._count_failure(route, "admission", error)

    # -- answer and release (`answer_started` / `release_started`: the base's None)

    def first_response(self, token: object, event: FirstResponse) -> None:
        """Record the first-response latency."""
        self._fam.first_response.get(event.route).observe(event.seconds)

    def interrupted_before_response(self, token: object, event: FirstResponse) -> None:
        """Record the censored first response (interrupted before `started()`)."""
        self._fam.first_response_interrupted.get(event.route).observe(event.seconds)

    def answer_finished(self, token: object, event: AnswerFinished) -> None:
        """Count a failure at stage `answer` on error."""
        if event.error is not None and not event.interrupted:
            self._count_failure(event.route, "answer", event.error)

    def release_finished(self, token: object, event: ReleaseFinished) -> None:
        """Count a failure at stage `release` on error."""
        if event.error is not None:
            self._count_failure(event.route, "release", event.error)

    # -- counters

    def reroute(self, event: Rerouted) -> None:
        """Count a reroute away from a route."""
        self._fam.reroutes.get(event.route).inc()

    def default_fallback(self, event: DefaultFallback) -> None:
        """Count a default fallback."""
        self._fam.fallbacks.get(event.route).inc()

    def clarification(self, event: Clarification) -> None:
        """Count a clarification by reason (and its participant in the window)."""
        self._fam.clarifications.get(event.reason).inc()
        self._fam.note_clarified(self._participant)

    def focus_transition(self, event: FocusChanged) -> None:
        """Count a focus transition."""
        self._fam.focus.get(event.route, event.transition).inc()

    def acknowledgment(self, event: AcknowledgmentFinished) -> None:
        """Count the acknowledgment (and a failure at stage `acknowledgment`)."""
        self._fam.acknowledgments.get(event.route, event.outcome, event.trigger).inc()
        if event.outcome == "failed":
            self._count_failure(event.route, "acknowledgment", event.error)

    def silence(self, event: SilenceMeasured) -> None:
        """Record the silence the participant heard after admission."""
        self._fam.silence.get(event.route).observe(event.seconds)

    def acknowledgment_generated(self, event: AcknowledgmentGenerated) -> None:
        """Record the acknowledgment's generation time."""
        if event.seconds >= 0:
            self._fam.ack_generation.get(event.route).observe(event.seconds)

    def answer_after_acknowledgment(self, event: AnswerAfterAcknowledgment) -> None:
        """Count the spoken acknowledgment needless when the answer was right behind it,
        by its trigger (an early one that turned out needless, or the delay's)."""
        if 0.0 <= event.seconds <= NEEDLESS_WITHIN_SECONDS:
            self._fam.needless.get(event.route, event.trigger).inc()

    def route_ineligible(self, event: RouteIneligible) -> None:
        """Count an ineligible candidate by route and reason (unknown reasons: other)."""
        reason = event.reason
        self._fam.ineligible.get(
            event.route, reason if reason in INELIGIBLE_REASONS else "other").inc()

    def failure(self, event: Failure) -> None:
        """Count a failure, unless a stage callback already counted this one."""
        self._counts_failure(event.route, event.stage, event.error)

    # -- end of turn

    def finished(self, event: TurnFinished) -> None:
        """Count the turn (once) and restore the caller's context."""
        if self._done:
            return
        self._done = True
        self._end_turn(event)
        if self._token is not None:
            _detach_context(self._token)
            self._token = None

    def _end_turn(self, event: TurnFinished) -> None:
        """What ending a turn records; the traced subclass also closes its spans."""
        self._finish_metrics(event.outcome, event.route, None)


class TracedTurn(TurnMetrics):
    """Spans and metrics of one sampled turn.

    Child spans get their attributes at creation where they are known, the rest in one
    `set_attributes` call at the end. The route, admission and `invoke_agent` spans are
    the current span while their call runs (decision services, destinations and agents
    nest their own spans under them); `_open` is that span, closed by `finished()` if
    its own `*_finished` call never came.
    """

    __slots__ = (
        "_answer", "_capture", "_clarification", "_ctx", "_focus_before", "_invoke", "_named",
        "_names", "_open", "_span", "_start_span", "_turn",
    )

    def __init__(
        self, families: Families, settings: TraceSettings, started: TurnStarted, span: Span,
    ) -> None:
        """`span` is the turn's recording span; it becomes current until `finished()`."""
        ctx = _in_context(span)
        token = _attach_context(ctx)
        self._fam = families
        self._participant = started.turn.participant_id
        self._token = token
        self._failed = None
        self._done = False
        self._capture = settings.capture
        self._turn: AgentTurn = started.turn
        self._focus_before = started.focus
        self._start_span = settings.start_span
        self._invoke = settings.invoke
        self._span = span
        self._ctx = ctx
        self._named: RouteRequest | None = None  # the request `_names` are of
        self._names: tuple[str, ...] = ()
        self._open: Op | None = None
        self._answer: Op | None = None
        self._clarification: str | None = None
        self._t0 = perf_counter()

    def _start_current(
        self, name: str, attributes: Mapping[str, AttributeValue], t0: float
    ) -> Op:
        """Start a child of the turn span and make it current (same task, LIFO): the
        turn's context plus the child, so the current context is not read again."""
        ctx = self._ctx
        span = self._start_span(name, ctx, INTERNAL, attributes)
        op = self._open = Op(span, t0, _attach_context(_in_context(span, ctx)))
        return op

    def _detach(self, op: Op) -> None:
        token = op.context_token
        if token is not None:
            _detach_context(token)
            op.context_token = None
        if self._open is op:
            self._open = None

    def _event(self, name: str, attributes: Attributes) -> None:
        self._span.add_event(name, attributes)

    # -- decision

    def decision_started(self, request: RouteRequest) -> object:
        """Open a `turnrouter.route` span, current during the decision call."""
        excluded = request.excluded
        # `request.candidate_names`, without a generator frame per name
        names = self._names = tuple(map(_name_of, request.candidates))
        self._named = request
        return self._start_current(SPAN_ROUTE, {
            ATTR.DECISION_CANDIDATES: names,
            ATTR.DECISION_EXCLUDED: tuple(sorted(excluded)) if excluded else (),
        }, perf_counter())

    def decision_finished(self, token: object, event: DecisionFinished) -> None:
        """Record the decision's duration, choice and scores; close its span."""
        if not isinstance(token, Op):
            super().decision_finished(token, event)
            return
        now = perf_counter()
        self._detach(token)
        span = token.span
        self._fam.decision_duration.observe_traced(now - token.t0, now, span)
        decision, error = event.decision, event.error
        if decision is not None:
            request = event.request
            names = self._names if request is self._named else request.candidate_names
            span.set_attributes(_decision_attributes(decision, names, self._capture))
        if error is not None:
            self._count_failure(None, "decision", error)
            set_error(span, error_type(error))
        span.end()

    # -- admission

    def admission_started(self, event: AdmissionStarted) -> object:
        """Open a `turnrouter.admission` span, current during the `admit()` call."""
        return self._start_current(SPAN_ADMISSION, {
            ATTR.ROUTE: event.route, ATTR.ADMISSION_FOCUSED: event.focused}, perf_counter())

    def admission_finished(self, token: object, event: AdmissionFinished) -> None:
        """Count the admission by disposition; close its span (timeouts are errors)."""
        if not isinstance(token, Op):
            super().admission_finished(token, event)
            return
        now = perf_counter()
        self._detach(token)
        span = token.span
        route, disposition, error, timed_out = (
            event.route, event.disposition, event.error, event.timed_out)
        label = _admission_label(disposition, error, timed_out)
        counter, duration = self._fam.admission_children(route, label, event.focused)
        counter.inc()
        duration.observe_traced(now - token.t0, now, span)
        attributes: Attributes = {ATTR.ADMISSION_DISPOSITION: label}
        if timed_out:
            self._count_failure(route, "admission", error)
            attributes[ATTR.ADMISSION_TIMED_OUT] = True
            attributes[ATTR.ERROR_TYPE] = "timeout"
            span.set_status(ERROR_STATUS)
        elif error is not None:
            self._count_failure(route, "admission", error)
            attributes[ATTR.ERROR_TYPE] = error_type(error)
            span.set_status(ERROR_STATUS)
        elif disposition is None:  # admit() was cancelled: the turn was interrupted
            attributes[ATTR.INTERRUPTED] = True
        span.set_attributes(attributes)
        span.end()

    # -- answer

    def answer_started(self, event: AnswerStarted) -> object:
        """Open `invoke_agent {route}` and make it current, so the agent's spans nest."""
        route, fallback = event.route, event.fallback
        found = self._invoke.get((route, fallback))
        name, attributes = invoke_span(route, fallback) if found is None else found
        if self._capture:
            attributes = {**attributes,
                          ATTR.GEN_AI_INPUT_MESSAGES: _messages("user", self._turn.query)}
        op = self._answer = self._start_current(name, attributes, 0.0)
        return op

    def first_response(self, token: object, event: FirstResponse) -> None:
        """Record the first-response latency and a `turnrouter.first_response` event."""
        if not isinstance(token, Op):
            super().first_response(token, event)
            return
        span = token.span
        seconds = event.seconds
        self._fam.first_response.get(event.route).observe_traced(seconds, perf_counter(), span)
        token.first_response = seconds  # set as an attribute when the span closes
        span.add_event(EVENT_FIRST_RESPONSE, {ATTR.FIRST_RESPONSE_SECONDS: seconds})

    def interrupted_before_response(self, token: object, event: FirstResponse) -> None:
        """Record the censored first response, its exemplar pointing at the answer span
        that was cut."""
        if not isinstance(token, Op):
            super().interrupted_before_response(token, event)
            return
        self._fam.first_response_interrupted.get(event.route).observe_traced(
            event.seconds, perf_counter(), token.span)

    def output_started(self, token: object, event: FirstResponse) -> None:
        """The span's first-response event and attribute at `started()`, when the
        histogram waits for the first audio heard (the front end's report)."""
        if isinstance(token, Op):
            token.first_response = event.seconds
            token.span.add_event(EVENT_FIRST_RESPONSE,
                                 {ATTR.FIRST_RESPONSE_SECONDS: event.seconds})

    def answer_finished(self, token: object, event: AnswerFinished) -> None:
        """Close the answer span with the result's disposition, error or interruption."""
        error, interrupted = event.error, event.interrupted
        if error is not None and not interrupted:
            self._count_failure(event.route, "answer", error)
        if isinstance(token, Op):
            self._close_answer(token, event.result, error, interrupted)

    def _close_answer(
        self, op: Op, result: DestinationResult | None, error: BaseException | None,
        interrupted: bool,
    ) -> None:
        if self._answer is op:
            self._answer = None
        self._detach(op)
        span = op.span
        if not span.is_recording():  # already closed
            return
        attributes: Attributes = {}
        if op.first_response is not None:
            attributes[ATTR.FIRST_RESPONSE_SECONDS] = op.first_response
        if result is not None:
            attributes[ATTR.RESULT_DISPOSITION] = result.disposition
            if self._capture and result.text:
                attributes[ATTR.GEN_AI_OUTPUT_MESSAGES] = _messages(
                    "assistant", result.text, finish_reason="stop")
        if interrupted:
            attributes[ATTR.INTERRUPTED] = True
        elif error is not None:
            attributes[ATTR.ERROR_TYPE] = error_type(error)
            span.set_status(ERROR_STATUS)
        if attributes:
            span.set_attributes(attributes)
        span.end()

    def _close_open(self, op: Op, error: BaseException | None, interrupted: bool) -> None:
        """Close a route or admission span whose `*_finished` call never came."""
        self._detach(op)
        span = op.span
        if not span.is_recording():
            return
        if interrupted:
            span.set_attribute(ATTR.INTERRUPTED, True)
        elif error is not None:
            set_error(span, error_type(error))
        span.end()

    # -- release

    def release_started(self, event: ReleaseStarted) -> object:
        """Open a `turnrouter.release` span."""
        return Op(self._start_span(
            SPAN_RELEASE, self._ctx, INTERNAL,
            {ATTR.ROUTE: event.route, ATTR.RELEASE_REASON: event.reason}), 0.0)

    def release_finished(self, token: object, event: ReleaseFinished) -> None:
        """Close the release span; count a failure at stage `release` on error."""
        error = event.error
        if error is not None:
            self._count_failure(event.route, "release", error)
        if isinstance(token, Op):
            if error is not None:
                set_error(token.span, error_type(error))
            token.span.end()

    # -- counters and events

    def reroute(self, event: Rerouted) -> None:
        """Count a reroute away from a route."""
        super().reroute(event)
        self._event(EVENT_REROUTE, {ATTR.ROUTE: event.route})

    def default_fallback(self, event: DefaultFallback) -> None:
        """Count a default fallback."""
        super().default_fallback(event)
        self._event(EVENT_DEFAULT_FALLBACK, {ATTR.ROUTE: event.route})

    def clarification(self, event: Clarification) -> None:
        """Count a clarification by reason (an attribute of the turn span at its end)."""
        super().clarification(event)
        self._clarification = event.reason

    def focus_transition(self, event: FocusChanged) -> None:
        """Count a focus transition."""
        super().focus_transition(event)
        self._event(EVENT_FOCUS, {ATTR.ROUTE: event.route,
                                  ATTR.FOCUS_TRANSITION: event.transition})

    def acknowledgment(self, event: AcknowledgmentFinished) -> None:
        """Count the acknowledgment; record a span from `started_at` to `ended_at`.

        Both times are on the `time.monotonic()` clock (`anyio.current_time()` under
        asyncio); the span converts them to wall-clock time.
        """
        super().acknowledgment(event)
        outcome = event.outcome
        attributes: Attributes = {
            ATTR.ROUTE: event.route,
            ATTR.ACK_OUTCOME: outcome,
            ATTR.ACK_TRIGGER: event.trigger,
            ATTR.ACK_DELAY_SECONDS: event.delay_seconds,
        }
        if event.predicted_first_response is not None:
            attributes[ATTR.ACK_PREDICTED_SECONDS] = event.predicted_first_response
        if event.probability_late is not None:
            attributes[ATTR.ACK_PROBABILITY_LATE] = event.probability_late
        if self._capture and event.text:
            attributes[ATTR.ACK_TEXT] = event.text
        if outcome == "failed":
            error = event.error
            attributes[ATTR.ERROR_TYPE] = error_type(error) if error is not None else "_OTHER"
        wall_ns, mono = time.time_ns(), time.monotonic()
        start_ns = wall_ns - int((mono - event.started_at) * 1e9)
        end_ns = max(start_ns, wall_ns - int((mono - event.ended_at) * 1e9))
        span = self._start_span(
            SPAN_ACKNOWLEDGMENT, self._ctx, INTERNAL, attributes, start_time=start_ns)
        if outcome == "failed":
            span.set_status(ERROR_STATUS)
        span.end(end_time=end_ns)

    def silence(self, event: SilenceMeasured) -> None:
        """Record the silence the participant heard after admission."""
        self._fam.silence.get(event.route).observe_traced(
            event.seconds, perf_counter(), self._span)

    def acknowledgment_generated(self, event: AcknowledgmentGenerated) -> None:
        """Record the generation time, with an exemplar pointing at the turn."""
        if event.seconds >= 0:
            self._fam.ack_generation.get(event.route).observe_traced(
                event.seconds, perf_counter(), self._span)

    def failure(self, event: Failure) -> None:
        """Count a failure, unless a stage callback already counted this one."""
        route, stage, error = event.route, event.stage, event.error
        if self._counts_failure(route, stage, error):
            attributes: Attributes = {ATTR.FAILURE_STAGE: stage,
                                      ATTR.ERROR_TYPE: error_type(error)}
            if route is not None:
                attributes[ATTR.ROUTE] = route
            self._event(EVENT_FAILURE, attributes)

    # -- end of turn

    def _end_turn(self, event: TurnFinished) -> None:
        """Count the turn and close any open span, then the turn span."""
        outcome: TurnOutcome = event.outcome
        route, error = event.route, event.error
        self._finish_metrics(outcome, route, self._span)
        interrupted = outcome == "interrupted"
        stale = self._open
        if stale is not None and stale is not self._answer:
            self._close_open(stale, error, interrupted)
        if self._answer is not None:  # answer_finished was never called
            self._close_answer(self._answer, None, error, interrupted)
        attributes: Attributes = {ATTR.OUTCOME: outcome, ATTR.ATTEMPTS: event.attempts}
        if route is not None:
            attributes[ATTR.ROUTE] = route
        focus_before, focus_after = event.focus_before, event.focus_after
        if focus_before is not None and focus_before != self._focus_before:
            attributes[ATTR.FOCUS_BEFORE] = focus_before
        if focus_after is not None:
            attributes[ATTR.FOCUS_AFTER] = focus_after
        if interrupted:
            attributes[ATTR.INTERRUPTED] = True
        if self._clarification is not None:
            attributes[ATTR.CLARIFICATION_REASON] = self._clarification
        span = self._span
        if not interrupted and (error is not None or outcome == "failed"):
            attributes[ATTR.ERROR_TYPE] = error_type(error) if error is not None else "_OTHER"
            span.set_status(ERROR_STATUS)
        span.set_attributes(attributes)
        span.end()
