"""The Pipecat adapter against what the user heard: a real `TTSService` subclass making
audio on a controlled clock, a real output transport playing it in (clock) real time,
and calls sharing one router."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import pytest

with warnings.catch_warnings():  # pipecat imports the deprecated audioop on 3.11-3.12
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import (
        EndFrame,
        Frame,
        FunctionCallFromLLM,
        LLMContextFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        ProposedUserStartedSpeakingFrame,
        ProposedUserStoppedSpeakingFrame,
        TranscriptionFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import (
        LLMAssistantAggregator,
        LLMUserAggregator,
        LLMUserAggregatorParams,
    )
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.llm_service import FunctionCallParams, LLMService
    from pipecat.services.settings import LLMSettings
    from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies

from turnrouter import AgentRouter, AgentTurn, OverloadPolicy, RoutedResult
from turnrouter.events import Heard
from turnrouter.integrations.pipecat import (
    FrameAgent,
    FrameOutput,
    PipecatLLMDestination,
    TurnRouterProcessor,
)
from turnrouter.telemetry import Telemetry
from turnrouter.testing import (
    ManualClock,
    RecordingObserver,
    ScriptedDecisions,
    ScriptedLLM,
    TelemetryCapture,
)

from .pipecat_kit import Agent, ClockTTS, Pipe, PlayingOutput, end_on_clock, run_clock

_LLM_SETTINGS = ("model", "system_instruction", "temperature", "max_tokens", "top_p", "top_k",
                 "frequency_penalty", "presence_penalty", "seed", "filter_incomplete_user_turns",
                 "user_turn_completion_config")

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def said(text: str, user: str = "") -> TranscriptionFrame:
    return TranscriptionFrame(text, user, "2026-12-01T08:00:00+00:00")


def measured(observer: RecordingObserver) -> tuple[Any, Any]:
    """(first response, silence) of the one turn recorded."""
    (turn_id,) = observer.turns
    (heard,) = [event for event in observer.events if event[0] == "heard"]
    silences = [event[2] for event in observer.turns[turn_id] if event[0] == "silence"]
    silence = heard[3] if heard[3] is not None else silences[0]
    return heard[2], silence


def voice(agent: FrameAgent, clock: ManualClock, **kwargs: Any) -> tuple[
        AgentRouter, RecordingObserver]:
    observer = RecordingObserver()
    name = agent.routing_aid("x").name
    router = AgentRouter({name: agent}, ScriptedDecisions(name), clock=clock,
                         telemetry=observer, **kwargs)
    return router, observer


async def test_acknowledged_turn_silence_is_the_acknowledgments_audio() -> None:
    """The acknowledgment pushed at 0.5 s is heard at 0.7 s (the TTS's first byte); the
    answer pushed at 1.0 s is heard at 1.2 s: silence ends at the acknowledgment's
    audio, the first response is the answer's own audio, not its neighbour's."""
    clock = ManualClock()
    agent = Agent("research", "Here is the report.", clock=clock, delay=1.0)
    router, observer = voice(agent, clock, acknowledgment_delay_secs=0.5,
                             acknowledgment_llm=ScriptedLLM("One moment."))
    tts, out = ClockTTS(clock, ttfb=0.2), PlayingOutput(clock)
    async with Pipe(TurnRouterProcessor(router), tts, out) as pipe:
        await pipe.send(said("research this"))
        with anyio.fail_after(20):
            await run_clock(clock, lambda: len(out.played) == 2)
        await end_on_clock(pipe, clock)
    ack, answer = out.played[tts.tag("One moment.")], out.played[tts.tag("Here is the report.")]
    assert ack == pytest.approx(0.7) and answer == pytest.approx(1.2)
    assert measured(observer) == (pytest.approx(answer), pytest.approx(ack))


async def test_fast_turn_is_measured_to_its_audio() -> None:
    """No acknowledgment: first response and silence both end at the answer's audio."""
    clock = ManualClock()
    agent = Agent("weather", "Sunny.", clock=clock, delay=0.1)
    router, observer = voice(agent, clock, acknowledgment_delay_secs=0.5,
                             acknowledgment_llm=ScriptedLLM("One moment."))
    tts, out = ClockTTS(clock, ttfb=0.3), PlayingOutput(clock)
    async with Pipe(TurnRouterProcessor(router), tts, out) as pipe:
        await pipe.send(said("rain?"))
        with anyio.fail_after(20):
            await run_clock(clock, lambda: bool(out.played))
        await end_on_clock(pipe, clock)
    heard_at = out.played[tts.tag("Sunny.")]
    assert heard_at == pytest.approx(0.4)
    assert measured(observer) == (pytest.approx(heard_at), pytest.approx(heard_at))


@pytest.mark.parametrize("nested", [False, True])
async def test_last_turn_of_the_call_is_measured_to_its_audio(nested: bool) -> None:
    """EndFrame right after the answer went out: the router stops only once the answer
    was heard, so the call's last turn is measured to its audio, not to started(). Also
    with the processor in a pipeline of its own, the output transport after it (it cannot
    see the output by walking its links), before the call's first audio: before, the end
    did not wait for a call that had played no audio yet, and the router recorded both
    at the text's push (0 s; newcomer20 F1)."""
    clock = ManualClock()
    agent = Agent("weather", "Sunny.")
    router, observer = voice(agent, clock)
    tts, out = ClockTTS(clock, ttfb=0.6), PlayingOutput(clock)
    processor = TurnRouterProcessor(router)
    async with Pipe(Pipeline([processor]) if nested else processor, tts, out) as pipe:
        await pipe.send(said("rain?"))
        with anyio.fail_after(10):
            await agent.pushed_first.wait()
        await end_on_clock(pipe, clock)
    assert out.played[tts.tag("Sunny.")] == pytest.approx(0.6)
    assert measured(observer) == (pytest.approx(0.6), pytest.approx(0.6))
    assert [pid[:5] for pid in agent.released] == ["call-"]  # the router stopped after


@pytest.mark.parametrize("nested", [False, True])
async def test_a_call_ending_before_late_audio_records_a_lower_bound(nested: bool) -> None:
    """EndFrame with the answer's audio still to come past `end_timeout_secs`: nothing
    was heard, so the first response is a lower bound when the end gave up, no silence
    is recorded, and the audio is not played after. Before, stopping the router recorded
    both at the text's push (0 s here) for a call that ended before its audio (voice13);
    and with the processor in a pipeline of its own (it cannot see the output by walking
    its links), the end did not wait at all (newcomer20 F1: 0.016 s recorded, the audio
    played 5 s later)."""

    class Watch(RecordingObserver):
        def __init__(self) -> None:
            super().__init__()
            self.measured = anyio.Event()

        def heard(self, event: Heard) -> None:
            super().heard(event)
            self.measured.set()

    clock = ManualClock()
    agent = Agent("weather", "Sunny.")
    observer = Watch()
    router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"), clock=clock,
                         telemetry=observer)
    tts, out = ClockTTS(clock, ttfb=2.0), PlayingOutput(clock)
    processor = TurnRouterProcessor(router, end_timeout_secs=0.05)
    async with Pipe(Pipeline([processor]) if nested else processor, tts, out) as pipe:
        await pipe.send(said("rain?"))
        with anyio.fail_after(10):
            await agent.pushed_first.wait()
            await clock.wait_for_sleepers(1)  # the TTS, on its way to the first audio
        clock.advance(1.0)
        await pipe.worker.queue_frame(EndFrame())
        with anyio.fail_after(10):  # the end gives up on the audio (real time)
            await observer.measured.wait()
        await end_on_clock(pipe, clock, send=False)
    assert [event for event in observer.events if event[0].startswith("heard")] == [
        ("heard_interrupted", "weather", pytest.approx(1.0))]
    assert not [event for event in observer.turns[next(iter(observer.turns))]
                if event[0] == "silence"]
    # Nor heard later: the speech still queued was dropped when the end gave up on it
    # (it played after the end had measured it unheard: voice17 F9).
    assert out.played == {}


