"""The README's three destinations, served by NATS workers (docs/distributed.md, "On one
machine"): `turnrouter worker --app nats_app:make_router --app-dir examples`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from turnrouter import AgentRouter, AgentTurn, Destination, DestinationResult
from turnrouter.decisions import LexicalDecisions
from turnrouter.runtime.nats import WorkerContext
from turnrouter.telemetry import Telemetry


class Reply(Destination):
    """A destination that answers every turn with one sentence."""

    def __init__(self, description: str, reply: str) -> None:
        super().__init__(description)
        self.reply = reply

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        await started()
        # The worker publishes the result's text as the turn's final output; a
        # destination that streams or answers early says it with `ctx.answer` instead.
        return DestinationResult(text=self.reply)


def make_router(ctx: WorkerContext) -> AgentRouter:
    """Called once per worker process: the worker owns the router's lifecycle."""
    return AgentRouter(
        {"weather": Reply("weather forecast, rain, temperature", "Sunny, 24 degrees."),
         "billing": Reply("invoices, payments, refunds", "Your last invoice is paid."),
         "conversation": Reply("small talk and anything else", "Happy to chat!")},
        LexicalDecisions(fallback_route="conversation"),
        default_destination="conversation",
        telemetry=Telemetry(registry=ctx.registry))  # served on --metrics-port
