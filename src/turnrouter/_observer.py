"""The one seam between routing logic and telemetry.

The router reports what happens to a `RouterObserver`; every method of the base
classes does nothing, so an unobserved router pays a few attribute look-ups per turn
(and builds no event: it checks `enabled` first). `turnrouter.telemetry.Telemetry` is
the OpenTelemetry + Prometheus implementation and `turnrouter.testing.RecordingObserver`
an in-memory one. Only those modules import telemetry libraries.

Each hook takes one frozen event (a `NamedTuple` from `turnrouter.events`), so a field
added later breaks no observer. Methods named `*_started` return an opaque token that
the router hands back to the matching `*_finished` call, so an implementation can keep
a span (or a start time) without the router knowing what it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

from ._contracts import AgentTurn, DestinationResult, RouteDecision, RouteRequest

__all__ = [
    "AcknowledgmentFinished",
    "AcknowledgmentGenerated",
    "AcknowledgmentOutcome",
    "AcknowledgmentTrigger",
    "AdmissionFinished",
    "AdmissionStarted",
    "AnswerAfterAcknowledgment",
    "AnswerFinished",
    "AnswerStarted",
    "Clarification",
    "ClarificationReason",
    "Configured",
    "ContextPatchEvent",
    "DecisionFinished",
    "DefaultFallback",
    "EstimateChanged",
    "Failure",
    "FailureStage",
    "FirstResponse",
    "FocusChanged",
    "FocusTransition",
    "Heard",
    "LimitExceeded",
    "LoadSampled",
    "MessageRejected",
    "ParticipantChanged",
    "PatchOutcome",
    "ReleaseFinished",
    "ReleaseReason",
    "ReleaseStarted",
    "Rerouted",
    "RouteIneligible",
    "RouterObserver",
    "SilenceMeasured",
    "TurnFinished",
    "TurnObserver",
    "TurnOutcome",
    "TurnShed",
    "TurnStarted",
]

TurnOutcome = Literal[
    "answer", "focus", "release", "clarify", "failed", "interrupted", "refused", "busy"
]
ClarificationReason = Literal[
    "no_eligible_route", "low_confidence", "destination", "default_unavailable",
    "decision_failed", "policy",
]
ReleaseReason = Literal[
    "reroute", "focus_taken", "post_answer", "ineligible", "departure", "shutdown"
]
FocusTransition = Literal["taken", "released", "lost"]
FailureStage = Literal["decision", "admission", "answer", "acknowledgment", "release", "cleanup"]
AcknowledgmentOutcome = Literal["emitted", "suppressed", "failed"]
AcknowledgmentTrigger = Literal["prediction", "delay"]
PatchOutcome = Literal[
    "applied", "diverged", "pending", "approved", "rejected", "dropped", "refused",
    "unsaved",
]


# ------------------------------------------------------------------ events of one turn


class TurnStarted(NamedTuple):
    """A turn begins (after ordering)."""

    turn: AgentTurn
    focus: str | None
    """The route holding the participant's focus when the turn began."""


class DecisionFinished(NamedTuple):
    """The decision-service call returned `decision` or raised `error`."""

    request: RouteRequest
    decision: RouteDecision | None
    error: BaseException | None


class AdmissionStarted(NamedTuple):
    """An `admit()` call begins."""

    route: str
    focused: bool


class AdmissionFinished(NamedTuple):
    """`admit()` returned `disposition`, raised `error`, or timed out (a decline)."""

    route: str
    focused: bool
    disposition: str | None
    """None when `admit()` raised or was cancelled."""
    error: BaseException | None
    timed_out: bool


class AnswerStarted(NamedTuple):
    """An `answer()` call begins; `fallback`: the default answered without admit()."""

    route: str
    fallback: bool


class FirstResponse(NamedTuple):
    """The destination called `started()` `seconds` after its answer began."""

    route: str
    seconds: float