async def test_a_call_with_no_output_ends_at_once_measured_at_started() -> None:
    """No output at all (a text pipeline): the end-of-call flush reaches the end of the
    pipeline with nothing heard, so the end does not wait `end_timeout_secs` for audio
    that will never come, and the turn falls back to `started()`."""
    clock = ManualClock()
    agent = Agent("weather", "Sunny.", clock=clock, delay=0.25)
    router, observer = voice(agent, clock)
    async with Pipe(Pipeline([TurnRouterProcessor(router)])) as pipe:
        await pipe.send(said("rain?"))
        with anyio.fail_after(10):
            await run_clock(clock, agent.pushed_first.is_set)
        rest = await pipe.end()  # bounded: the end does not wait 30 s
    assert any(isinstance(frame, EndFrame) for frame in rest)
    assert measured(observer) == (pytest.approx(0.25), pytest.approx(0.25))


class Remembering(FrameAgent):
    """Says a fixed answer and remembers the history each turn came with."""

    def __init__(self, gate: anyio.Event | None = None) -> None:
        super().__init__("conversation", "anything")
        self.histories: list[tuple[str, tuple[str, ...]]] = []
        self.gate = gate
        self.entered = anyio.Event()
        self.cancelled = 0
        self.released: set[str] = set()
        self.release_seen = anyio.Event()

    async def release(self, participant_id: str) -> None:
        self.released.add(participant_id)
        self.release_seen.set()

    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        self.histories.append((turn.query, tuple(e.user for e in turn.history)))
        self.entered.set()
        if self.gate is not None and turn.query.startswith("A"):
            try:
                await self.gate.wait()
            except BaseException:
                self.cancelled += 1
                raise
        await output.say(f"re: {turn.query}")
        return f"re: {turn.query}"


