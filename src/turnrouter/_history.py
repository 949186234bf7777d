"""Completed exchanges kept per participant under a UTF-8 byte budget."""

from __future__ import annotations

from collections.abc import Sequence

from ._contracts import AgentExchange

__all__ = ["History"]


class History:
    """Newest whole exchanges whose UTF-8 size fits the budget, with ids and timestamps.

    The tuples are rebuilt on append (never mutated), so a tuple handed to a destination
    or a `RoutingTurnContext` snapshot stays stable.
    """

    __slots__ = ("exchanges", "ids", "sizes", "stamps", "total")

    def __init__(self) -> None:
        self.exchanges: tuple[AgentExchange, ...] = ()
        self.ids: tuple[object | None, ...] = ()
        self.stamps: tuple[int | None, ...] = ()
        self.sizes: tuple[int, ...] = ()
        self.total = 0

    def seed(self, exchanges: Sequence[AgentExchange], budget: int) -> None:
        """Adopt caller-supplied history (ids and timestamps unknown), trimmed to budget."""
        for exchange in exchanges:
            self.append(exchange, None, None, budget)

    def append(
        self, exchange: AgentExchange, exchange_id: object | None, stamp: int | None,
        budget: int,
    ) -> None:
        """Add a completed exchange and drop the oldest ones until the budget holds."""
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
