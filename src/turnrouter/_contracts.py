"""Immutable contract objects exchanged between the router, destinations and deciders.

Public constructors validate their input and name the offending field (never echoing
text, which may be user content). Text fields reject lone surrogate code points, which
cannot be encoded as UTF-8 (history and telemetry store UTF-8). The router
builds its own internal copies through `_unchecked` constructors: those values were
validated once at the boundary, so re-checking them on every turn would only cost time.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from inspect import isawaitable
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeVar, get_args, runtime_checkable

from ._exceptions import ContractTypeError, ContractValueError
from ._redact import has_surrogates, preview

__all__ = [
    "CLARIFY",
    "NO_ROUTE",
    "Admission",
    "AdmissionDisposition",
    "AgentExchange",
    "AgentTurn",
    "DecisionService",
    "DestinationResult",
    "ResultDisposition",
    "RoutableAgent",
    "RouteDecision",
    "RouteRequest",
    "RoutingAid",
    "unset_field",
]

AdmissionDisposition = Literal["accept", "decline", "clarify", "release"]
ResultDisposition = Literal["answer", "focus", "release", "clarify"]
_ADMISSION_DISPOSITIONS: frozenset[str] = frozenset(get_args(AdmissionDisposition))
_RESULT_DISPOSITIONS: frozenset[str] = frozenset(get_args(ResultDisposition))

#: The decision choice meaning "ask the participant to clarify".
CLARIFY = "clarify"
#: The route of what the router says when no destination answers (the failure text
#: after none did, the busy text of a refused turn): as its metrics label it.
NO_ROUTE = "none"
#: How `PolicyDecisions` rationales start: a "clarify" with this prefix was forced by a
#: routing policy, and the router counts it under its own clarification reason.
POLICY_RATIONALE = "policy:"
#: Largest accepted `timestamp_us`: nanoseconds derived from it still fit a signed
#: 64-bit integer (telemetry timestamps), i.e. until the year 2262.
MAX_TIMESTAMP_US = (2**63 - 1) // 1000
#: Largest context version (`ParticipantSnapshot.history_version`,
#: `ContextPatch.source_context_version`): the largest integer a JSON reader keeps
#: exactly (2^53 - 1). A participant's history version wraps to 0 past it, so what an
#: import accepts the live path keeps writing and the next import accepts.
MAX_HISTORY_VERSION = 2**53 - 1

#: Longest accepted `AgentTurn.participant_id` / `turn_id`, in characters. Retained
#: exchanges keep their turn id outside the history's byte budget, so unbounded ids would
#: let a participant's snapshot outgrow `MAX_SNAPSHOT_BYTES` (what another replica
#: imports); 256 is also what the NATS front end allows a participant id in UTF-8 bytes.
MAX_ID_CHARS = 256

_T = TypeVar("_T")


def _shown(value: object) -> str:
    """The offending value for an error message: its type, plus the value itself only
    for numbers, booleans and None (text may be user content and is never echoed)."""
    kind = type(value).__name__
    if value is None or isinstance(value, bool | int | float):
        return f"{kind} {preview(value)}"
    return kind


def _type_error(cls: str, name: str, expected: str, value: object) -> ContractTypeError:
    return ContractTypeError(f"{cls}.{name} must be {expected}, got {_shown(value)}")


def _check_str(cls: str, name: str, value: object, *, nonempty: bool = False,
               owner: object = None) -> str:
    """`value` checked as a str field, as an exact `str`: a subclass's own methods
    (`encode`, `__len__`, `__eq__`, `__hash__`) would be what the router trusts, so its
    text is copied out, and set on `owner` when given (the frozen field)."""
    if not isinstance(value, str):
        raise _type_error(cls, name, "a str", value)
    if type(value) is not str:
        value = str.__str__(value)
        if owner is not None:
            object.__setattr__(owner, name, value)
    if nonempty and not value:
        raise ContractValueError(f"{cls}.{name} must not be empty")
    if not value.isascii() and has_surrogates(value):
        raise ContractValueError(
            f"{cls}.{name} holds a lone surrogate code point: it is not valid text and "
            "cannot be stored as UTF-8"
        )
    return value


def _exact_int(value: object, owner: object, name: str) -> object:
    """An int subclass's value as an exact `int`, set on `owner` (its comparisons are
    the subclass's own otherwise); anything else as it is."""
    if isinstance(value, int) and type(value) is not int and not isinstance(value, bool):
        value = int.__index__(value)
        object.__setattr__(owner, name, value)
    return value