class AnswerFinished(NamedTuple):
    """`answer()` returned `result`, raised `error`, or was interrupted."""

    route: str
    result: DestinationResult | None
    error: BaseException | None
    interrupted: bool


class ReleaseStarted(NamedTuple):
    """A `release()` / `participant_left()` call on a destination begins (for
    `participant_id`, when known: a departure's releases run outside any turn)."""

    route: str
    reason: ReleaseReason
    participant_id: str = ""


class ReleaseFinished(NamedTuple):
    """The release call finished, successfully or with `error`."""

    route: str
    reason: ReleaseReason
    error: BaseException | None


class Rerouted(NamedTuple):
    """`route` declined or released; the turn is routed again without it."""

    route: str


class DefaultFallback(NamedTuple):
    """The default destination answers without admission after exhausted declines."""

    route: str


class Clarification(NamedTuple):
    """The router asks the participant to clarify, for `reason`."""

    reason: ClarificationReason


class FocusChanged(NamedTuple):
    """`route` took, released or lost the participant's focus."""

    route: str
    transition: FocusTransition


class AcknowledgmentFinished(NamedTuple):
    """An acknowledgment was emitted, suppressed by `started()`, or failed.

    `started_at` / `ended_at` are readings of the router's clock (monotonic seconds).
    """

    route: str
    outcome: AcknowledgmentOutcome
    trigger: AcknowledgmentTrigger
    delay_seconds: float
    """When it was due to be heard, after the answer began."""
    predicted_first_response: float | None
    started_at: float
    ended_at: float
    text: str
    error: BaseException | None
    probability_late: float | None = None
    """The predicted probability that the answer starts after the delay, when the
    predictor knows the delay (the trigger acknowledges early when it is high enough)."""


class AcknowledgmentGenerated(NamedTuple):
    """The acknowledgment generator returned after `seconds` (whether or not the text
    was then spoken)."""

    route: str
    seconds: float


class AnswerAfterAcknowledgment(NamedTuple):
    """The answer started `seconds` after a spoken acknowledgment was heard (0 when it
    started while the acknowledgment was being delivered): a short gap means the
    acknowledgment was needless."""

    route: str
    trigger: AcknowledgmentTrigger
    seconds: float


class RouteIneligible(NamedTuple):
    """A candidate route was found ineligible while the turn was routed; `reason` is
    its routing aid's `eligibility`."""

    route: str
    reason: str


class SilenceMeasured(NamedTuple):
    """Time from admission to the first thing the participant heard."""

    route: str
    seconds: float


class Failure(NamedTuple):
    """A failure not reported by any `*_finished` event's `error`.

    Errors in `DecisionFinished`, `AdmissionFinished` (or its `timed_out`),
    `AnswerFinished`, `ReleaseFinished` and failed acknowledgments already count as
    failures of their stage; they are not reported twice.
    """

    route: str | None
    stage: FailureStage
    error: BaseException


class TurnFinished(NamedTuple):
    """The turn ended with `outcome`; `route` answered, if any destination did."""

    outcome: TurnOutcome
    route: str | None
    focus_before: str | None
    focus_after: str | None
    attempts: int
    """Routed choices made (the focus owner's admission is not one)."""
    error: BaseException | None


# ------------------------------------------------------------------ router-wide events


class ParticipantChanged(NamedTuple):
    """The router began or stopped holding state for a participant."""

    participant_id: str


class Configured(NamedTuple):
    """The router was constructed with these routes and acknowledgment delay."""

    routes: tuple[str, ...]
    acknowledgment_delay_secs: float | None
    acknowledgment_route_delays: tuple[tuple[str, float], ...] = ()
    """Routes with their own fallback delay (`acknowledgment_route_delays`), sorted."""

    def delay_of(self, route: str) -> float | None:
        """The fallback delay `route` runs with (None: acknowledgments off)."""
        if self.acknowledgment_delay_secs is None:
            return None
        return dict(self.acknowledgment_route_delays).get(route, self.acknowledgment_delay_secs)