async def test_two_calls_on_one_router_never_share_a_participant() -> None:
    """Two pipelines (two calls) on one router, no participant_id given: call B's turn
    does not cancel call A's, and neither call sees the other's exchanges."""
    gate = anyio.Event()
    agent = Remembering(gate)
    router = AgentRouter({"conversation": agent}, ScriptedDecisions("conversation"),
                         telemetry=Telemetry.disabled())
    call_a = TurnRouterProcessor(router, owns_router=False)
    call_b = TurnRouterProcessor(router, owns_router=False)
    assert call_a.participant_id != call_b.participant_id
    routed: list[RoutedResult] = []
    both = anyio.Event()

    @call_b.event_handler("on_turn_routed")
    async def _routed(proc: Any, turn: AgentTurn, result: RoutedResult) -> None:
        routed.append(result)
        if len(routed) == 2:
            both.set()

    async with Pipe(call_a) as a, Pipe(call_b) as b:
        await a.send(said("A: my account number is 1234"))
        with anyio.fail_after(10):
            await agent.entered.wait()
        await b.send(said("B: hello"), said("B: what did I say?"))
        with anyio.fail_after(10):
            await both.wait()
        gate.set()
        await a.end()
        await b.end()
    assert agent.cancelled == 0
    assert ("B: what did I say?", ("B: hello",)) in agent.histories
    assert all("A:" not in user for query, users in agent.histories if query.startswith("B")
               for user in users)


class Streaming(FrameAgent):
    """Streams its answer as an LLM service does: the response start at once, the text
    `delay` clock seconds later."""

    def __init__(self, clock: ManualClock, delay: float) -> None:
        super().__init__("research", "reports")
        self.clock = clock
        self.delay = delay

    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        await output.push(LLMFullResponseStartFrame())
        await self.clock.sleep(self.delay)
        await output.push(LLMTextFrame("Here it is."))
        await output.push(LLMFullResponseEndFrame())
        return "Here it is."


