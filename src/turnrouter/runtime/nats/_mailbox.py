"""A mailbox between a NATS subscription's callback and the one loop that reads it.

nats-py delivers a subscription's messages to a callback; the worker's partition loops
and the front end's output readers each read theirs in order, waiting a bounded time
for the next one. One small class serves both.

A busy mailbox waits once per message: it keeps one timer, armed for the earliest
deadline of a wait and re-armed when it fires early, instead of a timer per wait (each a
heap entry that stays in the event loop's heap, cancelled, until its long deadline).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Items in arrival order; `get(wait)` returns the next, or None after `wait`
    seconds without one (or at `wake()`)."""

    __slots__ = ("_deadline", "_due", "_items", "_timer", "_timer_loop", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        #: The current wait's deadline (event loop time).
        self._deadline = 0.0
        #: The one timer (its deadline `_due`, on `_timer_loop`), or None.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0

    def put(self, item: T) -> None:
        self._items.append(item)
        self.wake()

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
            deadline = self._deadline = loop.time() + wait
            waiter = self._waiter = loop.create_future()
            timer = self._timer
            if timer is None or self._due > deadline or self._timer_loop is not loop:
                # None armed, or armed too late for this wait (or on another loop).
                if timer is not None:
                    timer.cancel()
                self._arm(loop, deadline)
            try:
                await waiter
            finally:
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._due = when
        self._timer_loop = loop
        self._timer = loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """The timer fired: end the current wait if its deadline is this one, else arm
        again for it (the timer was armed by an earlier wait)."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._due >= self._deadline:
            waiter.set_result(None)
        else:
            loop = self._timer_loop
            assert loop is not None
            self._arm(loop, self._deadline)
