"""The time source of acknowledgments and first-response timing.

A `Clock` tells the time and sleeps until a deadline. `SystemClock` is the default (the
event loop's monotonic clock); `turnrouter.testing.ManualClock` is a deterministic fake
whose `advance()` wakes sleepers, so acknowledgment timing is testable without sleeping.
"""

from __future__ import annotations

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
        await anyio.sleep_until(deadline)

    def __repr__(self) -> str:
        return "SystemClock()"