async def test_a_response_start_frame_is_not_speech() -> None:
    """Pushing LLMFullResponseStartFrame first (as Pipecat LLM services do) does not
    count as the answer starting: the acknowledgment is still spoken, at its place in
    the speech path, and the first response is the text's audio."""
    clock = ManualClock()
    router, observer = voice(Streaming(clock, 2.0), clock, acknowledgment_delay_secs=0.5,
                             acknowledgment_llm=ScriptedLLM("One moment."))
    tts, out = ClockTTS(clock, ttfb=0.1), PlayingOutput(clock)
    async with Pipe(TurnRouterProcessor(router), tts, out) as pipe:
        await pipe.send(said("research this"))
        with anyio.fail_after(20):
            await run_clock(clock, lambda: len(out.played) == 2)
        await end_on_clock(pipe, clock)
    ack, answer = out.played[tts.tag("One moment.")], out.played[tts.tag("Here it is.")]
    assert ack == pytest.approx(0.6) and answer == pytest.approx(2.1)
    assert measured(observer) == (pytest.approx(answer), pytest.approx(ack))


async def test_the_turn_bound_keeps_the_newest_utterance(
        caplog: pytest.LogCaptureFixture) -> None:
    """Over max_turns running turns the oldest makes way for the newest (another user's
    included), each overflow counted, logged the first time and at powers of ten."""
    never = anyio.Event()
    agent = Agent("weather", "Sunny.", before_first=never)
    with TelemetryCapture() as capture:
        router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"),
                             telemetry=capture.telemetry)
        processor = TurnRouterProcessor(router, max_turns=2)
        seen: list[str] = []
        entered = anyio.Event()
        original = agent.respond

        async def respond(turn: AgentTurn, output: FrameOutput) -> str:
            seen.append(turn.participant_id)
            if turn.participant_id == "zoe":
                entered.set()
            return await original(turn, output)

        agent.respond = respond  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, "turnrouter.integrations.pipecat"):
            async with Pipe(processor) as pipe:
                await pipe.send(*[said(f"question {n}", f"user{n}") for n in range(12)])
                await pipe.send(said("and me?", "zoe"))
                with anyio.fail_after(10):
                    await entered.wait()
        assert capture.value("turnrouter_runtime_rejected_messages_total",
                             topic="pipecat", reason="overflow") == 11
    logged = [r.getMessage() for r in caplog.records if "overflow" in r.getMessage()]
    assert [message.split("(")[1] for message in logged] == [
        "1 so far in this pipeline)", "10 so far in this pipeline)"]
    assert "zoe" in seen




class ToolLLM(LLMService):
    """A Pipecat LLM service that first calls a tool (Pipecat runs it; the assistant
    aggregator asks for another inference with its result), then answers from it,
    `thinking` clock seconds after each context."""

    def __init__(self, clock: ManualClock, thinking: float = 0.0) -> None:
        unset: dict[str, Any] = {name: None for name in _LLM_SETTINGS}
        super().__init__(settings=LLMSettings(**unset))
        self.clock = clock
        self.thinking = thinking
        self.inferences = 0

        async def weather(params: FunctionCallParams) -> None:
            await params.result_callback({"sky": "sunny"})

        self.register_function("weather", weather)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        self.inferences += 1
        await self.push_frame(LLMFullResponseStartFrame())
        await self.clock.sleep(self.thinking)
        messages: list[Any] = list(frame.context.messages)
        tool = [m for m in messages if m.get("role") == "tool"]
        if not tool:
            await self.run_function_calls([FunctionCallFromLLM(
                function_name="weather", tool_call_id="call-1", arguments={},
                context=frame.context)])
        else:
            await self.push_frame(LLMTextFrame("It is sunny."))
        await self.push_frame(LLMFullResponseEndFrame())


