"""Completed exchanges kept per participant under a UTF-8 byte budget."""

from __future__ import annotations

from collections.abc import Sequence

from ._contracts import AgentExchange
from ._patches import EMPTY_CONTEXT_HASH, PatchExchangeId, context_hash

__all__ = ["History"]


class History:
    """Newest whole exchanges whose UTF-8 size fits the budget, with ids and timestamps.

    The tuples are rebuilt on append (never mutated), so a tuple handed to a destination
    or a `RoutingTurnContext` snapshot stays stable.

    Conversation exchanges (`append`) and background-derived ones (`add_background`,
    with a `PatchExchangeId`) share the tuples, in completion order, and the budget.
    `version` counts conversation appends; `prev_exchanges` / `prev_ids` are the tuples
    as they were before the latest one (for the divergence rule of a patch spawned by
    that turn). The context hash is computed on demand and cached.
    """

    __slots__ = ("_hash", "_hashed", "exchanges", "ids", "prev_exchanges", "prev_ids",
                 "sizes", "stamps", "total", "version")

    def __init__(self) -> None:
        self.exchanges: tuple[AgentExchange, ...] = ()
        self.ids: tuple[object | None, ...] = ()
        self.stamps: tuple[int | None, ...] = ()
        self.sizes: tuple[int, ...] = ()
        self.total = 0
        self.version = 0
        self.prev_exchanges: tuple[AgentExchange, ...] = ()
        self.prev_ids: tuple[object | None, ...] = ()
        self._hashed: tuple[AgentExchange, ...] | None = None
        self._hash = EMPTY_CONTEXT_HASH

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
        self.prev_ids = self.ids
        size = len(exchange.user.encode()) + len(exchange.assistant.encode())
        total = self.total + size
        if total <= budget:
            self.exchanges += (exchange,)
            self.ids += (exchange_id,)
            self.stamps += (stamp,)
            self.sizes += (size,)
            self.total = total
            return
        exchanges = (*self.exchanges, exchange)
        ids = (*self.ids, exchange_id)
        stamps = (*self.stamps, stamp)
        sizes = (*self.sizes, size)
        drop = 0
        while total > budget:
            total -= sizes[drop]
            drop += 1
        if drop:
            exchanges, ids, stamps, sizes = (
                exchanges[drop:], ids[drop:], stamps[drop:], sizes[drop:]
            )
        self.exchanges, self.ids, self.stamps, self.sizes, self.total = (
            exchanges, ids, stamps, sizes, total
        )

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
            keep = [index for index, item in enumerate(self.ids)
                    if not isinstance(item, PatchExchangeId)]
            if len(keep) != len(self.ids):
                self.exchanges = tuple(self.exchanges[index] for index in keep)
                self.ids = tuple(self.ids[index] for index in keep)
                self.stamps = tuple(self.stamps[index] for index in keep)
                self.sizes = tuple(self.sizes[index] for index in keep)
                self.total = sum(self.sizes)
        version, prev_exchanges, prev_ids = self.version, self.prev_exchanges, self.prev_ids
        self.append(exchange, exchange_id, stamp, budget)
        self.version, self.prev_exchanges, self.prev_ids = version, prev_exchanges, prev_ids

    def context_hash(self) -> str:
        """The hash of the retained conversation exchanges (cached until they change)."""
        if self._hashed is not self.exchanges:
            self._hash = context_hash(self.exchanges, self.ids)
            self._hashed = self.exchanges
        return self._hash

    def last_conversation_id(self) -> object | None:
        """The id of the newest retained conversation exchange (None if there is none)."""
        for exchange_id in reversed(self.ids):
            if not isinstance(exchange_id, PatchExchangeId):
                return exchange_id
        return None
