"""The time source of acknowledgments and first-response timing.

A `Clock` tells the time and sleeps until a deadline. `SystemClock` is the default (the
event loop's monotonic clock); `turnrouter.testing.ManualClock` is a deterministic fake
whose `advance()` wakes sleepers, so acknowledgment timing is testable without sleeping.
"""

from __future__ import annotations

import asyncio
import os
import threading
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

    # Optional: `busy_time()`, the seconds the event loop spent working (not idle), on
    # the same scale as `now()`; admission control projects the loop's busy fraction
    # from it (`OverloadPolicy.max_busy_fraction`). `SystemClock` reads the loop
    # thread's CPU time.


class SystemClock:
    """The event loop's clock: `time.monotonic()`, the clock asyncio and anyio sleep on.

    Its readings are on the same clock as `anyio.current_time()` under asyncio, so
    telemetry can convert them to wall-clock span times.
    """

    __slots__ = ("busy_time", "now")

    def __init__(self) -> None:
        # An instance attribute holding the builtin: `clock.now()` costs one C call.
        self.now = time.monotonic
        #: Seconds the calling thread (the event loop's) was not idle: how busy the
        #: loop was between two readings (`OverloadPolicy.max_busy_fraction`). A clock
        #: without it turns that projection off.
        self.busy_time = loop_busy_time

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


class _SchedStat(threading.local):
    """This thread's `/proc/thread-self/schedstat`, opened once (closed with the thread's
    locals); None where there is none (not Linux)."""

    fd: int | None = -1

    def __del__(self) -> None:
        fd = self.fd
        if fd is not None and fd >= 0:
            os.close(fd)


_SCHEDSTAT = _SchedStat()


def loop_busy_time() -> float:
    """Seconds the calling thread was running or waiting to run (not sleeping): on Linux
    its CPU time plus its time on the run queue, from `/proc/thread-self/schedstat`, so
    a process other work on the machine holds off its core reads busy, as its event
    loop then is; elsewhere its CPU time (`time.thread_time`). About 2 µs."""
    stat = _SCHEDSTAT
    fd = stat.fd
    if fd is not None:
        try:
            if fd < 0:
                fd = stat.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            running, waiting = os.pread(fd, 64, 0).split()[:2]
            return (int(running) + int(waiting)) / 1e9
        except (OSError, ValueError):
            stat.fd = None
    return time.thread_time()
