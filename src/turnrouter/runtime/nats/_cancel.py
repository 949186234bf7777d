"""Cancelling tasks that may lose a cancellation.

On Python 3.11, `asyncio.wait_for` returns the awaited result instead of raising when its
task is cancelled just as the result arrives (CPython gh-86296, fixed in 3.12). nats-py
awaits every reply that way (requests, JetStream publishes, flushes, connection
attempts), so a loop stopped only by `cancel()` can lose it and run on for good: a
worker whose shutdown waited for such a loop never ended, even on a second SIGTERM.
`cancel_and_wait` cancels again whatever is still running a moment later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

__all__ = ["RECANCEL_SECS", "cancel_and_wait"]

#: How long a cancelled task may take to end before it is cancelled again.
RECANCEL_SECS = 0.2


async def cancel_and_wait(tasks: Collection[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until every one ended, cancelling again each one still
    running after `RECANCEL_SECS`. What they ended with is retrieved and dropped (as
    `gather(..., return_exceptions=True)` does); a cancellation of the caller is raised."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_SECS)
    for task in tasks:
        if not task.cancelled():
            task.exception()
