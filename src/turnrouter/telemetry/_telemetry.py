"""`Telemetry`: the OpenTelemetry + Prometheus implementation of the observer seam.

Library code depends on the OpenTelemetry *API* only; the application installs an SDK.
Per-turn costs are kept small: a no-op tracer provider or an unsampled turn skips all
span work, labelled metric children are bound once and cached by label tuple, and metric
families are registered once per registry (several routers may share one registry).
"""

from __future__ import annotations

import heapq
import json
import math
import os
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Mapping
from contextvars import Token
from time import perf_counter
from typing import Any, Generic, TypeVar
from weakref import WeakKeyDictionary

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    TracerProvider,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from .._contracts import AgentTurn, DestinationResult, RouteDecision, RouteRequest
from .._observer import (
    NULL_OBSERVER,
    AcknowledgmentOutcome,
    AcknowledgmentTrigger,
    ClarificationReason,
    FailureStage,
    FocusTransition,
    PatchOutcome,
    ReleaseReason,
    RouterObserver,
    TurnObserver,
    TurnOutcome,
)
from ._metrics import LATENCY_BUCKETS, MetricSpec, metric
from ._spans import (
    ATTR,
    CONTENT_CAPTURE_ENV,
    EVENT_DEFAULT_FALLBACK,
    EVENT_FAILURE,
    EVENT_FIRST_RESPONSE,
    EVENT_FOCUS,
    EVENT_REROUTE,
    SPAN_ACKNOWLEDGMENT,
    SPAN_ADMISSION,
    SPAN_CONTEXT_PATCH,
    SPAN_INVOKE_AGENT_PREFIX,
    SPAN_RELEASE,
    SPAN_ROUTE,
    SPAN_TURN,
    TOP_SCORES,
    TRACER_NAME,
)

__all__ = ["Telemetry"]

_INTERNAL = SpanKind.INTERNAL
_ERROR_STATUS = Status(StatusCode.ERROR)
_NONE = "none"
_BOOL = {True: "true", False: "false"}

Attributes = dict[str, AttributeValue]

# --------------------------------------------------------------------------- metrics

_M = TypeVar("_M", Counter, Gauge, Histogram)
_C = TypeVar("_C")


class _Family(Generic[_C]):
    """A labelled metric with its children bound once and cached by label tuple; `wrap`
    turns a prometheus_client child into what callers use (itself, or a `_Latency`)."""

    __slots__ = ("_wrap", "children", "metric")

    def __init__(self, collector: Counter | Gauge | Histogram,
                 wrap: Callable[[Any], _C]) -> None:
        self.metric = collector
        self._wrap = wrap
        self.children: dict[tuple[str, ...], _C] = {}

    def get(self, *values: str) -> _C:
        """The child for these label values (`labels()` costs microseconds; this does not)."""
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self._wrap(self.metric.labels(*values))
        return child


def _same(child: Any) -> Any:
    return child


def _plain(collector: _M) -> _Family[_M]:
    """A family whose children are prometheus_client's own."""
    return _Family(collector, _same)


#: At most one trace exemplar per histogram bucket and child in this many seconds.
EXEMPLAR_INTERVAL_SECS = 1.0


class _Latency:
    """A latency histogram child whose trace exemplars are rate-limited per bucket.

    prometheus_client keeps one exemplar per bucket, the newest, and Prometheus reads it
    once per scrape (seconds apart); under load almost every exemplar is overwritten
    unseen, yet each one costs microseconds of validation. So a bucket takes a new
    exemplar only when its last one is `EXEMPLAR_INTERVAL_SECS` old: a scrape still sees
    an exemplar in every bucket that had traced observations, at most that much older
    than the newest, and a quiet deployment keeps every one.
    """

    __slots__ = ("_last", "child")

    def __init__(self, child: Histogram) -> None:
        #: The prometheus_client child: untraced observations go to it directly.
        self.child = child
        self._last = [-math.inf] * (len(LATENCY_BUCKETS) + 1)

    def observe_traced(self, seconds: float, now: float, span: Span) -> None:
        """Record one observation, with an exemplar pointing at `span` unless its bucket
        has a recent one (`now` is a `perf_counter()` reading)."""
        index = bisect_left(LATENCY_BUCKETS, seconds)  # prometheus_client: value <= bound
        last = self._last
        if now - last[index] < EXEMPLAR_INTERVAL_SECS:
            self.child.observe(seconds)
            return
        last[index] = now  # a race between threads at worst sets one exemplar more
        context = span.get_span_context()
        self.child.observe(seconds, {"trace_id": format(context.trace_id, "032x"),
                                     "span_id": format(context.span_id, "016x")})


