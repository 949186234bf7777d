"""A front end's publishes that wait for the stream's confirmation, sent again when
the connection is lost meanwhile (chaos20 O3).

nats-py sends a JetStream publish once and waits for the stream's reply until its
timeout. When the server dies in that time, the publish was lost or stored, and no reply
will ever come: the caller waited the full 5 s to learn so, although the connection was
back 0.1 s after the server. Here a lost connection cuts that wait short; the message goes
again as soon as the connection is back (its `Nats-Msg-Id` makes the stream drop it when
the first one was stored), and only the time left of the same bound is waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client

from ..._exceptions import LifecycleError

__all__ = ["Confirmations"]

_Callback = Callable[[], Awaitable[None]]
_T = TypeVar("_T")
#: How often a publish waiting for the connection's return looks at its state, besides
#: the reconnected callback (a connection whose callbacks were replaced after it was
#: handed to `NatsFrontEnd`).
_LOOK = 0.25


class Confirmations:
    """Tasks waiting in `publish` for the stream's reply, cut short (cancelled, then
    told apart from any other cancellation by `Task.uncancel`) at a disconnection."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._waiting: dict[asyncio.Task[Any], bool] = {}  # task -> cut by a disconnection
        self._back = asyncio.Event()
        if nc.is_connected:
            self._back.set()
        # Chained to the connection's own callbacks (nats-py keeps them as attributes;
        # a connection made elsewhere and handed to `NatsFrontEnd` gets them too).
        theirs_lost: _Callback | None = getattr(nc, "_disconnected_cb", None)
        theirs_back: _Callback | None = getattr(nc, "_reconnected_cb", None)

        async def lost() -> None:
            self._back.clear()
            for task, cut in self._waiting.items():
                if not cut:
                    self._waiting[task] = True
                    task.cancel()
            if theirs_lost is not None:
                await theirs_lost()

        async def back() -> None:
            self._back.set()
            if theirs_back is not None:
                await theirs_back()

        nc._disconnected_cb = lost  # (nats-py has no other hook)
        nc._reconnected_cb = back

    async def confirmed(self, send: Callable[[float], Awaitable[_T]], deadline: float,
                        what: str) -> _T:
        """`send(timeout)`'s result (the stream's reply), sent again after each
        disconnection until `deadline` (`time.monotonic()`): `LifecycleError` past it."""
        task = asyncio.current_task()
        assert task is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._nc.is_connected:
                # (disconnected again before it went: wait for the connection first)
                await self._wait_back(deadline, what)
                continue
            self._waiting[task] = False
            try:
                return await send(left)
            except asyncio.CancelledError:
                if not self._waiting.pop(task, False) or task.uncancel() > 0:
                    raise  # not (only) ours: the caller's cancellation
            finally:
                self._waiting.pop(task, None)
            await self._wait_back(deadline, what)

    async def _wait_back(self, deadline: float, what: str) -> None:
        """Until the connection is back (its callback, or its state looked at every
        `_LOOK` s), at most until `deadline`."""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if self._nc.is_connected:
                    return
                # Set but not connected: lost, its callback not run yet (it clears it).
                self._back.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, _LOOK)):
                        await self._back.wait()
        except TimeoutError:
            raise LifecycleError(
                f"publishing {what} failed: not confirmed; the connection to NATS was lost "
                f"while it waited and is not back; the message may have been stored: "
                f"publish it again once reconnected") from None
