"""Exactly one final output per turn over NATS, whoever ends it: a destination that
answers through `ctx.answer`, one written for the in-process router (its result's text
is the answer), a destination's clarification and the router's own clarification."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    Destination,
    DestinationResult,
    RouteDecision,
    RouteRequest,
)
from turnrouter.runtime import ResponseOutput, UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, NatsWorker, WorkerContext
from turnrouter.telemetry import Telemetry

from .conftest import NatsServer

pytestmark = pytest.mark.anyio

Started = Callable[[], Awaitable[None]]


class Plain(Destination):
    """Written for the in-process router: returns its answer, never calls ctx.answer.
    Its answer quotes the history it was given, so a test sees what was recorded."""

    description = "weather"

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        await started()
        said = [exchange.assistant for exchange in turn.history]
        return DestinationResult(text=f"sunny ({len(said)}: {' / '.join(said)})")


class Silent(Destination):
    """Answers with no text at all, and never calls ctx.answer."""

    description = "nothing to say"

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        return DestinationResult()


class Asks(Destination):
    """Asks which card before answering anything."""

    description = "cards"

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("clarify", text="Which card?")

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        raise AssertionError("never admitted")


class Spoken(Destination):
    """Answers through ctx.answer, with a preamble said first."""

    description = "news"

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__()
        self._ctx = ctx

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept", preamble="Checking the news.")

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        await started()
        await self._ctx.answer(turn, "news", "all quiet")
        return DestinationResult(text="all quiet")


class ByFirstWord:
    """Routes to the route named by the query's first word ('unsure': clarify)."""

    async def decide(self, request: RouteRequest) -> RouteDecision:
        word = request.turn.query.split()[0]
        names = {aid.name for aid in request.candidates}
        return RouteDecision(word if word in names else "clarify")


def make_router(ctx: WorkerContext) -> AgentRouter:
    return AgentRouter(
        {"weather": Plain(), "silent": Silent(), "cards": Asks(), "news": Spoken(ctx)},
        ByFirstWord(), default_destination="weather",
        telemetry=Telemetry(registry=ctx.registry))


async def test_every_turn_ends_once_whoever_ends_it(nats_server: NatsServer) -> None:
    config = NatsConfig(url=nats_server.url)
    worker = NatsWorker(make_router, config, registry=CollectorRegistry(), replica="end")
    run = asyncio.create_task(worker.run())
    front: NatsFrontEnd | None = None
    try:
        async with asyncio.timeout(15):
            await worker.ready.wait()
        front = await NatsFrontEnd.connect(config)
        outputs = front.outputs(deliver_new=False)
        heard: dict[str, list[ResponseOutput]] = {}

        async def say(text: str) -> list[ResponseOutput]:
            """Everything said for one query, up to its final output (bounded)."""
            assert front is not None
            query = UserQuery(participant_id="amy", text=text)
            await front.publish(query)
            async with asyncio.timeout(15):
                async for message in outputs:
                    heard.setdefault(message.request_id, []).append(message)
                    if message.request_id == query.message_id and message.final:
                        return heard[query.message_id]
            raise AssertionError("the output stream ended")

        plain = await say("weather today?")
        assert [(o.route, o.text, o.final) for o in plain] == [
            ("weather", "sunny (0: )", True)]
        # The router's own clarification ends the turn: said once, as its final output.
        unsure = await say("unsure what to ask")
        assert [(o.route, o.final) for o in unsure] == [("clarify", True)]
        asked = await say("cards please")
        assert [(o.route, o.text, o.final) for o in asked] == [("cards", "Which card?", True)]
        spoken = await say("news now")
        assert [(o.text, o.final) for o in spoken] == [
            ("Checking the news.", False), ("all quiet", True)]
        silent = await say("silent one")
        assert [(o.route, o.text, o.final) for o in silent] == [("silent", "", True)]
        # What was published is what the history holds, in order.
        again = await say("weather again?")
        assert again[-1].text == "sunny (3: sunny (0: ) / all quiet / )"
        # Nothing was said for a turn after its final output (the worker runs a
        # participant's turns in order, so a stray would have come before the last one's).
        for said in heard.values():
            assert [o.final for o in said].count(True) == 1
            assert said[-1].final
        await outputs.aclose()
    finally:
        if front is not None:
            await front.close()
        worker.request_stop()
        async with asyncio.timeout(20):
            await run