def _check_choice(cls: str, name: str, value: object, allowed: frozenset[str],
                  owner: object = None) -> None:
    value = _check_str(cls, name, value, owner=owner)
    if value not in allowed:
        raise ContractValueError(
            f"{cls}.{name} must be one of {sorted(allowed)}, got {preview(value)}"
        )


def _unchecked(cls: type[_T], **values: Any) -> _T:
    """Build a frozen instance without running `__post_init__` (already validated data)."""
    obj = object.__new__(cls)
    for key, value in values.items():
        object.__setattr__(obj, key, value)
    return obj


_set = object.__setattr__
_new = object.__new__


def _turn_with_history(turn: AgentTurn, history: tuple[AgentExchange, ...]) -> AgentTurn:
    """A copy of a validated turn carrying the router's (validated) history."""
    copy: AgentTurn = _new(AgentTurn)
    _set(copy, "participant_id", turn.participant_id)
    _set(copy, "turn_id", turn.turn_id)
    _set(copy, "query", turn.query)
    _set(copy, "history", history)
    _set(copy, "timestamp_us", turn.timestamp_us)
    return copy


def _query_turn(participant_id: str, turn_id: str, query: str,
                timestamp_us: int | None) -> AgentTurn:
    """A turn without history from a runtime's validated query, unchecked: its model
    checked what `AgentTurn` checks (the NATS worker routes it with
    `route_validated_turn`, not checked again)."""
    turn: AgentTurn = _new(AgentTurn)
    _set(turn, "participant_id", participant_id)
    _set(turn, "turn_id", turn_id)
    _set(turn, "query", query)
    _set(turn, "history", ())
    _set(turn, "timestamp_us", timestamp_us)
    return turn


def _exchange(user: str, assistant: str) -> AgentExchange:
    exchange: AgentExchange = _new(AgentExchange)
    _set(exchange, "user", user)
    _set(exchange, "assistant", assistant)
    return exchange


def _request(
    turn: AgentTurn, candidates: tuple[RoutingAid, ...], excluded: frozenset[str]
) -> RouteRequest:
    request: RouteRequest = _new(RouteRequest)
    _set(request, "turn", turn)
    _set(request, "candidates", candidates)
    _set(request, "excluded", excluded)
    return request


@dataclass(frozen=True, slots=True)
class Admission:
    """Destination decision made before it speaks or starts work.

    `accept` permits work, `decline` returns control for another route (a focused
    owner keeps its focus), `clarify` ends routing with a question, and `release`
    clears focus and returns the same query to ordinary routing.
    """

    disposition: AdmissionDisposition
    """`"accept"`, `"decline"`, `"clarify"` or `"release"`."""
    preamble: str = ""
    """Optional short acknowledgment, emitted only after acceptance."""
    text: str = ""
    """Optional text for clarification or release; release text precedes rerouting."""

    def __post_init__(self) -> None:
        disposition, preamble, text = self.disposition, self.preamble, self.text
        if (type(disposition) is str and disposition in _ADMISSION_DISPOSITIONS
                and type(preamble) is str and (not preamble or preamble.isascii())
                and type(text) is str and (not text or text.isascii())):
            return  # the common case, checked inline (validated on every turn)
        _check_choice("Admission", "disposition", disposition, _ADMISSION_DISPOSITIONS, self)
        _check_str("Admission", "preamble", preamble, owner=self)
        _check_str("Admission", "text", text, owner=self)


@dataclass(frozen=True, slots=True)
class AgentExchange:
    """One completed user request and destination-provided response context."""

    user: str
    """User request in the completed exchange."""
    assistant: str
    """Completed response context (the destination's `DestinationResult.text`),
    excluding progress acknowledgments."""

    def __post_init__(self) -> None:
        _check_str("AgentExchange", "user", self.user, owner=self)
        _check_str("AgentExchange", "assistant", self.assistant, owner=self)

    def size_bytes(self) -> int:
        """UTF-8 size of the exchange, the unit of the router's history budget."""
        return len(self.user.encode()) + len(self.assistant.encode())


