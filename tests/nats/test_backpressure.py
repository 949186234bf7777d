"""Backpressure on a real nats-server: a saturated replica stops taking messages, and a
query a newer one of the same participant follows is dropped before any work.

The worker runs in the test's loop; its router samples its lag on a `ManualClock`, so the
test makes it busy and ready again without real load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from turnrouter import AgentRouter, OverloadPolicy
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
    WorkerContext,
    encode_token,
)
from turnrouter.telemetry import Telemetry
from turnrouter.testing import ManualClock, ScriptedAgent, ScriptedDecisions

from .conftest import NatsServer, metric_value, until_true

pytestmark = pytest.mark.anyio

POLICY = OverloadPolicy(busy_lag_secs=0.1, shed_lag_secs=0.5, sample_secs=0.01)


async def until(condition: Callable[[], bool]) -> None:
    """Until what the worker does after nats-server delivers is visible (bounded)."""
    await until_true(condition, "the worker got there")


async def lag(clock: ManualClock, seconds: float, samples: int) -> None:
    for _ in range(samples):
        async with asyncio.timeout(15):
            await clock.wait_for_sleepers(1)
        clock.advance(POLICY.sample_secs + seconds)
        await asyncio.sleep(0)
        await asyncio.sleep(0)


@pytest.mark.parametrize("newer", ["query", "junk"])
async def test_a_busy_replica_holds_its_next_message_and_drops_a_superseded_query(
        nats_server: NatsServer, newer: str) -> None:
    """While the router is busy the partition's next message is held (not run, not
    shed) and the stream keeps the rest; once ready, the held query, followed by a
    newer one of the same participant, is acknowledged unrun and counted; the newer
    one is answered. Junk published on the participant's subject (anyone's) supersedes
    nothing: the held query is answered (before, it was dropped unrun, unanswered,
    counted as load: redteam22 F5)."""
    clock = ManualClock()
    agent = ScriptedAgent("echo")
    registry = CollectorRegistry()

    def make_router(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": agent}, ScriptedDecisions("echo"),
                           default_destination="echo", clock=clock, overload=POLICY,
                           telemetry=Telemetry(registry=ctx.registry))

    # A long pull window, so the pause outlasts the test's steps on a slow machine.
    config = NatsConfig(url=nats_server.url, partitions=2, pull_expires=5.0,
                        failover_timeout=20.0, ack_wait=30.0)
    worker = NatsWorker(make_router, config, registry=registry, replica="busy")
    run = asyncio.create_task(worker.run())

    def value(name: str, labels: str = "") -> float:
        return metric_value(generate_latest(registry).decode(), name, labels)

    def answered(pid: str) -> list[str | None]:
        return [call.query for call in agent.calls
                if call.method == "answer" and call.participant_id == pid]

    front = await NatsFrontEnd.connect(config)
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        gate = agent.answer_gate = anyio.Event()
        await front.publish(UserQuery(participant_id="held", text="hold"))
        async with asyncio.timeout(15):
            await agent.answer_entered.wait()
        agent.answer_gate = None
        await lag(clock, 0.2, samples=2)
        assert worker.router.busy

        await front.publish(UserQuery(participant_id="bea", text="one"))
        await until(lambda: value("turnrouter_nats_backpressure_total",
                                  'what="paused"') >= 1)
        # Held: the router never saw it (not even to shed it), and the next query of
        # the same participant waits in the stream behind it.
        assert "bea" not in worker.router.participants
        assert value("turnrouter_shed_turns_total") == 0
        if newer == "query":
            await front.publish(UserQuery(participant_id="bea", text="two"))
        else:
            await front.connection.publish(f"turnrouter.in.{encode_token('bea')}.query",
                                           b"junk")
            await front.connection.flush()
        await lag(clock, 0.0, samples=POLICY.calm_samples)
        assert not worker.router.busy
        await until(lambda: answered("bea") == (["two"] if newer == "query" else ["one"]))
        if newer == "junk":
            await until(lambda: value("turnrouter_runtime_rejected_messages_total",
                                      'reason="invalid"') == 1)
        superseded = 1 if newer == "query" else 0
        assert value("turnrouter_nats_backpressure_total", 'what="superseded"') == superseded
        assert value("turnrouter_runtime_rejected_messages_total",
                     'reason="superseded"') == superseded
        gate.set()
    finally:
        await front.close()
        worker.request_stop()
        async with asyncio.timeout(30):
            await run
