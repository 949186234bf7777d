"""`Telemetry`: the OpenTelemetry + Prometheus implementation of the observer seam.

Library code depends on the OpenTelemetry *API* only; the application installs an SDK.
Per-turn costs are kept small: a no-op tracer provider or an unsampled turn skips all
span work, labelled metric children are bound once and cached by label tuple, and metric
families are registered once per registry (several routers may share one registry).
Three layers: `_families` (metric families), `_turns` (per-turn observers) and this
facade, which also handles router-wide events and trace-context propagation.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    SpanContext,
    Tracer,
    TracerProvider,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import REGISTRY, CollectorRegistry

from .._observer import (
    NULL_OBSERVER,
    Configured,
    ContextPatchEvent,
    EstimateChanged,
    Failure,
    FocusChanged,
    Heard,
    LimitExceeded,
    LoadSampled,
    MessageRejected,
    ParticipantChanged,
    ReleaseFinished,
    ReleaseStarted,
    RouterObserver,
    TurnObserver,
    TurnShed,
    TurnStarted,
)
from ._families import NONE_LABEL, Families, families_for
from ._spans import (
    ATTR,
    CONTENT_CAPTURE_ENV,
    SPAN_CONTEXT_PATCH,
    SPAN_RELEASE,
    SPAN_TURN,
    TRACER_NAME,
)
from ._turns import (
    INTERNAL,
    Attributes,
    InvokeSpans,
    Op,
    TracedTurn,
    TraceSettings,
    TurnMetrics,
    error_type,
    invoke_span,
    set_error,
)

__all__ = ["MAX_TRACED_PARTICIPANTS", "Telemetry"]

#: Participants whose latest turn's span context is remembered, so spans outside any
#: turn (departure releases, context patches) join that participant's trace instead of
#: starting new ones. The least recently active is forgotten first (its later spans
#: start their own trace).
MAX_TRACED_PARTICIPANTS = 10_000

_PROPAGATOR = TraceContextTextMapPropagator()


def current_carrier() -> dict[str, str]:
    """The W3C headers (`traceparent`, `tracestate`) of the caller's current span, for a
    message published for another process to continue the trace; {} without a valid
    span (no SDK, or outside any span)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def _tracer_for(provider: TracerProvider) -> Tracer | None:
    """A tracer, or None when `provider` can only produce no-op spans."""
    if isinstance(provider, NoOpTracerProvider | ProxyTracerProvider):
        return None
    return provider.get_tracer(TRACER_NAME)


def _capture_from_env() -> bool:
    return os.environ.get(CONTENT_CAPTURE_ENV, "").strip().lower() == "true"



