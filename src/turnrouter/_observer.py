"""The one seam between routing logic and telemetry.

The router reports what happens to a `RouterObserver`; every method of the base
classes does nothing, so an unobserved router pays a few attribute look-ups per turn.
`turnrouter.telemetry.Telemetry` is the OpenTelemetry + Prometheus implementation and
`turnrouter.testing.RecordingObserver` an in-memory one. Only those modules import
telemetry libraries.

Methods named `*_started` return an opaque token that the router hands back to the
matching `*_finished` call, so an implementation can keep a span (or a start time)
without the router knowing what it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from ._contracts import AgentTurn, DestinationResult, RouteDecision, RouteRequest

__all__ = [
    "AcknowledgmentOutcome",
    "AcknowledgmentTrigger",
    "ClarificationReason",
    "FailureStage",
    "FocusTransition",
    "PatchOutcome",
    "ReleaseReason",
    "RouterObserver",
    "TurnObserver",
    "TurnOutcome",
]

TurnOutcome = Literal[
    "answer", "focus", "release", "clarify", "failed", "interrupted", "refused"
]
ClarificationReason = Literal[
    "no_eligible_route", "low_confidence", "destination", "default_unavailable",
    "decision_failed",
]
ReleaseReason = Literal[
    "reroute", "focus_taken", "post_answer", "ineligible", "departure", "shutdown"
]
FocusTransition = Literal["taken", "released", "lost"]
FailureStage = Literal["decision", "admission", "answer", "acknowledgment", "release", "cleanup"]
AcknowledgmentOutcome = Literal["emitted", "suppressed", "failed"]
AcknowledgmentTrigger = Literal["prediction", "delay"]
PatchOutcome = Literal[
    "applied", "diverged", "pending", "approved", "rejected", "dropped", "refused"
]


class TurnObserver:
    """Receives the events of one turn, in order. The base class ignores them all."""

    __slots__ = ()

    def decision_started(self, request: RouteRequest) -> object:
        """A decision-service call begins."""
        return None

    def decision_finished(
        self, token: object, request: RouteRequest, decision: RouteDecision | None,
        error: BaseException | None,
    ) -> None:
        """The decision-service call returned `decision` or raised `error`."""

    def admission_started(self, route: str, focused: bool) -> object:
        """An `admit()` call begins."""
        return None

    def admission_finished(
        self, token: object, route: str, focused: bool, disposition: str | None,
        error: BaseException | None, timed_out: bool = False,
    ) -> None:
        """`admit()` returned `disposition`, raised `error`, or timed out (a decline)."""

    def answer_started(self, route: str, fallback: bool) -> object:
        """An `answer()` call begins; `fallback` means the default answered without admit()."""
        return None

    def first_response(self, token: object, route: str, seconds: float) -> None:
        """The destination called `started()` `seconds` after its answer began."""

    def answer_finished(
        self, token: object, route: str, result: DestinationResult | None,
        error: BaseException | None, interrupted: bool,
    ) -> None:
        """`answer()` returned `result`, raised `error`, or was interrupted."""

    def release_started(self, route: str, reason: ReleaseReason) -> object:
        """A `release()` / `participant_left()` call on a destination begins."""
        return None

    def release_finished(
        self, token: object, route: str, reason: ReleaseReason, error: BaseException | None
    ) -> None:
        """The release call finished, successfully or with `error`."""

    def reroute(self, route: str) -> None:
        """`route` declined or released; the turn is routed again without it."""

    def default_fallback(self, route: str) -> None:
        """The default destination answers without admission after exhausted declines."""

    def clarification(self, reason: ClarificationReason) -> None:
        """The router asks the participant to clarify, for `reason`."""

    def focus_transition(self, route: str, transition: FocusTransition) -> None:
        """`route` took, released or lost the participant's focus."""

    def acknowledgment(  # started_at / ended_at are time.monotonic() readings
        self, route: str, outcome: AcknowledgmentOutcome, trigger: AcknowledgmentTrigger,
        delay_seconds: float, predicted_first_response: float | None,
        started_at: float, ended_at: float, text: str, error: BaseException | None,
    ) -> None:
        """An acknowledgment was emitted, suppressed by `started()`, or failed."""

    def silence(self, route: str, seconds: float) -> None:
        """Time from admission to the first thing the participant heard."""

    def failure(self, route: str | None, stage: FailureStage, error: BaseException) -> None:
        """A failure not reported by any `*_finished` call's `error` argument.

        Errors passed to `decision_finished`, `admission_finished` (or `timed_out`),
        `answer_finished`, `release_finished` and failed acknowledgments already count
        as failures of their stage; do not report them twice.
        """

    def finished(
        self, outcome: TurnOutcome, route: str | None, focus_before: str | None,
        focus_after: str | None, attempts: int, error: BaseException | None,
    ) -> None:
        """The turn ended with `outcome`; `route` answered, if any destination did."""


