"""`current_turn_context()`: routing metadata of the active turn, read from a ContextVar."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from ._exceptions import ContractValueError

__all__ = ["RoutingTurnContext", "current_turn_context"]


@dataclass(frozen=True, slots=True)
class RoutingTurnContext:
    """Read-only routing metadata captured from the current asynchronous context.

    Stable once returned: the router never mutates a snapshot, it installs a new one.
    Outside an active routed turn the identifiers are None and the tuples empty.
    """

    exchange_id: object | None = None
    """Identity of the current exchange, when one is active."""
    history_exchange_ids: tuple[object | None, ...] = ()
    """Exchange identities aligned with the active bounded history."""
    history_timestamps: tuple[int | None, ...] = ()
    """History timestamps aligned with the active history, in Unix microseconds."""

    def __post_init__(self) -> None:
        ids, stamps = self.history_exchange_ids, self.history_timestamps
        if not isinstance(ids, tuple):
            object.__setattr__(self, "history_exchange_ids", ids := tuple(ids))
        if not isinstance(stamps, tuple):
            object.__setattr__(self, "history_timestamps", stamps := tuple(stamps))
        if len(ids) != len(stamps):
            raise ContractValueError(
                "RoutingTurnContext.history_exchange_ids and history_timestamps must align "
                f"({len(ids)} ids, {len(stamps)} timestamps)"
            )


_OUTSIDE = RoutingTurnContext()

#: The router stores (exchange_id, view of the history metadata): `items[start:end]` of
#: an append-only list of (id, timestamp, size) triples (see `_history.History`), a view
#: that never changes once taken. The snapshot is built from it on demand, so a turn whose
#: agents never ask costs one tuple instead of a dataclass and two tuple copies.
_Meta = tuple[object | None, int | None, int]
_current: ContextVar[tuple[object, tuple[list[_Meta], int, int]] | None] = ContextVar(
    "turnrouter_turn_context", default=None)


def current_turn_context() -> RoutingTurnContext:
    """Return a stable snapshot of metadata for the active routed turn."""
    source = _current.get()
    if source is None:
        return _OUTSIDE
    items, start, end = source[1]
    meta = items[start:end]
    snapshot = object.__new__(RoutingTurnContext)
    object.__setattr__(snapshot, "exchange_id", source[0])
    object.__setattr__(snapshot, "history_exchange_ids", tuple(item[0] for item in meta))
    object.__setattr__(snapshot, "history_timestamps", tuple(item[1] for item in meta))
    return snapshot
