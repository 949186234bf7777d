"""The Pipecat adapter driven through real Pipecat pipelines (its own test helpers)."""

from __future__ import annotations

import asyncio
import logging
import re
import warnings

import pytest

with warnings.catch_warnings():  # pipecat imports the deprecated audioop on 3.11-3.12
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import (
        BotStartedSpeakingFrame,
        CancelFrame,
        EndFrame,
        Frame,
        InterimTranscriptionFrame,
        InterruptionFrame,
        LLMContextFrame,
        LLMContextUserTurnFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMRunFrame,
        LLMTextFrame,
        ProposedUserStartedSpeakingFrame,
        ProposedUserStoppedSpeakingFrame,
        TextFrame,
        TranscriptionFrame,
        TTSAudioRawFrame,
        TTSSpeakFrame,
    )
    from pipecat.observers.base_observer import BaseObserver, FramePushed
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import (
        LLMUserAggregator,
        LLMUserAggregatorParams,
    )
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.llm_service import LLMService
    from pipecat.tests.utils import run_test
    from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter import (
    Admission,
    AgentExchange,
    AgentRouter,
    AgentTurn,
    ContractTypeError,
    ContractValueError,
    DestinationResult,
    LifecycleError,
    LLMError,
    OverloadPolicy,
    RouteDecision,
    RoutedResult,
    RouterBusyError,
    RouteRequest,
)
from turnrouter.integrations.pipecat import (
    FrameAgent,
    FrameOutput,
    PipecatLLMDestination,
    TurnRouterProcessor,
    frame_output,
    turn_from_frame,
)
from turnrouter.telemetry import Telemetry
from turnrouter.testing import (
    ManualClock,
    RecordingObserver,
    ScriptedAgent,
    ScriptedDecisions,
    ScriptedLLM,
    TelemetryCapture,
)

from .pipecat_kit import Agent, FakeSpeech, Pipe, spoken
from .readme_reply import Reply

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


Started = Callable[[], Awaitable[None]]


def said(user: str, text: str) -> TranscriptionFrame:
    return TranscriptionFrame(text, user, "2026-12-01T08:00:00+00:00")


class Turns:
    """Collects the processor's on_turn_routed / on_turn_failed events."""

    def __init__(self, processor: TurnRouterProcessor) -> None:
        self.routed: list[tuple[AgentTurn, RoutedResult]] = []
        self.failed: list[tuple[AgentTurn, BaseException]] = []
        self.changed = anyio.Event()

        @processor.event_handler("on_turn_routed")
        async def _routed(proc: Any, turn: AgentTurn, routed: RoutedResult) -> None:
            self.routed.append((turn, routed))
            self.changed.set()

        @processor.event_handler("on_turn_failed")
        async def _failed(proc: Any, turn: AgentTurn, error: BaseException) -> None:
            self.failed.append((turn, error))
            self.changed.set()

    async def wait(self, count: int) -> None:
        with anyio.fail_after(10):
            while len(self.routed) + len(self.failed) < count:
                self.changed = anyio.Event()
                await self.changed.wait()

    @property
    def routes(self) -> list[str | None]:
        return [routed.route for _, routed in self.routed]


def build(agents: list[Agent], *decisions: str, **kwargs: Any) -> AgentRouter:
    kwargs.setdefault("telemetry", Telemetry.disabled())
    if "clock" in kwargs:
        # The load sampler sleeps on the router's clock too: tests that count a
        # ManualClock's sleepers count only the pipeline's.
        kwargs.setdefault("overload", None)
    return AgentRouter({agent.routing_aid("x").name: agent for agent in agents},
                       ScriptedDecisions(*decisions), **kwargs)


async def test_routes_a_transcription_to_the_chosen_destination() -> None:
    """A final transcription is routed; the destination's speech goes downstream and
    the transcription itself does not (it would reach the TTS)."""
    weather, chat = Agent("weather", "Sunny all day."), Agent("conversation", "Hi!")
    processor = TurnRouterProcessor(build([weather, chat], "weather"))
    turns = Turns(processor)
    down, _ = await run_test(processor, frames_to_send=[
        InterimTranscriptionFrame("will it", "alice", "t"), said("alice", "will it rain?")])
    assert spoken(list(down)) == ["Sunny all day."]
    assert not any(isinstance(frame, TranscriptionFrame) for frame in down)
    assert any(isinstance(frame, InterimTranscriptionFrame) for frame in down)
    assert turns.routes == ["weather"]
    assert turns.routed[0][0].participant_id == "alice"
    assert turns.routed[0][0].query == "will it rain?"


async def test_declined_route_falls_back_to_the_default() -> None:
    """Both routed choices declined: the default destination answers (route reported)."""
    booking, weather = Agent("booking", decline=True), Agent("weather", decline=True)
    chat = Agent("conversation", "Happy to chat.")
    processor = TurnRouterProcessor(build([booking, weather, chat], "booking", "weather"))
    turns = Turns(processor)
    down, _ = await run_test(processor, frames_to_send=[said("alice", "book me")])
    assert spoken(list(down)) == ["Happy to chat."]
    assert turns.routes == ["conversation"]


async def test_user_context_aggregator_output_is_routed() -> None:
    """The context frame after the aggregator's LLMContextUserTurnFrame is a turn of the
    configured participant (query: the newest user message); a speculative one is
    dropped, and one that is no user turn (LLMRunFrame) passes through to the LLM."""
    weather = Agent("weather", "Sunny.")
    processor = TurnRouterProcessor(build([weather], "weather"), participant_id="caller")
    turns = Turns(processor)
    context = LLMContext([{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "old question"},
                          {"role": "assistant", "content": "old answer"},
                          {"role": "user", "content": [{"type": "text", "text": "rain?"}]}])
    greeting = LLMContext([{"role": "system", "content": "greet the caller"}])
    down, _ = await run_test(processor, frames_to_send=[
        LLMContextFrame(context, speculation=True),
        LLMContextUserTurnFrame("rain?", "2026-12-01T08:00:00+00:00"),
        LLMContextFrame(context), LLMContextFrame(greeting)])
    assert spoken(list(down)) == ["Sunny."]
    assert [(t.participant_id, t.query) for t, _ in turns.routed] == [("caller", "rain?")]
    passed = [frame for frame in down if isinstance(frame, LLMContextFrame)]
    assert [frame.context for frame in passed] == [greeting]


async def test_acknowledgment_is_spoken_before_a_slow_answer() -> None:
    """An answer slower than the acknowledgment delay is preceded by the spoken ack."""
    clock = ManualClock()
    slow = Agent("research", "Here is the report.", clock=clock, delay=3.0)
    router = build([slow], "research", clock=clock, acknowledgment_delay_secs=0.5,
                   acknowledgment_llm=ScriptedLLM("Let me look that up."))
    processor = TurnRouterProcessor(router)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "research this"))
        with anyio.fail_after(10):
            await slow.entered.wait()
            await clock.wait_for_sleepers(2)  # the ack timer and the slow answer
        clock.advance(0.5)
        ack = await pipe.next_down(TTSSpeakFrame)
        assert ack.text == "Let me look that up."
        clock.advance(2.5)
        answer = await pipe.next_down(TTSSpeakFrame)
        assert answer.text == "Here is the report."
        await pipe.end()


