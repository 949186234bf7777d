"""NatsWorker in the test's own event loop: a graceful stop and a cancellation leave no
task behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from turnrouter import AgentRouter, AgentTurn, Destination, DestinationResult, LifecycleError
from turnrouter.decisions import LexicalDecisions
from turnrouter.runtime import ParticipantLeft, UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker, WorkerContext
from turnrouter.telemetry import Telemetry

from .app import make_router
from .conftest import NatsServer, metric_value, until_true
from .crowd import FAILURE, Heard, listening, serving
from .proxy import proxied

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
        # A turn's task leaves the worker's tasks at its own end (no done callback).
        await until_true(lambda: not any(t.get_name().startswith("turn ")
                                         for t in worker._tasks), "the turn's task gone")
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
    return metric_value(generate_latest(registry).decode(), name)


class _Long(Destination):
    """Answers "long" with a text over the output bound, anything else with "short|" and
    the previous user text ("-" when none); returned, not said through `ctx.answer`."""

    async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                     ) -> DestinationResult:
        await started()
        previous = turn.history[-1].user if turn.history else "-"
        return DestinationResult(
            text="x" * 70_000 if turn.query == "long" else f"short|{previous}")


def _long_router(ctx: WorkerContext) -> AgentRouter:
    return AgentRouter({"echo": _Long("anything")}, LexicalDecisions(fallback_route="echo"),
                       default_destination="echo")


async def test_an_answer_over_the_message_bound_ends_with_the_failure_text_named(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """An answer whose output exceeds `max_message_bytes` cannot go out: the turn ends
    with the failure text at once and the log names the bound. Before, it was held in
    the participant's record, whose write the server refused (over its 1 MiB payload
    bound for a longer one): a misleading "state write failed", the participant reset.
    The unsaid exchange is not in the history either: the next turn's previous one is
    the last heard (before, the router had recorded it before the worker found it too
    long, and under the default budget it pushed out everything heard before it)."""
    config = NatsConfig(url=nats_server.url)
    async with serving(config, "long", _long_router), listening(config) as (front, _):
        with caplog.at_level(logging.WARNING, logger="turnrouter"):
            assert await answered(front, "zoe", "hi") == "short|-"
            assert await answered(front, "zoe", "long") == FAILURE
            assert await answered(front, "zoe", "next") == "short|hi"
    messages = [record.getMessage() for record in caplog.records]
    assert any("over max_message_bytes 65536" in m for m in messages), messages
    assert not any("state write failed" in m for m in messages), messages


class _SlowRelease(Destination):
    """Answers with the query and how many exchanges the turn's history holds; its
    release waits for `gate` (`releasing` is set when it begins)."""

    def __init__(self) -> None:
        super().__init__("answers")
        self.releasing, self.gate = asyncio.Event(), asyncio.Event()

    async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                     ) -> DestinationResult:
        await started()
        return DestinationResult("focus", f"{turn.query}|{len(turn.history)}")

    async def release(self, participant_id: str) -> None:
        self.releasing.set()
        await self.gate.wait()


async def test_a_query_right_after_leaving_waits_for_the_departure_and_starts_afresh(
        nats_server: NatsServer) -> None:
    """A query published right after its participant's `left` is taken while the
    departure still releases their destinations: it waits for the departure and runs
    as their next session's first turn (clean history), as it does when the releases
    are quick. Before, the router refused it as departing, and nothing was said."""
    config = NatsConfig(url=nats_server.url)
    slow = _SlowRelease()

    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": slow}, LexicalDecisions(fallback_route="echo"),
                           default_destination="echo",
                           telemetry=Telemetry(registry=ctx.registry))

    async with serving(config, "departing", factory) as registry, \
            listening(config) as (front, _):
        assert await answered(front, "fay", "one") == "one|0"
        await front.publish(ParticipantLeft(participant_id="fay"))
        async with asyncio.timeout(15):
            await slow.releasing.wait()
        after = asyncio.create_task(answered(front, "fay", "two"))
        try:
            for _ in range(150):  # the query was taken (its queue wait observed): <= 15 s
                if queued(registry) >= 3:
                    break
                await asyncio.sleep(0.1)
            assert queued(registry) >= 3
            assert not after.done()
            slow.gate.set()
            assert await after == "two|0"
        finally:
            after.cancel()
        assert metric_value_of(registry, "turnrouter_turns_total") == 2
        assert metric_value_of(registry, "turnrouter_runtime_rejected_messages_total") == 0


def queued(registry: CollectorRegistry) -> float:
    """Inputs the worker took from its partitions so far."""
    return metric_value(generate_latest(registry).decode(),
                        "turnrouter_nats_input_wait_seconds_count", 'stage="queued"')


async def test_a_turn_the_router_refuses_ends_with_the_failure_text_and_is_counted(
        nats_server: NatsServer) -> None:
    """A router that holds `max_participants` refuses a new participant's turn: on NATS
    the turn still ends audibly (the failure text as its final output), and the refusal
    is counted as closed. Before, it ended silently and uncounted: a front end waiting
    for the turn's final output waited for ever."""
    config = NatsConfig(url=nats_server.url)

    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": _Long("anything")}, LexicalDecisions(fallback_route="echo"),
                           default_destination="echo", max_participants=1,
                           telemetry=Telemetry(registry=ctx.registry))

    async with serving(config, "full", factory) as registry, listening(config) as (front, _):
        assert await answered(front, "kim", "hi") == "short|-"
        assert await answered(front, "lee", "hi") == FAILURE
        assert await answered(front, "kim", "again") == "short|hi"
        assert metric_value(generate_latest(registry).decode(),
                            "turnrouter_runtime_rejected_messages_total",
                            'reason="closed",topic="nats_input"') == 1


