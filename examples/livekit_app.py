"""A LiveKit Agents app whose replies come from turnrouter, runnable offline.

    python examples/livekit_app.py            (needs `pip install -e '.[livekit,testing]'`)

A LiveKit `AgentSession` in text mode (no room, no network) takes three user messages;
a `RouterAgent` routes each one among three destinations:

- `weather`: a LiveKit LLM (a fake one here, streaming its reply word by word after a
  slow first token) wrapped in `LLMDestination`; slow enough that turnrouter says an
  acknowledgment first, as its own LiveKit speech;
- `music`: a destination of your own that says its answer with `speak()`;
- `billing`: a `HandoffDestination` that hands the session to another LiveKit agent.

Decisions come from turnrouter's lexical matcher. Telemetry is on: spans go to an
in-memory OpenTelemetry exporter (LiveKit's own spans included, so the nesting shows) and
metrics to a Prometheus registry; both are printed at the end. Exits 0 when every turn
was answered by the expected route.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

try:
    from livekit.agents import Agent, AgentSession, RunResult, llm
    from livekit.agents.llm import ChatChunk, ChoiceDelta
    from livekit.agents.telemetry import set_tracer_provider
    from livekit.agents.types import (
        DEFAULT_API_CONNECT_OPTIONS,
        NOT_GIVEN,
        APIConnectOptions,
        NotGivenOr,
    )
except ImportError as exc:  # one line, not a traceback (docs/integrations.md)
    missing = (exc.name or "?").partition(".")[0]
    sys.exit(f"examples/livekit_app.py needs the livekit extra ({missing} is missing): "
             "pip install -e '.[livekit,testing]'")

from turnrouter import (
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    RoutableAgent,
    RoutingAid,
)
from turnrouter.decisions import LexicalDecisions
from turnrouter.integrations.livekit import (
    HandoffDestination,
    LLMDestination,
    RouterAgent,
    TurnEnd,
    speak,
    stop_gracefully,
)
from turnrouter.llm import TemplateAcknowledger
from turnrouter.testing import TelemetryCapture

FIRST_TOKEN_SECONDS = 0.6        # the fake weather LLM's time to first token
ACK_DELAY_SECONDS = 0.2          # turnrouter acknowledges answers slower than this


class FakeStream(llm.LLMStream):
    """Streams the fake LLM's reply word by word after its first-token delay."""

    async def _run(self) -> None:
        await asyncio.sleep(FIRST_TOKEN_SECONDS)
        for index, word in enumerate(["Sunny,", "24", "degrees,", "no", "rain", "today."]):
            delta = ChoiceDelta(role="assistant", content=word if index == 0 else f" {word}")
            self._event_ch.send_nowait(ChatChunk(id=f"chunk-{index}", delta=delta))


class FakeWeatherLLM(llm.LLM[Any]):
    """A stand-in for any LiveKit LLM plugin (openai.LLM(), ...): no network needed."""

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
        return FakeStream(self, chat_ctx=chat_ctx, tools=tools or [],
                          conn_options=conn_options)


class Music:
    """A destination of your own: it says its answer with `speak()`, no session needed."""

    name = "music"

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("music", "plays songs, artists, albums and playlists")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        text = await speak("Playing some jazz for you.", started=started)
        return DestinationResult("answer", text)

    async def release(self, participant_id: str) -> None:
        return None


class BillingAgent(Agent):
    """The LiveKit agent the billing route hands the session to."""

    def __init__(self) -> None:
        super().__init__(instructions="You help with invoices and payments.")


async def main() -> int:
    with TelemetryCapture() as capture:
        set_tracer_provider(capture.tracer_provider)     # LiveKit's spans, same exporter
        destinations: dict[str, RoutableAgent] = {
            "weather": LLMDestination("weather", "weather forecast, rain, temperature",
                                      FakeWeatherLLM(), instructions="You forecast."),
            "music": Music(),
            "billing": HandoffDestination("billing", "invoice, payment, refund, bill",
                                          lambda turn: BillingAgent(),
                                          text="Let me pass you to billing."),
        }
        router = AgentRouter(
            destinations, LexicalDecisions({
                "weather": ["will it rain today", "what's the forecast", "is it cold"],
                "music": ["play some jazz", "put on a song", "play my playlist"],
                "billing": ["my invoice is wrong", "I was charged twice", "refund"],
            }), default_destination="weather",
            telemetry=capture.telemetry,
            acknowledgment_llm=TemplateAcknowledger(),
            acknowledgment_delay_secs=ACK_DELAY_SECONDS,
        )
        routes: list[str | None] = []

        def on_turn_end(end: TurnEnd) -> None:
            routes.append(None if end.routed is None else end.routed.route)

        session: AgentSession[Any] = AgentSession()
        await session.start(RouterAgent(router, participant_id="caller-1",
                                        on_turn_end=on_turn_end))
        for text in ("Will it rain today?", "Play some jazz", "My invoice is wrong"):
            result: RunResult[None] = await session.run(user_input=text)
            print(f"user:      {text}")
            for event in result.events:
                if event.type == "message" and event.item.role == "assistant":
                    print(f"assistant: {event.item.text_content}")
        await session.aclose()
        await stop_gracefully(router, timeout_secs=5.0)

        print("\nspans (name <- parent):")
        spans = capture.spans()
        names = {span.context.span_id: span.name for span in spans}
        for span in spans:
            if span.name.startswith(("turnrouter.", "invoke_agent")):
                parent = names.get(span.parent.span_id, "?") if span.parent else "-"
                print(f"  {span.name} <- {parent}")
        print("\nmetrics:")
        for line in capture.openmetrics().splitlines():
            if line.startswith(("turnrouter_turns_total{", "turnrouter_acknowledgments_total{")):
                print(f"  {line}")
        emitted = capture.value("turnrouter_acknowledgments_total", route="weather",
                                outcome="emitted", trigger="delay")
    expected = ["weather", "music", "billing"]
    if routes != expected or not emitted:
        print(f"unexpected: routes {routes}, acknowledgments {emitted}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