@dataclass(frozen=True, slots=True)
class AgentTurn:
    """The current user turn and the complete exchanges selected for a destination."""

    participant_id: str
    """Participant whose state and focus apply to this turn (at most `MAX_ID_CHARS`)."""
    turn_id: str
    """Stable identity used to correlate streamed output and cancellation."""
    query: str
    """Unmodified current user request."""
    history: tuple[AgentExchange, ...] = ()
    """Newest whole completed exchanges that fit the router's byte budget."""
    timestamp_us: int | None = None
    """Originating input time in Unix microseconds, when supplied by the caller."""

    def __post_init__(self) -> None:
        pid, turn_id, query = self.participant_id, self.turn_id, self.query
        if not (type(pid) is str and type(turn_id) is str and type(query) is str
                and pid and turn_id and len(pid) <= MAX_ID_CHARS and len(turn_id) <= MAX_ID_CHARS
                and pid.isascii() and turn_id.isascii() and query.isascii()):
            self._check_text()  # else the common case, checked inline (on every turn)
        history = self.history
        if not isinstance(history, tuple):
            if isinstance(history, str | bytes | Mapping) or not isinstance(history, Iterable):
                raise _type_error("AgentTurn", "history", "a sequence of AgentExchange", history)
            history = tuple(history)
            object.__setattr__(self, "history", history)
        if history:
            for index, exchange in enumerate(history):
                if not isinstance(exchange, AgentExchange):
                    raise _type_error("AgentTurn", f"history[{index}]", "an AgentExchange",
                                      exchange)
        ts = self.timestamp_us
        if ts is not None:
            if not isinstance(ts, int) or isinstance(ts, bool):
                raise _type_error("AgentTurn", "timestamp_us", "an int or None", ts)
            if type(ts) is not int:
                ts = int.__index__(ts)
                object.__setattr__(self, "timestamp_us", ts)
            if not 0 <= ts <= MAX_TIMESTAMP_US:
                raise ContractValueError(
                    f"AgentTurn.timestamp_us must be within [0, {MAX_TIMESTAMP_US}], "
                    f"got {preview(ts)}")

    def _check_text(self) -> None:
        _check_str("AgentTurn", "participant_id", self.participant_id, nonempty=True,
                   owner=self)
        _check_str("AgentTurn", "turn_id", self.turn_id, nonempty=True, owner=self)
        if len(self.participant_id) > MAX_ID_CHARS or len(self.turn_id) > MAX_ID_CHARS:
            name = "participant_id" if len(self.participant_id) > MAX_ID_CHARS else "turn_id"
            raise ContractValueError(
                f"AgentTurn.{name} must be at most MAX_ID_CHARS ({MAX_ID_CHARS}) characters, "
                f"got {len(getattr(self, name))}")
        _check_str("AgentTurn", "query", self.query, owner=self)


@dataclass(frozen=True, slots=True)
class DestinationResult:
    """Optional completed response context and the router's focus transition.

    Destinations return `answer`, `focus` or `release`; the router returns `clarify`
    when it asked for clarification before any answer work. `text` is kept in history,
    never delivered as output by the router.
    """

    disposition: ResultDisposition = "answer"
    """`"answer"` (focus unchanged), `"focus"` (take the participant's next turns) or
    `"release"` (clear focus after this answer); `"clarify"` only from the router."""
    text: str = ""
    """Completed response context kept in history (not spoken by the router)."""

    def __post_init__(self) -> None:
        disposition, text = self.disposition, self.text
        if (type(disposition) is str and disposition in _RESULT_DISPOSITIONS
                and type(text) is str and text.isascii()):
            return  # the common case, checked inline (validated on every turn)
        _check_choice("DestinationResult", "disposition", disposition, _RESULT_DISPOSITIONS,
                      self)
        _check_str("DestinationResult", "text", text, owner=self)


