"""turnrouter inside a Pipecat pipeline, offline: fake STT and TTS, three destinations.

    pip install -e '.[pipecat,demo]' && python examples/pipecat_app.py

The pipeline is a stock Pipecat one with the processor added before the LLM:
`fake STT -> user aggregator -> TurnRouterProcessor -> LLM -> its speaker -> fake TTS`.
A scripted caller asks three questions: the weather agent answers at once, the research
agent takes 1.5 s (so the router speaks an acknowledgment first), and small talk goes to
the (fake, streaming) Pipecat LLM service downstream.
Telemetry is on: spans (nested under Pipecat's own turn spans) and Prometheus metrics are
recorded in memory and summarised at the end. Exits 0 when every turn went where
expected.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from datetime import UTC, datetime
from typing import Any

try:
    with warnings.catch_warnings():  # pipecat imports the deprecated audioop on 3.11-3.12
        warnings.simplefilter("ignore", DeprecationWarning)
        from loguru import logger
        from opentelemetry import trace
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from pipecat.frames.frames import (
            BotStartedSpeakingFrame,
            BotStoppedSpeakingFrame,
            EndFrame,
            Frame,
            InputTextRawFrame,
            LLMContextFrame,
            LLMFullResponseEndFrame,
            LLMFullResponseStartFrame,
            LLMTextFrame,
            ProposedUserStartedSpeakingFrame,
            ProposedUserStoppedSpeakingFrame,
            TranscriptionFrame,
            TTSAudioRawFrame,
            TTSSpeakFrame,
        )
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.worker import PipelineWorker
        from pipecat.processors.aggregators.llm_context import LLMContext
        from pipecat.processors.aggregators.llm_response_universal import (
            LLMUserAggregator,
            LLMUserAggregatorParams,
        )
        from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
        from pipecat.services.llm_service import LLMService
        from pipecat.services.settings import LLMSettings
        from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
        from pipecat.workers.runner import WorkerRunner
        from prometheus_client import CollectorRegistry
except ImportError as exc:  # one line, not a traceback (docs/integrations.md)
    missing = (exc.name or "?").partition(".")[0]
    sys.exit(f"examples/pipecat_app.py needs the pipecat extra ({missing} is missing): "
             "pip install -e '.[pipecat,demo]'")

from turnrouter import AgentRouter, AgentTurn, RoutedResult
from turnrouter.decisions import LexicalDecisions
from turnrouter.integrations.pipecat import (
    FrameAgent,
    FrameOutput,
    PipecatLLMDestination,
    TurnRouterProcessor,
)
from turnrouter.telemetry import Telemetry

CALLER = [
    ("will it rain in Paris tomorrow?", "weather"),
    ("research the history of the Eiffel tower for me", "research"),
    ("thanks, how are you today?", "conversation"),
]


# -- fake speech services -------------------------------------------------------------

class FakeSTT(FrameProcessor):
    """Typed text in, final transcriptions out, framed by the user-speaking frames an
    STT with its own turn detection proposes (the user aggregator decides the turn)."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, InputTextRawFrame):
            print(f"caller: {frame.text}")
            await self.push_frame(ProposedUserStartedSpeakingFrame())
            await self.push_frame(TranscriptionFrame(
                frame.text, "caller", datetime.now(UTC).isoformat()))
            await self.push_frame(ProposedUserStoppedSpeakingFrame())
        else:
            await self.push_frame(frame, direction)


class FakeTTSOutput(FrameProcessor):
    """Speech out: 150 ms to the first audio, then BotStarted/StoppedSpeaking broadcast
    the way Pipecat's output transport does (turnrouter measures silence to it). Speaks
    TTSSpeakFrames and streamed LLM responses."""

    def __init__(self) -> None:
        super().__init__()
        self.spoken: list[str] = []
        self.changed = asyncio.Event()
        self._stream: list[str] | None = None

    async def _start_speaking(self) -> None:
        await asyncio.sleep(0.15)
        await self.broadcast_frame(BotStartedSpeakingFrame)
        await self.push_frame(TTSAudioRawFrame(b"\0\0" * 160, 16000, 1))

    async def _stop_speaking(self, text: str) -> None:
        print(f"  bot: {text}")
        await self.broadcast_frame(BotStoppedSpeakingFrame)
        self.spoken.append(text)
        self.changed.set()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSSpeakFrame):
            await self._start_speaking()
            await self._stop_speaking(frame.text)
        elif isinstance(frame, LLMFullResponseStartFrame):
            self._stream = []
        elif isinstance(frame, LLMTextFrame) and self._stream is not None:
            if not self._stream:
                await self._start_speaking()
            self._stream.append(frame.text)
        elif isinstance(frame, LLMFullResponseEndFrame) and self._stream is not None:
            text, self._stream = "".join(self._stream).strip(), None
            if text:
                await self._stop_speaking(text)
        await self.push_frame(frame, direction)


# -- destinations -----------------------------------------------------------------------

class Weather(FrameAgent):
    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        text = "Light rain in Paris tomorrow, 14 degrees."
        await output.say(text)
        return text


