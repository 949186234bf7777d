"""A participant hears their turns in order, and no output waits on a turn it must not
wait on: in-process workers on a real nats-server (review15's three deadlocks of the
first version of the ordering: an older turn's failure text held behind a newer turn's
answer, a fenced participant's held answers never released, an oversized query's
failure text holding its partition)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import nats
from turnrouter import (
    AgentRouter,
    AgentTurn,
    Destination,
    DestinationResult,
)
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsWorker,
    WorkerContext,
    encode_token,
)
from turnrouter.telemetry import Telemetry

from .app import Always
from .conftest import NatsServer, metric_value, until_true
from .crowd import Heard, listening
from .proxy import proxied

pytestmark = pytest.mark.anyio

Answer = Callable[[WorkerContext, AgentTurn], Awaitable[DestinationResult]]


class Scripted(Destination):
    """One destination whose `answer()` is the test's `script`."""

    def __init__(self, ctx: WorkerContext, script: Answer) -> None:
        super().__init__("everything")
        self._ctx, self._script = ctx, script

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        return await self._script(self._ctx, turn)


@contextlib.asynccontextmanager
async def serving(config: NatsConfig, script: Answer, registry: CollectorRegistry,
                  **router: Any) -> AsyncIterator[NatsWorker]:
    """An in-process worker whose router runs `script`; its graceful stop must end
    within 30 s when the block ends (a turn left waiting for ever would hang it)."""
    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": Scripted(ctx, script)}, Always(),
                           default_destination="echo",
                           telemetry=Telemetry(registry=ctx.registry), **router)

    worker = NatsWorker(factory, config, registry=registry, replica="order")
    run = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        yield worker
        worker.request_stop()
        async with asyncio.timeout(30):  # the graceful stop waits for every turn
            await asyncio.shield(run)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


def finals(heard: Heard, query: UserQuery) -> list[str]:
    return [o.text for o in heard.said.get(query.participant_id, ())
            if o.request_id == query.message_id and o.final]


async def test_an_older_turns_failure_is_not_held_behind_a_newer_turns_answer(
        nats_server: NatsServer) -> None:
    """The first turn gave its answer and works on; the second query cuts it, and its
    destination turns the cancellation into an error. The first turn's ending waits for
    the router's status callback (one yield), long enough for the second turn to answer:
    the first turn's ending must not wait for that newer answer (which waits for it).
    Before the fix neither turn ended audibly and the graceful stop hung."""
    first = UserQuery(participant_id="p", text="first")
    second = UserQuery(participant_id="p", text="second")

    async def script(ctx: WorkerContext, turn: AgentTurn) -> DestinationResult:
        if turn.query == "first":
            await ctx.answer(turn, "echo", "first answer")
            try:
                await asyncio.Event().wait()  # works on after its answer, until cut
            except asyncio.CancelledError:
                raise RuntimeError("clean-up failed while cut") from None
        await ctx.answer(turn, "echo", "second answer")
        return DestinationResult("answer", "second answer")

    async def status(what: str, pid: str) -> None:
        await asyncio.sleep(0)  # e.g. a status sent to the participant's UI

    registry = CollectorRegistry()
    config = NatsConfig(url=nats_server.url)
    async with listening(config) as (front, heard), \
            serving(config, script, registry, set_status=status):
        await front.publish(first)
        await until_true(lambda: metric_value(generate_latest(registry).decode(),
                                              "turnrouter_nats_inflight_marks_total") >= 1,
                         "the first turn marked in flight", within=15)
        await front.publish(second)
        await until_true(lambda: bool(finals(heard, first) and finals(heard, second)),
                         "both turns ended audibly", within=15)
        assert finals(heard, second) == ["second answer"]
        assert [o.request_id for o in heard.said["p"] if o.final] == [
            first.message_id, second.message_id]