@dataclass(frozen=True, slots=True)
class RoutingAid:
    """Brief routing metadata, separate from the destination's full instructions."""

    name: str
    """Stable route name used for attribution and decision labels."""
    description: str
    """Concise description used as a route-selection hint, not an authorization rule."""
    priority: int = 0
    """Tie-breaking preference after request relevance (higher wins)."""
    eligible: bool = True
    """Whether this destination may be selected for this participant now."""
    eligibility: str = "available"
    """Current participant-specific eligibility state."""

    def __post_init__(self) -> None:
        name, description, eligibility = self.name, self.description, self.eligibility
        if (type(name) is str and name and name.isascii() and type(description) is str
                and description.isascii() and type(self.priority) is int
                and type(self.eligible) is bool and type(eligibility) is str
                and eligibility.isascii()):
            return  # the common case, checked inline (destinations often build one a turn)
        _check_str("RoutingAid", "name", self.name, nonempty=True, owner=self)
        _check_str("RoutingAid", "description", self.description, owner=self)
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise _type_error("RoutingAid", "priority", "an int", self.priority)
        _exact_int(self.priority, self, "priority")
        if not isinstance(self.eligible, bool):
            raise _type_error("RoutingAid", "eligible", "a bool", self.eligible)
        _check_str("RoutingAid", "eligibility", self.eligibility, owner=self)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a decision service sees: the turn and the routes it may choose from."""

    turn: AgentTurn
    """The turn to route."""
    candidates: tuple[RoutingAid, ...]
    """Eligible routes not excluded for this turn, in registration order."""
    excluded: frozenset[str] = frozenset()
    """Routes that declined or released this turn."""

    def __post_init__(self) -> None:
        if not isinstance(self.turn, AgentTurn):
            raise _type_error("RouteRequest", "turn", "an AgentTurn", self.turn)
        candidates = self.candidates
        if not isinstance(candidates, tuple):
            if isinstance(candidates, str | bytes) or not isinstance(candidates, Iterable):
                raise _type_error("RouteRequest", "candidates", "a sequence of RoutingAid",
                                  candidates)
            candidates = tuple(candidates)
            object.__setattr__(self, "candidates", candidates)
        seen: set[str] = set()
        for index, aid in enumerate(candidates):
            if not isinstance(aid, RoutingAid):
                raise _type_error("RouteRequest", f"candidates[{index}]", "a RoutingAid", aid)
            if aid.name in seen:
                raise ContractValueError(
                    f"RouteRequest.candidates has {preview(aid.name)} twice")
            seen.add(aid.name)
        excluded = self.excluded
        if not isinstance(excluded, frozenset):
            if isinstance(excluded, str) or not isinstance(excluded, Iterable):
                raise _type_error("RouteRequest", "excluded", "a set of route names", excluded)
            try:
                excluded = frozenset(excluded)
            except TypeError:  # an unhashable element
                raise _type_error("RouteRequest", "excluded", "a set of route names",
                                  excluded) from None
            object.__setattr__(self, "excluded", excluded)
        for name in excluded:
            if not isinstance(name, str):
                raise _type_error("RouteRequest", "excluded", "a set of route names", excluded)
        overlap = seen & excluded
        if overlap:
            raise ContractValueError(
                f"RouteRequest.candidates include excluded routes {preview(sorted(overlap))}"
            )

    @property
    def candidate_names(self) -> tuple[str, ...]:
        """The candidates' route names, in order."""
        return tuple(aid.name for aid in self.candidates)


_EMPTY_SCORES: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """A decision service's answer: a candidate's name, or `"clarify"`.

    `scores` (higher is better) let the router pick the best eligible candidate when the
    choice is `clarify` or not a candidate. `rationale` says where the choice came from
    (a policy, a classifier, the lexical scorer) for tracing.
    """

    choice: str
    """A candidate's route name, or `"clarify"`."""
    confidence: float | None = None
    """The service's confidence in `choice`, in [0, 1] (None: not given)."""
    scores: Mapping[str, float] = field(default_factory=lambda: _EMPTY_SCORES)
    """Route -> score, higher is better (kept read-only); `-inf` is never chosen."""
    rationale: str = ""
    """Where the choice came from (`lexical: ...`, `classifier: ...`, `policy: ...`)."""

    def __post_init__(self) -> None:
        choice = self.choice
        if not (type(choice) is str and choice and choice.isascii()):  # else checked inline
            _check_str("RouteDecision", "choice", choice, nonempty=True, owner=self)
        confidence = self.confidence
        if confidence is not None:
            if not isinstance(confidence, int | float) or isinstance(confidence, bool):
                raise _type_error("RouteDecision", "confidence", "a float or None", confidence)
            if not 0.0 <= confidence <= 1.0:
                raise ContractValueError(
                    f"RouteDecision.confidence must be within [0, 1], got {preview(confidence)}"
                )
            object.__setattr__(self, "confidence", float(confidence))
        scores = self.scores
        if scores is not _EMPTY_SCORES:
            if not isinstance(scores, Mapping):
                raise _type_error("RouteDecision", "scores", "a mapping of route to float",
                                  scores)
            frozen: dict[str, float] = {}
            for key, value in scores.items():
                if not isinstance(key, str):
                    raise _type_error("RouteDecision", "scores key", "a str", key)
                key = _check_str("RouteDecision", "scores key", key)
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise _type_error("RouteDecision", f"scores[{preview(key)}]", "a float",
                                      value)
                try:
                    number = float(value)
                except OverflowError:
                    raise ContractValueError(
                        f"RouteDecision.scores[{preview(key)}] is too large for a float"
                    ) from None
                if number != number or number == math.inf:
                    # (+inf was taken, then ignored when picking the best; -inf, a log
                    # probability of 0, means "never this route" and is kept)
                    raise ContractValueError(
                        f"RouteDecision.scores[{preview(key)}] must be a number below "
                        f"infinity, got {number}")
                frozen[key] = number
            object.__setattr__(self, "scores", MappingProxyType(frozen))
        rationale = self.rationale
        if not (type(rationale) is str and rationale.isascii()):  # else checked inline
            _check_str("RouteDecision", "rationale", rationale, owner=self)