class EstimateChanged(NamedTuple):
    """The timing predictor's estimate of `route`'s first response changed."""

    route: str
    seconds: float


class Heard(NamedTuple):
    """A front end reported when an answer was first heard (`route_turn(...,
    report_heard=True)` and `mark_heard`), possibly after its turn ended.

    `silence_seconds` is None when something else (a preamble, an acknowledgment) had
    ended the silence. `interrupted`: the participant barged in (`interrupt()`) before
    any of the answer was heard; `first_response_seconds` is then a lower bound (to the
    barge-in), recorded as interrupted before a response, and no silence is recorded.
    """

    route: str
    first_response_seconds: float
    silence_seconds: float | None
    interrupted: bool = False


class LimitExceeded(NamedTuple):
    """A bound overflowed and something was dropped or refused (see `docs/limits.md`):
    `history_exchanges`, `seeded_history`, `waiting_turns`, `participants`,
    `departed_participants`, `patch_bytes`, `snapshot_history` or `release_timeout`."""

    limit: str


class LoadSampled(NamedTuple):
    """The router sampled its saturation (every `OverloadPolicy.sample_secs` while
    turns run): event-loop lag, turns in flight, the longest wait before routing over
    the period, and the state (0 ready, 1 busy: new participants refused, 2 shedding:
    new turns refused too)."""

    lag_secs: float
    turns_in_flight: int
    wait_secs: float
    state: int


class TurnShed(NamedTuple):
    """A turn was refused for load before any work: the whole turn, reported once (no
    `turn_started`: a shed turn must cost next to nothing). Its outcome is `busy`;
    `reason` is `new_participant` (busy) or `shedding`."""

    turn: AgentTurn
    reason: str


class MessageRejected(NamedTuple):
    """A front end refused an input: malformed (`invalid`, `wrong_type`), refused
    (`closed`), or any reason word the front end names."""

    topic: str
    reason: str


class ContextPatchEvent(NamedTuple):
    """A background context patch was applied, held, settled, dropped or refused.

    `patch_id` is None for a refused patch (it never got one). `diverged`: the
    participant's context had moved on since the task's stamp.
    """

    participant_id: str
    patch_id: str | None
    task_id: str
    strategy: str
    outcome: PatchOutcome
    diverged: bool


# ------------------------------------------------------------------ observers


class TurnObserver:
    """Receives the events of one turn, in order. The base class ignores them all."""

    __slots__ = ()

    def decision_started(self, request: RouteRequest) -> object:
        """A decision-service call begins."""
        return None

    def decision_finished(self, token: object, event: DecisionFinished) -> None:
        """The decision-service call ended."""

    def admission_started(self, event: AdmissionStarted) -> object:
        """An `admit()` call begins."""
        return None

    def admission_finished(self, token: object, event: AdmissionFinished) -> None:
        """The `admit()` call ended."""

    def answer_started(self, event: AnswerStarted) -> object:
        """An `answer()` call begins."""
        return None

    def first_response(self, token: object, event: FirstResponse) -> None:
        """The destination called `started()`."""

    def output_started(self, token: object, event: FirstResponse) -> None:
        """The destination called `started()` in a turn whose first response is measured
        to the first audio heard (`route_turn(..., report_heard=True)`): `event.seconds`
        is to `started()`; the latency itself comes later, as `RouterObserver.heard`."""

    def interrupted_before_response(self, token: object, event: FirstResponse) -> None:
        """The turn was interrupted `event.seconds` after its `answer()` began, before
        `started()`: a censored first response (the true one is longer; the timing
        samples record it as `censored`). Called before `answer_finished`."""

    def answer_finished(self, token: object, event: AnswerFinished) -> None:
        """The `answer()` call ended."""

    def release_started(self, event: ReleaseStarted) -> object:
        """A release during the turn begins."""
        return None

    def release_finished(self, token: object, event: ReleaseFinished) -> None:
        """That release ended."""

    def reroute(self, event: Rerouted) -> None:
        """A route declined or released; the turn is routed again without it."""

    def default_fallback(self, event: DefaultFallback) -> None:
        """The default answers without admission."""

    def clarification(self, event: Clarification) -> None:
        """The router asks the participant to clarify."""

    def focus_transition(self, event: FocusChanged) -> None:
        """A route took, released or lost focus."""

    def acknowledgment(self, event: AcknowledgmentFinished) -> None:
        """An acknowledgment ended (emitted, suppressed or failed)."""

    def acknowledgment_generated(self, event: AcknowledgmentGenerated) -> None:
        """The acknowledgment text was generated."""

    def answer_after_acknowledgment(self, event: AnswerAfterAcknowledgment) -> None:
        """The answer started after a spoken acknowledgment."""

    def route_ineligible(self, event: RouteIneligible) -> None:
        """A route was ineligible for this turn."""

    def silence(self, event: SilenceMeasured) -> None:
        """The silence after admission ended."""

    def failure(self, event: Failure) -> None:
        """A failure not reported by any `*_finished` event."""

    def finished(self, event: TurnFinished) -> None:
        """The turn ended."""