class _LosesACancel(Destination):
    """Answers "hi" at once, except "hold": that answer waits for ever and survives its
    first cancellation, as an await through Python 3.11's `asyncio.wait_for` does when
    the cancellation comes with the awaited reply (CPython gh-86296)."""

    def __init__(self) -> None:
        super().__init__("holds")
        self.holding = asyncio.Event()

    async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                     ) -> DestinationResult:
        await started()
        if turn.query != "hold":
            return DestinationResult(text="hi")
        self.holding.set()
        with contextlib.suppress(asyncio.CancelledError):  # the lost cancellation
            await asyncio.Event().wait()
        await asyncio.Event().wait()
        return DestinationResult(text="never")


async def test_a_cancelled_run_ends_though_a_task_lost_its_first_cancellation(
        nats_server: NatsServer) -> None:
    """The process going down cancels run(): every task it started is cancelled, also
    one that lost the first cancellation (cancelled again until it ends). Before, the
    end waited for it for good: a worker stuck in its shutdown, whatever the signals."""
    before = asyncio.all_tasks()
    holds = _LosesACancel()

    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": holds}, LexicalDecisions(fallback_route="echo"),
                           default_destination="echo")

    config = NatsConfig(url=nats_server.url)
    worker = NatsWorker(factory, config, registry=CollectorRegistry())
    run = asyncio.create_task(worker.run())
    async with asyncio.timeout(15):
        await worker.ready.wait()
    front = await NatsFrontEnd.connect(config)
    try:
        await front.publish(UserQuery(participant_id="zed", text="hold"))
        async with asyncio.timeout(15):
            await holds.holding.wait()
    finally:
        await front.close()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(20):
            await run
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()


@pytest.mark.parametrize("own_registry", [True, False])
async def test_a_router_whose_metrics_miss_the_workers_registry_is_named_at_start(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture, own_registry: bool) -> None:
    """A factory that gives the router a registry of its own (or the default one) leaves
    the worker's /metrics with turnrouter_nats_* only: said once at start, with the fix.
    A factory using `ctx.registry`, as the docs show, hears nothing of it."""

    def factory(ctx: WorkerContext) -> AgentRouter:
        if not own_registry:
            return make_router(ctx)
        return AgentRouter({"echo": _Long("echo")}, LexicalDecisions(), default_destination="echo",
                           telemetry=Telemetry(registry=CollectorRegistry()))

    caplog.set_level(logging.WARNING, logger="turnrouter.runtime.nats")
    async with serving(NatsConfig(url=nats_server.url, partitions=1), "r", factory):
        pass
    named = [r.getMessage() for r in caplog.records if "ctx.registry" in r.getMessage()]
    assert len(named) == (1 if own_registry else 0), named