async def test_no_acknowledgment_before_a_fast_answer() -> None:
    """An answer that starts before the delay suppresses the acknowledgment."""
    clock = ManualClock()
    observer = RecordingObserver()
    fast = Agent("weather", "Sunny.")
    router = build([fast], "weather", clock=clock, acknowledgment_delay_secs=0.5,
                   acknowledgment_llm=ScriptedLLM("One moment."), telemetry=observer)
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        await turns.wait(1)
        await pipe.end()
    assert spoken(pipe.seen) == ["Sunny."]
    turn_id = turns.routed[0][0].turn_id
    acks = [e for e in observer.turns[turn_id] if e[0] == "acknowledgment"]
    assert acks == [("acknowledgment", "weather", "suppressed", "delay")]


async def test_barge_in_before_the_answer_interrupts_the_turn() -> None:
    """An InterruptionFrame before the destination spoke interrupts its turn: nothing is
    said, and the interruption still travels downstream."""
    waiting = anyio.Event()
    agent = Agent("weather", "Sunny.", before_first=waiting)
    observer = RecordingObserver()
    processor = TurnRouterProcessor(build([agent], "weather", telemetry=observer))
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await agent.entered.wait()
        await pipe.worker.queue_frame(InterruptionFrame())
        await pipe.next_down(InterruptionFrame)
        assert agent.outcome == ["CancelledError"]
        assert processor.turns_in_flight == 0
        await pipe.end()
    assert spoken(pipe.seen) == []
    (turn_id,) = observer.turns
    assert observer.outcome(turn_id) == "interrupted"


class SlowToStop(FrameAgent):
    """Says its first sentence, then waits; cancelled, it takes its time to end (a
    cleanup closing an upstream stream) until `cleaned` is set."""

    def __init__(self) -> None:
        super().__init__("slow", "answers slowly")
        self.cancelled, self.cleaned, self.ended = anyio.Event(), anyio.Event(), anyio.Event()

    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        await output.say("First.")
        try:
            await anyio.Event().wait()
        finally:
            self.cancelled.set()
            with anyio.CancelScope(shield=True):
                await self.cleaned.wait()
            self.ended.set()
        return "First."


async def test_barge_in_goes_downstream_before_a_slow_destination_ended() -> None:
    """voice22 F1: the InterruptionFrame waited for the router's interrupt to drain, so a
    destination slow to end on cancellation kept the bot talking over the user for as
    long (2 to 5 s measured, unbounded for one that swallows the cancel). Now the frame
    goes downstream while the destination still cleans up; the turn then ends
    interrupted, once, and nothing is left running."""
    slow = SlowToStop()
    observer = RecordingObserver()
    router = AgentRouter({"slow": slow}, ScriptedDecisions("slow"), telemetry=observer)
    processor = TurnRouterProcessor(router)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        assert (await pipe.next_down(TTSSpeakFrame)).text == "First."
        await pipe.worker.queue_frame(InterruptionFrame())
        await pipe.next_down(InterruptionFrame)
        with anyio.fail_after(10):
            await slow.cancelled.wait()
        assert not slow.ended.is_set() and processor.turns_in_flight == 1
        for _ in range(20):  # a flapping VAD: barge-ins while the destination cleans up
            await pipe.worker.queue_frame(InterruptionFrame())
            await pipe.next_down(InterruptionFrame)
        def draining() -> int:
            return sum(1 for task in asyncio.all_tasks()
                       if task.get_name().endswith("turnrouter-interrupt") and not task.done())

        with anyio.fail_after(10):  # the waits taken over end (one wait per participant)
            while draining() > 1:
                await anyio.lowlevel.checkpoint()
        assert draining() == 1
        slow.cleaned.set()
        with anyio.fail_after(10):
            await slow.ended.wait()
        await pipe.end()
    assert spoken(pipe.seen) == ["First."]
    assert processor.turns_in_flight == 0
    (turn_id,) = observer.turns
    assert observer.outcome(turn_id) == "interrupted"


async def test_barge_in_during_the_answer_stops_its_frames() -> None:
    """An InterruptionFrame after the first sentence cancels the rest of the answer, and
    the turn's output refuses frames afterwards (no stale audio)."""
    gate = anyio.Event()
    agent = Agent("weather", "First.", gate=gate, second="Second.")
    processor = TurnRouterProcessor(build([agent], "weather"))
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        assert (await pipe.next_down(TTSSpeakFrame)).text == "First."
        await pipe.worker.queue_frame(InterruptionFrame())
        await pipe.next_down(InterruptionFrame)
        assert agent.outcome == ["CancelledError"]
        assert agent.output is not None
        with pytest.raises(LifecycleError, match="has ended"):
            await agent.output.say("late")
        await pipe.end()
    assert spoken(pipe.seen) == ["First."]


async def test_new_turn_replaces_the_running_one() -> None:
    """A second transcription replaces the first turn while it is still answering: the
    processor never waits for a turn inside process_frame."""
    never = anyio.Event()
    first = Agent("research", "Working on it.", gate=never)
    second = Agent("weather", "Sunny.")
    processor = TurnRouterProcessor(build([first, second], "research", "weather"))
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "research this"))
        assert (await pipe.next_down(TTSSpeakFrame)).text == "Working on it."
        await pipe.send(said("alice", "actually, will it rain?"))
        assert (await pipe.next_down(TTSSpeakFrame)).text == "Sunny."
        await turns.wait(1)
        assert first.outcome == ["CancelledError"]
        assert turns.routes == ["weather"]
        await pipe.end()


async def test_failing_destination_speaks_the_failure_text() -> None:
    """A destination failing before it spoke: the router's failure text is spoken and
    on_turn_failed reports the error; the pipeline keeps running."""
    broken = Agent("weather", error=RuntimeError("backend down"))
    router = build([broken], "weather", failure_text="Sorry, that failed.")
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    down, _ = await run_test(processor, frames_to_send=[said("alice", "rain?")])
    assert spoken(list(down)) == ["Sorry, that failed."]
    assert [type(error) for _, error in turns.failed] == [RuntimeError]


