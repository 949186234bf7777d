"""What front ends (runtimes, framework adapters) exchange with the router.

A front end feeds turns and lifecycle events to an `AgentRouter` through its public
front-end methods (`route_turn`, `begin_departure`, `readmit`, `drain`, ...). This module
holds the small value types of that seam: the routed result, the departure handle, and
the participant snapshot that moves a participant between router replicas.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import TypeVar

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticSerializationError

from . import _strict_json as strict_json
from ._contracts import MAX_HISTORY_VERSION, MAX_ID_CHARS, MAX_TIMESTAMP_US, DestinationResult
from ._exceptions import ContractTypeError, ContractValueError
from ._lifecycle import OwnedOperation
from ._models import ContractModel, error_location
from ._patches import ContextPatch, MergeStrategy, PendingContextPatch
from ._redact import has_surrogates, preview

__all__ = [
    "MAX_SESSION_TURNS",
    "MAX_SNAPSHOT_BYTES",
    "MAX_SNAPSHOT_CONTAINERS",
    "MAX_SNAPSHOT_ITEMS",
    "SNAPSHOT_ITEMS_SLACK",
    "Departure",
    "ParticipantSnapshot",
    "RoutedResult",
    "SnapshotExchange",
    "SnapshotPatch",
]

_Text = TypeVar("_Text", str, str | None, tuple[str, ...])

#: Largest serialized snapshot `ParticipantSnapshot.from_json` accepts (history is
#: bounded by the router's byte budget, pending patches by `max_pending_patches`).
MAX_SNAPSHOT_BYTES = 4 * 1024 * 1024
#: Most JSON objects and arrays a snapshot may hold, counted as its `{` and `[`
#: characters (those inside text too: a cheap bound read before parsing). Parsing and
#: validating cost per object, not per byte: 4 MiB of tiny exchanges took half a
#: second; a default router's largest export holds a few thousand.
MAX_SNAPSHOT_CONTAINERS = 16_384
#: Most JSON values a snapshot may hold, counted as its `,`, `{` and `[` characters
#: outside strings before parsing. Parsing costs per value, not per byte, and holds the
#: interpreter's lock throughout: 4 MiB of `0,` (two million numbers) took 0.1 s to
#: read, a stall of the event loop even from a thread; the worst within this bound took
#: 23 ms (`benchmarks/bench_snapshot_parse.py`). A default router's largest snapshot
#: holds about 275,000 (8 held patches of 64 KiB of tiny numbers); `apply_context_patch`
#: refuses a patch past it.
MAX_SNAPSHOT_ITEMS = 524_288
#: Values an export keeps free under `MAX_SNAPSHOT_ITEMS` (as `SNAPSHOT_SLACK` keeps
#: bytes): an import writes every default field out (2 more), a NATS replica adds the
#: ids of turns left in flight (at most 63), and a participant's next turns add their
#: session's turn ids (at most 64) before the export drops history to fit again. An
#: import takes at most `MAX_SNAPSHOT_ITEMS` less half of it, and at most the bound less
#: all of it besides the history (the part an export cannot drop).
SNAPSHOT_ITEMS_SLACK = 256
#: Turn ids a participant's session remembers, its first turns': a patch naming a turn
#: its session never had comes from an earlier session of that participant id and is
#: refused (docs/router.md, "Lifecycle" of context patches). A session past this many
#: turns stops checking (an earlier session's result arriving that late is rare), so
#: a long session costs nothing per turn and its snapshot carries no ids.
MAX_SESSION_TURNS = 64


@dataclass(frozen=True, slots=True)
class RoutedResult:
    """The outcome of `AgentRouter.route_turn`: the contract's result and who answered."""

    result: DestinationResult
    """What `handle()` returns for the same turn."""
    route: str | None
    """The route whose answer (or admission clarification) ended the turn; None when the
    router itself asked the participant to clarify."""