NULL_TURN_OBSERVER = TurnObserver()


class RouterObserver:
    """Receives router-level events and opens a `TurnObserver` per turn.

    The base class is the "telemetry off" observer: it ignores everything.
    """

    __slots__ = ()

    #: False when every method is a no-op, so callers may skip building events.
    enabled: bool = False

    def turn_started(self, event: TurnStarted) -> TurnObserver:
        """A turn begins (after ordering); return its observer."""
        return NULL_TURN_OBSERVER

    def participant_added(self, event: ParticipantChanged) -> None:
        """The router holds state for a new participant."""

    def participant_removed(self, event: ParticipantChanged) -> None:
        """The router dropped a participant's state (departure, shutdown, hand-over)."""

    def focus_transition(self, event: FocusChanged) -> None:
        """A participant's focus ended outside any turn (`lost`: a departure, a stop)."""

    def release_started(self, event: ReleaseStarted) -> object:
        """A release outside any turn (departure, shutdown) begins."""
        return None

    def release_finished(self, token: object, event: ReleaseFinished) -> None:
        """That release ended."""

    def failure(self, event: Failure) -> None:
        """A failure outside any turn (for example `cleanup_participant`)."""

    def configured(self, event: Configured) -> None:
        """The router was constructed."""

    def predicted_first_response(self, event: EstimateChanged) -> None:
        """The timing predictor's estimate for a route changed."""

    def heard(self, event: Heard) -> None:
        """A front end reported when an answer was first heard."""

    def message_rejected(self, event: MessageRejected) -> None:
        """A front end refused an input before the router saw it."""

    def limit_exceeded(self, event: LimitExceeded) -> None:
        """A bound overflowed (counted; the router logs it)."""

    def context_patch(self, event: ContextPatchEvent) -> None:
        """A context patch event (applied, held, settled, dropped, refused)."""

    def load_sampled(self, event: LoadSampled) -> None:
        """The router sampled its saturation (see `OverloadPolicy`)."""

    def turn_shed(self, event: TurnShed) -> None:
        """A turn was refused for load (outcome `busy`); no other event reports it."""

    def enter_context(self, carrier: Mapping[str, str]) -> object:
        """Make a remote W3C trace context (from a runtime message) current; return a token."""
        return None

    def exit_context(self, token: object) -> None:
        """Undo `enter_context` (same task, reverse order)."""

    def inject_context(self) -> dict[str, str]:
        """The current trace context as W3C headers for an outgoing message."""
        return {}


NULL_OBSERVER = RouterObserver()