async def test_two_users_are_routed_concurrently() -> None:
    """Two users' turns run side by side: bob is answered while alice's turn waits."""
    gate = anyio.Event()
    alice_agent = Agent("research", "Alice, working.", gate=gate, second="Alice, done.")
    bob_agent = Agent("weather", "Bob, sunny.")
    decisions = lambda request: "research" if request.turn.participant_id == "alice" else (  # noqa: E731
        "weather")
    router = AgentRouter({"research": alice_agent, "weather": bob_agent},
                         ScriptedDecisions(decisions), telemetry=Telemetry.disabled())
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "research this"), said("bob", "rain?"))
        texts = {(await pipe.next_down(TTSSpeakFrame)).text for _ in range(2)}
        assert texts == {"Alice, working.", "Bob, sunny."}
        await turns.wait(1)
        assert [t.participant_id for t, _ in turns.routed] == ["bob"]
        gate.set()
        assert (await pipe.next_down(TTSSpeakFrame)).text == "Alice, done."
        await turns.wait(2)
        await pipe.end()


async def test_end_frame_lets_the_answer_finish_then_stops_the_router() -> None:
    """EndFrame during an answer: the answer completes before EndFrame leaves the
    processor, then the router stops (its participants are released)."""
    clock = ManualClock()
    slow = Agent("research", "Done at last.", clock=clock, delay=2.0)
    processor = TurnRouterProcessor(build([slow], "research", clock=clock))
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "research this"))
        with anyio.fail_after(10):
            await clock.wait_for_sleepers(1)
        await pipe.worker.queue_frame(EndFrame())
        await ManualClock.settle()
        assert slow.outcome == []  # EndFrame waits for the turn instead of cancelling
        clock.advance(2.0)
        await pipe.next_down(EndFrame)
        await pipe.end_wait()
    kinds = [type(frame) for frame in pipe.seen]
    assert kinds.index(TTSSpeakFrame) < kinds.index(EndFrame)
    assert slow.outcome == ["done"]
    assert slow.released == ["alice"]


async def test_end_frame_waits_a_bounded_time_for_a_hung_turn() -> None:
    """A turn that never finishes does not hold the pipeline's end: after
    end_timeout_secs it is interrupted and the router stops."""
    never = anyio.Event()
    hung = Agent("weather", "Sunny.", before_first=never)
    processor = TurnRouterProcessor(build([hung], "weather"), end_timeout_secs=0.05)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await hung.entered.wait()
        await pipe.end()
    assert hung.outcome == ["CancelledError"]
    assert hung.released == ["alice"]


async def test_cancel_frame_stops_the_router_at_once() -> None:
    """CancelFrame interrupts the running turn (router stopped) instead of waiting."""
    never = anyio.Event()
    agent = Agent("weather", "Sunny.", before_first=never)
    processor = TurnRouterProcessor(build([agent], "weather"))
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await agent.entered.wait()
        await pipe.worker.queue_frame(CancelFrame())
        await pipe.end_wait()
    assert agent.outcome == ["CancelledError"]
    assert agent.released == ["alice"]


async def test_silence_is_measured_to_the_first_audio_heard() -> None:
    """With a TTS taking 0.4 s to its first audio, silence and first response are
    measured to BotStartedSpeakingFrame, not to the frame push."""
    clock = ManualClock()
    observer = RecordingObserver()
    agent = Agent("weather", "Sunny.")
    router = build([agent], "weather", clock=clock, telemetry=observer)
    processor = TurnRouterProcessor(router)
    speech = FakeSpeech(clock, ttfb=0.4)
    async with Pipe(Pipeline([processor, speech])) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await clock.wait_for_sleepers(1)
        clock.advance(0.4)
        await pipe.next_down(TTSAudioRawFrame)
        await pipe.end()
    heard = [event for event in observer.events if event[0] == "heard"]
    assert heard == [("heard", "weather", pytest.approx(0.4), pytest.approx(0.4))]


@pytest.mark.parametrize("stop", ["barge-in", "cancel"])
async def test_a_barge_in_or_hang_up_before_late_audio_records_no_silence(stop: str) -> None:
    """The answer's text went out at once, its audio would start 2 s later, and the user
    barges in at 1.5 s (or hangs up, CancelFrame, at 0.4 s): nothing was heard, so no
    silence is recorded and the first response is a lower bound at that moment
    (interrupted before a response). Before, the turn being over, the processor did not
    tell the router, and the next turn recorded ~0 s at the text's push for a caller who
    heard nothing (voice7); a cancel on the call's first turn, before the router knew the
    call reports audio, recorded the answer heard at its text's push (voice17 F2)."""
    clock = ManualClock()
    observer = RecordingObserver()
    router = build([Agent("weather", "Sunny.")], "weather", clock=clock, telemetry=observer)
    processor = TurnRouterProcessor(router)
    speech = FakeSpeech(clock, ttfb=2.0)
    at = 1.5 if stop == "barge-in" else 0.4
    async with Pipe(Pipeline([processor, speech])) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await clock.wait_for_sleepers(1)  # the TTS, on its way to the first audio
        clock.advance(at)
        if stop == "barge-in":
            await pipe.worker.queue_frame(InterruptionFrame())
            await pipe.next_down(InterruptionFrame)
            await pipe.end()
        else:
            await pipe.worker.queue_frame(CancelFrame())
            await pipe.end_wait()
    heard = [event for event in observer.events if event[0].startswith("heard")]
    assert heard == [("heard_interrupted", "weather", pytest.approx(at))]
    assert not [event for event in observer.events if event[0] == "silence"]


def test_a_second_processor_owning_the_same_router_is_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two live processors owning one router (the default `owns_router=True` for
    calls sharing a router): the first call to end would stop the router for both,
    the other call losing its participants' history and focus mid-call (voice17 F5).
    The second one logs a WARNING naming `owns_router=False`; sharing processors and
    a processor of another router do not."""
    router = build([Agent("weather", "Sunny.")], "weather")
    first = TurnRouterProcessor(router)
    with caplog.at_level(logging.WARNING, logger="turnrouter.integrations.pipecat"):
        TurnRouterProcessor(router, owns_router=False)
        TurnRouterProcessor(build([Agent("weather", "Sunny.")], "weather"))
        assert not caplog.records
        TurnRouterProcessor(router)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "owns_router=False" in caplog.records[0].getMessage()
    assert first.router is router


async def test_without_heard_reports_silence_ends_at_the_frame_push() -> None:
    """report_heard=False: silence ends at started() (the first frame pushed)."""
    clock = ManualClock()
    capture = TelemetryCapture()
    with capture:
        router = build([Agent("weather", "Sunny.")], "weather", clock=clock,
                       telemetry=capture.telemetry)
        processor = TurnRouterProcessor(router, report_heard=False)
        speech = FakeSpeech(clock, ttfb=0.4)
        async with Pipe(Pipeline([processor, speech])) as pipe:
            await pipe.send(said("alice", "rain?"))
            with anyio.fail_after(10):
                await clock.wait_for_sleepers(1)
            clock.advance(0.4)
            await pipe.next_down(TTSAudioRawFrame)
            await pipe.end()
        assert capture.value("turnrouter_silence_seconds_sum", route="weather") == 0.0


async def test_turn_spans_nest_under_pipecat_turn_span(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With Pipecat tracing on, turnrouter.turn is a child of Pipecat's `turn` span, and
    the destination's frames still flow."""
    from opentelemetry import trace

    with TelemetryCapture() as capture:
        monkeypatch.setattr(trace, "get_tracer_provider", lambda: capture.tracer_provider)
        router = build([Agent("weather", "Sunny.")], "weather", telemetry=capture.telemetry)
        processor = TurnRouterProcessor(router)
        turns = Turns(processor)
        async with Pipe(processor, enable_tracing=True) as pipe:
            await pipe.send(said("alice", "rain?"))
            await turns.wait(1)
            await pipe.end()
        pipecat_turn = capture.span("turn")
        ours = capture.span("turnrouter.turn")
        assert ours.parent is not None
        assert ours.parent.span_id == pipecat_turn.context.span_id
        assert ours.context.trace_id == pipecat_turn.context.trace_id