async def test_llm_turn_with_a_tool_call_ends_with_the_final_answer() -> None:
    """In-pipeline LLM calling a tool: the turn ends with the answer after the tool's
    result, its text is the turn's result and history, and the answer's audio (not the
    acknowledgment's) is its first response."""
    clock = ManualClock()
    llm = ToolLLM(clock, thinking=0.4)
    observer = RecordingObserver()
    chat = PipecatLLMDestination(llm, "chat", "anything", in_pipeline=True)
    router = AgentRouter({"chat": chat}, ScriptedDecisions("chat"), clock=clock,
                         telemetry=observer, acknowledgment_delay_secs=0.5,
                         acknowledgment_llm=ScriptedLLM("One moment."))
    processor = TurnRouterProcessor(router)
    routed: list[RoutedResult] = []

    @processor.event_handler("on_turn_routed")
    async def _routed(proc: Any, turn: AgentTurn, result: RoutedResult) -> None:
        routed.append(result)

    context = LLMContext([{"role": "system", "content": "You are a weather bot."}])
    user = LLMUserAggregator(context, params=LLMUserAggregatorParams(
        user_turn_strategies=ExternalUserTurnStrategies()))
    tts, out = ClockTTS(clock, ttfb=0.1), PlayingOutput(clock)
    async with Pipe(user, processor, llm, processor.speaker, tts, out,
                    LLMAssistantAggregator(context)) as pipe:
        await pipe.send(ProposedUserStartedSpeakingFrame(), said("weather?", "alice"),
                        ProposedUserStoppedSpeakingFrame())
        with anyio.fail_after(20):
            await run_clock(clock, lambda: bool(routed) and len(out.played) == 2)
        history = router.history_of(processor.participant_id)
        await end_on_clock(pipe, clock)
    assert llm.inferences == 2
    assert routed[0].result.text == "It is sunny."
    assert [(e.user, e.assistant) for e in history] == [("weather?", "It is sunny.")]
    ack, answer = out.played[tts.tag("One moment.")], out.played[tts.tag("It is sunny.")]
    assert ack < answer
    assert measured(observer) == (pytest.approx(answer), pytest.approx(ack))


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from pipecat.utils.tracing.service_decorators import traced_llm


class TracedLLM(LLMService):
    """A Pipecat LLM service whose inference is traced as Pipecat's own services are
    (its `llm` span)."""

    def __init__(self) -> None:
        unset: dict[str, Any] = {name: None for name in _LLM_SETTINGS}
        super().__init__(settings=LLMSettings(**unset))

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMContextFrame):
            await self._infer(frame.context)
        else:
            await self.push_frame(frame, direction)

    @traced_llm
    async def _infer(self, context: LLMContext) -> None:
        await self.push_frame(LLMFullResponseStartFrame())
        await self.push_frame(LLMTextFrame("Sunny."))
        await self.push_frame(LLMFullResponseEndFrame())


