"""Owned operations and per-participant turn ordering.

Departure and shutdown are *owned* operations: they run in a task of their own so no
caller's cancellation can abandon them half done, and every concurrent caller joins the
same operation. Turns, by contrast, run in the caller's task under a cancel scope: a
turn is on the hot path, and a cancel scope costs far less than a task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import anyio

from ._exceptions import DestinationContractError

__all__ = ["DROPPED", "OwnedOperation", "TurnQueue", "TurnRun"]

#: The reason of a waiting turn dropped because too many turns were waiting.
DROPPED = "dropped: too many turns waiting (max_waiting_turns)"
#: Why a running turn is cut when its participant's next turn arrives.
SUPERSEDED = "superseded by a newer turn"


class OwnedOperation:
    """A coroutine run once in its own task and joined by any number of callers.

    Cancelling a joiner does not cancel the operation: the joiner waits for the
    operation to finish, then its cancellation propagates.
    """

    __slots__ = ("_task",)

    def __init__(self, coro: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.get_running_loop().create_task(coro)

    @property
    def done(self) -> bool:
        return self._task.done()

    def add_done_callback(self, callback: Callable[[BaseException | None], object]) -> None:
        """Call `callback(error)` on the event loop once the operation ended (None on
        success); the error counts as retrieved."""
        self._task.add_done_callback(partial(_report_end, callback))

    async def join(self) -> None:
        """Wait for the operation; re-raise its error (a fresh copy for groups)."""
        if not self._task.done():
            await self._wait()
        await anyio.lowlevel.checkpoint_if_cancelled()
        error = self._task.exception()
        if error is None:
            return
        if isinstance(error, BaseExceptionGroup):
            raise error.derive(error.exceptions) from None
        raise error

    async def settle(self) -> BaseException | None:
        """Wait for the operation, shielded; its error (None on success). A joiner
        cancelled meanwhile gets its cancellation once the operation is done."""
        if not self._task.done():
            await self._wait()
        task = self._task
        return asyncio.CancelledError() if task.cancelled() else task.exception()

    async def _wait(self) -> None:
        """Wait for the task, shielded from the joiner's cancellation until it is done."""
        cancelled: BaseException | None = None
        with anyio.CancelScope(shield=True):
            while not self._task.done():
                try:
                    await asyncio.shield(self._task)
                except asyncio.CancelledError as exc:
                    # Native cancellation pierces anyio's shield: remember it, keep waiting.
                    if not self._task.done() or not self._task.cancelled():
                        cancelled = exc
                except BaseException:
                    # The operation failed (it is done): `join` raises its error, unless
                    # the joiner was cancelled meanwhile.
                    break
        if cancelled is not None:
            # The joiner's cancellation wins over the operation's failure, which stays
            # tracked for a retry (the contract: cancellation propagates after the
            # operation completes, whatever its outcome).
            raise cancelled


def _report_end(callback: Callable[[BaseException | None], object],
                task: asyncio.Task[None]) -> None:
    callback(asyncio.CancelledError() if task.cancelled() else task.exception())