async def test_turn_of_a_departing_participant_is_refused_and_counted() -> None:
    """A transcription from a participant whose departure began is refused by the
    router: counted (outcome refused), reported through on_turn_failed, nothing said."""
    gate = anyio.Event()
    with TelemetryCapture() as capture:
        agent = ScriptedAgent("weather")
        agent.release_gate = gate
        router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"),
                             telemetry=capture.telemetry)
        await router.route_turn(AgentTurn("alice", "t0", "hi"), output=_silent)
        departure = router.begin_departure("alice")  # its release waits for the gate
        processor = TurnRouterProcessor(router, owns_router=False)
        turns = Turns(processor)
        down, _ = await run_test(processor, frames_to_send=[said("alice", "rain?")])
        gate.set()
        with anyio.fail_after(10):
            await departure.join()
        assert spoken(list(down)) == []
        assert [type(error) for _, error in turns.failed] == [LifecycleError]
        assert capture.value("turnrouter_turns_total", route="none", outcome="refused") == 1


async def test_turn_overflow_is_refused_and_counted() -> None:
    """Over max_turns running turns, a new turn is refused and counted (overflow)."""
    never = anyio.Event()
    agent = Agent("weather", "Sunny.", before_first=never)
    with TelemetryCapture() as capture:
        processor = TurnRouterProcessor(
            build([agent], "weather", telemetry=capture.telemetry), max_turns=1)
        async with Pipe(processor) as pipe:
            await pipe.send(said("alice", "rain?"))
            with anyio.fail_after(10):
                await agent.entered.wait()
            await pipe.send(said("bob", "and here?"), said("carol", "x" * 5000))
            await pipe.send(TextFrame("marker"))
            await pipe.next_down(TextFrame)
            assert processor.turns_in_flight == 1
        assert capture.value("turnrouter_runtime_rejected_messages_total",
                             topic="pipecat", reason="overflow") == 1
        assert capture.value("turnrouter_runtime_rejected_messages_total",
                             topic="pipecat", reason="oversized") == 1


@pytest.mark.parametrize("text", [None, 5, b"hi", ["hi"]])
async def test_a_transcription_whose_text_is_not_text_is_counted_invalid(text: object) -> None:
    """A `TranscriptionFrame` whose text is not a str (a speech-to-text service's bug)
    is refused and counted `invalid`, as other malformed frames are; before, it was
    swallowed without a count or a line. The next transcription is routed."""
    agent = Agent("weather", "Sunny.")
    with TelemetryCapture() as capture:
        processor = TurnRouterProcessor(build([agent], "weather", telemetry=capture.telemetry))
        junk = said("alice", "x")
        junk.text = text  # type: ignore[assignment]
        down, _ = await run_test(processor, frames_to_send=[junk, said("alice", "rain?")])
        assert spoken(list(down)) == ["Sunny."]
        assert capture.value("turnrouter_runtime_rejected_messages_total",
                             topic="pipecat", reason="invalid") == 1


