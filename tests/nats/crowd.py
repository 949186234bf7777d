"""Participants talking to a worker fleet over NATS, and what they heard."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from turnrouter import AgentRouter, OverloadPolicy
from turnrouter.runtime import ResponseOutput, UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker, WorkerContext

from .app import PREAMBLE, make_router
from .conftest import settled

#: What `NatsWorker` takes to build its router.
RouterFactory = Callable[[WorkerContext], AgentRouter]

FAILURE = NatsConfig().failure_text
#: What a query hears that waited in the stream past `max_input_wait` (a loaded machine).
BUSY = OverloadPolicy().busy_text


@dataclass
class Heard:
    """Everything the output stream delivered, by turn, in stream order."""

    finals: dict[str, list[ResponseOutput]] = field(default_factory=dict)
    order: dict[str, list[str]] = field(default_factory=dict)
    events: dict[str, asyncio.Event] = field(default_factory=dict)
    at: dict[str, float] = field(default_factory=dict)
    count: int = 0
    waiters: list[tuple[int, asyncio.Event]] = field(default_factory=list)
    said: dict[str, list[ResponseOutput]] = field(default_factory=dict)
    """Every output of each participant (preambles too, every route), in order."""

    async def more(self, turns: int) -> None:
        """Until `turns` more turns ended (the caller bounds the wait)."""
        event = asyncio.Event()
        self.waiters.append((self.count + turns, event))
        await event.wait()

    def add(self, message: ResponseOutput) -> None:
        self.said.setdefault(message.participant_id, []).append(message)
        if message.route not in ("echo", "none") or message.text == PREAMBLE:
            return
        self.count += 1
        for goal, event in self.waiters:
            if goal <= self.count:
                event.set()
        self.finals.setdefault(message.request_id, []).append(message)
        self.order.setdefault(message.participant_id, []).append(message.request_id)
        self.at.setdefault(message.request_id, time.monotonic())
        self.events.setdefault(message.request_id, asyncio.Event()).set()


async def listen(front: NatsFrontEnd, heard: Heard, ready: asyncio.Event) -> None:
    """Everything the output stream delivers, into `heard` (`ready` once subscribed);
    a preamble also sets the event `started <turn id>`."""
    async for message in front.outputs(subscribed=ready):
        heard.add(message)
        if message.text == PREAMBLE:
            heard.events.setdefault(f"started {message.request_id}", asyncio.Event()).set()


@contextlib.asynccontextmanager
async def listening(target: str | NatsConfig,
                    **options: Any) -> AsyncIterator[tuple[NatsFrontEnd, Heard]]:
    """A front end on `target` (a URL, or a whole configuration; `options` go to
    `NatsFrontEnd.connect`) and everything its output stream delivered (all routes),
    listened to from before the first query; closed on exit."""
    config = NatsConfig(url=target) if isinstance(target, str) else target
    fe = await NatsFrontEnd.connect(config, **options)
    heard = Heard()
    ready = asyncio.Event()
    task = asyncio.create_task(listen(fe, heard, ready))
    try:
        async with asyncio.timeout(15):
            await ready.wait()
        yield fe, heard
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fe.close()


async def ask(front: NatsFrontEnd, heard: Heard, pid: str, text: str) -> str:
    """Publish one query; its terminal output's text (bounded wait)."""
    query = UserQuery(participant_id=pid, text=text)
    event = heard.events.setdefault(query.message_id, asyncio.Event())
    await front.publish(query)
    async with asyncio.timeout(15):
        await event.wait()
    return heard.finals[query.message_id][0].text


@dataclass
class Sent:
    participant: str
    index: int
    turn_id: str
    text: str
    at: float