class Research(FrameAgent):
    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        await asyncio.sleep(1.5)  # a slow search: the router acknowledges meanwhile
        text = "The Eiffel tower opened in 1889 for the World's Fair."
        await output.say(text)
        return text


class CannedStreamingLLM(LLMService):
    """A Pipecat LLM service streaming a canned reply, without a network. Its system
    prompt is on the service (`system_instruction`), where Pipecat wants it."""

    def __init__(self, system_instruction: str) -> None:
        settings: dict[str, Any] = dict.fromkeys((
            "model", "temperature", "max_tokens", "top_p", "top_k", "frequency_penalty",
            "presence_penalty", "seed", "filter_incomplete_user_turns",
            "user_turn_completion_config"))
        super().__init__(settings=LLMSettings(system_instruction=system_instruction,
                                              **settings))

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        await self.push_frame(LLMFullResponseStartFrame())
        for token in ("I'm doing well,", " thanks", " for asking!"):
            await asyncio.sleep(0.05)
            await self.push_frame(LLMTextFrame(token))
        await self.push_frame(LLMFullResponseEndFrame())


class CannedAcknowledgments:
    """turnrouter's acknowledgment LLM (an `LLMService`: async complete())."""

    async def complete(self, prompt: str, *, max_tokens: int, reasoning: bool = False) -> str:
        return "Let me look into that."


# -- the app ----------------------------------------------------------------------------

def tree(spans: list[ReadableSpan], root: ReadableSpan, depth: int = 0) -> list[str]:
    lines = ["  " * depth + root.name]
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        if span.parent is not None and span.parent.span_id == root.context.span_id:
            lines += tree(spans, span, depth + 1)
    return lines


async def main() -> int:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # the app's choice; Pipecat traces through it
    registry = CollectorRegistry()
    llm = CannedStreamingLLM("You are a friendly assistant.")

    router = AgentRouter(
        {
            "weather": Weather("weather", "weather forecasts, rain, temperature"),
            "research": Research("research", "research a topic, history, facts, reports"),
            "conversation": PipecatLLMDestination(
                llm, "conversation", "small talk, greetings, thanks", in_pipeline=True),
        },
        LexicalDecisions({
            "weather": ["will it rain", "what is the temperature", "weather forecast"],
            "research": ["research this topic", "find the history of", "look up facts"],
            "conversation": ["how are you", "thanks", "hello there"],
        }),
        acknowledgment_llm=CannedAcknowledgments(), acknowledgment_delay_secs=0.5,
        telemetry=Telemetry(tracer_provider=provider, registry=registry),
    )
    processor = TurnRouterProcessor(router)
    routed: list[RoutedResult] = []

    async def on_turn_routed(proc: Any, turn: AgentTurn, result: RoutedResult) -> None:
        print(f"  (answered by {result.route})")
        routed.append(result)

    processor.add_event_handler("on_turn_routed", on_turn_routed)

    speech = FakeTTSOutput()
    context = LLMContext()  # the system prompt is the LLM service's system_instruction
    user_aggregator = LLMUserAggregator(context, params=LLMUserAggregatorParams(
        user_turn_strategies=ExternalUserTurnStrategies()))
    worker = PipelineWorker(
        Pipeline([FakeSTT(), user_aggregator, processor, llm, processor.speaker, speech]),
        enable_tracing=True, cancel_on_idle_timeout=False)

    async def answered(count: int) -> None:
        """Until `count` turns were routed and the last answer was spoken."""
        while len(routed) < count or routed[-1].result.text not in speech.spoken:
            speech.changed.clear()
            await speech.changed.wait()

    async def caller() -> None:
        for count, (text, _) in enumerate(CALLER, 1):
            await worker.queue_frame(InputTextRawFrame(text))
            await asyncio.wait_for(answered(count), 10)  # the caller listens, then asks
        await worker.queue_frame(EndFrame())  # drains the router, then stops it

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.wait_for(asyncio.gather(runner.run(), caller()), 60)

    print("\nmetrics:")
    for route in ("weather", "research", "conversation"):
        turns = registry.get_sample_value(
            "turnrouter_turns_total", {"route": route, "outcome": "answer"})
        silence = registry.get_sample_value("turnrouter_silence_seconds_sum", {"route": route})
        print(f"  {route:<13} turns={turns or 0:.0f} silence={silence or 0:.2f}s")
    acks = registry.get_sample_value("turnrouter_acknowledgments_total", {
        "route": "research", "outcome": "emitted", "trigger": "delay"})
    print(f"  acknowledgments emitted before research answers: {acks or 0:.0f}")

    spans = list(exporter.get_finished_spans())
    print("\none Pipecat turn with turnrouter's spans under it:")
    for span in spans:
        names = tree(spans, span)
        if span.name == "turn" and any("invoke_agent research" in n for n in names):
            print("\n".join("  " + line for line in names))
            break

    expected = [route for _, route in CALLER]
    routes = [result.route for result in routed]
    ok = routes == expected and acks == 1
    print("\nok" if ok else f"\nunexpected: routed {routes}, expected {expected}; acks {acks}")
    return 0 if ok else 1


if __name__ == "__main__":
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    sys.exit(asyncio.run(main()))