class FakeLLM(LLMService):
    """A Pipecat LLM service answering out of band from the context it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[list[Any]] = []

    async def run_inference(self, context: LLMContext, max_tokens: int | None = None,
                            system_instruction: str | None = None,
                            response_schema: dict[str, Any] | None = None) -> str | None:
        messages: list[Any] = list(context.messages)
        self.contexts.append(messages)
        return f"LLM says: {messages[-1]['content']}"


async def test_llm_destination_answers_with_a_pipecat_llm_service() -> None:
    """PipecatLLMDestination speaks the service's reply; the router's history reaches
    the LLM context before the query."""
    llm = FakeLLM()
    chat = PipecatLLMDestination(llm, "conversation", "small talk")
    processor = TurnRouterProcessor(build([chat], "conversation"))  # type: ignore[list-item]
    down, _ = await run_test(processor, frames_to_send=[said("alice", "hello")])
    assert spoken(list(down)) == ["LLM says: hello"]
    turn = AgentTurn("alice", "t2", "again", (AgentExchange("hello", "LLM says: hello"),))
    messages: list[Any] = chat.context_for(turn).messages
    assert [m["content"] for m in messages] == [
        "hello", "LLM says: hello", "again"]


class StreamingLLM(LLMService):
    """A Pipecat LLM service in the pipeline, streaming like the real ones: start frame,
    text chunks (the second one after `gate`), an optional error, end frame."""

    def __init__(self, *chunks: str, gate: anyio.Event | None = None,
                 fail: bool = False, clock: ManualClock | None = None,
                 thinking: float = 0.0) -> None:
        super().__init__()
        self.chunks = chunks
        self.gate = gate
        self.clock = clock
        self.thinking = thinking
        self.fail = fail
        self.contexts: list[list[Any]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        messages: list[Any] = list(frame.context.messages)
        self.contexts.append(messages)
        await self.push_frame(LLMFullResponseStartFrame())
        try:
            if self.clock is not None:
                await self.clock.sleep(self.thinking)
            for index, chunk in enumerate(self.chunks):
                if index == 1 and self.gate is not None:
                    await self.gate.wait()
                await self.push_frame(LLMTextFrame(chunk))
            if self.fail:
                await self.push_error(error_msg="quota", exception=RuntimeError("quota"))
        finally:
            await self.push_frame(LLMFullResponseEndFrame())


def in_pipeline(llm: StreamingLLM, *others: Agent, decisions: tuple[str, ...] = ("chat",),
                **kwargs: Any) -> tuple[TurnRouterProcessor, Pipeline, RecordingObserver]:
    observer = RecordingObserver()
    chat = PipecatLLMDestination(llm, "chat", "small talk", in_pipeline=True,
                                 system_instruction="Be brief.")
    agents: dict[str, Any] = {"chat": chat, **{a.routing_aid("x").name: a for a in others}}
    if "clock" in kwargs:
        kwargs.setdefault("overload", None)  # its sampler would be one more sleeper
    router = AgentRouter(agents, ScriptedDecisions(*decisions), telemetry=observer, **kwargs)
    processor = TurnRouterProcessor(router)
    return processor, Pipeline([processor, llm, processor.speaker]), observer


async def test_llm_in_the_pipeline_streams_routed_turns() -> None:
    """in_pipeline: the LLM downstream streams the answer of the turns routed to it; the
    result is the full text and the first response is its first token, not its end."""
    clock, gate = ManualClock(), anyio.Event()
    llm = StreamingLLM("Hello", " there.", gate=gate)
    processor, pipeline, observer = in_pipeline(llm, clock=clock)
    turns = Turns(processor)
    async with Pipe(pipeline) as pipe:
        await pipe.send(said("alice", "hi"))
        assert (await pipe.next_down(LLMTextFrame)).text == "Hello"
        clock.advance(2.0)
        gate.set()
        await turns.wait(1)
        await pipe.end()
    texts = [frame.text for frame in pipe.seen if isinstance(frame, LLMTextFrame)]
    assert texts == ["Hello", " there."]
    assert turns.routed[0][1].result.text == "Hello there."
    assert [m["content"] for m in llm.contexts[0]] == ["Be brief.", "hi"]
    heard = [event for event in observer.events if event[0] == "heard"]
    assert heard == [("heard", "chat", 0.0, 0.0)]  # no audio report: started() time


async def test_acknowledgment_overtakes_a_slow_llm_in_the_pipeline() -> None:
    """With the processor's speaker before the TTS, an acknowledgment of a slow LLM
    response is spoken first, not queued behind the response in the LLM service."""
    clock = ManualClock()
    llm = StreamingLLM("Here you go.", clock=clock, thinking=2.0)
    _, pipeline, _ = in_pipeline(
        llm, clock=clock, acknowledgment_delay_secs=0.5,
        acknowledgment_llm=ScriptedLLM("One moment."))
    async with Pipe(pipeline) as pipe:
        await pipe.send(said("alice", "hi"))
        with anyio.fail_after(10):
            await clock.wait_for_sleepers(2)  # the ack timer and the LLM thinking
        clock.advance(0.5)
        assert (await pipe.next_down(TTSSpeakFrame)).text == "One moment."
        clock.advance(1.5)
        assert (await pipe.next_down(LLMTextFrame)).text == "Here you go."
        await pipe.end()


async def test_barge_in_during_a_streamed_llm_answer() -> None:
    """An InterruptionFrame mid-stream interrupts the turn and the LLM's response: the
    rest of it never reaches the TTS."""
    gate = anyio.Event()
    llm = StreamingLLM("Once upon", " a time.", gate=gate)
    _, pipeline, observer = in_pipeline(llm)
    async with Pipe(pipeline) as pipe:
        await pipe.send(said("alice", "tell me a story"))
        assert (await pipe.next_down(LLMTextFrame)).text == "Once upon"
        await pipe.worker.queue_frame(InterruptionFrame())
        await pipe.next_down(InterruptionFrame)
        gate.set()
        await pipe.end()
    texts = [frame.text for frame in pipe.seen if isinstance(frame, LLMTextFrame)]
    assert texts == ["Once upon"]
    (turn_id,) = observer.turns
    assert observer.outcome(turn_id) == "interrupted"


async def test_new_turn_cuts_a_streamed_llm_answer() -> None:
    """A new turn replacing a streamed answer pushes an InterruptionFrame downstream, so
    the LLM and TTS drop the old response before the new answer."""
    gate = anyio.Event()
    llm = StreamingLLM("Once upon", " a time.", gate=gate)
    processor, pipeline, _ = in_pipeline(llm, Agent("weather", "Sunny."),
                                         decisions=("chat", "weather"))
    turns = Turns(processor)
    async with Pipe(pipeline) as pipe:
        await pipe.send(said("alice", "tell me a story"))
        assert (await pipe.next_down(LLMTextFrame)).text == "Once upon"
        await pipe.send(said("alice", "no, the weather"))
        await pipe.next_down(InterruptionFrame)
        assert (await pipe.next_down(TTSSpeakFrame)).text == "Sunny."
        gate.set()
        await turns.wait(1)
        await pipe.end()
    texts = [frame.text for frame in pipe.seen if isinstance(frame, LLMTextFrame)]
    assert texts == ["Once upon"]
    assert turns.routes == ["weather"]


async def test_llm_error_frame_fails_the_turn() -> None:
    """An error from the LLM service before any token: LLMError, and the router's
    failure text is spoken."""
    llm = StreamingLLM(fail=True)
    processor, pipeline, _ = in_pipeline(llm, failure_text="Sorry, that failed.")
    turns = Turns(processor)
    async with Pipe(pipeline) as pipe:
        await pipe.send(said("alice", "hi"))
        await turns.wait(1)
        await pipe.end()
    assert spoken(pipe.seen) == ["Sorry, that failed."]
    assert [type(error) for _, error in turns.failed] == [LLMError]


def user_aggregator(context: LLMContext) -> LLMUserAggregator:
    """Pipecat's user context aggregator, driven by proposed user-speaking frames (what
    an STT with its own turn detection sends); it broadcasts the interruptions."""
    return LLMUserAggregator(context, params=LLMUserAggregatorParams(
        user_turn_strategies=ExternalUserTurnStrategies()))


def user_says(text: str) -> list[Frame]:
    return [ProposedUserStartedSpeakingFrame(), said("alice", text),
            ProposedUserStoppedSpeakingFrame()]


async def test_behind_the_user_aggregator_the_llm_gets_the_app_context() -> None:
    """Placed after Pipecat's user aggregator (the LLM after it, as in a stock app), a
    turn routed to the LLM destination sends the app's own context (system prompt and
    all) to the LLM service."""
    llm = StreamingLLM("Rain later.")
    processor, _, _ = in_pipeline(llm)
    turns = Turns(processor)
    context = LLMContext([{"role": "system", "content": "You are a weather bot."}])
    async with Pipe(Pipeline([user_aggregator(context), processor, llm,
                              processor.speaker])) as pipe:
        await pipe.send(*user_says("will it rain?"))
        await turns.wait(1)
        await pipe.end()
    assert [m["content"] for m in llm.contexts[0]] == ["You are a weather bot.", "will it rain?"]
    assert turns.routed[0][1].result.text == "Rain later."


class _FlushedWhileRouting:
    """Routes to "chat"; meanwhile the app's assistant aggregator flushes what the user
    heard before speaking again (as it does at the interruption): after their message."""

    def __init__(self, context: LLMContext) -> None:
        self.context = context

    async def decide(self, request: RouteRequest) -> RouteDecision:
        self.context.add_message({"role": "assistant", "content": "Let me think."})
        return RouteDecision("chat")


async def test_what_was_heard_before_the_user_spoke_again_goes_before_their_message(
        ) -> None:
    """An acknowledgment (or the start of an answer) heard before a barge-in reaches the
    app's context through its assistant aggregator only at the interruption, after the
    user's new message, while the turn is being routed: the LLM gets it before that
    message, so the conversation it answers ends with what the user said. Before, its
    last message was its own acknowledgment (voice13 D1)."""
    llm = StreamingLLM("A joke.")
    context = LLMContext([{"role": "system", "content": "You are a bot."},
                          {"role": "user", "content": "meaning of life?"}])
    chat = PipecatLLMDestination(llm, "chat", "small talk", in_pipeline=True)
    processor = TurnRouterProcessor(AgentRouter({"chat": chat}, _FlushedWhileRouting(context),
                                                telemetry=Telemetry.disabled()))
    turns = Turns(processor)
    async with Pipe(Pipeline([user_aggregator(context), processor, llm,
                              processor.speaker])) as pipe:
        await pipe.send(*user_says("tell me a joke"))
        await turns.wait(1)
        await pipe.end()
    assert [(m["role"], m["content"]) for m in llm.contexts[0]] == [
        ("system", "You are a bot."), ("user", "meaning of life?"),
        ("assistant", "Let me think."), ("user", "tell me a joke")]


async def test_user_aggregator_barge_in_interrupts_the_answer() -> None:
    """The user starting to speak again (the aggregator's interruption) interrupts the
    turn being answered."""
    gate = anyio.Event()
    agent = Agent("weather", "Let me see.", gate=gate, second="Rain later.")
    observer = RecordingObserver()
    processor = TurnRouterProcessor(build([agent], "weather", telemetry=observer))
    async with Pipe(Pipeline([user_aggregator(LLMContext()), processor])) as pipe:
        await pipe.send(*user_says("will it rain?"))
        assert (await pipe.next_down(TTSSpeakFrame)).text == "Let me see."
        await pipe.send(ProposedUserStartedSpeakingFrame())
        await pipe.next_down(InterruptionFrame)
        assert agent.outcome == ["CancelledError"]
        await pipe.end()
    (turn_id,) = observer.turns
    assert observer.outcome(turn_id) == "interrupted"
    assert spoken(pipe.seen) == ["Let me see."]


async def test_shared_router_is_not_stopped_by_one_pipeline() -> None:
    """owns_router=False: EndFrame waits for this pipeline's turns and lets its
    participants depart, but leaves the shared router running; CancelFrame interrupts
    this pipeline's turns only."""
    clock = ManualClock()
    slow = Agent("research", "Done.", clock=clock, delay=1.0)
    router = build([slow], "research", clock=clock)
    ending = TurnRouterProcessor(router, owns_router=False)
    async with Pipe(ending) as pipe:
        await pipe.send(said("alice", "research this"))
        with anyio.fail_after(10):
            await clock.wait_for_sleepers(1)
        await pipe.worker.queue_frame(EndFrame())
        await ManualClock.settle()
        clock.advance(1.0)
        await pipe.end_wait()
    assert slow.outcome == ["done"]
    with anyio.fail_after(10):
        await slow.release_seen.wait()  # the call's participant departed
    assert slow.released == ["alice"]
    never = anyio.Event()
    gated = Agent("weather", "Sunny.", before_first=never)
    shared = AgentRouter({"weather": gated, "conversation": ScriptedAgent("conversation")},
                         ScriptedDecisions("weather", "conversation"),
                         telemetry=Telemetry.disabled())
    cancelled = TurnRouterProcessor(shared, owns_router=False)
    async with Pipe(cancelled) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await gated.entered.wait()
        await pipe.worker.queue_frame(CancelFrame())
        await pipe.end_wait()
    assert gated.outcome == ["CancelledError"]
    routed = await shared.route_turn(AgentTurn("bob", "b1", "hello"), output=_silent)
    assert routed.route == "conversation"  # still running: not stopped by the pipeline


async def _silent(turn: AgentTurn, route: str, text: str) -> None:
    return None


async def test_destination_pushing_junk_fails_its_turn() -> None:
    """A destination pushing something that is not a Pipecat frame gets ContractTypeError
    naming the problem; its turn fails with the failure text spoken."""
    from turnrouter import ContractTypeError

    class Junk(FrameAgent):
        async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
            await output.push("not a frame")  # type: ignore[arg-type]
            return ""

    processor = TurnRouterProcessor(build(
        [Junk("weather", "forecasts")], "weather", failure_text="Sorry."))  # type: ignore[list-item]
    turns = Turns(processor)
    down, _ = await run_test(processor, frames_to_send=[said("alice", "rain?")])
    assert spoken(list(down)) == ["Sorry."]
    (_, error), = turns.failed
    assert isinstance(error, ContractTypeError) and "pipecat Frame" in str(error)


async def test_frame_output_outside_a_routed_turn_is_refused() -> None:
    """frame_output() outside a turn routed by the processor raises LifecycleError."""
    async def started() -> None:
        return None

    with pytest.raises(LifecycleError, match="TurnRouterProcessor"):
        frame_output(started)


def test_processor_rejects_bad_configuration() -> None:
    """Wrong router type or bounds are refused with errors naming the argument."""
    from turnrouter import MAX_ID_CHARS, ConfigurationError, ContractTypeError

    with pytest.raises(ContractTypeError, match="AgentRouter"):
        TurnRouterProcessor(object())  # type: ignore[arg-type]
    router = build([Agent("weather")], "weather")
    with pytest.raises(ConfigurationError, match="max_turns"):
        TurnRouterProcessor(router, max_turns=0)
    with pytest.raises(ConfigurationError, match="participant_id"):
        TurnRouterProcessor(router, participant_id="")
    with pytest.raises(ConfigurationError, match="MAX_ID_CHARS"):
        TurnRouterProcessor(router, participant_id="a" * (MAX_ID_CHARS + 1))
    with pytest.raises(ConfigurationError, match="end_timeout_secs"):
        TurnRouterProcessor(router, end_timeout_secs=float("nan"))


SURROGATE = re.compile("[\ud800-\udfff]")
junk_text = st.one_of(st.text(), st.text(alphabet=st.characters(codec=None)),
                      st.binary().map(lambda b: b.decode("utf-8", "surrogateescape")))
junk_value: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | junk_text | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(junk_text, inner, max_size=4),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(junk_text, st.text(min_size=5000, max_size=6000), junk_value),
       user=st.one_of(junk_text, junk_value), stamp=st.one_of(junk_text, junk_value))