async def test_pipecat_llm_span_nests_in_the_destinations_span(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With Pipecat tracing on: Pipecat's `llm` span of a routed answer is a child of the
    destination's `invoke_agent` span, and the release spans of the router's stop at the
    call's end are children of Pipecat's conversation span, not roots."""
    from opentelemetry import trace

    with TelemetryCapture() as capture:
        monkeypatch.setattr(trace, "get_tracer_provider", lambda: capture.tracer_provider)
        llm = TracedLLM()
        chat = PipecatLLMDestination(llm, "chat", "anything", in_pipeline=True)
        router = AgentRouter({"chat": chat}, ScriptedDecisions("chat"),
                             telemetry=capture.telemetry)
        processor = TurnRouterProcessor(router)
        routed = anyio.Event()

        @processor.event_handler("on_turn_routed")
        async def _routed(proc: Any, turn: AgentTurn, result: RoutedResult) -> None:
            routed.set()

        async with Pipe(processor, llm, processor.speaker, enable_tracing=True) as pipe:
            await pipe.send(said("rain?"))
            with anyio.fail_after(10):
                await routed.wait()
            await pipe.end()
        invoke = capture.span("invoke_agent chat")
        llm_span = capture.span("llm")
        assert llm_span.parent is not None
        assert llm_span.parent.span_id == invoke.context.span_id
        conversation = capture.span("conversation")
        releases = [span for span in capture.spans() if span.name == "turnrouter.release"]
        assert releases
        assert all(span.parent is not None
                   and span.parent.span_id == conversation.context.span_id
                   for span in releases)


async def test_answer_sent_before_the_acknowledgments_audio_is_not_credited_with_it() -> None:
    """The answer goes out at 0.6 s, after the acknowledgment (0.5 s) but before its
    audio (0.7 s): the acknowledgment's audio is not the answer's first response; the
    answer's own audio (after the acknowledgment's) is."""
    clock = ManualClock()
    agent = Agent("research", "Here is the report.", clock=clock, delay=0.6)
    router, observer = voice(agent, clock, acknowledgment_delay_secs=0.5,
                             acknowledgment_llm=ScriptedLLM("One moment."))
    tts, out = ClockTTS(clock, ttfb=0.2), PlayingOutput(clock)
    async with Pipe(TurnRouterProcessor(router), tts, out) as pipe:
        await pipe.send(said("research this"))
        with anyio.fail_after(20):
            await run_clock(clock, lambda: len(out.played) == 2)
        await end_on_clock(pipe, clock)
    ack, answer = out.played[tts.tag("One moment.")], out.played[tts.tag("Here is the report.")]
    assert ack == pytest.approx(0.7) and answer > ack + 0.25
    assert measured(observer) == (pytest.approx(answer), pytest.approx(ack))


@pytest.mark.parametrize("with_speaker", [True, False])
async def test_llm_answer_is_measured_to_its_audio(with_speaker: bool) -> None:
    """An in-pipeline LLM's streamed answer, with or without the processor's speaker
    before the TTS: first response and silence end at its audio."""
    clock = ManualClock()
    llm = ToolLLM(clock, thinking=0.3)
    observer = RecordingObserver()
    chat = PipecatLLMDestination(llm, "chat", "anything", in_pipeline=True)
    router = AgentRouter({"chat": chat}, ScriptedDecisions("chat"), clock=clock,
                         telemetry=observer)
    processor = TurnRouterProcessor(router)
    tts, out = ClockTTS(clock, ttfb=0.2), PlayingOutput(clock)
    context = LLMContext([{"role": "tool", "content": "sunny", "tool_call_id": "call-1"}])
    user = LLMUserAggregator(context, params=LLMUserAggregatorParams(
        user_turn_strategies=ExternalUserTurnStrategies()))
    speaker = [processor.speaker] if with_speaker else []
    async with Pipe(user, processor, llm, *speaker, tts, out) as pipe:
        await pipe.send(ProposedUserStartedSpeakingFrame(), said("weather?", "alice"),
                        ProposedUserStoppedSpeakingFrame())
        with anyio.fail_after(20):
            await run_clock(clock, lambda: bool(out.played))
        await end_on_clock(pipe, clock)
    answer = out.played[tts.tag("It is sunny.")]
    assert answer == pytest.approx(0.5)
    assert measured(observer) == (pytest.approx(answer), pytest.approx(answer))


@pytest.mark.parametrize("max_turns", [64, 128])
async def test_many_users_then_one_more_on_a_shared_router(max_turns: int) -> None:
    """A call sharing its router hears 70 users at once, then one more: the newest is
    routed (over max_turns the oldest turns make way, some before they ran), the call
    ends cleanly, and every participant routed departs at its end."""
    agent = Remembering()
    # (71 new participants in one instant: past the router's admission budget of new
    # participants per sample, `OverloadPolicy.new_per_sample`; here max_turns is tested)
    router = AgentRouter({"conversation": agent}, ScriptedDecisions("conversation"),
                         telemetry=Telemetry.disabled(),
                         overload=OverloadPolicy(new_per_sample=256))
    processor = TurnRouterProcessor(router, owns_router=False, max_turns=max_turns)
    routed: list[str] = []
    last = anyio.Event()

    @processor.event_handler("on_turn_routed")
    async def _routed(proc: Any, turn: AgentTurn, result: RoutedResult) -> None:
        routed.append(turn.participant_id)
        if turn.participant_id == "newest":
            last.set()

    async with Pipe(processor) as pipe:
        await pipe.send(*[said(f"hello {n}", f"user{n}") for n in range(70)])
        await pipe.send(said("and me?", "newest"))
        with anyio.fail_after(10):
            await last.wait()
        await pipe.end()
    with anyio.fail_after(10):
        while len(agent.released) < len(set(routed)):  # every one routed departs
            agent.release_seen = anyio.Event()
            await agent.release_seen.wait()
    assert "newest" in routed


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from pipecat.frames.frames import (
        BotStartedSpeakingFrame,
        BotStoppedSpeakingFrame,
        TTSSpeakFrame,
    )
    from pipecat.processors.frame_processor import FrameProcessor


class UpstreamOnlyOutput(FrameProcessor):
    """A hand-written output (no BaseOutputTransport): speaks each TTSSpeakFrame after
    `ttfb` clock seconds and tells only upstream when the bot starts and stops."""

    def __init__(self, clock: ManualClock, ttfb: float) -> None:
        super().__init__()
        self.clock, self.ttfb = clock, ttfb
        self.started: list[float] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, TTSSpeakFrame):
            await self.clock.sleep(self.ttfb)
            self.started.append(self.clock.now())
            await self.push_frame(BotStartedSpeakingFrame(), FrameDirection.UPSTREAM)
            await self.push_frame(BotStoppedSpeakingFrame(), FrameDirection.UPSTREAM)


async def test_an_output_telling_only_upstream_is_heard() -> None:
    """An output that sends BotStartedSpeakingFrame upstream only still reports the
    answer heard at its audio."""
    clock = ManualClock()
    router, observer = voice(Agent("weather", "Sunny."), clock)
    out = UpstreamOnlyOutput(clock, ttfb=0.3)
    async with Pipe(TurnRouterProcessor(router), out) as pipe:
        await pipe.send(said("rain?"))
        with anyio.fail_after(20):
            await run_clock(clock, lambda: bool(out.started))
        await end_on_clock(pipe, clock)
    assert measured(observer) == (pytest.approx(0.3), pytest.approx(0.3))


async def test_a_returned_answer_is_heard_once_and_in_the_pipecat_context() -> None:
    """A README-style destination (started(), then its text returned): the processor
    speaks the text as the answer, so the output plays it once, the assistant
    aggregator puts it in Pipecat's context once, next to the router's history, and the
    first response is its audio."""
    from turnrouter import Destination, DestinationResult

    class Reply(Destination):
        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            await started()
            return DestinationResult(text="Sunny, 24 degrees.")

    clock = ManualClock()
    observer = RecordingObserver()
    router = AgentRouter({"weather": Reply("forecasts")}, ScriptedDecisions("weather"),
                         clock=clock, telemetry=observer)
    processor = TurnRouterProcessor(router)
    context = LLMContext([{"role": "system", "content": "You are a weather bot."}])
    tts, out = ClockTTS(clock, ttfb=0.3), PlayingOutput(clock)
    async with Pipe(processor, tts, out, LLMAssistantAggregator(context)) as pipe:
        await pipe.send(said("rain?", "alice"))
        with anyio.fail_after(20):
            await run_clock(clock, lambda: bool(out.played))
        history = [e.assistant for e in router.history_of("alice")]
        await end_on_clock(pipe, clock)
    assert list(tts.tags) == ["Sunny, 24 degrees."]
    assert out.played[tts.tag("Sunny, 24 degrees.")] == pytest.approx(0.3)
    assert measured(observer) == (pytest.approx(0.3), pytest.approx(0.3))
    assistant = [m["content"] for m in context.get_messages()
                 if isinstance(m, dict) and m.get("role") == "assistant"]
    assert assistant == history == ["Sunny, 24 degrees."]


class _IdleLLM(LLMService):
    """A Pipecat LLM service that passes frames on (only where it sits matters)."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)