class Crowd:
    """`participants` each send turns one after the other, waiting for each ending."""

    def __init__(self, front: NatsFrontEnd, participants: int, *, timeout: float = 15.0,
                 prefix: str = "u", pause: float = 0.0, quick: int = 0) -> None:
        self.front, self.timeout, self.pause = front, timeout, pause
        # The first `quick` participants are answered at once (tests/nats/app.py).
        self.pids = [f"{'q' if i < quick else prefix}{i}" for i in range(participants)]
        self.heard = Heard()
        self.sent: dict[str, list[Sent]] = {pid: [] for pid in self.pids}
        self.unanswered: list[Sent] = []
        self.published: dict[str, set[str]] = {}
        self._stop = asyncio.Event()

    async def listen(self, ready: asyncio.Event) -> None:
        # Every publish, duplicates included (a plain subscription, before the stream's
        # deduplication): a turn must never be ended with two different texts.
        async def raw(msg: Any) -> None:
            message = ResponseOutput.model_validate_json(msg.data)
            if message.route in ("echo", "none") and message.text != PREAMBLE:
                self.published.setdefault(message.request_id, set()).add(message.text)

        await self.front.connection.subscribe("turnrouter.out.*", cb=raw)
        await settled(self.front.connection)  # the server has the subscription now
        async for message in self.front.outputs(subscribed=ready):
            self.heard.add(message)

    async def talk(self, pid: str, turns: int | None) -> None:
        index = 0
        while (turns is None and not self._stop.is_set()) or (
                turns is not None and index < turns):
            query = UserQuery(participant_id=pid, text=f"{pid}#{index}")
            event = self.heard.events.setdefault(query.message_id, asyncio.Event())
            sent = Sent(pid, index, query.message_id, query.text, time.monotonic())
            self.sent[pid].append(sent)
            await self.front.publish(query)
            try:
                await asyncio.wait_for(event.wait(), self.timeout)
            except TimeoutError:
                self.unanswered.append(sent)
            index += 1
            if self.pause:  # pacing of the load, not a wait for async work
                await asyncio.sleep(self.pause)

    def stop(self) -> None:
        self._stop.set()

    def check(self, gap_bound: float) -> dict[str, float]:
        """Assert: nothing lost, nothing answered twice, order, history, focus, gap."""
        # A turn not answered within the talk timeout may still have ended since (late,
        # not lost: the gap bound below judges lateness).
        lost = [s for s in self.unanswered if s.turn_id not in self.heard.finals]
        assert not lost, f"lost turns: {lost[:5]}"
        worst, failures, busy, answers = 0.0, 0, 0, 0
        for pid, sent in self.sent.items():
            turn_ids = [s.turn_id for s in sent]
            assert self.heard.order.get(pid, []) == turn_ids, f"order of {pid}"
            previous_answered = "-"
            answered_before = False
            for s in sent:
                finals = self.heard.finals[s.turn_id]
                assert len(finals) == 1, f"{s.turn_id} ended {len(finals)} times"
                texts = self.published.get(s.turn_id, set())
                assert len(texts) == 1, f"{s.turn_id} was ended with {texts} (published)"
                worst = max(worst, self.heard.at[s.turn_id] - s.at)
                final = finals[0]
                if final.route == "none":
                    assert final.text in (FAILURE, BUSY)
                    failures += final.text == FAILURE
                    busy += final.text == BUSY
                    continue
                answers += 1
                text, previous, flag = final.text.split("|")
                assert text == s.text
                assert previous == previous_answered, (
                    f"{pid} turn {s.index}: history ends with {previous!r}, "
                    f"expected {previous_answered!r}")
                assert flag == ("F" if answered_before else "N"), f"focus of {pid}"
                previous_answered, answered_before = s.text, True
        assert worst <= gap_bound, f"a turn waited {worst:.2f} s"
        return {"worst": worst, "failures": failures, "busy": busy, "answers": answers}


@contextlib.asynccontextmanager
async def running(worker: NatsWorker) -> AsyncIterator[NatsWorker]:
    """`worker` running in this process once ready (15 s at most) until the block ends,
    then stopped gracefully (bounded: 30 s; it drains and hands its partitions over)."""
    run = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        yield worker
    finally:
        worker.request_stop()
        if not worker.ready.is_set():
            run.cancel()  # a start that did not finish: nothing to drain
        async with asyncio.timeout(30):
            await asyncio.gather(run, return_exceptions=True)
    if not run.cancelled() and run.exception() is not None:
        raise AssertionError("the worker failed") from run.exception()


@contextlib.asynccontextmanager
async def serving(config: NatsConfig, replica: str, factory: RouterFactory = make_router
                  ) -> AsyncIterator[CollectorRegistry]:
    """One in-process worker of `factory`'s router on `config` until the block ends
    (then a graceful stop); its metrics' registry."""
    registry = CollectorRegistry()
    async with running(NatsWorker(factory, config, registry=registry, replica=replica)):
        yield registry