def test_transcription_boundary_takes_junk(text: Any, user: Any, stamp: Any) -> None:
    """Junk transcription fields give a valid turn, no turn, ContractValueError (too
    long) or ContractTypeError (text that is not a str, counted invalid)."""
    frame = TranscriptionFrame("", "", "")
    frame.text, frame.user_id, frame.timestamp = text, user, stamp  # bypass validation
    if not isinstance(text, str):
        with pytest.raises(ContractTypeError, match=r"TranscriptionFrame\.text"):
            turn_from_frame(frame, turn_id="t1", max_query_chars=4096)
        return
    if isinstance(text, str) and len(text) > 4096 and text.strip():
        with pytest.raises(ContractValueError, match="max_query_chars"):
            turn_from_frame(frame, turn_id="t1", max_query_chars=4096)
        return
    turn = turn_from_frame(frame, turn_id="t1", max_query_chars=4096)
    if turn is not None:
        assert isinstance(turn.query, str) and turn.query == turn.query.strip()
        assert 0 < len(turn.query) <= 4096
        expected = user if isinstance(user, str) and user else "user"
        assert turn.participant_id == SURROGATE.sub("\ufffd", expected)
        assert not SURROGATE.search(turn.query)


@settings(max_examples=200, deadline=None)
@given(messages=st.one_of(junk_value, st.lists(junk_value, max_size=6),
                          st.lists(st.fixed_dictionaries(
                              {"role": st.sampled_from(["user", "assistant", 3]),
                               "content": junk_value}), max_size=6)))
