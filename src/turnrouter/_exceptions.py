"""The one exceptions module: every error turnrouter raises derives from `TurnrouterError`.

Errors that callers already catch by builtin type (`ValueError`, `TypeError`,
`RuntimeError`) also derive from that builtin, so both spellings work.
"""

from __future__ import annotations

import asyncio

__all__ = [
    "ConfigurationError",
    "ContractTypeError",
    "ContractValueError",
    "DestinationContractError",
    "LLMError",
    "LifecycleError",
    "PatchNotSavedError",
    "PendingPatchLimitError",
    "PolicyError",
    "RouterBusyError",
    "TurnInterrupted",
    "TurnrouterError",
    "UnknownPatchError",
]


class TurnrouterError(Exception):
    """Root of every error raised by turnrouter."""

    #: The message is turnrouter's own, naming a misuse and its fix with no user text,
    #: so a WARNING about it may show it whole (else only the type is shown).
    own_message: bool = False


class ConfigurationError(TurnrouterError, ValueError):
    """A constructor or configuration argument is invalid; the message names it."""


class ContractValueError(TurnrouterError, ValueError):
    """A contract object got a value outside its domain; the message names the field."""


class ContractTypeError(TurnrouterError, TypeError):
    """A contract object got a value of the wrong type; the message names the field."""


class DestinationContractError(TurnrouterError):
    """A destination returned something the agent protocol does not allow."""


class LifecycleError(TurnrouterError, RuntimeError):
    """The operation is not allowed in the router's or participant's current state.

    Raised by `handle()` while a departure or shutdown is pending, or after a cleanup
    failed until the caller retried it successfully.
    """


class RouterBusyError(LifecycleError):
    """The router shed the turn for load (outcome `busy`, see `OverloadPolicy`).

    The participant was already told (the policy's `busy_text` went to the turn's
    output); retry later or place the participant on another replica.
    """


class UnknownPatchError(LifecycleError, LookupError):
    """No pending patch has this id: never held, already settled, or dropped."""


class PatchNotSavedError(LifecycleError):
    """A context patch's change (merged, held, approved or rejected) was made in this
    replica's memory, but the participant's record holding it was not written: on a
    NATS fleet the participant moved to another replica first (its partition moved
    while the server was unreachable, or was handed over), or the write got no answer.
    The participant continues from their record, which does not (or may not) hold the
    change; the message names the cause. Apply the result again where the participant
    is served, e.g. at their next turn. The in-process router never raises it.
    """


class PendingPatchLimitError(LifecycleError):
    """A human-gated patch was refused: the participant already holds the maximum."""


class LLMError(TurnrouterError):
    """An LLM call failed: HTTP status, unreadable reply, connection error or timeout.

    `status` is the HTTP status (None when no response came back) and `body` the start
    of the response body, both also named in the message. Neither ever carries a
    credential (URLs are redacted, echoed keys and `Authorization` values masked) nor
    the prompt (a body echoing the request is withheld). turnrouter logs the message at
    WARNING when a classifier or acknowledgment call fails (the body at DEBUG only): an
    `LLMService` of your own that raises it keeps user text out of the message too.
    """

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class PolicyError(TurnrouterError, ValueError):
    """A routing policy could not be loaded or holds an invalid decision."""


class TurnInterrupted(TurnrouterError, asyncio.CancelledError):
    """The turn was cancelled by `interrupt()`, a newer turn, a departure or `stop()`.

    The contract says task cancellation propagates to the caller of `handle()`; this
    is that cancellation, made recognisable: it is an `asyncio.CancelledError` (so a
    task awaiting `handle()` ends cancelled) and a `TurnrouterError` (so callers can
    tell an interrupted turn from their own cancellation). Completed history and focus
    are kept.
    """

    def __init__(self, participant_id: str, turn_id: str, reason: str = "interrupted") -> None:
        super().__init__(f"turn {turn_id!r} of participant {participant_id!r} was {reason}")
        self.participant_id = participant_id
        self.turn_id = turn_id
        self.reason = reason
