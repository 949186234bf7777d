"""Typed runtime messages: pydantic-validated, frozen, with publication identity.

Every message carries a publication id, its originating time and, optionally, W3C trace
context (`traceparent` / `tracestate`), so a turn published by an upstream speech
recogniser continues that trace through the router.

Text fields reject lone surrogate code points (not valid text: the exchange could not be
stored as UTF-8 later) and `timestamp_us` is bounded like `AgentTurn.timestamp_us`.
"""

from __future__ import annotations

import operator
import os
import time
import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .._contracts import MAX_ID_CHARS, MAX_TIMESTAMP_US
from .._redact import has_surrogates

__all__ = [
    "Interrupted",
    "ParticipantJoined",
    "ParticipantLeft",
    "ResponseOutput",
    "RuntimeMessage",
    "UserQuery",
]


def new_message_id() -> str:
    """A new publication id (what a message gets when none is given): 32 hex digits,
    128 random bits, unique across processes and publishers like a `uuid4()`, and
    unpredictable: front ends sharing a NATS user see each other's ids in the outputs,
    and a process prefix with a counter let one of them publish another's *next* ids
    first, so the stream dropped that front end's queries as duplicates (redteam16 F3).
    An id identifies, it does not authorise; it just cannot be guessed."""
    return os.urandom(16).hex()


def _now_us() -> int:
    return time.time_ns() // 1000


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weak reference that knows its key (as `weakref.KeyedRef`, whose Python-level
    constructor costs several times this one's)."""

    __slots__ = ("key", "values")
    key: int
    values: tuple[object, ...]


class _Validated:
    """The message instances known valid, by identity (weakly held).

    Built by their validating constructor or returned by `Topic.coerce`; instances from
    `model_construct()` or `model_copy(update=...)` are never in it (identity, not
    equality: a bypassed copy can compare equal yet carry junk), so `Topic.coerce`
    validates them. Each entry keeps the field values it was validated with: one whose
    field was changed since (`object.__setattr__`) is not known valid any more, and is
    validated again where it is published (bounds17 H1: it reached a subscriber's turn,
    whose contract error cancelled every turn of the runtime).
    """

    __slots__ = ("_forget", "_refs")

    def __init__(self) -> None:
        self._refs: dict[int, _Ref] = {}
        refs = self._refs

        def forget(ref: _Ref) -> None:
            if refs.get(ref.key) is ref:
                del refs[ref.key]

        # One callback for every entry: a message costs one weak reference, no closure.
        self._forget = forget

    def add(self, message: BaseModel) -> None:
        key = id(message)
        ref = _Ref(message, self._forget)
        ref.key = key
        ref.values = tuple(message.__dict__.values())
        self._refs[key] = ref

    def __contains__(self, message: object) -> bool:
        ref = self._refs.get(id(message))
        if ref is None or ref() is not message:
            return False
        values = ref.values
        current = message.__dict__
        if len(current) != len(values):
            return False
        return all(map(operator.is_, current.values(), values))


VALIDATED = _Validated()


class RuntimeMessage(BaseModel):
    """Fields every published message carries."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def __init__(self, **data: Any) -> None:
        # What pydantic's own `__init__` does, without its extra frame (every message
        # pays it: a shed query two messages, its caller's and the busy text).
        self.__pydantic_validator__.validate_python(data, self_instance=self)
        VALIDATED.add(self)  # validated just now: delivery need not validate it again

    message_id: str = Field(default_factory=new_message_id, min_length=1, max_length=MAX_ID_CHARS)
    """Publication identity; a query's becomes its turn id."""
    timestamp_us: int = Field(default_factory=_now_us, ge=0, le=MAX_TIMESTAMP_US)
    """Originating time in Unix microseconds."""
    traceparent: str | None = None
    """W3C trace context of the publisher, if any."""
    tracestate: str | None = None

    @field_validator("*")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        """Reject text holding a lone surrogate (it cannot be encoded as UTF-8)."""
        if isinstance(value, str) and has_surrogates(value):
            raise ValueError("holds a lone surrogate code point, which is not valid text")
        return value

    def trace_carrier(self) -> dict[str, str]:
        """The W3C headers as a propagation carrier."""
        carrier: dict[str, str] = {}
        if self.traceparent:
            carrier["traceparent"] = self.traceparent
            if self.tracestate:
                carrier["tracestate"] = self.tracestate
        return carrier


class UserQuery(RuntimeMessage):
    """A participant's finished utterance (one turn)."""

    participant_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    text: str


class ResponseOutput(RuntimeMessage):
    """Text said for a turn: control text (acknowledgment, preamble, clarification) or
    the turn's final output (its answer, or the failure text)."""

    participant_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    request_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    """The turn id the text belongs to (the query's message id)."""
    route: str
    text: str
    final: bool = False
    """True for the turn's final output (its answer, or the failure text: one per turn),
    False for control text said along the way. On the in-process runtime's topics the
    router sets it on the text that ends a turn it ended (a clarification, the failure
    text); an answer is the destination's to publish, final on its last output
    (docs/router.md, "Runtime topics"). `turnrouter worker` publishes a returned
    `DestinationResult.text` as the final output itself."""


class ParticipantJoined(RuntimeMessage):
    """A participant (re)joined: admission reopens for them."""

    participant_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)


class ParticipantLeft(RuntimeMessage):
    """A participant left: their state is released."""

    participant_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)


class Interrupted(RuntimeMessage):
    """Barge-in: cancel a participant's response work (all participants when None)."""

    participant_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
