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
    # from it (`OverloadPolicy.max_busy_fraction`). `SystemClock` reads the time the
    # loop's thread was running or waiting for a core (`loop_busy_time`).


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


class _SchedStat:
    """A thread's open `/proc/thread-self/schedstat`, closed when the thread ends (its
    thread-local values are dropped then)."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)  # (None: the open failed)
        if fd is not None:
            os.close(fd)


#: Per thread: its `_SchedStat`, or None where there is none (not Linux).
_THREAD = threading.local()


def loop_busy_time() -> float:
    """Seconds the calling thread was running or waiting to run (not sleeping): on Linux
    its CPU time plus its time on the run queue, from `/proc/thread-self/schedstat`, so
    a process other work on the machine holds off its core reads busy, as its event
    loop then is; elsewhere its CPU time (`time.thread_time`). 2.5-6 µs a read."""
    local = _THREAD
    stat = getattr(local, "schedstat", 0)  # (0: not opened yet in this thread)
    if stat is not None:
        try:
            if not isinstance(stat, _SchedStat):
                stat = local.schedstat = _SchedStat()
            running, waiting = os.pread(stat.fd, 64, 0).split()[:2]
            return (int(running) + int(waiting)) / 1e9
        except (OSError, ValueError):
            local.schedstat = None
    return time.thread_time()