class TurnRun:
    """One turn's place in its participant's queue, and the handle that cancels it.

    A running turn is cancelled through its own asyncio task (`task.cancel()`, later
    consumed with `uncancel()`, as `asyncio.timeout` does): far cheaper per turn than
    a cancel scope. While `protected`, a cancel request is only recorded: the turn is
    finishing bookkeeping that must not be torn (history, focus, a release call).
    """

    #: What every new turn starts with, as class-level defaults (no `__slots__`): a new
    #: turn stores only its id (the router builds one per turn).
    task: asyncio.Task[Any] | None = None
    base = 0
    reason = ""
    protected = False
    cancel_sent = False
    finished = False
    _wake: anyio.Event | None = None
    _done: anyio.Event | None = None

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id

    def cancel(self, reason: str) -> None:
        """Cancel the turn whether it runs or waits; the first reason is kept."""
        if self.finished:
            return
        if not self.reason:
            self.reason = reason
        task = self.task
        if task is None:
            if self._wake is not None:
                self._wake.set()
        elif not self.protected and not self.cancel_sent:
            self.cancel_sent = True
            task.cancel()

    def attach(self, task: asyncio.Task[Any]) -> None:
        """The turn starts running in `task`."""
        self.task = task
        self.base = task.cancelling()

    def stray(self, exc: BaseException, what: str) -> BaseException:
        """`exc`, or, for a plain `CancelledError` nobody asked for (work the turn
        awaited raised it, a future cancelled elsewhere, while neither an interrupt nor
        the caller cancelled the turn's task), a `DestinationContractError` saying so:
        a failure, said and counted as one, not a silent turn read as a barge-in that
        would end the caller's task as cancelled."""
        task = self.task
        if (type(exc) is not asyncio.CancelledError or self.reason or task is None
                or task.cancelling() > self.base):
            return exc
        error = DestinationContractError(
            f"{what} raised CancelledError, but nothing cancelled the turn (a future or "
            "task it awaited was cancelled elsewhere)")
        error.__cause__ = exc
        return error

    def consume_cancel(self) -> bool:
        """Take back our own cancel request; True if an outer cancellation remains."""
        if not self.cancel_sent:
            return False
        self.cancel_sent = False
        assert self.task is not None
        return self.task.uncancel() > self.base

    async def wait_finished(self) -> None:
        """Wait until the turn has fully drained."""
        if self.finished:
            return
        if self._done is None:
            self._done = anyio.Event()
        await self._done.wait()

    def mark_finished(self) -> None:
        self.finished = True
        if self._done is not None:
            self._done.set()


class TurnQueue:
    """Runs a participant's turns one at a time, in arrival order."""

    __slots__ = ("running", "waiting")

    def __init__(self) -> None:
        self.running: TurnRun | None = None
        #: The turns waiting behind `running`, oldest first (None until one waits).
        self.waiting: deque[TurnRun] | None = None

    def runs(self) -> list[TurnRun]:
        """The running turn and the waiting ones, oldest first."""
        runs = [self.running] if self.running is not None else []
        if self.waiting:
            runs.extend(self.waiting)
        return runs

    async def enter(self, run: TurnRun, max_waiting: int) -> bool:
        """Wait for `run`'s turn. False if it was cancelled before it could start.

        With `max_waiting` turns already waiting, the oldest waiting one is dropped
        (cancelled with `DROPPED`): it is stale, newer turns of the participant follow.
        """
        if self.running is None and not self.waiting:
            self.running = run
            return True
        waiting = self.waiting
        if waiting is None:
            waiting = self.waiting = deque()
        live = [queued for queued in waiting if not queued.reason]
        if len(live) >= max_waiting:
            live[0].cancel(DROPPED)
        run._wake = anyio.Event()
        waiting.append(run)
        try:
            await run._wake.wait()
        except BaseException:
            self._abandon(run)
            raise
        if run.reason:  # cancelled while waiting
            self._abandon(run)
            return False
        return True

    def _abandon(self, run: TurnRun) -> None:
        if self.running is run:
            self.leave(run)
            return
        if self.waiting is not None and run in self.waiting:
            self.waiting.remove(run)
        run.mark_finished()

    def leave(self, run: TurnRun) -> None:
        """`run` is over: hand the participant to the next waiting turn."""
        run.finished = True  # `mark_finished()`, inline: once per turn
        if run._done is not None:
            run._done.set()
        if self.running is not run:
            return
        self.running = None
        waiting = self.waiting
        while waiting:
            nxt = waiting.popleft()
            if nxt.reason:
                nxt.mark_finished()
                assert nxt._wake is not None
                nxt._wake.set()
                continue
            self.running = nxt
            assert nxt._wake is not None
            nxt._wake.set()
            break
