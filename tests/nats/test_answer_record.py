"""A record that holds an answer holds its exchange: a new owner claiming it says that
answer and runs the participant's next turns with it in their history
(docs/distributed.md, "State moves with the participant").

chaos17 F2: after a server kill -9 during a backlog, a turn's in-flight mark waited
behind a record write the lost server had not answered, and was built once the turn
had finished: it wrote the turn's answer into the record's outbox beside the snapshot of
before (a mark reuses the last one). The replica lost the partition before its finished
record landed; the new owner claimed the mark's record, said the answer (heard) and ran
the next turns without that exchange."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import nats
from turnrouter import (
    AgentRouter,
    AgentTurn,
    Destination,
    DestinationResult,
    ParticipantSnapshot,
)
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsFrontEnd,
    NatsWorker,
    WorkerContext,
    encode_token,
    parse_record,
)
from turnrouter.telemetry import Telemetry

from .app import Always
from .conftest import NatsServer, metric_value, until_true
from .crowd import Heard, listening
from .proxy import proxied

pytestmark = pytest.mark.anyio

Script = Callable[[WorkerContext, AgentTurn], Awaitable[DestinationResult]]


class Scripted(Destination):
    """One destination whose `answer()` is the test's `script`."""

    def __init__(self, ctx: WorkerContext, script: Script) -> None:
        super().__init__("everything")
        self._ctx, self._script = ctx, script

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        return await self._script(self._ctx, turn)


def finals(heard: Heard, pid: str) -> list[str]:
    """The turn ids of `pid`'s final outputs, in the order heard."""
    return [o.request_id for o in heard.said.get(pid, ()) if o.final]


async def test_a_mark_built_after_its_turn_finished_holds_the_exchange(
        nats_server: NatsServer) -> None:
    """The second turn's in-flight mark waits behind the first turn's finished record,
    whose write the server gets late (held by a proxy, as by a server that went away);
    meanwhile the second turn's destination answers. The mark lands, the second turn's
    finished record does not (held, then lost with the replica's connection): the
    record then holds the second answer, and must hold its exchange. The replica is cut
    off for good (its connection refused, as a replica that died); a new replica claims
    the record, says the second answer and runs a third turn: the participant's history
    holds exactly the answers heard, in order. Before the fix the record held the
    second answer beside the first turn's snapshot: heard first, second, third; history
    first, third."""
    config = NatsConfig(url=nats_server.url, partitions=1)
    pid = "pat"
    first = UserQuery(participant_id=pid, text="first")
    second = UserQuery(participant_id=pid, text="second")
    third = UserQuery(participant_id=pid, text="third")
    record_subject = f"$KV.{config.bucket}.0.{encode_token(pid)}"
    first_go, second_go, second_idle = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def script(ctx: WorkerContext, turn: AgentTurn) -> DestinationResult:
        if turn.query == "first":
            await first_go.wait()
        elif turn.query == "second":
            await second_go.wait()
        text = f"{turn.query} answer"
        await ctx.answer(turn, "echo", text)
        return DestinationResult("answer", text)

    async def status(what: str, who: str) -> None:
        # Called once the turn's destination returned; the worker then records its end
        # (the answer joins the outbox) and waits for the participant's record.
        if what == "idle" and second_go.is_set():
            second_idle.set()

    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": Scripted(ctx, script)}, Always(),
                           default_destination="echo",
                           telemetry=Telemetry(registry=ctx.registry), set_status=status)

    registry = CollectorRegistry()

    def marks() -> float:  # (counted as a mark is made, before its write)
        return metric_value(generate_latest(registry).decode(),
                            "turnrouter_nats_inflight_marks_total")

    def written() -> float:  # record writes that landed (a claim's not counted)
        return metric_value(generate_latest(registry).decode(),
                            "turnrouter_nats_state_write_seconds_count")

    async with proxied(nats_server.port) as proxy, listening(config) as (front, heard):
        old = NatsWorker(factory, dataclasses.replace(config, url=proxy.url),
                         registry=registry, replica="old")
        new = NatsWorker(factory, config, registry=CollectorRegistry(), replica="new")
        runs = [asyncio.create_task(old.run())]
        nc = await nats.connect(nats_server.url)
        try:
            async with asyncio.timeout(15):
                await old.ready.wait()
            await front.publish(first)
            await until_true(lambda: written() >= 1,
                             "the first turn's in-flight mark written", within=15)
            # Record writes reach the server only when released: the first one (the
            # first turn's finished record) when `late` is, then the next one goes
            # through and the rest are held (`later`).
            late = proxy.hold(lambda subject, _: subject == record_subject)
            through = [0]

            def after_one(subject: str, _: bytes) -> bool:
                if subject != record_subject:
                    return False
                through[0] += 1
                return through[0] > 1

            later = proxy.hold(after_one)
            first_go.set()
            async with asyncio.timeout(15):
                await late.holding(1)
            await front.publish(second)  # delivered: the first turn's message is acked
            await until_true(lambda: marks() >= 2, "the second turn marked in flight",
                             within=15)
            second_go.set()
            async with asyncio.timeout(15):
                await second_idle.wait()  # its answer joined the outbox: it waits too
            assert late.release() == 1
            async with asyncio.timeout(15):
                await later.holding(1)  # the mark landed; the finished record is held
            kv = await nc.jetstream().key_value(config.bucket)
            record = parse_record((await kv.get(f"0.{encode_token(pid)}")).value or b"")
            assert record.snapshot is not None
            history = [x.turn_id for x in
                       ParticipantSnapshot.from_json(record.snapshot).history]
            answered = [e[0] for e in record.outbox if e[1] == "echo"]
            assert second.message_id in answered
            marked = (answered, history)  # (checked at the end: the rest shows why)
            # The replica is cut off (its finished record lost with the connection).
            proxy.refusing = True
            later.drop(len(later.held))
            proxy.reset()
            runs.append(asyncio.create_task(new.run()))
            async with asyncio.timeout(15):
                await new.ready.wait()
            await front.publish(third)
            await until_true(lambda: third.message_id in finals(heard, pid),
                             "the third turn answered by the new replica", within=30)
            heard_ids = finals(heard, pid)
            assert heard_ids == [first.message_id, second.message_id, third.message_id]
            record = parse_record((await kv.get(f"0.{encode_token(pid)}")).value or b"")
            assert record.snapshot is not None and record.owner == "new"
            history = [x.turn_id for x in
                       ParticipantSnapshot.from_json(record.snapshot).history]
            assert history == heard_ids
            assert set(marked[0]) <= set(marked[1]), (
                f"the mark's record holds answers {marked[0]}, its history {marked[1]}")
        finally:
            await nc.close()
            new.request_stop()
            for run in runs:
                run.cancel()
            async with asyncio.timeout(20):
                await asyncio.gather(*runs, return_exceptions=True)


