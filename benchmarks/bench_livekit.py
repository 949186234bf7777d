"""What routing through `RouterAgent` adds to a LiveKit turn (text mode, no network).

    python benchmarks/bench_livekit.py [turns_per_round] [rounds]

Same user messages, same fake LLM streaming the same reply: a plain LiveKit `Agent`
answering with it, and a `RouterAgent` whose one route is an `LLMDestination` around it
(telemetry off, then on with the SDK recording in memory). Rounds are interleaved and the
median per-turn time of each is reported with its ratio to the plain agent. The machine
is noisy: compare ratios from one run. Results: docs/integrations.md.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

from livekit.agents import Agent, AgentSession, llm
from livekit.agents.llm import ChatChunk, ChoiceDelta
from livekit.agents.types import (
    DEFAULT_API_CONNECT_OPTIONS,
    NOT_GIVEN,
    APIConnectOptions,
    NotGivenOr,
)

from turnrouter import AgentRouter, RouterObserver
from turnrouter.integrations.livekit import LLMDestination, RouterAgent
from turnrouter.telemetry import Telemetry
from turnrouter.testing import ScriptedDecisions, TelemetryCapture

REPLY = "Sunny, 24 degrees, no rain today."


class _Stream(llm.LLMStream):
    async def _run(self) -> None:
        for index, word in enumerate(REPLY.split(" ")):
            self._event_ch.send_nowait(ChatChunk(id=str(index), delta=ChoiceDelta(
                role="assistant", content=word if index == 0 else f" {word}")))


class InstantLLM(llm.LLM[Any]):
    """Streams `REPLY` at once."""

    def chat(
        self,
        *,
        chat_ctx: llm.ChatContext,
        tools: list[llm.Tool] | None = None,
        conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
        parallel_tool_calls: NotGivenOr[bool] = NOT_GIVEN,
        tool_choice: NotGivenOr[llm.ToolChoice] = NOT_GIVEN,
        extra_kwargs: NotGivenOr[dict[str, Any]] = NOT_GIVEN,
    ) -> llm.LLMStream:
        return _Stream(self, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options)


def _routed(telemetry: RouterObserver) -> RouterAgent:
    router = AgentRouter(
        {"weather": LLMDestination("weather", "forecast", InstantLLM(), instructions="x")},
        ScriptedDecisions("weather"), telemetry=telemetry, context_budget_bytes=512)
    return RouterAgent(router, participant_id="bench", depart_on_close=False)


async def _per_turn(session: AgentSession[Any], turns: int) -> float:
    start = time.perf_counter()
    for index in range(turns):
        await session.run(user_input=f"will it rain {index}?")
    return (time.perf_counter() - start) / turns


async def main(turns: int, rounds: int) -> None:
    with TelemetryCapture() as capture:
        agents: dict[str, Agent] = {
            "plain LiveKit agent": Agent(instructions="x", llm=InstantLLM()),
            "RouterAgent, telemetry off": _routed(Telemetry.disabled()),
            "RouterAgent, telemetry on": _routed(capture.telemetry),
        }
        sessions: dict[str, AgentSession[Any]] = {}
        for name, agent in agents.items():
            sessions[name] = AgentSession()
            await sessions[name].start(agent)
            await _per_turn(sessions[name], 20)                    # warm up
        samples: dict[str, list[float]] = {name: [] for name in agents}
        for _ in range(rounds):
            for name, session in sessions.items():
                samples[name].append(await _per_turn(session, turns))
        for session in sessions.values():
            await session.aclose()
    base = statistics.median(samples["plain LiveKit agent"])
    print(f"{turns} turns x {rounds} interleaved rounds, median per turn:")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"  {name:28} {median * 1e3:7.2f} ms  {median / base:5.2f}x")


if __name__ == "__main__":
    args = [int(arg) for arg in sys.argv[1:3]]
    asyncio.run(main(*(args + [100, 5][len(args):])))
