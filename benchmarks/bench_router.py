"""Router overhead: AgentRouter.handle() against a minimal hand-written routing loop.

Both drive the same instant fake agents and decision service, in one process and one
run, so the ratio is meaningful on a noisy machine. Also measures router state per
participant after one short turn.

    .venv/bin/python benchmarks/bench_router.py [--turns N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RoutingAid,
)
from turnrouter.telemetry import Telemetry

_ACCEPT = Admission("accept")
_RESULT = DestinationResult("answer", "done")


class InstantAgent:
    def __init__(self, name: str) -> None:
        self.aid = RoutingAid(name, f"{name} requests")

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return self.aid

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return _ACCEPT

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        await started()
        return _RESULT

    async def release(self, participant_id: str) -> None:
        return None


class FirstCandidate:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision(request.candidates[0].name)


async def _noop_output(turn: AgentTurn, route: str, text: str) -> None:
    return None


async def _started() -> None:
    return None


async def minimal_loop(agents: dict[str, InstantAgent], decisions: FirstCandidate,
                       turns: list[AgentTurn]) -> None:
    """The least a router must do: decide, admit, answer, remember the exchange."""
    history: dict[str, list[tuple[str, str]]] = {}
    for turn in turns:
        candidates = tuple(agent.routing_aid(turn.participant_id) for agent in agents.values())
        request = RouteRequest(turn, candidates)
        decision = await decisions.decide(request)
        agent = agents[decision.choice]
        admission = await agent.admit(turn, focused=False)
        if admission.disposition == "accept":
            result = await agent.answer(turn, started=_started)
            history.setdefault(turn.participant_id, []).append((turn.query, result.text))


async def router_loop(router: AgentRouter, turns: list[AgentTurn]) -> None:
    for turn in turns:
        await router.handle(turn)


def _turns(n: int, participants: int) -> list[AgentTurn]:
    return [AgentTurn(f"p{i % participants}", f"t{i}", "what's the weather") for i in range(n)]


async def measure(n: int, repeats: int) -> dict[str, float]:
    agents = {name: InstantAgent(name) for name in ("weather", "calendar", "conversation")}
    decisions = FirstCandidate()
    turns = _turns(n, 100)
    results: dict[str, list[float]] = {"minimal": [], "router": []}
    for _ in range(repeats):
        router = AgentRouter(agents, decisions, output=_noop_output,
                             telemetry=Telemetry.disabled())
        start = time.perf_counter()
        await minimal_loop(agents, decisions, turns)
        results["minimal"].append(time.perf_counter() - start)
        start = time.perf_counter()
        await router_loop(router, turns)
        results["router"].append(time.perf_counter() - start)
    return {key: statistics.median(values) / n * 1e6 for key, values in results.items()}


async def state_per_participant(participants: int) -> float:
    agents = {name: InstantAgent(name) for name in ("weather", "calendar", "conversation")}
    router = AgentRouter(agents, FirstCandidate(), output=_noop_output,
                         telemetry=Telemetry.disabled())
    turns = [AgentTurn(f"participant-{i}", f"t{i}", "what's the weather") for i in
             range(participants)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    await router_loop(router, turns)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    # The turn objects are the caller's; count only what the router retains.
    return grown / participants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    figures = asyncio.run(measure(args.turns, args.repeats))
    ratio = figures["router"] / figures["minimal"]
    print(f"minimal loop      {figures['minimal']:7.2f} µs/turn")
    print(f"AgentRouter       {figures['router']:7.2f} µs/turn (telemetry disabled)")
    print(f"ratio             {ratio:7.2f}x  (goal <= 4x)")
    per_participant = asyncio.run(state_per_participant(5000))
    print(f"router state      {per_participant:7.0f} bytes/participant after one turn "
          "(goal <= 2048)")


if __name__ == "__main__":
    main()
