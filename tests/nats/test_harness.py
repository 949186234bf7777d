"""The test harness's own guarantees: a task the tests cancel ends, on Python 3.11 too."""

from __future__ import annotations

import asyncio
import sys

import pytest

import nats

from .conftest import NatsServer, cancelled, settled

pytestmark = pytest.mark.anyio


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps it from 3.12")
def test_wait_for_loses_a_cancellation_that_arrives_with_the_result() -> None:
    """Why `cancelled` cancels again: on Python 3.11 `asyncio.wait_for`, which nats-py
    awaits every reply with, returns the result instead of raising when the task is
    cancelled after the awaited future completed but before wait_for woke up (CPython
    gh-86296). test_takeover.py's `rewrite` loop lost its cancellation so and ran on for
    good: the test hung in its `finally`, once in about 12 runs. (Run in an event loop of
    its own: it is about asyncio alone, not about the tests' shared runner, which a
    cancellation escaping a test stops for good.)"""

    async def scenario() -> tuple[str, int]:
        reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiting = asyncio.Event()

        async def request() -> str:
            waiting.set()
            # The standard library's own: importing pipecat replaces asyncio.wait_for
            # with a backport of 3.12's (wait_for2) for the whole process.
            return await asyncio.tasks.wait_for(reply, 10)

        task = asyncio.create_task(request())
        async with asyncio.timeout(5):
            await waiting.wait()  # the task waits in wait_for (set, then suspended)
        reply.set_result("reply")  # wait_for is woken by a callback only scheduled
        task.cancel()  # so the cancellation arrives first
        async with asyncio.timeout(5):
            result = await task
        return result, task.cancelling()

    assert asyncio.run(scenario()) == ("reply", 1)  # asked for, and lost


async def test_cancelled_ends_a_loop_that_lost_its_cancellation(
        nats_server: NatsServer) -> None:
    """A loop that publishes and waits for the server "until cancelled", and loses its
    first cancellation as nats-py's requests do on Python 3.11 (here on every version,
    deterministically), is still ended by `cancelled`, within its bound; a plain
    `cancel()` and `gather` waited for it for ever."""
    nc = await nats.connect(nats_server.url)
    rounds = 0
    lost = asyncio.Event()
    first = asyncio.Event()

    async def publish_until_cancelled() -> None:
        nonlocal rounds
        while True:
            try:
                await nc.publish("harness.rounds", b"")
                await settled(nc)
            except asyncio.CancelledError:
                if lost.is_set():
                    raise
                lost.set()  # what wait_for does on 3.11 when the reply came with it
            rounds += 1
            first.set()

    task = asyncio.create_task(publish_until_cancelled())
    try:
        async with asyncio.timeout(15):
            await first.wait()
        await cancelled(task, within=15)
        assert lost.is_set() and task.cancelled()
    finally:
        await nc.close()  # ends the loop if it still runs (its next request fails)
