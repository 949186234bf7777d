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
    seconds without one (or at `wake()`).

    The bound of a wait needs no timer per `get`: a reader that waits again and again
    (a partition's loop: one wait per message) would make and cancel one each time. One
    timer is kept instead, armed at most as late as the current wait's end; when it
    fires before that end (an earlier, shorter wait's), it is armed again for it."""

    __slots__ = ("_deadline", "_items", "_timer", "_timer_at", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0  # loop time when the current wait ends
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # loop time the timer is armed for

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
            deadline = self._deadline = loop.time() + wait
            timer = self._timer
            if timer is None or self._timer_at > deadline:
                if timer is not None:
                    timer.cancel()
                self._timer_at = deadline
                self._timer = loop.call_at(deadline, self._expire)
            try:
                await waiter
            finally:
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()

    def _expire(self) -> None:
        """The timer fired: end the current wait if it is due by now, else arm the
        timer again for its end (no wait: it lapses until the next `get`)."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._deadline <= self._timer_at:
            waiter.set_result(None)
        else:
            self._timer_at = self._deadline
            self._timer = waiter.get_loop().call_at(self._deadline, self._expire)
