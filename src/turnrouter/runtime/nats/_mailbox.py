"""A mailbox between a NATS subscription's callback and the one loop that reads it.

nats-py delivers a subscription's messages to a callback; the worker's partition loops
and the front end's output readers each read theirs in order, waiting a bounded time
for the next one. One small class serves both.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Items in arrival order; `get(wait)` returns the next, or None after `wait`
    seconds without one (or at `wake()`)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        self._items.append(item)
        self.wake()

    def put_latest(self, item: T, like: Callable[[T], bool]) -> None:
        """Put `item`, in place of the last one queued when `like` says that one is of
        the same kind and says nothing `item` does not (an idle heartbeat after an idle
        heartbeat): a reader that stopped reading holds one, not one per beat."""
        items = self._items
        if items and like(items[-1]):
            items[-1] = item
            self.wake()
        else:
            self.put(item)

    def wake(self) -> None:
        """End a wait for the next item now (`get` returns None)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._items.clear()

    async def get(self, wait: float) -> T | None:
        if not self._items:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(wait, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