class _Families:
    """Every family of `METRICS`, registered once on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._created: list[Counter | Gauge | Histogram] = []
        try:
            self.turns = _plain(self._counter("turnrouter_turns_total"))
            self.clarifications = _plain(self._counter("turnrouter_clarifications_total"))
            self.admissions = _plain(self._counter("turnrouter_admissions_total"))
            self.reroutes = _plain(self._counter("turnrouter_reroutes_total"))
            self.fallbacks = _plain(self._counter("turnrouter_default_fallbacks_total"))
            self.failures = _plain(self._counter("turnrouter_failures_total"))
            self.interruptions = self._counter("turnrouter_interruptions_total")
            self.focus = _plain(self._counter("turnrouter_focus_transitions_total"))
            self.turn_duration = _Family(
                self._histogram("turnrouter_turn_duration_seconds"), _Latency)
            self.decision_duration = _Latency(
                self._histogram("turnrouter_decision_duration_seconds"))
            self.admission_duration = _Family(
                self._histogram("turnrouter_admission_duration_seconds"), _Latency)
            self.first_response = _Family(
                self._histogram("turnrouter_first_response_seconds"), _Latency)
            self.silence = _Family(self._histogram("turnrouter_silence_seconds"), _Latency)
            self.acknowledgments = _plain(self._counter("turnrouter_acknowledgments_total"))
            self.ack_delay = self._gauge("turnrouter_acknowledgment_delay_seconds")
            self.predicted = _plain(self._gauge("turnrouter_predicted_first_response_seconds"))
            self.context_patches = _plain(self._counter("turnrouter_context_patches_total"))
            self.rejected = _plain(self._counter("turnrouter_runtime_rejected_messages_total"))
            self.participants = self._gauge("turnrouter_active_participants")
            self.in_flight = self._gauge("turnrouter_turns_in_flight")
        except BaseException:
            for collector in self._created:  # leave the registry as it was
                registry.unregister(collector)
            raise
        del self._created
        # Children updated together on every turn, bound once per label combination.
        self._turn_pairs: dict[tuple[str, str], tuple[Counter, _Latency]] = {}
        self._admission_pairs: dict[tuple[str, str, bool], tuple[Counter, _Latency]] = {}

    def turn_children(self, route: str, outcome: str) -> tuple[Counter, _Latency]:
        """`turnrouter_turns_total` and `turnrouter_turn_duration_seconds` children."""
        key = (route, outcome)
        pair = self._turn_pairs.get(key)
        if pair is None:
            pair = self._turn_pairs[key] = (
                self.turns.get(route, outcome), self.turn_duration.get(route, outcome))
        return pair

    def admission_children(
        self, route: str, disposition: str, focused: bool
    ) -> tuple[Counter, _Latency]:
        """`turnrouter_admissions_total` and `turnrouter_admission_duration_seconds` children."""
        key = (route, disposition, focused)
        pair = self._admission_pairs.get(key)
        if pair is None:
            pair = self._admission_pairs[key] = (
                self.admissions.get(route, disposition, _BOOL[bool(focused)]),
                self.admission_duration.get(route))
        return pair

    def _spec(self, name: str, kind: str) -> MetricSpec:
        spec = metric(name)
        if spec.type != kind:  # pragma: no cover - guards edits of METRICS
            raise TypeError(f"{name} is defined as a {spec.type}, not a {kind}")
        return spec

    def _counter(self, name: str) -> Counter:
        spec = self._spec(name, "counter")
        created = Counter(spec.name, spec.documentation, spec.labels, registry=self._registry)
        self._created.append(created)
        return created

    def _gauge(self, name: str) -> Gauge:
        spec = self._spec(name, "gauge")
        created = Gauge(spec.name, spec.documentation, spec.labels, registry=self._registry)
        self._created.append(created)
        return created

    def _histogram(self, name: str) -> Histogram:
        spec = self._spec(name, "histogram")
        assert spec.buckets is not None
        created = Histogram(spec.name, spec.documentation, spec.labels,
                            registry=self._registry, buckets=spec.buckets)
        self._created.append(created)
        return created


_PROPAGATOR = TraceContextTextMapPropagator()

_FAMILIES: WeakKeyDictionary[CollectorRegistry, _Families] = WeakKeyDictionary()
_FAMILIES_LOCK = threading.Lock()


def _families_for(registry: CollectorRegistry) -> _Families:
    """The families registered on `registry`, registering them on first use."""
    with _FAMILIES_LOCK:
        families = _FAMILIES.get(registry)
        if families is None:
            families = _FAMILIES[registry] = _Families(registry)
        return families


# --------------------------------------------------------------------------- helpers


def _error_type(error: BaseException) -> str:
    return type(error).__qualname__


def _set_error(span: Span, error_type: str) -> None:
    span.set_status(_ERROR_STATUS)
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


def _tracer_for(provider: TracerProvider) -> Tracer | None:
    """A tracer, or None when `provider` can only produce no-op spans."""
    if isinstance(provider, NoOpTracerProvider | ProxyTracerProvider):
        return None
    return provider.get_tracer(TRACER_NAME)


def _decision_attributes(decision: RouteDecision, capture: bool) -> Attributes:
    attributes: Attributes = {ATTR.DECISION_CHOICE: decision.choice}
    if decision.confidence is not None:
        attributes[ATTR.DECISION_CONFIDENCE] = decision.confidence
    scores: Mapping[str, float] = decision.scores
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


def _decision_source(rationale: str) -> str:
    """The rationale's `source:` prefix ("policy", "classifier", "lexical"), if any.

    Not content: a short identifier, so telemetry tells a policy's choice from a
    classifier's even with content capture off.
    """
    head, sep, _ = rationale.partition(":")
    if sep and 0 < len(head) <= 32 and head.replace("_", "").replace("-", "").isalnum():
        return head
    return ""


def _messages(role: str, text: str, **extra: str) -> str:
    """A GenAI semantic-conventions message list with one text part, as JSON."""
    return json.dumps(
        [{"role": role, "parts": [{"type": "text", "content": text}], **extra}],
        ensure_ascii=False,
    )


def _capture_from_env() -> bool:
    return os.environ.get(CONTENT_CAPTURE_ENV, "").strip().lower() == "true"


class _Op:
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


# --------------------------------------------------------------------------- observer


class Telemetry(RouterObserver):
    """OpenTelemetry spans and Prometheus metrics for an `AgentRouter`.

    `tracer_provider=None` follows the global provider (re-checked cheaply per turn, so
    an SDK installed after construction is picked up); `registry=None` uses
    prometheus_client's default registry. Several `Telemetry` objects may share one
    registry. Query, answer, acknowledgment and rationale text are recorded only with
    `capture_content=True` or `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.
    """

    __slots__ = (
        "_capture", "_families", "_follow_global", "_provider", "_recent_failures",
        "_registry", "_tracer",
    )

    enabled = True

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        registry: CollectorRegistry | None = None,
        capture_content: bool = False,
    ) -> None:
        self._registry = REGISTRY if registry is None else registry
        self._families = _families_for(self._registry)
        self._capture = bool(capture_content) or _capture_from_env()
        self._follow_global = tracer_provider is None or isinstance(
            tracer_provider, ProxyTracerProvider)
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        if not self._follow_global:
            assert tracer_provider is not None
            self._provider = tracer_provider
            self._tracer = _tracer_for(tracer_provider)
        # Errors already counted by a router-level release, so that a matching
        # `failure()` call for the same exception is not counted twice.
        self._recent_failures: deque[BaseException] = deque(maxlen=8)

    @staticmethod
    def disabled() -> RouterObserver:
        """An observer that records nothing: no spans, no registry writes."""
        return NULL_OBSERVER

    @property
    def capture_content(self) -> bool:
        """Whether message content (query, answer, rationale) is recorded on spans."""
        return self._capture

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry the metrics are registered on."""
        return self._registry

    def _current_tracer(self) -> Tracer | None:
        if self._follow_global:
            provider = trace.get_tracer_provider()
            if provider is not self._provider:
                self._provider = provider
                self._tracer = _tracer_for(provider)
        return self._tracer

    # -- RouterObserver

    def turn_started(self, turn: AgentTurn, focus: str | None) -> TurnObserver:
        """Open the `turnrouter.turn` span and make it current until `finished()`."""
        families = self._families
        families.in_flight.inc()
        tracer = self._current_tracer()
        if tracer is None:
            return _TurnMetrics(families, None)
        attributes: Attributes = {
            ATTR.PARTICIPANT_ID: turn.participant_id,
            ATTR.TURN_ID: turn.turn_id,
        }
        if focus is not None:
            attributes[ATTR.FOCUS_BEFORE] = focus
        if self._capture:
            attributes[ATTR.QUERY] = turn.query
        span = tracer.start_span(SPAN_TURN, kind=_INTERNAL, attributes=attributes)
        ctx = trace.set_span_in_context(span)
        token = otel_context.attach(ctx)
        if not span.is_recording():
            # Unsampled: propagate the context, skip every child span and attribute.
            return _TurnMetrics(families, token)
        return _TracedTurn(families, token, self._capture, turn, focus, tracer, span, ctx)

    def participant_added(self, participant_id: str) -> None:
        """Count one more active participant."""
        self._families.participants.inc()

    def participant_removed(self, participant_id: str) -> None:
        """Count one fewer active participant."""
        self._families.participants.dec()

    def release_started(self, route: str, reason: ReleaseReason) -> object:
        """Open a `turnrouter.release` span under the caller's current span."""
        tracer = self._current_tracer()
        if tracer is not None:
            span = tracer.start_span(SPAN_RELEASE, kind=_INTERNAL, attributes={
                ATTR.ROUTE: route, ATTR.RELEASE_REASON: reason})
            if span.is_recording():
                return _Op(span, 0.0)
        return None

    def release_finished(
        self, token: object, route: str, reason: ReleaseReason, error: BaseException | None
    ) -> None:
        """Close the release span; count a failure at stage `release` on error."""
        if error is not None:
            self._families.failures.get(route, "release").inc()
            self._recent_failures.append(error)
        if isinstance(token, _Op):
            if error is not None:
                _set_error(token.span, _error_type(error))
            token.span.end()

    def failure(self, route: str | None, stage: FailureStage, error: BaseException) -> None:
        """Count a failure outside any turn (unless already counted for this error)."""
        recent = self._recent_failures
        for index, seen in enumerate(recent):
            if seen is error:
                del recent[index]
                return
        self._families.failures.get(route or _NONE, stage).inc()

    def configured(
        self, *, routes: tuple[str, ...], acknowledgment_delay_secs: float | None
    ) -> None:
        """Publish the fallback acknowledgment delay (NaN when acknowledgments are off)."""
        delay = math.nan if acknowledgment_delay_secs is None else acknowledgment_delay_secs
        self._families.ack_delay.set(delay)

    def predicted_first_response(self, route: str, seconds: float) -> None:
        """Publish the timing predictor's estimate for `route`."""
        self._families.predicted.get(route).set(seconds)

    def heard(self, route: str, first_response_seconds: float,
              silence_seconds: float | None) -> None:
        """Record first response (and silence) measured to the first audio heard."""
        families = self._families
        families.first_response.get(route).child.observe(first_response_seconds)
        if silence_seconds is not None:
            families.silence.get(route).child.observe(silence_seconds)

    def context_patch(self, strategy: str, outcome: str) -> None:
        """Count a background context patch by strategy and outcome."""
        self._families.context_patches.get(strategy, outcome).inc()

    def context_patch_event(
        self, participant_id: str, patch_id: str, task_id: str, strategy: str,
        outcome: PatchOutcome, diverged: bool,
    ) -> None:
        """Record a `turnrouter.context_patch` span under the caller's current span.

        The counter is `context_patch`'s; this adds the span (when tracing is on).
        """
        tracer = self._current_tracer()
        if tracer is None:
            return
        span = tracer.start_span(SPAN_CONTEXT_PATCH, kind=_INTERNAL, attributes={
            ATTR.PARTICIPANT_ID: participant_id,
            ATTR.PATCH_ID: patch_id,
            ATTR.PATCH_TASK_ID: task_id,
            ATTR.PATCH_STRATEGY: strategy,
            ATTR.PATCH_OUTCOME: outcome,
            ATTR.PATCH_DIVERGED: diverged,
        })
        span.end()

    def message_rejected(self, topic: str, reason: str) -> None:
        """Count a runtime message the router's subscriber rejected."""
        self._families.rejected.get(topic, reason).inc()

    def enter_context(self, carrier: Mapping[str, str]) -> object:
        """Continue the publisher's trace: make its W3C context current for the turn."""
        if not carrier:
            return None
        return otel_context.attach(_PROPAGATOR.extract(carrier))

    def exit_context(self, token: object) -> None:
        """Restore the context `enter_context` replaced."""
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]

    def inject_context(self) -> dict[str, str]:
        """The current span's W3C headers, for an outgoing runtime message."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier


class _TurnMetrics(TurnObserver):
    """The metrics of one turn that is not traced (no-op provider, or not sampled).

    Tokens are `perf_counter()` start times or None, so a call allocates nothing but the
    float; `_token` restores the caller's context when an unsampled turn made its
    non-recording span current (to propagate the trace context).
    """

    __slots__ = ("_done", "_failed", "_fam", "_t0", "_token")

    def __init__(self, families: _Families, token: Token[Context] | None) -> None:
        self._fam = families
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
            duration.child.observe(now - self._t0)
        else:
            duration.observe_traced(now - self._t0, now, span)
        fam.in_flight.dec()
        if outcome == "interrupted":
            fam.interruptions.inc()

    # -- decision and admission

    def decision_started(self, request: RouteRequest) -> object:
        """Note the start time."""
        return perf_counter()

    def decision_finished(
        self, token: object, request: RouteRequest, decision: RouteDecision | None,
        error: BaseException | None,
    ) -> None:
        """Record the decision's duration; count a failure at stage `decision` on error."""
        if isinstance(token, float):
            self._fam.decision_duration.child.observe(perf_counter() - token)
        if error is not None:
            self._count_failure(None, "decision", error)

    def admission_started(self, route: str, focused: bool) -> object:
        """Note the start time."""
        return perf_counter()

    def admission_finished(
        self, token: object, route: str, focused: bool, disposition: str | None,
        error: BaseException | None, timed_out: bool = False,
    ) -> None:
        """Count the admission by disposition (timeout, error, interrupted if it did not
        return) and record its duration."""
        counter, duration = self._fam.admission_children(
            route, _admission_label(disposition, error, timed_out), focused)
        counter.inc()
        if isinstance(token, float):
            duration.child.observe(perf_counter() - token)
        if error is not None or timed_out:
            self._count_failure(route, "admission", error)

    # -- answer and release (`answer_started` / `release_started`: the base's None)

    def first_response(self, token: object, route: str, seconds: float) -> None:
        """Record the first-response latency."""
        self._fam.first_response.get(route).child.observe(seconds)

    def answer_finished(
        self, token: object, route: str, result: DestinationResult | None,
        error: BaseException | None, interrupted: bool,
    ) -> None:
        """Count a failure at stage `answer` on error."""
        if error is not None and not interrupted:
            self._count_failure(route, "answer", error)

    def release_finished(
        self, token: object, route: str, reason: ReleaseReason, error: BaseException | None
    ) -> None:
        """Count a failure at stage `release` on error."""
        if error is not None:
            self._count_failure(route, "release", error)

    # -- counters

    def reroute(self, route: str) -> None:
        """Count a reroute away from `route`."""
        self._fam.reroutes.get(route).inc()

    def default_fallback(self, route: str) -> None:
        """Count a default fallback to `route`."""
        self._fam.fallbacks.get(route).inc()

    def clarification(self, reason: ClarificationReason) -> None:
        """Count a clarification by reason."""
        self._fam.clarifications.get(reason).inc()

    def focus_transition(self, route: str, transition: FocusTransition) -> None:
        """Count a focus transition."""
        self._fam.focus.get(route, transition).inc()

    def acknowledgment(
        self, route: str, outcome: AcknowledgmentOutcome, trigger: AcknowledgmentTrigger,
        delay_seconds: float, predicted_first_response: float | None,
        started_at: float, ended_at: float, text: str, error: BaseException | None,
    ) -> None:
        """Count the acknowledgment (and a failure at stage `acknowledgment`)."""
        self._fam.acknowledgments.get(route, outcome, trigger).inc()
        if outcome == "failed":
            self._count_failure(route, "acknowledgment", error)

    def silence(self, route: str, seconds: float) -> None:
        """Record the silence the participant heard after admission."""
        self._fam.silence.get(route).child.observe(seconds)

    def failure(self, route: str | None, stage: FailureStage, error: BaseException) -> None:
        """Count a failure, unless a stage callback already counted this one."""
        self._counts_failure(route, stage, error)

    # -- end of turn

    def finished(
        self, outcome: TurnOutcome, route: str | None, focus_before: str | None,
        focus_after: str | None, attempts: int, error: BaseException | None,
    ) -> None:
        """Count the turn (once) and restore the caller's context."""
        if self._done:
            return
        self._done = True
        self._end_turn(outcome, route, focus_before, focus_after, attempts, error)
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None

    def _end_turn(
        self, outcome: TurnOutcome, route: str | None, focus_before: str | None,
        focus_after: str | None, attempts: int, error: BaseException | None,
    ) -> None:
        """What ending a turn records; the traced subclass also closes its spans."""
        self._finish_metrics(outcome, route, None)


class _TracedTurn(_TurnMetrics):
    """Spans and metrics of one sampled turn.

    Child spans get their attributes at creation where they are known, the rest in one
    `set_attributes` call at the end. The route, admission and `invoke_agent` spans are
    the current span while their call runs (decision services, destinations and agents
    nest their own spans under them); `_open` is that span, closed by `finished()` if
    its own `*_finished` call never came.
    """

    __slots__ = (
        "_answer", "_capture", "_clarification", "_ctx", "_focus_before", "_open", "_span",
        "_tracer", "_turn",
    )

    def __init__(
        self, families: _Families, token: Token[Context], capture: bool, turn: AgentTurn,
        focus_before: str | None, tracer: Tracer, span: Span, ctx: Context,
    ) -> None:
        self._fam = families
        self._token = token
        self._failed = None
        self._done = False
        self._capture = capture
        self._turn = turn
        self._focus_before = focus_before
        self._tracer = tracer
        self._span = span
        self._ctx = ctx
        self._open: _Op | None = None
        self._answer: _Op | None = None
        self._clarification: str | None = None
        self._t0 = perf_counter()

    def _start_current(self, name: str, attributes: Attributes, t0: float) -> _Op:
        """Start a child of the turn span and make it current (same task, LIFO)."""
        span = self._tracer.start_span(
            name, context=self._ctx, kind=_INTERNAL, attributes=attributes)
        op = self._open = _Op(span, t0, otel_context.attach(trace.set_span_in_context(span)))
        return op

    def _detach(self, op: _Op) -> None:
        if op.context_token is not None:
            otel_context.detach(op.context_token)
            op.context_token = None
        if self._open is op:
            self._open = None

    def _event(self, name: str, attributes: Attributes) -> None:
        self._span.add_event(name, attributes)

    # -- decision

    def decision_started(self, request: RouteRequest) -> object:
        """Open a `turnrouter.route` span, current during the decision call."""
        excluded = request.excluded
        return self._start_current(SPAN_ROUTE, {
            ATTR.DECISION_CANDIDATES: request.candidate_names,
            ATTR.DECISION_EXCLUDED: tuple(sorted(excluded)) if excluded else (),
        }, perf_counter())

    def decision_finished(
        self, token: object, request: RouteRequest, decision: RouteDecision | None,
        error: BaseException | None,
    ) -> None:
        """Record the decision's duration, choice and scores; close its span."""
        if not isinstance(token, _Op):
            super().decision_finished(token, request, decision, error)
            return
        now = perf_counter()
        self._detach(token)
        span = token.span
        self._fam.decision_duration.observe_traced(now - token.t0, now, span)
        if decision is not None:
            span.set_attributes(_decision_attributes(decision, self._capture))
        if error is not None:
            self._count_failure(None, "decision", error)
            _set_error(span, _error_type(error))
        span.end()

    # -- admission

    def admission_started(self, route: str, focused: bool) -> object:
        """Open a `turnrouter.admission` span, current during the `admit()` call."""
        return self._start_current(SPAN_ADMISSION, {
            ATTR.ROUTE: route, ATTR.ADMISSION_FOCUSED: focused}, perf_counter())

    def admission_finished(
        self, token: object, route: str, focused: bool, disposition: str | None,
        error: BaseException | None, timed_out: bool = False,
    ) -> None:
        """Count the admission by disposition; close its span (timeouts are errors)."""
        if not isinstance(token, _Op):
            super().admission_finished(token, route, focused, disposition, error, timed_out)
            return
        now = perf_counter()
        self._detach(token)
        span = token.span
        label = _admission_label(disposition, error, timed_out)
        counter, duration = self._fam.admission_children(route, label, focused)
        counter.inc()
        duration.observe_traced(now - token.t0, now, span)
        attributes: Attributes = {ATTR.ADMISSION_DISPOSITION: label}
        if timed_out:
            self._count_failure(route, "admission", error)
            attributes[ATTR.ADMISSION_TIMED_OUT] = True
            attributes[ATTR.ERROR_TYPE] = "timeout"
            span.set_status(_ERROR_STATUS)
        elif error is not None:
            self._count_failure(route, "admission", error)
            attributes[ATTR.ERROR_TYPE] = _error_type(error)
            span.set_status(_ERROR_STATUS)
        elif disposition is None:  # admit() was cancelled: the turn was interrupted
            attributes[ATTR.INTERRUPTED] = True
        span.set_attributes(attributes)
        span.end()

    # -- answer

    def answer_started(self, route: str, fallback: bool) -> object:
        """Open `invoke_agent {route}` and make it current, so the agent's spans nest."""
        attributes: Attributes = {
            ATTR.GEN_AI_OPERATION_NAME: "invoke_agent",
            ATTR.GEN_AI_AGENT_NAME: route,
            ATTR.FALLBACK: fallback,
        }
        if self._capture:
            attributes[ATTR.GEN_AI_INPUT_MESSAGES] = _messages("user", self._turn.query)
        op = self._answer = self._start_current(
            SPAN_INVOKE_AGENT_PREFIX + route, attributes, 0.0)
        return op

    def first_response(self, token: object, route: str, seconds: float) -> None:
        """Record the first-response latency and a `turnrouter.first_response` event."""
        if not isinstance(token, _Op):
            super().first_response(token, route, seconds)
            return
        span = token.span
        self._fam.first_response.get(route).observe_traced(seconds, perf_counter(), span)
        token.first_response = seconds  # set as an attribute when the span closes
        span.add_event(EVENT_FIRST_RESPONSE, {ATTR.FIRST_RESPONSE_SECONDS: seconds})

    def answer_finished(
        self, token: object, route: str, result: DestinationResult | None,
        error: BaseException | None, interrupted: bool,
    ) -> None:
        """Close the answer span with the result's disposition, error or interruption."""
        if error is not None and not interrupted:
            self._count_failure(route, "answer", error)
        if isinstance(token, _Op):
            self._close_answer(token, result, error, interrupted)

    def _close_answer(
        self, op: _Op, result: DestinationResult | None, error: BaseException | None,
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
            attributes[ATTR.ERROR_TYPE] = _error_type(error)
            span.set_status(_ERROR_STATUS)
        if attributes:
            span.set_attributes(attributes)
        span.end()

    def _close_open(self, op: _Op, error: BaseException | None, interrupted: bool) -> None:
        """Close a route or admission span whose `*_finished` call never came."""
        self._detach(op)
        span = op.span
        if not span.is_recording():
            return
        if interrupted:
            span.set_attribute(ATTR.INTERRUPTED, True)
        elif error is not None:
            _set_error(span, _error_type(error))
        span.end()

    # -- release

    def release_started(self, route: str, reason: ReleaseReason) -> object:
        """Open a `turnrouter.release` span."""
        return _Op(self._tracer.start_span(
            SPAN_RELEASE, context=self._ctx, kind=_INTERNAL,
            attributes={ATTR.ROUTE: route, ATTR.RELEASE_REASON: reason}), 0.0)

    def release_finished(
        self, token: object, route: str, reason: ReleaseReason, error: BaseException | None
    ) -> None:
        """Close the release span; count a failure at stage `release` on error."""
        if error is not None:
            self._count_failure(route, "release", error)
        if isinstance(token, _Op):
            if error is not None:
                _set_error(token.span, _error_type(error))
            token.span.end()

    # -- counters and events

    def reroute(self, route: str) -> None:
        """Count a reroute away from `route`."""
        self._fam.reroutes.get(route).inc()
        self._event(EVENT_REROUTE, {ATTR.ROUTE: route})

    def default_fallback(self, route: str) -> None:
        """Count a default fallback to `route`."""
        self._fam.fallbacks.get(route).inc()
        self._event(EVENT_DEFAULT_FALLBACK, {ATTR.ROUTE: route})

    def clarification(self, reason: ClarificationReason) -> None:
        """Count a clarification by reason (an attribute of the turn span at its end)."""
        self._fam.clarifications.get(reason).inc()
        self._clarification = reason

    def focus_transition(self, route: str, transition: FocusTransition) -> None:
        """Count a focus transition."""
        self._fam.focus.get(route, transition).inc()
        self._event(EVENT_FOCUS, {ATTR.ROUTE: route, ATTR.FOCUS_TRANSITION: transition})

    def acknowledgment(
        self, route: str, outcome: AcknowledgmentOutcome, trigger: AcknowledgmentTrigger,
        delay_seconds: float, predicted_first_response: float | None,
        started_at: float, ended_at: float, text: str, error: BaseException | None,
    ) -> None:
        """Count the acknowledgment; record a span from `started_at` to `ended_at`.

        Both times are on the `time.monotonic()` clock (`anyio.current_time()` under
        asyncio); the span converts them to wall-clock time.
        """
        super().acknowledgment(route, outcome, trigger, delay_seconds,
                               predicted_first_response, started_at, ended_at, text, error)
        attributes: Attributes = {
            ATTR.ROUTE: route,
            ATTR.ACK_OUTCOME: outcome,
            ATTR.ACK_TRIGGER: trigger,
            ATTR.ACK_DELAY_SECONDS: delay_seconds,
        }
        if predicted_first_response is not None:
            attributes[ATTR.ACK_PREDICTED_SECONDS] = predicted_first_response
        if self._capture and text:
            attributes[ATTR.ACK_TEXT] = text
        if outcome == "failed":
            attributes[ATTR.ERROR_TYPE] = _error_type(error) if error is not None else "_OTHER"
        wall_ns, mono = time.time_ns(), time.monotonic()
        start_ns = wall_ns - int((mono - started_at) * 1e9)
        end_ns = max(start_ns, wall_ns - int((mono - ended_at) * 1e9))
        span = self._tracer.start_span(
            SPAN_ACKNOWLEDGMENT, context=self._ctx, kind=_INTERNAL, attributes=attributes,
            start_time=start_ns)
        if outcome == "failed":
            span.set_status(_ERROR_STATUS)
        span.end(end_time=end_ns)

    def silence(self, route: str, seconds: float) -> None:
        """Record the silence the participant heard after admission."""
        self._fam.silence.get(route).observe_traced(seconds, perf_counter(), self._span)

    def failure(self, route: str | None, stage: FailureStage, error: BaseException) -> None:
        """Count a failure, unless a stage callback already counted this one."""
        if self._counts_failure(route, stage, error):
            attributes: Attributes = {ATTR.FAILURE_STAGE: stage,
                                      ATTR.ERROR_TYPE: _error_type(error)}
            if route is not None:
                attributes[ATTR.ROUTE] = route
            self._event(EVENT_FAILURE, attributes)

    # -- end of turn

    def _end_turn(
        self, outcome: TurnOutcome, route: str | None, focus_before: str | None,
        focus_after: str | None, attempts: int, error: BaseException | None,
    ) -> None:
        """Count the turn and close any open span, then the turn span."""
        self._finish_metrics(outcome, route, self._span)
        interrupted = outcome == "interrupted"
        stale = self._open
        if stale is not None and stale is not self._answer:
            self._close_open(stale, error, interrupted)
        if self._answer is not None:  # answer_finished was never called
            self._close_answer(self._answer, None, error, interrupted)
        attributes: Attributes = {ATTR.OUTCOME: outcome, ATTR.ATTEMPTS: attempts}
        if route is not None:
            attributes[ATTR.ROUTE] = route
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
            attributes[ATTR.ERROR_TYPE] = _error_type(error) if error is not None else "_OTHER"
            span.set_status(_ERROR_STATUS)
        span.set_attributes(attributes)
        span.end()