class Telemetry(RouterObserver):
    """OpenTelemetry spans and Prometheus metrics for an `AgentRouter`.

    `tracer_provider=None` follows the global provider (re-checked cheaply at each
    turn's start, so an SDK installed after construction is picked up); `registry=None` uses
    prometheus_client's default registry. Several `Telemetry` objects may share one
    registry (a scrape adds up their counts). Each thread that records through a
    `Telemetry` (a router's event loop, usually one) writes its own lock-free shard of
    the counters and histograms. Query, answer, acknowledgment and rationale text are
    recorded only with `capture_content=True` or
    `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.

    Args:
        tracer_provider: Where spans go; None follows the global OpenTelemetry provider
            (a no-op until the application installs an SDK, and then span work is
            skipped).
        registry: The Prometheus registry the metric families are registered in, once
            per registry; None uses prometheus_client's default `REGISTRY`.
        capture_content: Record query, answer, acknowledgment and rationale text on
            spans (default False: no user text leaves the process).
    """

    __slots__ = (
        "_capture", "_follow_global", "_invoke", "_latest", "_local", "_provider",
        "_recent_failures", "_registry", "_settings", "_tracer",
    )

    enabled = True

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        registry: CollectorRegistry | None = None,
        capture_content: bool = False,
    ) -> None:
        self._registry = REGISTRY if registry is None else registry
        # Each thread's shard of the metric families (see `_families`); this thread's is
        # made now, so the families are registered when the constructor returns.
        self._local = threading.local()
        self._local.families = families_for(self._registry)
        self._capture = bool(capture_content) or _capture_from_env()
        self._follow_global = tracer_provider is None or isinstance(
            tracer_provider, ProxyTracerProvider)
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        self._settings: TraceSettings | None = None
        if not self._follow_global:
            assert tracer_provider is not None
            self._provider = tracer_provider
            self._tracer = _tracer_for(tracer_provider)
        else:
            self._current_tracer()
        # Errors already counted by a router-level release, so that a matching
        # `failure()` call for the same exception is not counted twice.
        self._recent_failures: deque[BaseException] = deque(maxlen=8)
        # The configured routes' answer span names and start attributes, made once.
        self._invoke: InvokeSpans = {}
        #: Participant -> its latest turn's span context (bounded, least recent first).
        self._latest: OrderedDict[str, SpanContext] = OrderedDict()

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

    @property
    def _families(self) -> Families:
        """The calling thread's shard: updates need no lock, a scrape adds shards up."""
        try:
            return self._local.families  # type: ignore[no-any-return]
        except AttributeError:
            families = self._local.families = families_for(self._registry)
            return families

    def _current_tracer(self) -> Tracer | None:
        if self._follow_global:
            provider = trace.get_tracer_provider()
            if provider is not self._provider:
                self._provider = provider
                self._tracer = _tracer_for(provider)
        return self._tracer

    # -- RouterObserver

    def turn_started(self, event: TurnStarted) -> TurnObserver:
        """Open the `turnrouter.turn` span and make it current until `finished()`."""
        families = self._families
        families.turns_begun += 1
        if families.in_flight is not None:  # multiprocess mode
            families.in_flight.inc()
        turn, focus = event.turn, event.focus
        families.note_speaker(turn.participant_id)
        tracer = self._current_tracer()
        if tracer is None:
            return TurnMetrics(families, None, turn.participant_id)
        attributes: Attributes = {
            ATTR.PARTICIPANT_ID: turn.participant_id,
            ATTR.TURN_ID: turn.turn_id,
        }
        if focus is not None:
            attributes[ATTR.FOCUS_BEFORE] = focus
        if self._capture:
            attributes[ATTR.QUERY] = turn.query
        span = tracer.start_span(SPAN_TURN, kind=INTERNAL, attributes=attributes)
        self._remember(turn.participant_id, span.get_span_context())
        if not span.is_recording():
            # Unsampled: propagate the context, skip every child span and attribute.
            return TurnMetrics(families, otel_context.attach(trace.set_span_in_context(span)),
                               turn.participant_id)
        settings = self._settings
        if settings is None or settings.tracer is not tracer:
            settings = self._settings = TraceSettings(
                tracer, tracer.start_span, self._capture, self._invoke)
        return TracedTurn(families, settings, event, span)

    def _remember(self, participant_id: str, context: SpanContext) -> None:
        latest = self._latest
        latest[participant_id] = context
        latest.move_to_end(participant_id)
        if len(latest) > MAX_TRACED_PARTICIPANTS:
            latest.popitem(last=False)

    def _context_of(self, participant_id: str) -> Context | None:
        """The participant's latest turn as parent, when no span is current (None: the
        current context is the parent)."""
        if trace.get_current_span().get_span_context().is_valid:
            return None
        latest = self._latest.get(participant_id) if participant_id else None
        if latest is None:
            return None
        return trace.set_span_in_context(NonRecordingSpan(latest))

    def participant_added(self, event: ParticipantChanged) -> None:
        """Count one more active participant."""
        self._families.participants.inc()

    def participant_removed(self, event: ParticipantChanged) -> None:
        """Count one fewer active participant."""
        self._families.participants.dec()

    def focus_transition(self, event: FocusChanged) -> None:
        """Count a focus that ended outside any turn (a departure, a stop)."""
        self._families.focus.get(event.route, event.transition).inc()

    def release_started(self, event: ReleaseStarted) -> object:
        """Open a `turnrouter.release` span under the caller's current span, or (a
        departure, outside any turn) in the participant's latest turn's trace."""
        tracer = self._tracer  # as found at the latest turn's start
        if tracer is not None:
            span = tracer.start_span(SPAN_RELEASE, kind=INTERNAL, attributes={
                ATTR.ROUTE: event.route, ATTR.RELEASE_REASON: event.reason},
                context=self._context_of(event.participant_id))
            if span.is_recording():
                return Op(span, 0.0)
        return None

    def release_finished(self, token: object, event: ReleaseFinished) -> None:
        """Close the release span; count a failure at stage `release` on error."""
        error = event.error
        if error is not None:
            self._families.failures.get(event.route, "release").inc()
            self._recent_failures.append(error)
        if isinstance(token, Op):
            if error is not None:
                set_error(token.span, error_type(error))
            token.span.end()

    def failure(self, event: Failure) -> None:
        """Count a failure outside any turn (unless already counted for this error)."""
        recent = self._recent_failures
        for index, seen in enumerate(recent):
            if seen is event.error:
                del recent[index]
                return
        self._families.failures.get(event.route or NONE_LABEL, event.stage).inc()

    def configured(self, event: Configured) -> None:
        """Publish the fallback acknowledgment delay, router-wide and per route (NaN when
        acknowledgments are off); make the routes' answer span names and start attributes once."""
        delay = event.acknowledgment_delay_secs
        families = self._families
        families.ack_delay.set(math.nan if delay is None else delay)
        for route in event.routes:  # the delay each route runs with
            own = event.delay_of(route)
            families.ack_route_delay.labels(route).set(math.nan if own is None else own)
            # Interrupted-before-a-response series exist from the start (a count of 0),
            # so the tuning dashboard can add them to every route's first responses.
            families.first_response_interrupted.get(route)
        # Bounded by the routers' configurations (a shared Telemetry: all their routes).
        for route in event.routes:
            for fallback in (False, True):
                self._invoke[(route, fallback)] = invoke_span(route, fallback)

    def predicted_first_response(self, event: EstimateChanged) -> None:
        """Publish the timing predictor's estimate for a route."""
        self._families.predicted.labels(event.route).set(event.seconds)

    def heard(self, event: Heard) -> None:
        """Record first response (and silence) measured to the first audio heard, or a
        first response cut short by a barge-in before anything was heard."""
        families = self._families
        if event.interrupted:
            families.first_response_interrupted.get(event.route).observe(
                event.first_response_seconds)
            return
        families.first_response.get(event.route).observe(event.first_response_seconds)
        if event.silence_seconds is not None:
            families.silence.get(event.route).observe(event.silence_seconds)

    def context_patch(self, event: ContextPatchEvent) -> None:
        """Count a context patch event; record a `turnrouter.context_patch` span under the
        caller's current span, or in the participant's latest turn's trace (not for a
        refused patch, which has no id)."""
        self._families.context_patches.get(event.strategy, event.outcome).inc()
        if event.patch_id is None:
            return
        tracer = self._tracer  # as found at the latest turn's start
        if tracer is None:
            return
        span = tracer.start_span(SPAN_CONTEXT_PATCH, kind=INTERNAL,
                                 context=self._context_of(event.participant_id), attributes={
            ATTR.PARTICIPANT_ID: event.participant_id,
            ATTR.PATCH_ID: event.patch_id,
            ATTR.PATCH_TASK_ID: event.task_id,
            ATTR.PATCH_STRATEGY: event.strategy,
            ATTR.PATCH_OUTCOME: event.outcome,
            ATTR.PATCH_DIVERGED: event.diverged,
        })
        span.end()

    def message_rejected(self, event: MessageRejected) -> None:
        """Count an input a front end rejected."""
        self._families.rejected.get(event.topic, event.reason).inc()

    def limit_exceeded(self, event: LimitExceeded) -> None:
        """Count an overflowed bound."""
        self._families.overflows.get(event.limit).inc()

    def load_sampled(self, event: LoadSampled) -> None:
        """Record a saturation sample: loop lag, longest wait, admission state."""
        families = self._families
        families.loop_lag.observe(event.lag_secs)
        families.turn_wait.set(event.wait_secs)
        families.overload_state.set(event.state)
        if families.multiprocess is not None:  # the windows slide: published while busy
            families.multiprocess.publish_windows()

    def turn_shed(self, event: TurnShed) -> None:
        """Count a turn refused for load: by reason, and as a turn (route none, outcome
        busy; no span and no duration: shedding must stay cheap)."""
        families = self._families
        families.shed.get(event.reason).inc()
        families.turns.get(NONE_LABEL, "busy").inc()

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