@runtime_checkable
class DecisionService(Protocol):
    """Chooses a route for a turn from the request's candidates."""

    async def decide(self, request: RouteRequest) -> RouteDecision:
        """Return a candidate's name or `"clarify"`, ideally with scores."""
        ...


@runtime_checkable
class RoutableAgent(Protocol):
    """An agent that owns its state and handles admitted or fallback turns.

    An optional `async participant_left(participant_id)` method, when present, is called
    on departure instead of `release()`.
    """

    def routing_aid(self, participant_id: str) -> RoutingAid:
        """Describe this participant's current eligibility and route scope."""
        ...

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        """Accept, decline, clarify, or release before producing spoken output."""
        ...

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        """Answer an admitted (or default-fallback) turn; await `started()` before output."""
        ...

    async def release(self, participant_id: str) -> None:
        """Handle route release; also the departure fallback without `participant_left`."""
        ...



def checked_shape(decision: RouteDecision) -> bool:
    """Whether `decision` has the shape its validation guarantees, in a few type tests.

    The router re-checks the contract objects that enter a turn, because
    `object.__new__` and `object.__setattr__` skip validation. A decision's full
    re-validation costs ~4 us with eleven scores (the others' well under 1 us), on every
    turn, so a decision that passes this test is taken as validated: validation stores
    its scores as a read-only copy of its own. One that fails gets the full check, which
    names the field.
    """
    choice, confidence, rationale = decision.choice, decision.confidence, decision.rationale
    scores = decision.scores
    return (type(choice) is str and choice != "" and choice.isascii()
            and (confidence is None or (type(confidence) is float and 0.0 <= confidence <= 1.0))
            and type(scores) is MappingProxyType and type(rationale) is str
            and (not rationale or rationale.isascii())
            # Any read-only mapping passed before (bounds17 M2: a str score failed the
            # turn instead of counting a decision failure): its items' types too.
            and all(type(route) is str and type(score) is float
                    for route, score in scores.items()))


def say_through(callback: Callable[[AgentTurn, str, str], Awaitable[None]],
                turn: AgentTurn, route: str, text: str) -> Awaitable[None]:
    """Call an output callback; what it returns, for the caller to await (no coroutine
    layer of its own).

    A plain `def output(turn, route, text)` (a natural first try) runs, returns None,
    and `await None` would fail with "object NoneType can't be used in 'await'
    expression", which names neither the callback nor the fix: this says both.
    """
    result = callback(turn, route, text)
    if not isawaitable(result):
        name = getattr(callback, "__qualname__", type(callback).__qualname__)
        error = ContractTypeError(
            f"output callback {name} returned {type(result).__name__}, not an awaitable: "
            "it must be an async function (async def output(turn, route, text))")
        error.own_message = True  # (no user text: logged whole, newcomer18 F2)
        raise error
    return result


def unset_field(obj: object, exc: AttributeError) -> ContractTypeError:
    """The error for a contract object one of whose fields was never set (built with
    `object.__new__`, which skips the constructor): it names the field."""
    name = exc.name if isinstance(getattr(exc, "name", None), str) else "a field"
    return ContractTypeError(
        f"{type(obj).__name__}.{name} was never set (the object was built without its "
        "constructor, e.g. object.__new__)")