NULL_TURN_OBSERVER = TurnObserver()


class RouterObserver:
    """Receives router-level events and opens a `TurnObserver` per turn.

    The base class is the "telemetry off" observer: it ignores everything.
    """

    __slots__ = ()

    #: False when every method is a no-op, so callers may skip building arguments.
    enabled: bool = False

    def turn_started(self, turn: AgentTurn, focus: str | None) -> TurnObserver:
        """A turn begins (after ordering and initialization); return its observer."""
        return NULL_TURN_OBSERVER

    def participant_added(self, participant_id: str) -> None:
        """The router holds state for a new participant."""

    def participant_removed(self, participant_id: str) -> None:
        """The router dropped a participant's state (departure or shutdown)."""

    def release_started(self, route: str, reason: ReleaseReason) -> object:
        """A release outside any turn (departure, shutdown) begins."""
        return None

    def release_finished(
        self, token: object, route: str, reason: ReleaseReason, error: BaseException | None
    ) -> None:
        """That release finished."""

    def failure(self, route: str | None, stage: FailureStage, error: BaseException) -> None:
        """A failure outside any turn (for example `cleanup_participant`)."""

    def configured(
        self, *, routes: tuple[str, ...], acknowledgment_delay_secs: float | None
    ) -> None:
        """The router was constructed with these routes and acknowledgment delay."""

    def predicted_first_response(self, route: str, seconds: float) -> None:
        """The timing predictor's current estimate for `route` changed."""

    def heard(self, route: str, first_response_seconds: float,
              silence_seconds: float | None) -> None:
        """A front end reported when an answer was first heard (`route_turn(...,
        report_heard=True)` and `mark_heard`): first response and silence measured to
        that moment, possibly after the turn ended. `silence_seconds` is None when
        something else (a preamble, an acknowledgment) had ended the silence."""

    def message_rejected(self, topic: str, reason: str) -> None:
        """A runtime message was malformed (`invalid`, `wrong_type`) or refused (`closed`)."""

    def enter_context(self, carrier: Mapping[str, str]) -> object:
        """Make a remote W3C trace context (from a runtime message) current; return a token."""
        return None

    def exit_context(self, token: object) -> None:
        """Undo `enter_context` (same task, reverse order)."""

    def inject_context(self) -> dict[str, str]:
        """The current trace context as W3C headers for an outgoing message."""
        return {}

    def context_patch(self, strategy: str, outcome: str) -> None:
        """A background context patch was applied, held, settled, dropped or refused.

        `outcome` is a `PatchOutcome`; called once per event (the counter).
        """

    def context_patch_event(
        self, participant_id: str, patch_id: str, task_id: str, strategy: str,
        outcome: PatchOutcome, diverged: bool,
    ) -> None:
        """Details of one patch event (every outcome but `refused`), after `context_patch`.

        `diverged`: the participant's context had moved on since the task's stamp.
        """


NULL_OBSERVER = RouterObserver()
