"""A router for trying a deployment: `turnrouter worker --app
turnrouter.runtime.nats.example:make_router`. One destination echoes each query through
`ctx.answer`; replace it with your own factory."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..._contracts import (
    Admission,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RoutingAid,
)
from ..._router import AgentRouter
from ..._timing import RouteTimingPredictor
from ._worker import WorkerContext

__all__ = ["make_router"]


class _Echo:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("echo", "repeats what the participant said")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        await started()
        text = f"you said: {turn.query}"
        await self._ctx.answer(turn, "echo", text)
        return DestinationResult("focus", text)

    async def release(self, participant_id: str) -> None:
        return None


class _Echoes:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision("echo")


def make_router(ctx: WorkerContext) -> AgentRouter:
    """An echo router with telemetry on the worker's registry and fleet-wide timing."""
    from ...telemetry import Telemetry

    predictor = RouteTimingPredictor()
    ctx.learn_from_fleet(predictor)
    return AgentRouter({"echo": _Echo(ctx)}, _Echoes(), default_destination="echo",
                       telemetry=Telemetry(registry=ctx.registry),
                       timing_predictor=predictor, timing_sink=ctx.timing_sink)
