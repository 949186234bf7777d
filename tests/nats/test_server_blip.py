"""A turn running while the server blips (kill -9 and restart, or a freeze past
`failover_timeout`) on a fleet whose replicas all survive ends with its own answer,
heard once, its destination run once, the history holding what was heard
(docs/distributed.md, "The server crashes (kill -9), freezes, or restarts").

Before, the replica running it was told its pin was gone (a `423`: a restarted server
forgets every pin, a resumed one unpins the clients it heard nothing from) and ended
the turn at once with the failure text, its answer a moment away (chaos20 O1: about 25
turns per server kill -9 at 100 turns/s, every worker alive)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import nats
from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    ParticipantSnapshot,
    RoutingAid,
)
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import (
    NatsConfig,
    NatsWorker,
    WorkerContext,
    encode_token,
    parse_record,
)

from .app import Always
from .conftest import NatsServer, metric_value, until_true
from .crowd import ask, listening, running

pytestmark = pytest.mark.anyio

#: One partition: one replica owns it, the other stands by.
CONFIG = NatsConfig(partitions=1)


@dataclasses.dataclass
class Gate:
    """Shared by the replicas' destinations: a query starting with `held` waits for
    `go` once it started (`started`); every run of a turn is counted."""

    started: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    go: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    runs: Counter[str] = dataclasses.field(default_factory=Counter)


class Held:
    """Answers `<query>|<exchanges in the history>`, a `held` query once let go."""

    def __init__(self, ctx: WorkerContext, gate: Gate) -> None:
        self._ctx, self._gate = ctx, gate

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("echo", "echoes")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        self._gate.runs[turn.turn_id] += 1
        await started()
        if turn.query.startswith("held"):
            self._gate.started.set()
            await self._gate.go.wait()
        text = f"{turn.query}|{len(turn.history)}"
        await self._ctx.answer(turn, "echo", text)
        return DestinationResult("focus", text)

    async def release(self, participant_id: str) -> None:
        return None


@contextlib.asynccontextmanager
async def replica(config: NatsConfig, name: str, gate: Gate,
                  registry: CollectorRegistry) -> AsyncIterator[NatsWorker]:
    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": Held(ctx, gate)}, Always(), default_destination="echo")

    async with running(NatsWorker(factory, config, replica=name,
                                  registry=registry)) as worker:
        yield worker


def counted(registries: list[CollectorRegistry], name: str) -> float:
    return sum(metric_value(generate_latest(r).decode(), name) for r in registries)


async def record_of(server: NatsServer, pid: str) -> tuple[list[str], list[str | None]]:
    """(turns in flight, turn ids of the history) of `pid`'s record."""
    nc = await nats.connect(server.url)
    try:
        kv = await nc.jetstream().key_value(CONFIG.bucket)
        record = parse_record((await kv.get(f"0.{encode_token(pid)}")).value or b"")
    finally:
        await nc.close()
    assert record.snapshot is not None
    history = ParticipantSnapshot.from_json(record.snapshot).history
    return record.inflight, [item.turn_id for item in history]


async def until_marked(server: NatsServer, pid: str, turn_id: str,
                       within: float = 15.0) -> None:
    """Until `pid`'s record marks `turn_id` in flight (and nothing else), at most
    `within` seconds (a bounded poll of the server's state, as `until_true`)."""
    deadline = time.monotonic() + within
    while (await record_of(server, pid))[0] != [turn_id]:
        if time.monotonic() > deadline:
            raise AssertionError(f"{turn_id} marked in flight within {within:g} s")
        await asyncio.sleep(0.01)


async def a_turn_through(server: NatsServer, blip: Callable[[], Awaitable[None]]) -> None:
    """Two replicas; "ann" talks once, then a `held` turn starts, is marked in flight,
    and `blip` happens; once the server re-pinned the partition (a replica took it
    over) and the old pin was refused, the destination answers. That answer is the
    turn's one ending, its destination ran once, the next turn follows with both
    exchanges in the history, and the record holds exactly what was heard."""
    gate = Gate()
    config = dataclasses.replace(CONFIG, url=server.url)
    registries = [CollectorRegistry(), CollectorRegistry()]
    async with replica(config, "one", gate, registries[0]) as one, \
            replica(config, "two", gate, registries[1]) as two, \
            listening(server.url) as (front, heard):
        await until_true(lambda: len(one.owned_partitions) + len(two.owned_partitions) == 1,
                         "one replica owns the partition")
        assert await ask(front, heard, "ann", "hello") == "hello|0"
        held = UserQuery(participant_id="ann", text="held")
        event = heard.events.setdefault(held.message_id, asyncio.Event())
        await front.publish(held)
        async with asyncio.timeout(15):
            await gate.started.wait()
        await until_marked(server, "ann", held.message_id)
        lost = counted(registries, "turnrouter_nats_partitions_lost_total")
        taken = counted(registries, "turnrouter_nats_takeovers_total")
        await blip()
        await until_true(
            lambda: counted(registries, "turnrouter_nats_partitions_lost_total") > lost
            and counted(registries, "turnrouter_nats_takeovers_total") > taken,
            "the old pin refused and the partition pinned afresh")
        gate.go.set()
        async with asyncio.timeout(15):
            await event.wait()
        assert heard.finals[held.message_id][0].text == "held|1"
        assert await ask(front, heard, "ann", "again") == "again|2"
        assert [m.text for m in heard.finals[held.message_id]] == ["held|1"]
        assert gate.runs[held.message_id] == 1
        inflight, history = await record_of(server, "ann")
        assert inflight == []
        assert history == heard.order["ann"]
        assert len(history) == 3


async def test_a_turn_running_across_a_server_kill_nine_ends_with_its_answer(
        synced_server: NatsServer) -> None:
    """kill -9 of the server and its restart at once: the replica running the turn gets
    the partition back (the other leaves it alone for a moment after its reconnect)
    and keeps the participant, its record being still its own."""
    async def kill_and_restart() -> None:
        await asyncio.to_thread(synced_server.crash)
        await asyncio.to_thread(synced_server.restart)

    await a_turn_through(synced_server, kill_and_restart)


async def test_a_turn_running_across_a_short_server_freeze_ends_with_its_answer(
        synced_server: NatsServer) -> None:
    """The server frozen (SIGSTOP) for 2.5 s, past `failover_timeout` and shorter than
    the worker takes to count the connection lost: on resume it unpins the silent
    owner and the standby replica takes the partition; the old owner's turn runs on,
    and the new owner, waiting for a living previous owner's write, says its answer."""
    async def freeze() -> None:
        await asyncio.to_thread(synced_server.freeze)
        await asyncio.sleep(2.5)  # the outage itself
        synced_server.thaw()

    await a_turn_through(synced_server, freeze)