async def test_a_fenced_participants_held_answers_hold_nothing_back(
        nats_server: NatsServer) -> None:
    """The first turn's finished record is held back (a proxy) while the second turn
    fails at once; then another writer moves the record on, so the held write is
    refused and this replica lets the participant go. The second turn's failure text,
    waiting behind the first turn's answer that this replica will now never publish,
    must go out (before the fix: nothing heard, the graceful stop hung)."""
    first = UserQuery(participant_id="p", text="first")
    second = UserQuery(participant_id="p", text="second")

    async def script(ctx: WorkerContext, turn: AgentTurn) -> DestinationResult:
        if turn.query == "first":
            await ctx.answer(turn, "echo", "first answer")
            await asyncio.sleep(0.3)  # works on after its answer: marked in flight
            return DestinationResult("answer", "first answer")
        raise RuntimeError("the second turn fails at once")

    registry = CollectorRegistry()

    def counted(name: str) -> float:
        return metric_value(generate_latest(registry).decode(), name)

    async with proxied(nats_server.port) as proxy:
        config = NatsConfig(url=nats_server.url)
        async with listening(config) as (front, heard), \
                serving(NatsConfig(url=proxy.url), script, registry):
            await front.publish(first)
            await until_true(lambda: counted("turnrouter_nats_inflight_marks_total") >= 1,
                             "the first turn marked in flight", within=15)
            key = f".{encode_token('p')}"
            subjects: list[str] = []

            def record_write(subject: str, data: bytes) -> bool:
                # The finished record only (its history holds the answer): on a loaded
                # machine the in-flight mark's write, counted before it is sent, can
                # still be on its way; holding it stopped the partition (the message
                # unacknowledged), so the second query never came (CI red at load 12).
                if (subject.startswith("$KV.") and subject.endswith(key)
                        and b"first answer" in data):
                    subjects.append(subject)
                    return True
                return False

            writes = proxy.hold(record_write)
            async with asyncio.timeout(15):
                await writes.holding(1)  # the first turn's finished record
            await front.publish(second)
            await until_true(lambda: counted("turnrouter_failures_total") >= 1,
                             "the second turn failed", within=15)
            nc = await nats.connect(nats_server.url)  # another replica's write
            try:
                await nc.jetstream().publish(subjects[0], b"{}")
            finally:
                await nc.close()
            writes.release()
            await until_true(lambda: bool(finals(heard, second)),
                             "the second turn ended audibly", within=15)
            assert len(finals(heard, second)) == 1


async def test_an_oversized_query_does_not_hold_its_partition_behind_a_running_turn(
        nats_server: NatsServer) -> None:
    """A participant's turn answered and works on; an oversized query of theirs is
    refused with the failure text at once, without waiting for that turn's end: the
    partition's next input (another participant's) is answered meanwhile (before the
    fix the partition waited for the turn's end)."""
    done = asyncio.Event()

    async def script(ctx: WorkerContext, turn: AgentTurn) -> DestinationResult:
        await ctx.answer(turn, "echo", f"answer to {turn.query}")
        if turn.query == "late":
            await done.wait()  # works on after its answer (a tool call, a summary)
        return DestinationResult("answer", f"answer to {turn.query}")

    config = NatsConfig(url=nats_server.url, partitions=1)
    registry = CollectorRegistry()
    async with listening(config) as (front, heard), serving(config, script, registry):
        try:
            await front.publish(UserQuery(participant_id="ann", text="late"))
            await until_true(lambda: metric_value(generate_latest(registry).decode(),
                                                  "turnrouter_nats_inflight_marks_total") >= 1,
                             "ann's turn marked in flight", within=15)
            big = UserQuery(participant_id="ann", text="x" * (config.max_message_bytes + 100))
            nc = await nats.connect(nats_server.url)  # past the front end's own check
            try:
                await nc.jetstream().publish(
                    config.input_subject("ann", "query"), big.model_dump_json().encode(),
                    headers={"Nats-Msg-Id": f"{encode_token('ann')}.{big.message_id}"})
            finally:
                await nc.close()
            hello = UserQuery(participant_id="bob", text="hello")
            await front.publish(hello)
            await until_true(lambda: bool(finals(heard, hello) and finals(heard, big)),
                             "bob answered and ann's oversized query refused while ann's "
                             "turn still runs", within=15)
            assert finals(heard, hello) == ["answer to hello"]
            assert finals(heard, big) == [config.failure_text]
        finally:
            done.set()


async def test_a_turn_cut_by_its_participants_next_turn_ends_silently_during_a_stop(
        nats_server: NatsServer) -> None:
    """While the worker drains for a graceful stop, a participant's next query cuts
    their running turn: the cut turn ends silently, as at any other time (chaos15b D5:
    it ended with the failure text on a stopping worker); the next one is answered."""
    first = UserQuery(participant_id="p", text="first")
    second = UserQuery(participant_id="p", text="second")
    running = asyncio.Event()

    async def script(ctx: WorkerContext, turn: AgentTurn) -> DestinationResult:
        if turn.query == "first":
            running.set()
            await asyncio.Event().wait()  # until cut
        return DestinationResult("answer", "second answer")

    registry = CollectorRegistry()
    config = NatsConfig(url=nats_server.url)
    async with listening(config) as (front, heard), \
            serving(config, script, registry) as worker:
        await front.publish(first)
        async with asyncio.timeout(15):
            await running.wait()
        worker.request_stop()  # drains: the first turn still runs
        await front.publish(second)
        await until_true(lambda: bool(finals(heard, second)), "the second turn answered",
                         within=15)
        assert finals(heard, second) == ["second answer"]
        assert finals(heard, first) == []