class Departure:
    """A participant's departure in progress (see `AgentRouter.begin_departure`).

    Admission is already closed when this handle exists. Any number of callers may
    `join()`; cancelling a joiner never abandons the departure.

    Args:
        operation: The router's departure operation (None: nothing left to wait for).
            Front ends get a `Departure` from `AgentRouter.begin_departure`, never build one.
    """

    __slots__ = ("_operation",)

    def __init__(self, operation: OwnedOperation | None) -> None:
        self._operation = operation

    @property
    def done(self) -> bool:
        """Whether the departure finished (successfully or not)."""
        return self._operation is None or self._operation.done

    async def join(self) -> None:
        """Wait for the departure; raise its `ExceptionGroup` of release failures."""
        if self._operation is not None:
            await self._operation.join()

    def add_done_callback(self, callback: Callable[[BaseException | None], object]) -> None:
        """Call `callback(error)` on the event loop once the departure ended: None, or
        what `join()` would raise. For a front end that only reports failures, this is
        cheaper than a task that joins. A departure that is already done calls back soon.
        """
        if self._operation is None:
            asyncio.get_running_loop().call_soon(callback, None)
        else:
            self._operation.add_done_callback(callback)


class SnapshotPatch(ContractModel):
    """An applied context patch, as stored with its history exchange."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    patch_id: str = Field(min_length=1)
    task_id: str = Field(min_length=1)
    strategy: MergeStrategy
    diverged: bool
    patch: ContextPatch


class SnapshotExchange(ContractModel):
    """One retained exchange with its id and completion time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str
    assistant: str
    turn_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    """The conversation turn's id (None for caller-seeded exchanges)."""
    stamp_us: int | None = Field(default=None, ge=0, le=MAX_TIMESTAMP_US)
    patch: SnapshotPatch | None = None
    """Set for a background-derived exchange (an applied context patch)."""

    @field_validator("user", "assistant", "turn_id")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return _storable(value)


#: What `ParticipantSnapshot.to_json` leaves out: `cleanup_pending` while false,
#: `session_turns` while None (so a snapshot without them reads as before).
_LEFT_OUT: dict[tuple[bool, bool], set[str] | None] = {
    (False, False): {"cleanup_pending", "session_turns"},
    (False, True): {"cleanup_pending"},
    (True, False): {"session_turns"},
    (True, True): None,
}