@pytest.mark.parametrize("answered", ["in the outage", "after the return"])
async def test_a_turn_running_when_the_store_went_back_ends_once(
        tmp_path: Path, answered: str) -> None:
    """The server comes back on an older copy of its store (a backup from two turns
    ago) while a turn marked in flight runs: the copy knows nothing of it. The
    partition, pinned afresh, is lost and taken back; the replica finds the record at
    an older revision of its own (nobody claimed it since) and ends the turn from
    what it held: its answer, given while the server was away or after the return
    (its write, refused for that older revision, lands over it: the participant was
    kept, its record being still this replica's). Exactly one final, and the history
    holds the answers heard. Before, the refusal and the record were taken for a newer
    owner's claim: the turn never ended (chaos17 F1: every turn running at such a
    restart); and a turn answered after the return ended with the failure text, its
    destination cut when the old pin was refused (chaos20 O1)."""
    server = NatsServer(sync_always=True)
    config = NatsConfig(url=server.url, partitions=1)
    pid = "olga"
    backup = tmp_path / "store"
    go, started, said = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def script(ctx: WorkerContext, turn: AgentTurn) -> DestinationResult:
        if turn.query == "fourth":
            started.set()
            await go.wait()
        text = f"{turn.query} answer"
        await ctx.answer(turn, "echo", text)
        if turn.query == "fourth":
            said.set()
        return DestinationResult("answer", text)

    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": Scripted(ctx, script)}, Always(),
                           default_destination="echo",
                           telemetry=Telemetry(registry=ctx.registry))

    registry = CollectorRegistry()

    def written() -> float:
        return metric_value(generate_latest(registry).decode(),
                            "turnrouter_nats_state_write_seconds_count")

    worker = NatsWorker(factory, config, registry=registry, replica="solo")
    run = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        async with listening(config) as (front, heard):
            queries = [UserQuery(participant_id=pid, text=text)
                       for text in ("first", "second", "third", "fourth")]
            assert await ask_query(front, heard, queries[0]) == "first answer"
            await asyncio.to_thread(server.crash)
            shutil.copytree(server.store, backup)  # the copy the server comes back on
            await asyncio.to_thread(server.restart)
            await until_true(lambda: front.connection.is_connected,
                             "the front end reconnected", within=15)
            for query in queries[1:3]:
                assert await ask_query(front, heard, query, within=30) == (
                    f"{query.text} answer")
            before = written()
            await front.publish(queries[3])
            async with asyncio.timeout(15):
                await started.wait()
            await until_true(lambda: written() > before, "the turn marked in flight",
                             within=15)
            await asyncio.to_thread(server.crash)
            if answered == "in the outage":
                go.set()
                async with asyncio.timeout(15):
                    await said.wait()  # held: its record write waits for the server
            shutil.rmtree(server.store)
            shutil.copytree(backup, server.store)
            await asyncio.to_thread(server.restart)
            await until_true(lambda: front.connection.is_connected,
                             "the front end reconnected", within=15)
            # The partition is served again (another participant answered).
            assert await ask(front, heard, "other", "hello", within=30) == "hello answer"
            go.set()
            await until_true(lambda: queries[3].message_id in finals(heard, pid),
                             "the running turn ended", within=30)
            assert [o.text for o in heard.said[pid] if o.final] == [
                f"{q.text} answer" for q in queries]
            nc = await nats.connect(server.url)
            try:
                kv = await nc.jetstream().key_value(config.bucket)
                record = parse_record((await kv.get(f"0.{encode_token(pid)}")).value
                                      or b"")
            finally:
                await nc.close()
            assert record.snapshot is not None
            assert [x.turn_id for x in ParticipantSnapshot.from_json(
                record.snapshot).history] == [q.message_id for q in queries]
    finally:
        worker.request_stop()
        go.set()
        async with asyncio.timeout(30):
            await asyncio.gather(run, return_exceptions=True)
        server.close()


async def ask_query(front: NatsFrontEnd, heard: Heard, query: UserQuery, *,
                    within: float = 15) -> str:
    """Publish `query`; its final output's text (a wait of at most `within` s)."""
    event = heard.events.setdefault(query.message_id, asyncio.Event())
    await front.publish(query)
    async with asyncio.timeout(within):
        await event.wait()
    return heard.finals[query.message_id][0].text


async def ask(front: NatsFrontEnd, heard: Heard, pid: str, text: str, *,
              within: float = 15) -> str:
    return await ask_query(front, heard, UserQuery(participant_id=pid, text=text),
                           within=within)
