"""Completed exchanges kept per participant under a UTF-8 byte budget and a count bound."""

from __future__ import annotations

from collections.abc import Sequence

from ._contracts import MAX_HISTORY_VERSION, AgentExchange, unset_field
from ._patches import EMPTY_CONTEXT_HASH, PatchExchangeId, context_hash

__all__ = ["History", "Meta", "MetaView", "view_items"]


#: Per retained exchange: its id (None, a caller's id or a `PatchExchangeId`), its
#: completion timestamp in microseconds (None if unknown) and its UTF-8 size.
Meta = tuple[object | None, int | None, int]

#: A stable view of the retained exchanges' metadata: `items[start:end]` of a list that
#: is only ever appended to (see `History`), so the view never changes once taken.
MetaView = tuple[list[Meta], int, int]

#: Trimmed entries at the front of the metadata list before it is copied anew.
_COMPACT_AFTER = 64


def view_items(view: MetaView) -> list[Meta]:
    """The metadata of a view, oldest first."""
    items, start, end = view
    return items[start:end]

_MAX_VERSION = MAX_HISTORY_VERSION  # ParticipantSnapshot.history_version's bound


class History:
    """Newest whole exchanges whose UTF-8 size fits the budget, with ids and timestamps.

    `exchanges` is a tuple rebuilt on append (never mutated), so a tuple handed to a
    destination stays stable. Each exchange's id, timestamp and size live in an
    append-only list: trimming the oldest only advances `_start`, and once enough
    trimmed entries accumulate the live ones move to a new list; the old list, still
    held by earlier views (a `RoutingTurnContext`'s source), never changes. So an append
    costs one tuple copy, not two, and `view()` costs nothing.

    Conversation exchanges (`append`) and background-derived ones (`add_background`,
    with a `PatchExchangeId`) share the exchanges, in completion order, and the budget.
    `version` counts conversation appends; `prev_exchanges` / `prev_view` are the state
    before the latest one (for the divergence rule of a patch spawned by that turn). The
    context hash is computed on demand and cached.

    The history owns its bounds: `budget` UTF-8 bytes (the contract's) and at most
    `max_exchanges` exchanges, so even empty exchanges cannot pile up.
    """

    __slots__ = ("_hash", "_hashed", "_meta", "_prev_end", "_prev_meta", "_prev_start",
                 "_start", "budget", "exchanges", "max_exchanges", "prev_exchanges", "total",
                 "version")

    def __init__(self, budget: int, max_exchanges: int) -> None:
        self.budget = budget
        self.max_exchanges = max_exchanges
        self.exchanges: tuple[AgentExchange, ...] = ()
        self._meta: list[Meta] = []
        self._start = 0
        self.total = 0
        self.version = 0
        self.prev_exchanges: tuple[AgentExchange, ...] = ()
        # `prev_view` in parts: a tuple holding the list would be one more object per
        # participant for the garbage collector to walk, and it is rarely read.
        self._prev_meta, self._prev_start, self._prev_end = self._meta, 0, 0
        self._hashed: tuple[AgentExchange, ...] | None = None
        self._hash = EMPTY_CONTEXT_HASH

    def view(self) -> MetaView:
        """A stable view of the retained exchanges' metadata."""
        return self._meta, self._start, len(self._meta)

    @property
    def prev_view(self) -> MetaView:
        """The view before the latest conversation append."""
        return self._prev_meta, self._prev_start, self._prev_end

    def settle(self) -> None:
        """Take the current exchanges as the state before the latest append (a history
        rebuilt from a snapshot, whose previous state is not known)."""
        self.prev_exchanges = self.exchanges
        self._prev_meta, self._prev_start, self._prev_end = self.view()

    @property
    def ids(self) -> tuple[object | None, ...]:
        """The retained exchanges' ids, oldest first."""
        return tuple(item[0] for item in self._meta[self._start:])

    @property
    def stamps(self) -> tuple[int | None, ...]:
        """The retained exchanges' completion timestamps (µs), oldest first."""
        return tuple(item[1] for item in self._meta[self._start:])

    def seed(self, exchanges: Sequence[AgentExchange]) -> int:
        """Adopt caller-supplied history (ids and timestamps unknown), trimmed to the
        bounds. Only the newest exchanges that can be kept are read, so a huge history
        costs no more than a small one. Returns how many the count bound dropped."""
        budget, room = self.budget, self.max_exchanges
        kept: list[tuple[AgentExchange, int]] = []
        total = 0
        index = len(exchanges)
        while index > 0 and len(kept) < room:
            exchange = exchanges[index - 1]
            try:
                exchange.__post_init__()  # only those read: a bypassed one names its field
            except AttributeError as exc:
                raise unset_field(exchange, exc) from None
            size = len(exchange.user.encode()) + len(exchange.assistant.encode())
            if total + size > budget:
                break
            total += size
            kept.append((exchange, size))
            index -= 1
        dropped = index if len(kept) == room else 0
        kept.reverse()
        self.version = (self.version + len(exchanges)) % (_MAX_VERSION + 1)
        self.exchanges = tuple(exchange for exchange, _ in kept)
        meta = self._meta = [(None, None, size) for _, size in kept]
        self._start, self.total = 0, total
        # As if appended one by one: the state before the newest seeded exchange.
        self.prev_exchanges = self.exchanges[:-1]
        self._prev_meta, self._prev_start, self._prev_end = meta, 0, max(len(meta) - 1, 0)
        return dropped

    def append(
        self, exchange: AgentExchange, exchange_id: object | None, stamp: int | None,
        extra_bytes: int = 0,
    ) -> int:
        """Add a completed exchange and drop the oldest ones until the bounds hold.

        `extra_bytes` counts a payload kept with the exchange (a patch's facts and
        artifacts) against the budget. Returns how many the count bound dropped.
        """
        # Wraps at the snapshot's bound (MAX_HISTORY_VERSION, reachable only by an
        # imported snapshot), so the next export and import still validate: the version
        # only has to change.
        self.version = self.version + 1 if self.version < _MAX_VERSION else 0
        meta = self._meta
        self.prev_exchanges = self.exchanges
        self._prev_meta, self._prev_start, self._prev_end = meta, self._start, len(meta)
        size = len(exchange.user.encode()) + len(exchange.assistant.encode()) + extra_bytes
        total = self.total + size
        budget = self.budget
        if total <= budget and len(self.exchanges) < self.max_exchanges:
            self.exchanges += (exchange,)
            meta.append((exchange_id, stamp, size))
            self.total = total
            return 0
        start = first = self._start
        end = len(meta)
        while total > budget and start < end:
            total -= meta[start][2]
            start += 1
        by_count = 0
        while end - start >= self.max_exchanges:
            total -= meta[start][2]
            start += 1
            by_count += 1
        if total > budget:  # the new exchange alone exceeds the budget
            self.exchanges, self._meta, self._start, self.total = (), [], 0, 0
            return by_count
        self.exchanges = (*self.exchanges[start - first:], exchange)
        if start > _COMPACT_AFTER and 2 * start > end:
            meta = self._meta = meta[start:]  # a new list: earlier views keep the old one
            start = 0
        meta.append((exchange_id, stamp, size))
        self._start = start
        self.total = total
        return by_count

    def drop_oldest(self, count: int) -> None:
        """Drop the `count` oldest exchanges (a participant's snapshot outgrowing its
        bounds, `Registry.fitted`); the version and the state before the latest append
        stay (a stamp of a patch still compares with the exchanges it saw)."""
        start = self._start
        count = min(count, len(self._meta) - start)
        if count <= 0:
            return
        self.total -= sum(item[2] for item in self._meta[start:start + count])
        self.exchanges = self.exchanges[count:]
        self._start = start + count

    # ------------------------------------------------------------ background patches

    def add_background(
        self, exchange: AgentExchange, exchange_id: PatchExchangeId, stamp: int | None,
        extra_bytes: int, *, replace: bool,
    ) -> int:
        """Add a patch's exchange (after removing earlier ones when `replace`).

        Counts against the budget like any exchange, but is not a conversation exchange:
        the version and the previous-state tuples stay as they were.
        """
        if replace:
            live = self._meta[self._start:]
            keep = [index for index, item in enumerate(live)
                    if not isinstance(item[0], PatchExchangeId)]
            if len(keep) != len(live):
                self.exchanges = tuple(self.exchanges[index] for index in keep)
                self._meta = [live[index] for index in keep]  # a new list, as above
                self._start = 0
                self.total = sum(item[2] for item in self._meta)
        version, prev_exchanges = self.version, self.prev_exchanges
        prev = self._prev_meta, self._prev_start, self._prev_end
        dropped = self.append(exchange, exchange_id, stamp, extra_bytes)
        self.version, self.prev_exchanges = version, prev_exchanges
        self._prev_meta, self._prev_start, self._prev_end = prev
        return dropped

    def context_hash(self) -> str:
        """The hash of the retained conversation exchanges (cached until they change)."""
        if self._hashed is not self.exchanges:
            self._hash = context_hash(self.exchanges, self.ids)
            self._hashed = self.exchanges
        return self._hash

    def last_conversation_id(self) -> object | None:
        """The id of the newest retained conversation exchange (None if there is none)."""
        meta = self._meta
        for index in range(len(meta) - 1, self._start - 1, -1):
            exchange_id = meta[index][0]
            if not isinstance(exchange_id, PatchExchangeId):
                return exchange_id
        return None