class ParticipantSnapshot(ContractModel):
    """A participant's router state, to move it to another router replica.

    Focus, the retained history (ids and timestamps included), the routes used (they
    are released on departure), held context patches and the lifecycle flags
    (`cleanup_pending`: an initialization began and failed, so the departure cleans up
    even if none succeeds; written only when true, so a replica of a version without
    the field reads every other snapshot during a rolling upgrade), and
    `session_turns`: the ids of the turns of the participant's current session while it
    has had at most `MAX_SESSION_TURNS` (None, left out of the JSON: more turns, or a
    snapshot of a version without the field; then a patch's `spawned_from_event_id`
    is not checked against them). The divergence rule's "state before the newest
    exchange" is not carried: a patch spawned by the turn just before a move is compared
    with the moved context only.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    participant_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    focus: str | None = None
    history: tuple[SnapshotExchange, ...] = ()
    history_version: int = Field(default=0, ge=0, le=MAX_HISTORY_VERSION)
    used: tuple[str, ...] = ()
    pending: tuple[PendingContextPatch, ...] = ()
    initialized: bool = False
    departed: bool = False
    cleanup_pending: bool = False
    # (last: the router writes its export's JSON around the history and appends this;
    # a NATS record carries it in its header, where a worker of an earlier version,
    # whose reader of snapshots knows no such field, ignores it: runtime/nats/_wire.py)
    session_turns: tuple[str, ...] | None = Field(default=None, max_length=MAX_SESSION_TURNS)

    @field_validator("participant_id", "focus", "used")
    @classmethod
    def _text(cls, value: _Text) -> _Text:
        return _storable(value)

    @field_validator("session_turns")
    @classmethod
    def _turn_ids(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        for turn_id in value:
            if not 0 < len(turn_id) <= MAX_ID_CHARS:
                raise ValueError(f"turn ids are 1 to {MAX_ID_CHARS} characters")
        return _storable(value)

    @field_validator("used")
    @classmethod
    def _once_each(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # A route named again adds nothing: the import reads each once (a snapshot
        # naming one route 600,000 times cost the import ~50 ms on the event loop).
        return tuple(dict.fromkeys(value)) if len(value) > 1 else value

    @field_validator("pending")
    @classmethod
    def _one_each(cls, value: tuple[PendingContextPatch, ...]
                  ) -> tuple[PendingContextPatch, ...]:
        # Held patches are kept by id: of two sharing one, the import kept the last and
        # the other was gone without a word (redteam20 F6), never to be approved.
        if len(value) > 1:
            seen: set[str] = set()
            for held in value:
                if held.patch_id in seen:
                    raise ValueError(f"two pending patches share the id "
                                     f"{preview(held.patch_id)}")
                seen.add(held.patch_id)
        return value

    @model_validator(mode="after")
    def _known_valid(self) -> ParticipantSnapshot:
        _VALIDATED[id(self)] = self
        return self

    def to_json(self) -> str:
        """Compact JSON (UTF-8 text)."""
        return self.model_dump_json(
            exclude=_LEFT_OUT[self.cleanup_pending, self.session_turns is not None])

    @classmethod
    def from_json(cls, data: str | bytes) -> ParticipantSnapshot:
        """Parse and validate a snapshot; `ContractValueError` names what is wrong (past
        `MAX_SNAPSHOT_BYTES` or `MAX_SNAPSHOT_CONTAINERS` before any parsing)."""
        if not isinstance(data, str | bytes | bytearray):
            raise ContractTypeError(
                f"ParticipantSnapshot.from_json takes str or bytes, got {type(data).__name__}")
        if len(data) > MAX_SNAPSHOT_BYTES:
            raise ContractValueError(
                f"participant snapshot of {len(data)} bytes exceeds MAX_SNAPSHOT_BYTES "
                f"({MAX_SNAPSHOT_BYTES})")
        containers = strict_json.containers(data, MAX_SNAPSHOT_CONTAINERS)
        if containers > MAX_SNAPSHOT_CONTAINERS:
            raise ContractValueError(
                f"participant snapshot holds {containers} objects and arrays, over "
                f"MAX_SNAPSHOT_CONTAINERS ({MAX_SNAPSHOT_CONTAINERS})")
        items = strict_json.items(data, MAX_SNAPSHOT_ITEMS)
        if items > MAX_SNAPSHOT_ITEMS:
            raise ContractValueError(
                f"participant snapshot holds {items} values, over MAX_SNAPSHOT_ITEMS "
                f"({MAX_SNAPSHOT_ITEMS})")
        try:
            snapshot = cls.model_validate_json(data)
        except ValidationError as exc:
            raise ContractValueError(
                f"invalid participant snapshot: {exc.error_count()} error(s), first: "
                f"{_first_error(exc)}") from None
        except (RecursionError, UnicodeDecodeError, ValueError) as exc:
            raise ContractValueError(f"invalid participant snapshot: {exc!r:.200}") from exc
        _READ_FROM_JSON[id(snapshot)] = snapshot
        return snapshot


def _storable(value: _Text) -> _Text:
    """Text (or a tuple of texts) storable as UTF-8: no lone surrogate code points."""
    for text in (value,) if value is None or isinstance(value, str) else value:
        if text is not None and not text.isascii() and has_surrogates(text):
            raise ValueError("holds a lone surrogate code point (not valid text)")
    return value


#: Snapshots built by validation, by identity (weakly held): `model_construct()` and
#: `model_copy(update=...)` skip validation, so `checked_snapshot` validates those again.
_VALIDATED: weakref.WeakValueDictionary[int, ParticipantSnapshot] = (
    weakref.WeakValueDictionary())


#: Snapshots `from_json` read (weakly held): every value in them came from JSON, so
#: their export reads back; one built from Python data may hold values JSON cannot carry.
_READ_FROM_JSON: weakref.WeakValueDictionary[int, ParticipantSnapshot] = (
    weakref.WeakValueDictionary())


def read_from_json(snapshot: ParticipantSnapshot) -> bool:
    """Whether `ParticipantSnapshot.from_json` built `snapshot`."""
    return _READ_FROM_JSON.get(id(snapshot)) is snapshot


def checked_snapshot(snapshot: ParticipantSnapshot) -> ParticipantSnapshot:
    """`snapshot` if validation built it, else a validated copy of its fields (nested
    values too); `ContractValueError` names the first bad field."""
    if _VALIDATED.get(id(snapshot)) is snapshot:
        return snapshot
    turns = getattr(snapshot, "session_turns", None)
    if isinstance(turns, Sized) and not isinstance(turns, str | bytes | bytearray):
        # Counted before each is validated: a million of them cost ~0.2 s of the event
        # loop (4 s when none is text) before the count was read (redteam20).
        count = len(turns)
        if count > MAX_SESSION_TURNS:
            raise ContractValueError(
                f"invalid participant snapshot: session_turns holds {count} turn ids, "
                f"over MAX_SESSION_TURNS ({MAX_SESSION_TURNS})")
    try:
        fields = snapshot.model_dump(warnings=False)
        return ParticipantSnapshot.model_validate(fields)
    except ValidationError as exc:
        raise ContractValueError(
            f"invalid participant snapshot: {exc.error_count()} error(s), first: "
            f"{_first_error(exc)}") from None
    except (PydanticSerializationError, RecursionError, TypeError, ValueError,
            AttributeError) as exc:
        raise ContractValueError(
            f"invalid participant snapshot: {type(exc).__name__} reading its fields") from exc


def reimported(snapshot: ParticipantSnapshot) -> ParticipantSnapshot:
    """`snapshot` exported and read back (`to_json`, then `from_json`): what an import
    installs is then exactly what the next replica's import reads. `ContractValueError`
    when it cannot be exported (a field set past validation with `object.__setattr__`,
    nested ones too, holding what JSON cannot carry), when its export, every default
    field included, is over `MAX_SNAPSHOT_BYTES` (a compact snapshot leaving defaults out
    grows by their size), or names the field the export breaks."""
    try:
        data = snapshot.model_dump_json(warnings=False)
    except (PydanticSerializationError, RecursionError, TypeError, ValueError,
            AttributeError) as exc:
        raise ContractValueError(
            f"participant snapshot cannot be exported ({type(exc).__name__}): a field was "
            "set past validation") from exc
    size = len(data.encode("utf-8", "surrogatepass"))
    if size > MAX_SNAPSHOT_BYTES:
        raise ContractValueError(
            f"participant snapshot exports to {size} bytes, over MAX_SNAPSHOT_BYTES "
            f"({MAX_SNAPSHOT_BYTES}): no replica could import its export again")
    _check_room(snapshot, data)
    return ParticipantSnapshot.from_json(data)


def _check_room(snapshot: ParticipantSnapshot, data: str) -> None:
    """`ContractValueError` unless the export `data` of `snapshot` leaves the room for
    values its participant's next turns take (`SNAPSHOT_ITEMS_SLACK`): past it, what it
    exports next could be refused by every replica (its state lost at its next move)."""
    roomy = MAX_SNAPSHOT_ITEMS - SNAPSHOT_ITEMS_SLACK
    items = strict_json.items(data, roomy)
    if items <= roomy:
        return
    if items > MAX_SNAPSHOT_ITEMS - SNAPSHOT_ITEMS_SLACK // 2:
        raise ContractValueError(
            f"participant snapshot exports to {items} values, over MAX_SNAPSHOT_ITEMS "
            f"({MAX_SNAPSHOT_ITEMS}) less the room its next turns take "
            f"({SNAPSHOT_ITEMS_SLACK // 2}): its next export could be imported nowhere")
    history = strict_json.items(snapshot.model_dump_json(include={"history"},
                                                         warnings=False), 0)
    if items - history > roomy:
        raise ContractValueError(
            f"participant snapshot holds {items - history} values besides its history, "
            f"over MAX_SNAPSHOT_ITEMS ({MAX_SNAPSHOT_ITEMS}) less the room its next "
            f"turns take ({SNAPSHOT_ITEMS_SLACK}): no export of it could be imported")


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_input=False)[0]
    where = error_location(first.get("loc", ()))
    return f"{where}: {first.get('msg', '')}"
