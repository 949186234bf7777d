"""Span names and attribute keys (a public interface: see `docs/telemetry.md`)."""

from __future__ import annotations

__all__ = [
    "ATTR",
    "CONTENT_CAPTURE_ENV",
    "EVENT_DEFAULT_FALLBACK",
    "EVENT_FAILURE",
    "EVENT_FIRST_RESPONSE",
    "EVENT_FOCUS",
    "EVENT_REROUTE",
    "SPAN_ACKNOWLEDGMENT",
    "SPAN_ADMISSION",
    "SPAN_CONTEXT_PATCH",
    "SPAN_INVOKE_AGENT_PREFIX",
    "SPAN_RELEASE",
    "SPAN_ROUTE",
    "SPAN_TURN",
    "TOP_SCORES",
    "TRACER_NAME",
]

TRACER_NAME = "turnrouter"

SPAN_TURN = "turnrouter.turn"
SPAN_ROUTE = "turnrouter.route"
SPAN_ADMISSION = "turnrouter.admission"
SPAN_INVOKE_AGENT_PREFIX = "invoke_agent "
"""The answer span is named `invoke_agent {route}` (GenAI semantic conventions)."""
SPAN_ACKNOWLEDGMENT = "turnrouter.acknowledgment"
SPAN_RELEASE = "turnrouter.release"
SPAN_CONTEXT_PATCH = "turnrouter.context_patch"

EVENT_FIRST_RESPONSE = "turnrouter.first_response"
"""On `invoke_agent {route}`, at the destination's first `started()`."""
# Events on the turn span.
EVENT_REROUTE = "turnrouter.reroute"
EVENT_DEFAULT_FALLBACK = "turnrouter.default_fallback"
EVENT_FOCUS = "turnrouter.focus"
EVENT_FAILURE = "turnrouter.failure"

#: How many of the highest decision scores are recorded on the route span.
TOP_SCORES = 3

#: The standard GenAI switch for recording message content.
CONTENT_CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


class ATTR:
    """Attribute keys. Content attributes are set only when content capture is on."""

    # turnrouter.turn
    PARTICIPANT_ID = "turnrouter.participant.id"
    TURN_ID = "turnrouter.turn.id"
    OUTCOME = "turnrouter.outcome"
    ROUTE = "turnrouter.route"
    FOCUS_BEFORE = "turnrouter.focus.before"
    FOCUS_AFTER = "turnrouter.focus.after"
    ATTEMPTS = "turnrouter.attempts"
    INTERRUPTED = "turnrouter.interrupted"
    CLARIFICATION_REASON = "turnrouter.clarification.reason"
    QUERY = "turnrouter.query"  # content
    # events on the turn span (with turnrouter.route, error.type)
    FOCUS_TRANSITION = "turnrouter.focus.transition"
    FAILURE_STAGE = "turnrouter.failure.stage"
    # turnrouter.route
    DECISION_CHOICE = "turnrouter.decision.choice"
    DECISION_CONFIDENCE = "turnrouter.decision.confidence"
    DECISION_CANDIDATES = "turnrouter.decision.candidates"
    DECISION_EXCLUDED = "turnrouter.decision.excluded"
    DECISION_MARGIN = "turnrouter.decision.margin"
    DECISION_SCORES_PREFIX = "turnrouter.decision.scores."
    DECISION_DROPPED_SCORES = "turnrouter.decision.dropped_scores"
    DECISION_RATIONALE = "turnrouter.decision.rationale"  # content
    DECISION_SOURCE = "turnrouter.decision.source"
    # turnrouter.admission
    ADMISSION_DISPOSITION = "turnrouter.admission.disposition"
    ADMISSION_FOCUSED = "turnrouter.admission.focused"
    ADMISSION_TIMED_OUT = "turnrouter.admission.timed_out"
    # invoke_agent {route}
    GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
    GEN_AI_AGENT_NAME = "gen_ai.agent.name"
    GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"  # content
    GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"  # content
    FALLBACK = "turnrouter.fallback"
    FIRST_RESPONSE_SECONDS = "turnrouter.first_response.seconds"
    RESULT_DISPOSITION = "turnrouter.result.disposition"
    # turnrouter.acknowledgment
    ACK_OUTCOME = "turnrouter.acknowledgment.outcome"
    ACK_TRIGGER = "turnrouter.acknowledgment.trigger"
    ACK_DELAY_SECONDS = "turnrouter.acknowledgment.delay.seconds"
    ACK_PREDICTED_SECONDS = "turnrouter.acknowledgment.predicted_first_response.seconds"
    ACK_PROBABILITY_LATE = "turnrouter.acknowledgment.probability_late"
    ACK_TEXT = "turnrouter.acknowledgment.text"  # content
    # turnrouter.release
    RELEASE_REASON = "turnrouter.release.reason"
    # turnrouter.context_patch (also turnrouter.participant.id)
    PATCH_ID = "turnrouter.context_patch.id"
    PATCH_TASK_ID = "turnrouter.context_patch.task_id"
    PATCH_STRATEGY = "turnrouter.context_patch.strategy"
    PATCH_OUTCOME = "turnrouter.context_patch.outcome"
    PATCH_DIVERGED = "turnrouter.context_patch.diverged"
    # errors
    ERROR_TYPE = "error.type"