class _Held(Destination):
    """As `_Long` for short answers, but "wait" waits for `go` (a turn that outlasts
    `idle_after`)."""

    def __init__(self) -> None:
        super().__init__("anything")
        self.waiting = asyncio.Event()
        self.go = asyncio.Event()

    async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                     ) -> DestinationResult:
        await started()
        if turn.query == "wait":
            self.waiting.set()
            await self.go.wait()
        previous = turn.history[-1].user if turn.history else "-"
        return DestinationResult(text=f"short|{previous}")


async def test_idle_participants_free_their_slot_and_keep_their_history(
        nats_server: NatsServer) -> None:
    """Sessions that end without `left` (an app closed, a front end crashed, made-up
    participants) no longer hold the router's `max_participants` for good: a participant
    with no input for `idle_after` is let go (counted), a new one takes the slot, and
    the one let go comes back with its history from its record. One whose turn runs
    past `idle_after` stays. Before, every new participant heard the failure text once
    the cap was held (redteam12 F4)."""
    config = NatsConfig(url=nats_server.url, partitions=1, idle_after=1.0)
    held = _Held()

    def factory(ctx: WorkerContext) -> AgentRouter:
        return AgentRouter({"echo": held}, LexicalDecisions(fallback_route="echo"),
                           default_destination="echo", max_participants=2,
                           telemetry=Telemetry(registry=ctx.registry))

    def value(registry: CollectorRegistry, name: str) -> float:
        return metric_value(generate_latest(registry).decode(), name)

    idle = "turnrouter_nats_idle_participants_total"
    async with serving(config, "idle", factory) as registry, \
            listening(config) as (front, heard):
        waiting = UserQuery(participant_id="kim", text="wait")
        await front.publish(waiting)
        async with asyncio.timeout(15):
            await held.waiting.wait()
        assert await answered(front, "lee", "hi") == "short|-"
        await until_true(lambda: value(registry, idle) >= 1, "lee let go")
        # kim, idle as long (its input came first) but its turn running, stays.
        assert value(registry, idle) == 1
        assert value(registry, "turnrouter_active_participants") == 1
        held.go.set()
        async with asyncio.timeout(15):
            await heard.events.setdefault(waiting.message_id, asyncio.Event()).wait()
        await until_true(lambda: value(registry, idle) >= 2, "kim let go")
        assert value(registry, "turnrouter_active_participants") == 0
        assert await answered(front, "max", "hi") == "short|-"
        assert await answered(front, "joe", "hi") == "short|-"  # two slots: both free
        await until_true(lambda: value(registry, idle) >= 4, "max and joe let go")
        assert await answered(front, "kim", "again") == "short|wait"
        assert await answered(front, "lee", "again") == "short|hi"


async def test_a_start_that_fails_at_its_last_check_leaves_no_task_running(
        nats_server: NatsServer) -> None:
    """Start-up's last check of the server (`$JS.API.INFO` on both connections, held
    back here by a proxy) fails after `reconnect_for`: `run()` raises, and the presence,
    probe, pin and partition loops it had started are ended with it (before, only a
    worker that got ready cancelled them: they ran on against closed connections)."""
    started = {"presence", "probes", "pins", "mirror", "resend", "idle", "partition 0"}
    async with proxied(nats_server.port) as proxy:
        proxy.hold(lambda subject, _payload: subject == "$JS.API.INFO")
        config = NatsConfig(url=proxy.url, partitions=1, reconnect_for=0.5)
        worker = NatsWorker(make_router, config, registry=CollectorRegistry())
        with pytest.raises(LifecycleError, match="start-up failed"):
            async with asyncio.timeout(30):
                await worker.run()
    assert not worker.ready.is_set()
    left = [task.get_name() for task in asyncio.all_tasks()
            if task.get_name() in started and not task.done()]
    assert left == []
