"""Completed exchanges kept per participant under a UTF-8 byte budget."""

from __future__ import annotations

from collections.abc import Sequence

from ._contracts import AgentExchange
from ._patches import EMPTY_CONTEXT_HASH, PatchExchangeId, context_hash

__all__ = ["History"]


#: Per retained exchange: its id (None, a caller's id or a `PatchExchangeId`), its
#: completion timestamp in microseconds (None if unknown) and its UTF-8 size.
Meta = tuple[object | None, int | None, int]


class History:
    """Newest whole exchanges whose UTF-8 size fits the budget, with ids and timestamps.

    The tuples are rebuilt on append (never mutated), so a tuple handed to a destination
    or a `RoutingTurnContext` snapshot stays stable. An exchange's id, timestamp and size
    live in one `meta` tuple, so an append copies two tuples instead of four.

    Conversation exchanges (`append`) and background-derived ones (`add_background`,
    with a `PatchExchangeId`) share the tuples, in completion order, and the budget.
    `version` counts conversation appends; `prev_exchanges` / `prev_meta` are the tuples
    as they were before the latest one (for the divergence rule of a patch spawned by
    that turn). The context hash is computed on demand and cached.
    """

    __slots__ = ("_hash", "_hashed", "exchanges", "meta", "prev_exchanges", "prev_meta",
                 "total", "version")

    def __init__(self) -> None:
        self.exchanges: tuple[AgentExchange, ...] = ()
        self.meta: tuple[Meta, ...] = ()
        self.total = 0
        self.version = 0
        self.prev_exchanges: tuple[AgentExchange, ...] = ()
        self.prev_meta: tuple[Meta, ...] = ()
        self._hashed: tuple[AgentExchange, ...] | None = None
        self._hash = EMPTY_CONTEXT_HASH

    @property
    def ids(self) -> tuple[object | None, ...]:
        """The retained exchanges' ids, oldest first."""
        return tuple(item[0] for item in self.meta)

    @property
    def stamps(self) -> tuple[int | None, ...]:
        """The retained exchanges' completion timestamps (µs), oldest first."""
        return tuple(item[1] for item in self.meta)

    def seed(self, exchanges: Sequence[AgentExchange], budget: int) -> None:
        """Adopt caller-supplied history (ids and timestamps unknown), trimmed to budget."""
        for exchange in exchanges:
            self.append(exchange, None, None, budget)

    def append(
        self, exchange: AgentExchange, exchange_id: object | None, stamp: int | None,
        budget: int,
    ) -> None:
        """Add a completed exchange and drop the oldest ones until the budget holds."""
        self.version += 1
        self.prev_exchanges = self.exchanges
        self.prev_meta = self.meta
        size = len(exchange.user.encode()) + len(exchange.assistant.encode())
        total = self.total + size
        if total <= budget:
            self.exchanges += (exchange,)
            self.meta += ((exchange_id, stamp, size),)
            self.total = total
            return
        meta = self.meta
        drop = 0
        while total > budget and drop < len(meta):
            total -= meta[drop][2]
            drop += 1
        if total > budget:  # the new exchange alone exceeds the budget
            self.exchanges, self.meta, self.total = (), (), 0
            return
        self.exchanges = (*self.exchanges[drop:], exchange)
        self.meta = (*meta[drop:], (exchange_id, stamp, size))
        self.total = total

    # ------------------------------------------------------------ background patches

    def add_background(
        self, exchange: AgentExchange, exchange_id: PatchExchangeId, stamp: int | None,
        budget: int, *, replace: bool,
    ) -> None:
        """Add a patch's exchange (after removing earlier ones when `replace`).

        Counts against the budget like any exchange, but is not a conversation exchange:
        the version and the previous-state tuples stay as they were.
        """
        if replace:
            keep = [index for index, item in enumerate(self.meta)
                    if not isinstance(item[0], PatchExchangeId)]
            if len(keep) != len(self.meta):
                self.exchanges = tuple(self.exchanges[index] for index in keep)
                self.meta = tuple(self.meta[index] for index in keep)
                self.total = sum(item[2] for item in self.meta)
        version, prev_exchanges, prev_meta = self.version, self.prev_exchanges, self.prev_meta
        self.append(exchange, exchange_id, stamp, budget)
        self.version, self.prev_exchanges, self.prev_meta = version, prev_exchanges, prev_meta

    def context_hash(self) -> str:
        """The hash of the retained conversation exchanges (cached until they change)."""
        if self._hashed is not self.exchanges:
            self._hash = context_hash(self.exchanges, self.ids)
            self._hashed = self.exchanges
        return self._hash

    def last_conversation_id(self) -> object | None:
        """The id of the newest retained conversation exchange (None if there is none)."""
        for item in reversed(self.meta):
            if not isinstance(item[0], PatchExchangeId):
                return item[0]
        return None
