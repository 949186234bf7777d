"""The time source of acknowledgments and first-response timing.

A `Clock` tells the time and sleeps until a deadline. `SystemClock` is the default (the
event loop's monotonic clock); `turnrouter.testing.ManualClock` is a deterministic fake
whose `advance()` wakes sleepers, so acknowledgment timing is testable without sleeping.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable

import anyio

__all__ = ["Clock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    """A monotonic time source in seconds."""

    def now(self) -> float:
        """The current time, in seconds on this clock's (arbitrary) origin."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once `now() >= deadline` (at once when it already is); cancellable."""
        ...


class SystemClock:
    """The event loop's clock: `time.monotonic()`, the clock asyncio and anyio sleep on.

    Its readings are on the same clock as `anyio.current_time()` under asyncio, so
    telemetry can convert them to wall-clock span times.
    """

    __slots__ = ("now",)

    def __init__(self) -> None:
        # An instance attribute holding the builtin: `clock.now()` costs one C call.
        self.now = time.monotonic

    async def sleep_until(self, deadline: float) -> None:
        # Under asyncio, asyncio's own sleep on the loop's clock: what `anyio.sleep_until`
        # does there, without its two look-ups of the running library (the overload
        # sampler sleeps ~20 times a second while turns run).
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another event loop (anyio on trio)
            await anyio.sleep_until(deadline)
            return
        delay = deadline - loop.time()
        if not delay > 0.0:
            if delay != delay:
                raise ValueError(f"sleep_until: the deadline is not a number: {deadline!r}")
            delay = 0.0
        await asyncio.sleep(delay)

    def __repr__(self) -> str:
        return "SystemClock()"