def test_context_boundary_takes_junk_messages(messages: Any) -> None:
    """Junk or deeply nested context messages give a turn, no turn, or a named error."""
    context = LLMContext(messages)  # LLMContext takes any messages unchecked
    try:
        turn = turn_from_frame(LLMContextFrame(context), turn_id="t1")
    except ContractValueError:
        return
    assert turn is None or (turn.participant_id == "user" and turn.query.strip())


def test_unrelated_frames_carry_no_turn() -> None:
    """Frames that are not final user turns give None."""
    for frame in (TextFrame("hi"), TTSSpeakFrame("hi"), BotStartedSpeakingFrame(),
                  InterimTranscriptionFrame("hi", "a", "t"), TranscriptionFrame("  ", "a", "t")):
        assert turn_from_frame(frame, turn_id="t") is None


# ---------------------------------------------------------------- returned text, endings


def router_history(processor: TurnRouterProcessor) -> list[str]:
    return [e.assistant for e in processor.router.history_of("alice")]


def reply_router(reply: Reply, **kwargs: Any) -> AgentRouter:
    kwargs.setdefault("telemetry", Telemetry.disabled())
    return AgentRouter({"weather": reply}, ScriptedDecisions("weather"), **kwargs)


async def test_a_returned_answer_is_said_once_as_the_turns_answer() -> None:
    """A README-style destination behind the processor: its returned text is said once,
    as its own speech would be: the acknowledgment suppressed by its started(), the
    router's history holding what was said, first response and silence measured to the
    text's audio."""
    clock = ManualClock()
    observer = RecordingObserver()
    router = reply_router(Reply("Sunny, 24 degrees."), clock=clock, telemetry=observer,
                          overload=None, acknowledgment_delay_secs=0.5,
                          acknowledgment_llm=ScriptedLLM("One moment."))
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    speech = FakeSpeech(clock, ttfb=0.4)
    async with Pipe(Pipeline([processor, speech])) as pipe:
        await pipe.send(said("alice", "rain?"))
        await turns.wait(1)
        with anyio.fail_after(10):
            await clock.wait_for_sleepers(1)             # the TTS's first byte
        clock.advance(0.4)
        await pipe.next_down(TTSAudioRawFrame)
        history = router_history(processor)
        await pipe.end()
    assert speech.spoken == ["Sunny, 24 degrees."]
    assert spoken(pipe.seen) == ["Sunny, 24 degrees."]
    assert history == ["Sunny, 24 degrees."]
    ((turn, routed),) = turns.routed
    assert routed.route == "weather"
    acks = [e for e in observer.turns[turn.turn_id] if e[0] == "acknowledgment"]
    assert acks == [("acknowledgment", "weather", "suppressed", "delay")]
    heard = [event for event in observer.events if event[0] == "heard"]
    assert heard == [("heard", "weather", pytest.approx(0.4), pytest.approx(0.4))]


async def test_end_frame_lets_a_returned_answer_be_said_first() -> None:
    """EndFrame while a README-style destination works: its returned text is said
    before EndFrame leaves the processor (the call's last answer is heard)."""
    gate = anyio.Event()
    reply = Reply("Sunny.", gate=gate)
    processor = TurnRouterProcessor(reply_router(reply))
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await reply.entered.wait()
        await pipe.worker.queue_frame(EndFrame())
        await ManualClock.settle()
        assert reply.outcome == []               # EndFrame waits for the turn
        gate.set()
        await pipe.next_down(EndFrame)
        await pipe.end_wait()
    assert spoken(pipe.seen) == ["Sunny."]
    kinds = [type(frame) for frame in pipe.seen]
    assert kinds.index(TTSSpeakFrame) < kinds.index(EndFrame)


class SpeaksToo(FrameAgent):
    """Says its answer through the pipeline (as `how` says) and returns another text."""

    def __init__(self, how: str) -> None:
        super().__init__("weather", "forecasts")
        self.how = how

    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        if self.how == "say":
            await output.say("Sunny.")
        elif self.how == "unmarked":           # speech the destination did not call speech
            await output.push(TTSSpeakFrame("Sunny."), speech=False)
        else:                                   # the LLM downstream answers
            await output.push(LLMRunFrame())
        return "It will be sunny all day."


@pytest.mark.parametrize("how", ["say", "unmarked", "llm"])
async def test_a_destination_that_spoke_is_not_said_again(how: str) -> None:
    """A destination that said its answer through the pipeline (or handed it to the LLM
    downstream) and returned another text is heard once: its own speech."""
    router = build([SpeaksToo(how)], "weather")  # type: ignore[list-item]
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        await turns.wait(1)
        history = router_history(processor)
        await pipe.end()
    assert spoken(pipe.seen) == ([] if how == "llm" else ["Sunny."])
    assert [type(f) for f in pipe.seen if isinstance(f, LLMRunFrame)] == (
        [LLMRunFrame] if how == "llm" else [])
    assert history == ["It will be sunny all day."]


async def test_a_barged_in_turns_returned_answer_is_not_said() -> None:
    """An InterruptionFrame while the destination works interrupts its turn: what it
    would have returned is never said."""
    gate = anyio.Event()
    reply = Reply("Sunny.", gate=gate)
    processor = TurnRouterProcessor(reply_router(reply))
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await reply.entered.wait()
        await pipe.worker.queue_frame(InterruptionFrame())
        await pipe.next_down(InterruptionFrame)
        gate.set()
        assert processor.turns_in_flight == 0
        history = router_history(processor)
        await pipe.end()
    assert reply.outcome == ["CancelledError"]
    assert spoken(pipe.seen) == []
    assert history == []


