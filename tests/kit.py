"""Builders shared by the router tests (not a test module)."""

from __future__ import annotations

from typing import Any

import anyio

from turnrouter import AgentRouter, AgentTurn, DestinationResult
from turnrouter.llm import LLMError, OpenAIChatClient
from turnrouter.runtime import AgentRuntime, ResponseOutput, Topic
from turnrouter.testing import OutputRecorder, RecordingObserver, ScriptedAgent, ScriptedDecisions


class Harness:
    """A router over scripted agents, with its output recorder and observer."""

    def __init__(self, *agents: ScriptedAgent, decisions: ScriptedDecisions | None = None,
                 default: str = "conversation", **kwargs: Any) -> None:
        names = [agent.name for agent in agents]
        if default not in names:
            agents = (*agents, ScriptedAgent(default))
        self.agents = {agent.name: agent for agent in agents}
        self.decisions = decisions or ScriptedDecisions(agents[0].name)
        self.output = OutputRecorder()
        self.observer = RecordingObserver()
        kwargs.setdefault("telemetry", self.observer)
        self.router = AgentRouter(self.agents, self.decisions, output=self.output,
                                  default_destination=default, **kwargs)
        self.outcomes: dict[str, DestinationResult | BaseException] = {}
        self._count = 0

    def __getitem__(self, name: str) -> ScriptedAgent:
        return self.agents[name]

    def turn(self, query: str = "hello", participant: str = "p1", **kwargs: Any) -> AgentTurn:
        self._count += 1
        return AgentTurn(participant, f"t{self._count}", query, **kwargs)

    async def say(self, query: str = "hello", participant: str = "p1",
                  **kwargs: Any) -> DestinationResult:
        return await self.router.handle(self.turn(query, participant, **kwargs))

    async def capture(self, turn: AgentTurn) -> None:
        """Run a turn and keep its result or exception (for use in task groups)."""
        try:
            self.outcomes[turn.turn_id] = await self.router.handle(turn)
        except Exception as exc:  # TurnInterrupted is a TurnrouterError too
            self.outcomes[turn.turn_id] = exc


async def publish_and_drain(router: AgentRouter, output: Topic[ResponseOutput],
                            *messages: tuple[Topic[Any], Any]) -> list[ResponseOutput]:
    """Publish `messages` to `router` through an in-process runtime, wait until every
    runtime task finished, and return what the router published on `output`."""
    outputs: list[ResponseOutput] = []

    async def collect(message: ResponseOutput) -> None:
        outputs.append(message)

    async with AgentRuntime() as runtime:
        runtime.register(router.runtime_subscriber())
        runtime.subscribe(output, collect)
        for topic, message in messages:
            await runtime.publish(topic, message)
    return outputs


def completion(client: OpenAIChatClient, prompt: str) -> str | LLMError:
    """One completion's text, or the LLMError it raised (bounded at 60 s)."""

    async def main() -> str | LLMError:
        with anyio.fail_after(60):
            try:
                return await client.complete(prompt, max_tokens=8)
            except LLMError as exc:
                return exc

    return anyio.run(main)