@pytest.mark.parametrize(("layout", "problem"), [
    ("llm, processor, tts, out", "an LLM service sits before the TurnRouterProcessor"),
    ("speaker, processor, tts, out", "processor.speaker sits before the TurnRouterProcessor"),
    ("processor, tts, out, speaker", "processor.speaker sits after the output transport"),
    ("processor, speaker, tts, out", "needs its LLM service after the TurnRouterProcessor"),
    ("processor, llm, speaker, tts, out", None),
])
async def test_a_pipeline_in_the_wrong_order_is_named_at_its_start(
        layout: str, problem: str | None, caplog: pytest.LogCaptureFixture) -> None:
    """Where the processor, its speaker and an in-pipeline LLM sit is checked at
    `StartFrame`, one WARNING per problem naming the fix: each used to fail silently (an
    LLM before the processor answered every turn itself; a speaker before it lost the
    first utterance; one after the output was never heard; an in-pipeline LLM missing
    downstream left the caller in silence for 60 s: voice17 F4). The documented order
    warns of nothing."""
    clock = ManualClock()
    llm = _IdleLLM()
    router = AgentRouter({"chat": PipecatLLMDestination(llm, "chat", "small talk",
                                                        in_pipeline=True)},
                         ScriptedDecisions("chat"), telemetry=Telemetry.disabled(),
                         clock=clock, overload=None)
    processor = TurnRouterProcessor(router)
    parts: dict[str, Any] = {"llm": llm, "processor": processor,
                             "speaker": processor.speaker, "tts": ClockTTS(clock),
                             "out": PlayingOutput(clock)}
    with caplog.at_level(logging.WARNING, logger="turnrouter.integrations.pipecat"):
        async with Pipe(*(parts[name] for name in layout.split(", "))) as pipe:
            await end_on_clock(pipe, clock)
    warned = [r.getMessage() for r in caplog.records
              if r.name == "turnrouter.integrations.pipecat" and r.levelname == "WARNING"]
    if problem is None:
        assert warned == []
    else:
        assert any(problem in message for message in warned), warned


