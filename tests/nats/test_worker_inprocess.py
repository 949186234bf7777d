"""NatsWorker in the test's own event loop: a graceful stop and a cancellation leave no
task behind."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from turnrouter import AgentRouter, AgentTurn, Destination, DestinationResult
from turnrouter.decisions import LexicalDecisions
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker, WorkerContext

from .app import make_router
from .conftest import NatsServer, metric_value
from .crowd import FAILURE, Heard, listening, serving

pytestmark = pytest.mark.anyio


async def answered(front: NatsFrontEnd, pid: str, text: str = "hi") -> str:
    """One query's terminal text, read from the output stream (bounded)."""
    heard = Heard()
    query = UserQuery(participant_id=pid, text=text)
    outputs = front.outputs(deliver_new=False)
    await front.publish(query)
    try:
        async with asyncio.timeout(15):
            async for message in outputs:
                heard.add(message)
                if query.message_id in heard.finals:
                    return heard.finals[query.message_id][0].text
    finally:
        await outputs.aclose()
    raise AssertionError("the output stream ended")


async def test_graceful_stop_hands_over_and_leaves_no_task(nats_server: NatsServer) -> None:
    """request_stop(): the worker drains, unpins every partition and returns; no task of
    its own survives."""
    before = asyncio.all_tasks()
    registry = CollectorRegistry()
    worker = NatsWorker(make_router, NatsConfig(url=nats_server.url), registry=registry,
                        replica="inproc")
    run = asyncio.create_task(worker.run())
    async with asyncio.timeout(15):
        await worker.ready.wait()
    front = await NatsFrontEnd.connect(NatsConfig(url=nats_server.url))
    try:
        assert await answered(front, "ivy") == "hi|-|N"
        assert worker.owned_partitions
        worker.request_stop()
        async with asyncio.timeout(20):
            await run
    finally:
        await front.close()
    assert worker.owned_partitions == frozenset()
    assert metric_value_of(registry, "turnrouter_nats_partitions_owned") == 0
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()


async def test_cancelled_run_leaves_no_task(nats_server: NatsServer) -> None:
    """Cancelling run() (the process is going down) ends every task it started."""
    before = asyncio.all_tasks()
    worker = NatsWorker(make_router, NatsConfig(url=nats_server.url),
                        registry=CollectorRegistry())
    run = asyncio.create_task(worker.run())
    async with asyncio.timeout(15):
        await worker.ready.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(20):
            await run
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()


async def test_drain_is_bounded_and_the_cut_turn_ends_with_failure_text(
        nats_server: NatsServer) -> None:
    """A turn that outlasts drain_timeout does not hold the graceful end; it is cut and
    ends with the failure text, and the next replica serves the participant."""
    config = NatsConfig(url=nats_server.url, drain_timeout=0.5)
    first = NatsWorker(make_router, config, registry=CollectorRegistry(), replica="a")
    run = asyncio.create_task(first.run())
    async with asyncio.timeout(15):
        await first.ready.wait()
    front = await NatsFrontEnd.connect(config)
    outputs = front.outputs(deliver_new=False)
    try:
        slow = UserQuery(participant_id="zed", text="slow")
        await front.publish(slow)
        async with asyncio.timeout(15):
            async for message in outputs:  # its preamble: the slow turn is running
                if message.request_id == slow.message_id:
                    break
            first.request_stop()
            await run
        async with asyncio.timeout(15):
            async for message in outputs:
                if message.request_id == slow.message_id:
                    assert (message.route, message.text) == ("none", config.failure_text)
                    break
        second = NatsWorker(make_router, config, registry=CollectorRegistry(),
                            replica="b")
        other = asyncio.create_task(second.run())
        try:
            assert await answered(front, "zed") == "hi|-|N"
        finally:
            second.request_stop()
            async with asyncio.timeout(20):
                await other
    finally:
        await outputs.aclose()
        await front.close()


def metric_value_of(registry: CollectorRegistry, name: str) -> float:
    from prometheus_client import generate_latest

    return metric_value(generate_latest(registry).decode(), name)


class _Long(Destination):
    """Answers "long" with a text over the output bound, anything else with "short"."""

    async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                     ) -> DestinationResult:
        await started()
        return DestinationResult(text="x" * 70_000 if turn.query == "long" else "short")


def _long_router(ctx: WorkerContext) -> AgentRouter:
    return AgentRouter({"echo": _Long("anything")}, LexicalDecisions(fallback_route="echo"),
                       default_destination="echo")


async def test_an_answer_over_the_message_bound_ends_with_the_failure_text_named(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """An answer whose output exceeds `max_message_bytes` cannot go out: the turn ends
    with the failure text at once and the log names the bound. Before, it was held in
    the participant's record, whose write the server refused (over its 1 MiB payload
    bound for a longer one): a misleading "state write failed", the participant reset."""
    config = NatsConfig(url=nats_server.url)
    async with serving(config, "long", _long_router), listening(config) as (front, _):
        with caplog.at_level(logging.WARNING, logger="turnrouter"):
            assert await answered(front, "zoe", "long") == FAILURE
            assert await answered(front, "zoe", "next") == "short"
    messages = [record.getMessage() for record in caplog.records]
    assert any("over max_message_bytes 65536" in m for m in messages), messages
    assert not any("state write failed" in m for m in messages), messages