async def test_a_replaced_turns_returned_answer_is_not_said() -> None:
    """The user speaks again while the destination works: the replaced turn's text is
    never said, the new turn's is, once."""
    reply = Reply("Sunny.", gate=anyio.Event())
    processor = TurnRouterProcessor(reply_router(reply))
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "rain?"))
        with anyio.fail_after(10):
            await reply.entered.wait()
        await pipe.send(said("alice", "rain tomorrow?"))
        await turns.wait(1)
        history = router_history(processor)
        await pipe.end()
    assert reply.outcome == ["CancelledError", "done"]
    assert [turn.query for turn, _ in turns.routed] == ["rain tomorrow?"]
    assert spoken(pipe.seen) == ["Sunny."]
    assert history == ["Sunny."]


class Pushed(BaseObserver):
    """The texts a `TurnRouterProcessor` pushes as `TTSSpeakFrame`s, seen as they leave
    it (an interruption may drop a frame from the next processor's queue before the
    sink sees it; this sees it anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    async def on_push_frame(self, data: FramePushed) -> None:
        if isinstance(data.frame, TTSSpeakFrame) and isinstance(
                data.source, TurnRouterProcessor):
            self.texts.append(data.frame.text)


@pytest.mark.parametrize("stop", [InterruptionFrame, CancelFrame])
async def test_an_answer_cut_after_it_returned_is_not_said(stop: type[Frame]) -> None:
    """An interruption (or the call cancelled) after the destination returned, while
    its turn still finishes (a release after the answer): the text is not said, not
    even once the turn completes, since the user barged in or the call ended."""
    agent = ScriptedAgent("weather", results=[DestinationResult("focus", "Booked."),
                                              DestinationResult("release", "Bye.")])
    router = build([agent], "weather")  # type: ignore[list-item]
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    pushed = Pushed()
    async with Pipe(processor) as pipe:
        pipe.worker.add_observer(pushed)
        await pipe.send(said("alice", "book a table"))
        await turns.wait(1)
        assert (await pipe.next_down(TTSSpeakFrame)).text == "Booked."
        gate = agent.release_gate = anyio.Event()
        await pipe.send(said("alice", "that's all"))
        with anyio.fail_after(10):
            await agent.release_entered.wait()  # answered; the release runs
        history = router_history(processor)
        await pipe.worker.queue_frame(stop())
        await ManualClock.settle()               # the processor took the frame in
        gate.set()
        if stop is InterruptionFrame:
            await turns.wait(2)
            await pipe.next_down(InterruptionFrame)
            await pipe.end()
        else:
            await pipe.end_wait()
            while not pipe.down.empty():
                pipe.seen.append(pipe.down.get_nowait())
    assert pushed.texts == spoken(pipe.seen) == ["Booked."]
    assert history == ["Booked.", "Bye."]


async def test_the_routers_clarification_is_said() -> None:
    """No usable choice: the router's clarification question is said, nothing else."""
    router = build([Agent("weather")], "clarify", clarification_text="Which city?")
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "hmm"))
        await turns.wait(1)
        await pipe.end()
    assert spoken(pipe.seen) == ["Which city?"]
    assert turns.routes == [None]


POLICY = OverloadPolicy(busy_lag_secs=0.1, shed_lag_secs=0.5, sample_secs=0.01,
                        busy_text="Busy, call back soon.")


async def busy_while_alice_waits(pipe: Pipe, reply: Reply, clock: ManualClock,
                                 router: AgentRouter) -> None:
    """Alice's turn admitted and waiting for its reply, then two lagging samples of the
    router's load sampler on the manual clock: the router is busy."""
    await pipe.send(said("alice", "rain?"))
    with anyio.fail_after(10):
        await reply.entered.wait()
    for _ in range(2):
        with anyio.fail_after(10):
            await clock.wait_for_sleepers(1)
        clock.advance(POLICY.sample_secs + 0.2)
        await ManualClock.settle()
    assert router.busy


async def test_the_busy_text_is_said_to_a_shed_turn() -> None:
    """A saturated router sheds a newcomer's turn: the busy text is said to it, the
    turn fails with RouterBusyError, and the admitted caller still gets its answer."""
    clock = ManualClock()
    gate = anyio.Event()
    reply = Reply("Sunny.", gate=gate)
    router = reply_router(reply, clock=clock, overload=POLICY)
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await busy_while_alice_waits(pipe, reply, clock, router)
        await pipe.send(said("bob", "hello?"))
        assert (await pipe.next_down(TTSSpeakFrame)).text == "Busy, call back soon."
        await turns.wait(1)
        assert [type(error) for _, error in turns.failed] == [RouterBusyError]
        gate.set()
        await turns.wait(2)
        await pipe.end()
    assert reply.outcome == ["done"]
    assert spoken(pipe.seen) == ["Busy, call back soon.", "Sunny."]


async def test_newcomers_a_busy_router_refuses_take_no_admitted_callers_place(
        caplog: pytest.LogCaptureFixture) -> None:
    """max_turns=1 and alice's turn running when three newcomers speak to a busy router:
    each hears the busy text, and alice's turn is not cancelled to make room for turns
    that cannot run (before: the bound cancelled it, and she heard nothing). The
    refusals are logged once, not once per turn."""
    clock = ManualClock()
    gate = anyio.Event()
    reply = Reply("Sunny.", gate=gate)
    router = reply_router(reply, clock=clock, overload=POLICY)
    processor = TurnRouterProcessor(router, max_turns=1)
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await busy_while_alice_waits(pipe, reply, clock, router)
        await pipe.send(*(said(f"guest{i}", "hello?") for i in range(3)))
        await turns.wait(3)
        assert [type(error) for _, error in turns.failed] == [RouterBusyError] * 3
        gate.set()
        await turns.wait(4)
        await pipe.end()
    assert reply.outcome == ["done"]
    assert spoken(pipe.seen) == ["Busy, call back soon."] * 3 + ["Sunny."]
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("turnrouter")]
    assert not any("failed" in m for m in messages), messages
    assert [m for m in messages if "busy router" in m] == [
        "pipecat turns refused by a busy router: 1 so far in this pipeline"]


async def test_the_dropped_turn_text_is_said() -> None:
    """More turns wait behind a running one than max_waiting_turns: the oldest waiting
    turn is dropped and the router's dropped-turn text is said; the newest is answered."""
    agent = ScriptedAgent("weather", admissions=[Admission("release"), "accept"])
    agent.release_gate = gate = anyio.Event()
    router = build([agent], "weather", max_waiting_turns=1)  # type: ignore[list-item]
    processor = TurnRouterProcessor(router)
    turns = Turns(processor)
    async with Pipe(processor) as pipe:
        await pipe.send(said("alice", "one"))
        with anyio.fail_after(10):
            await agent.release_entered.wait()  # turn one cannot be cut while it releases
        await pipe.send(said("alice", "two"), said("alice", "three"))
        dropped = await pipe.next_down(TTSSpeakFrame)
        gate.set()
        await turns.wait(1)
        await pipe.end()
    assert "repeat" in dropped.text
    assert [turn.query for turn, _ in turns.routed] == ["three"]
    assert spoken(pipe.seen) == [dropped.text, "weather answer"]