async def test_a_slow_tts_does_not_teach_the_predictor_to_acknowledge_quick_answers(
        ) -> None:
    """The answer's text is ready in 0.35 s (under the 0.5 s delay) and the TTS takes
    1.5 s to its first audio, turn after turn: no acknowledgment is ever said, every
    answer is heard at 1.85 s. The timing predictor learned the time to the audio
    before, predicted ~1.9 s, and from the seventh turn on acknowledged early, the
    acknowledgment's own audio delaying each answer to 3.25 s (voice17 F1)."""
    clock = ManualClock()
    agent = Agent("weather", "Light rain.", clock=clock, delay=0.35)
    router, observer = voice(agent, clock, acknowledgment_delay_secs=0.5,
                             acknowledgment_llm=ScriptedLLM("One moment."))
    tts, out = ClockTTS(clock, ttfb=1.5), PlayingOutput(clock)

    def heard() -> list[Any]:
        return [event for event in observer.events if event[0] == "heard"]

    def heard_all(turns: int) -> Callable[[], bool]:
        return lambda: len(heard()) >= turns

    async with Pipe(TurnRouterProcessor(router), tts, out) as pipe:
        for turn in range(10):
            await pipe.send(said("rain tomorrow?"))
            with anyio.fail_after(20):
                await run_clock(clock, heard_all(turn + 1))
            clock.advance(1.0)  # the answer plays; the caller thinks
        await end_on_clock(pipe, clock)
    assert "One moment." not in tts.tags
    assert [event[2] for event in heard()] == [pytest.approx(1.85)] * 10
