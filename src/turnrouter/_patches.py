"""Background context patches: results of slow background work merged into a context.

A destination that starts slow work ("I'll book it and let you know") stamps it with the
participant's `ContextState` (version and hash); when the work finishes, a `ContextPatch`
goes to `AgentRouter.apply_context_patch(...)`. The router compares the stamp with the
participant's context now, marks the patch diverged when the conversation moved on, and
merges it (append, replace) or holds it for a human (human_gated). See
`docs/router.md`, "Background context patches".
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, TypeVar

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
)

from . import _strict_json as strict_json
from ._context import _current
from ._contracts import MAX_HISTORY_VERSION, MAX_ID_CHARS, AgentExchange
from ._exceptions import ContractValueError, PendingPatchLimitError, UnknownPatchError
from ._models import ContractModel, error_location
from ._redact import preview

__all__ = [
    "MAX_IMPORTED_PATCH_DEPTH",
    "MAX_PATCH_DEPTH",
    "AppliedContextPatch",
    "ContextPatch",
    "ContextState",
    "MergeStrategy",
    "PatchExchangeId",
    "PendingContextPatch",
    "PendingPatchLimitError",
    "UnknownPatchError",
    "context_hash",
    "current_context_patches",
]


class MergeStrategy(enum.StrEnum):
    """How a patch reaches the participant's context."""

    APPEND = "append"
    """Add the patch's digest to the context, after what is already there."""
    REPLACE = "replace"
    """Remove every earlier background-derived exchange, then add this patch's."""
    HUMAN_GATED = "human_gated"
    """Hold the patch and ask the participant; `approve_patch` appends it."""


_T = TypeVar("_T")

#: Deepest nesting of objects and arrays in a context patch's JSON (the patch object is
#: 1, its facts 2, a list in them 3, ...). A participant's snapshot holds a merged patch
#: 4 levels deeper (`history[].patch.patch`) and a held one 3, and an import reads at
#: most about 200 levels: a patch nested near that read back alone, but not in the
#: snapshot, so the participant's state was lost at its next move.
MAX_PATCH_DEPTH = 128
#: The deepest held patch an imported snapshot may carry: one an earlier version
#: accepted deeper than `MAX_PATCH_DEPTH` still moves (refusing it would lose the whole
#: participant), as long as, approved, it sits where an import still reads it (about 200
#: levels, with a margin for the record a runtime wraps the snapshot in).
MAX_IMPORTED_PATCH_DEPTH = 190


def _utc_now() -> datetime:
    return datetime.now(UTC)


class ReadOnlyList(tuple[_T, ...]):
    """A tuple equal to a list of the same items: the reference types the patch's
    sequences as lists (`digest == ["..."]` holds, `model_dump()` gives lists), while
    turnrouter keeps a held or merged patch unchangeable in place."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return list(self) == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__

    def __repr__(self) -> str:
        return repr(list(self))


def _nothing() -> ReadOnlyList[Any]:
    return _NOTHING


_NOTHING: ReadOnlyList[Any] = ReadOnlyList()
if TYPE_CHECKING:  # what a caller may pass, and compare the values with: any sequence
    _Lines = Sequence[str]
    _Records = Sequence[dict[str, Any]]
else:
    _Lines = Annotated[tuple[str, ...], AfterValidator(ReadOnlyList),
                       PlainSerializer(list, return_type=list[str])]
    _Records = Annotated[tuple[dict[str, Any], ...], AfterValidator(ReadOnlyList),
                         PlainSerializer(list, return_type=list[dict[str, Any]])]


class ContextPatch(ContractModel):
    """Structured summary of a completed background task's contribution to context."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str = Field(min_length=1, description="Identifier of the task that produced "
                         "this patch.")
    spawned_from_event_id: str | None = Field(
        default=None, max_length=MAX_ID_CHARS,
        description="Turn id of the foreground turn that spawned the task.")
    source_context_version: int | None = Field(
        default=None, ge=0, le=MAX_HISTORY_VERSION,
        description="Context version the task branched from.")
    source_context_hash: str | None = Field(
        default=None, min_length=1, max_length=MAX_ID_CHARS,
        description="Context hash the task branched from.")
    context_diverged: bool = Field(
        default=False, description="Whether the context changed since the task was spawned "
        "(set by the router when it detects it).")
    completed_at: datetime = Field(default_factory=_utc_now,
                                   description="When the task completed.")
    digest: _Lines = Field(
        default_factory=_nothing, description="Short human-readable summary lines of the result.")
    facts: dict[str, Any] = Field(default_factory=dict,
                                  description="Structured facts extracted from the task.")
    artifacts: _Records = Field(
        default_factory=_nothing,
        description="Artifacts (files, links, payloads) the task produced.")
    sources: _Records = Field(
        default_factory=_nothing, description="Source references the task consulted.")
    recommended_next_steps: _Lines = Field(
        default_factory=_nothing, description="Suggested follow-up actions.")
    assumptions: _Lines = Field(
        default_factory=_nothing, description="Assumptions the task made.")

    @field_validator("completed_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        """Naive times are taken as UTC, so every patch has a comparable instant."""
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)

    @field_validator("digest", "recommended_next_steps", "assumptions")
    @classmethod
    def _lines(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for line in value:
            if "\n" in line:
                raise ValueError("lines must not contain newlines")
        return value


class PendingContextPatch(ContractModel):
    """A context patch awaiting human approval (`MergeStrategy.HUMAN_GATED`).

    Built as the reference's dataclass is, by position or keyword.

    Args:
        patch_id: Approve or reject it by this id.
        task_id: The task whose completion produced the patch.
        patch: The payload merged (appended) if approved.
        strategy: The strategy it was submitted with (`human_gated`).
        created_at: Unix time (seconds) when it was held (now by default).
        participant_id: turnrouter's (keyword only): the participant holding it. The
            router's own always name it; a snapshot's without it are the snapshot's
            participant's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    _POSITIONAL = ("patch_id", "task_id", "patch", "strategy", "created_at")

    if TYPE_CHECKING:
        def __init__(self, patch_id: str, task_id: str, patch: ContextPatch,
                     strategy: MergeStrategy | str = MergeStrategy.HUMAN_GATED,
                     created_at: float = ..., *, participant_id: str | None = None
                     ) -> None: ...

    patch_id: str = Field(min_length=1, description="Approve or reject it by this id.")
    participant_id: str | None = Field(
        default=None, min_length=1,
        description="The participant holding it (None: the snapshot's holding it).")
    task_id: str = Field(min_length=1)
    patch: ContextPatch = Field(description="The payload merged (appended) if approved; "
                                "`context_diverged` as detected when it was held.")
    strategy: MergeStrategy = MergeStrategy.HUMAN_GATED
    created_at: float = Field(
        default_factory=time.time,
        ge=0, le=253_402_300_799, allow_inf_nan=False,  # up to 9999-12-31: exportable
        description="Unix time (seconds) when the patch was held (now by default).")


@dataclass(frozen=True, slots=True)
class AppliedContextPatch:
    """A patch merged into a participant's context (returned, and visible to turns)."""

    patch_id: str
    """The id `apply_context_patch` returned for this patch."""
    participant_id: str
    """The participant whose context it was merged into."""
    task_id: str
    """The background task's id (`ContextPatch.task_id`)."""
    strategy: MergeStrategy
    """`append`, `replace`, or `human_gated` for an approved patch (merged as append)."""
    diverged: bool
    """The context had moved on since the task branched from it (see the docs)."""
    patch: ContextPatch
    """The payload, with `context_diverged` equal to `diverged`."""
    exchange_id: str
    """Its exchange's id in the history: `patch:<task_id>`."""


class ContextState(NamedTuple):
    """A participant's context version and hash: stamp background work with it."""

    version: int
    """Completed conversation exchanges so far (caller-seeded ones included)."""
    hash: str
    """blake2b-128 hex digest of the retained conversation exchanges' text."""


class PatchExchangeId(str):
    """The exchange id of a patch's history entry: `patch:<task_id>`, with the patch.

    It is a `str` equal to `"patch:<task_id>"`, so ids compare as plain strings, and
    `isinstance(exchange_id, PatchExchangeId)` tells background-derived exchanges apart.
    """

    applied: AppliedContextPatch

    def __new__(cls, applied: AppliedContextPatch) -> PatchExchangeId:
        made = super().__new__(cls, applied.exchange_id)
        made.applied = applied
        return made


def context_hash(
    exchanges: Sequence[AgentExchange], ids: Sequence[object | None]
) -> str:
    """Digest of the conversation exchanges (background-derived ones are skipped)."""
    digest = hashlib.blake2b(digest_size=16)
    for exchange, exchange_id in zip(exchanges, ids, strict=True):
        if isinstance(exchange_id, PatchExchangeId):
            continue
        for text in (exchange.user, exchange.assistant):
            data = text.encode()
            digest.update(len(data).to_bytes(8, "big"))
            digest.update(data)
    return digest.hexdigest()


EMPTY_CONTEXT_HASH = context_hash((), ())


def patch_size_bytes(patch: ContextPatch) -> int:
    """The patch's serialized (JSON, UTF-8) size: what it costs to keep and to move.

    Raises `ContractValueError` for a patch whose facts or artifacts are not JSON data.
    """
    return len(_patch_json(patch))


def checked_patch(patch: ContextPatch, limit: int,
                  depth: int = MAX_PATCH_DEPTH) -> tuple[ContextPatch, int]:
    """`patch` validated (a copy when it was not valid as it stands) and its serialized
    size (`patch_size_bytes`).

    A patch built by `model_construct()`, `model_copy(update=...)` or changed with
    `object.__setattr__` skipped validation, and facts may hold values a JSON reader
    cannot take back (an integer past its range, nesting past `MAX_PATCH_DEPTH`):
    accepted as they are, they would make every later export of the participant
    unreadable (an import validates it). So a
    patch within `limit` bytes (over it the caller refuses it by size) is validated
    again, and its JSON read back as an import reads it; `ContractValueError` names the
    first bad field. NaN and infinity are refused too: JSON has no form for them, so the
    participant's next move would have turned them into null.
    """
    data = _patch_json(patch)
    if len(data) > limit:
        return patch, len(data)
    nests = strict_json.nesting(data, depth)
    if nests > depth:
        bound = ("MAX_PATCH_DEPTH" if depth == MAX_PATCH_DEPTH else
                 "MAX_IMPORTED_PATCH_DEPTH")
        raise ContractValueError(
            f"invalid context patch {_shown(patch)}: its JSON nests {nests} levels deep, "
            f"over {bound} ({depth}): a participant's snapshot holds it "
            "deeper still, and no replica could read that snapshot back; flatten its "
            "facts, artifacts or sources")
    refuse_non_finite(patch)
    try:
        validated = ContextPatch.model_validate(
            {name: getattr(patch, name, None) for name in ContextPatch.model_fields})
        read = ContextPatch.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors(include_input=False)[0]
        where = error_location(first.get("loc", ()))
        raise ContractValueError(
            f"invalid context patch {_shown(patch)}: {exc.error_count()} error(s), "
            f"first: {where}: {first.get('msg', '')}") from None
    for name in ("facts", "artifacts", "sources"):
        if getattr(read, name) != getattr(validated, name):
            # A set, tuple, bytes or non-text key: JSON carries it as something else, so
            # the participant's state would change at its next move or import.
            raise ContractValueError(
                f"invalid context patch {_shown(patch)}: {name} hold values that are not "
                "JSON data (a set, tuple, bytes, or a key that is not text): they would "
                "read back as something else after a move")
    # Equal is not enough: a bypassed `context_diverged=0` equals validation's False,
    # and kept as it was it made every later export warn (an int for a bool).
    same = validated == patch and all(
        type(getattr(validated, name)) is type(getattr(patch, name, None))
        for name in ContextPatch.model_fields)
    return (patch if same else validated), len(data)


def refuse_non_finite(patch: ContextPatch) -> None:
    """`ContractValueError` when the patch's facts, artifacts or sources hold a NaN or
    infinite float: JSON has no form for them, so the participant's next move would
    turn them into null. A JSON reader makes them too (`NaN`, `Infinity`, `1e400`),
    so a snapshot read from JSON is checked for them as well."""
    for name in ("facts", "artifacts", "sources"):
        if _holds_non_finite(getattr(patch, name, None)):
            raise ContractValueError(
                f"invalid context patch {_shown(patch)}: {name} holds NaN or infinity, "
                "which JSON cannot carry (a participant's state moves as JSON)")


def _holds_non_finite(value: object) -> bool:
    """Whether JSON data `value` holds a NaN or infinite float (iterative: any depth the
    size bound lets through). Asked of the C encoder first: what it writes without a
    NaN or infinity holds none (a walk in Python of a 1 MB list of numbers cost ~50 ms,
    and an import asks of every patch); what it refuses is walked."""
    if value:
        try:
            json.dumps(value, allow_nan=False)
        except (ValueError, TypeError, RecursionError):
            pass  # a NaN, or something else the encoder refuses: the walk says
        else:
            return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _patch_json(patch: ContextPatch) -> bytes:
    try:
        return patch.model_dump_json(warnings=False).encode()
    except (ValueError, TypeError, RecursionError) as exc:  # PydanticSerializationError too
        if isinstance(exc, RecursionError) or "depth exceeded" in str(exc)[:200]:
            raise ContractValueError(
                f"invalid context patch {_shown(patch)}: its JSON nests deeper than "
                f"MAX_PATCH_DEPTH ({MAX_PATCH_DEPTH}); flatten its facts, artifacts or "
                "sources") from None
        raise ContractValueError(
            f"context patch {_shown(patch)} is not JSON-serializable: facts, artifacts "
            f"and sources must be JSON data, and texts valid (no lone surrogate) "
            f"({type(exc).__name__})") from None


def _shown(patch: ContextPatch) -> str:
    """The patch's task id for a message: bounded (an id may be any length)."""
    return preview(getattr(patch, "task_id", None))


_PAYLOAD = ("facts", "artifacts", "sources", "recommended_next_steps", "assumptions")


def patch_payload_bytes(patch: ContextPatch) -> int:
    """What a retained patch holds beyond its history exchange's text (the digest): the
    serialized size of its non-empty facts, artifacts, sources, next steps and
    assumptions (0 for a digest-only patch)."""
    fields = {name for name in _PAYLOAD if getattr(patch, name)}
    if not fields:
        return 0
    try:
        return len(patch.model_dump_json(include=fields, warnings=False).encode())
    except (ValueError, TypeError, RecursionError) as exc:  # PydanticSerializationError too
        raise ContractValueError(
            f"context patch {_shown(patch)} is not JSON-serializable: facts, artifacts "
            f"and sources must be JSON data ({type(exc).__name__})") from None


def patch_user_text(task_id: str, diverged: bool) -> str:
    """The `user` side of a patch's history exchange."""
    if diverged:
        return f"[background: {task_id} (context changed since it started)]"
    return f"[background: {task_id}]"


def current_context_patches() -> tuple[AppliedContextPatch, ...]:
    """The applied patches whose exchanges are in the active turn's history, oldest first.

    Outside a routed turn: `()`. A patch trimmed out of the history budget is not
    visible, exactly as its exchange is not.
    """
    source = _current.get()
    if source is None:
        return ()
    items, start, end = source[1]
    return tuple(
        item[0].applied for item in items[start:end] if isinstance(item[0], PatchExchangeId)
    )
