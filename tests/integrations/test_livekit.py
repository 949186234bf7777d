"""The LiveKit adapter driven through LiveKit Agents' own text-mode `AgentSession`."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.trace import NoOpTracerProvider

pytest.importorskip("livekit.agents", reason="needs the livekit extra")

from livekit.agents import (
    Agent,
    AgentSession,
    AgentStateChangedEvent,
    RunResult,
    llm,
)
from livekit.agents.llm import ChatChunk, ChoiceDelta
from livekit.agents.telemetry import set_tracer_provider
from livekit.agents.types import (
    DEFAULT_API_CONNECT_OPTIONS,
    NOT_GIVEN,
    APIConnectOptions,
    NotGivenOr,
)
from livekit.agents.voice.io import TextOutput

from turnrouter import (
    MAX_ID_CHARS,
    Admission,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContextPatch,
    ContractTypeError,
    ContractValueError,
    DestinationResult,
    LifecycleError,
    OverloadPolicy,
    RouterBusyError,
    RoutingAid,
)
from turnrouter.integrations.livekit import (
    HandoffDestination,
    LLMDestination,
    RouterAgent,
    TurnEnd,
    speak,
    stop_gracefully,
)
from turnrouter.telemetry import Telemetry
from turnrouter.testing import (
    ManualClock,
    ScriptedAgent,
    ScriptedDecisions,
    ScriptedLLM,
    TelemetryCapture,
)

from .readme_reply import Reply

pytestmark = pytest.mark.anyio

Started = Callable[[], Awaitable[None]]


async def _say(turn: AgentTurn, route: str, text: str) -> None:
    await speak(text)


def speaking(name: str, **kwargs: Any) -> ScriptedAgent:
    """A scripted destination that says its answer in the LiveKit session."""
    return ScriptedAgent(name, output=_say, **kwargs)


class Ends:
    """`on_turn_end` recorder with a bounded wait."""

    def __init__(self) -> None:
        self.items: list[TurnEnd] = []
        self._changed = asyncio.Event()

    def __call__(self, end: TurnEnd) -> None:
        self.items.append(end)
        self._changed.set()

    async def wait(self, count: int = 1) -> list[TurnEnd]:
        with anyio.fail_after(5):
            while len(self.items) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.items


class TwoParts:
    """A destination that says one part, waits for `gate`, then says a second part."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.gate = asyncio.Event()
        self.first_said = asyncio.Event()
        self.cancelled = False
        self.speakers: list[str] = []
        self._spoke = asyncio.Event()

    async def wait_speakers(self, count: int) -> None:
        """Wait (bounded) until `count` turns said their first part."""
        with anyio.fail_after(5):
            while len(self.speakers) < count:
                self._spoke.clear()
                await self._spoke.wait()

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid(self.name, f"handles {self.name}")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        await speak("Part one.", started=started)
        self.first_said.set()
        self.speakers.append(turn.participant_id)
        self._spoke.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        await speak(" Part two.")
        return DestinationResult("answer", "Part one. Part two.")

    async def release(self, participant_id: str) -> None:
        return None


class Slow:
    """A destination that starts speaking only once `gate` opens."""

    def __init__(self, name: str, *, gated: bool) -> None:
        self.name = name
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.entered = asyncio.Event()

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid(self.name, f"handles {self.name}")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        self.entered.set()
        await self.gate.wait()
        text = await speak(f"{self.name} answer", started=started)
        return DestinationResult("answer", text)

    async def release(self, participant_id: str) -> None:
        return None


class FakeStream(llm.LLMStream):
    async def _run(self) -> None:
        reply = self._llm.reply  # type: ignore[attr-defined]
        for index, word in enumerate(reply.split(" ")):
            text = word if index == 0 else f" {word}"
            self._event_ch.send_nowait(ChatChunk(id=f"c{index}", delta=ChoiceDelta(
                role="assistant", content=text)))


class FakeLLM(llm.LLM[Any]):
    """A LiveKit LLM streaming a fixed reply word by word; records the prompts."""

    def __init__(self, reply: str) -> None:
        super().__init__()
        self.reply = reply
        self.prompts: list[llm.ChatContext] = []

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
        self.prompts.append(chat_ctx)
        return FakeStream(self, chat_ctx=chat_ctx, tools=tools or [],
                          conn_options=conn_options)


class GatedText(TextOutput):
    """A session text output that holds the first text it gets until `gate` opens."""

    def __init__(self) -> None:
        super().__init__(label="gated", next_in_chain=None)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def capture_text(self, text: str) -> None:
        self.entered.set()
        await self.gate.wait()

    def flush(self) -> None:
        return None


def said(result: RunResult[Any]) -> list[str]:
    """The assistant messages a run recorded, in order."""
    texts = []
    for event in result.events:
        if event.type == "message" and event.item.role == "assistant":
            texts.append(event.item.text_content or "")
    return texts


def make_router(*agents: Any, decisions: Any, **kwargs: Any) -> AgentRouter:
    kwargs.setdefault("telemetry", Telemetry.disabled())
    return AgentRouter({agent.name: agent for agent in agents}, decisions, **kwargs)


@asynccontextmanager
async def session_for(router: AgentRouter, participant_id: str = "alice",
                      **kwargs: Any) -> AsyncIterator[tuple[AgentSession[Any], Ends]]:
    ends = Ends()
    session: AgentSession[Any] = AgentSession()
    await session.start(RouterAgent(router, participant_id=participant_id,
                                    on_turn_end=ends, **kwargs))
    try:
        yield session, ends
    finally:
        await session.aclose()


async def run(session: AgentSession[Any], text: str) -> RunResult[Any]:
    with anyio.fail_after(5):
        return await session.run(user_input=text)


# ---------------------------------------------------------------- routing


async def test_a_turn_is_routed_and_the_answer_is_said() -> None:
    """The router's choice answers; its text is the session's reply."""
    weather, music = speaking("weather"), speaking("music")
    router = make_router(weather, music, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        result = await run(session, "will it rain?")
        assert said(result) == ["weather answer"]
        end = (await ends.wait())[0]
    assert end.routed is not None and end.routed.route == "weather"
    assert weather.calls[-1].query == "will it rain?"
    assert music.count("answer") == 0


async def test_blank_and_over_long_messages_are_no_turns() -> None:
    """A blank user message is no turn, and one over `max_query_chars` is refused and
    counted `oversized`, as the Pipecat adapter does; before, both were routed (a
    100,000-character message then sat in the history). The next message is routed."""
    weather = speaking("weather")
    with TelemetryCapture() as capture:
        router = make_router(weather, decisions=ScriptedDecisions("weather"),
                             telemetry=capture.telemetry)
        async with session_for(router, max_query_chars=50) as (session, ends):
            assert said(await run(session, "   ")) == []
            assert said(await run(session, "x" * 51)) == []
            assert said(await run(session, "rain?")) == ["weather answer"]
            await ends.wait()
        assert [call.query for call in weather.calls if call.method == "answer"] == ["rain?"]
        assert capture.value("turnrouter_runtime_rejected_messages_total",
                             topic="livekit", reason="oversized") == 1
    with pytest.raises(ConfigurationError, match="max_query_chars"):
        RouterAgent(router, max_query_chars=0)


async def test_the_default_answers_after_declines() -> None:
    """Declined routes fall back to the default destination."""
    weather = speaking("weather", admissions="decline")
    music = speaking("music", admissions="decline")
    chat = speaking("conversation")
    router = make_router(weather, music, chat,
                         decisions=ScriptedDecisions("weather", "music"))
    async with session_for(router) as (session, ends):
        result = await run(session, "hello")
        assert said(result) == ["conversation answer"]
        end = (await ends.wait())[0]
    assert end.routed is not None and end.routed.route == "conversation"


async def test_turn_ids_are_livekit_message_ids_and_history_builds_up() -> None:
    """Each user message is one turn (its LiveKit item id); answers enter history."""
    weather = speaking("weather")
    router = make_router(weather, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        await run(session, "one")
        await run(session, "two")
        first, second = await ends.wait(2)
        user_ids = [item.id for item in session.history.items
                    if isinstance(item, llm.ChatMessage) and item.role == "user"]
    assert [first.turn.turn_id, second.turn.turn_id] == user_ids
    assert [exchange.user for exchange in router.history_of("alice")] == ["one", "two"]


async def test_a_clarification_is_said() -> None:
    """With no usable choice the router's clarification question is the reply."""
    weather = speaking("weather")
    router = make_router(weather, decisions=ScriptedDecisions("clarify"),
                         clarification_text="Which one?")
    async with session_for(router) as (session, ends):
        result = await run(session, "hmm")
        assert said(result) == ["Which one?"]
        end = (await ends.wait())[0]
    assert end.routed is not None and end.routed.route is None


async def test_a_preamble_is_said_before_the_answer_in_the_turns_reply() -> None:
    """An admission preamble is said first, in the one reply of the turn."""
    weather = speaking("weather", admissions=Admission("accept", preamble="Let me see."))
    router = make_router(weather, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, _):
        result = await run(session, "rain?")
    assert said(result) == ["Let me see. weather answer"]


async def test_a_failing_turn_end_callback_does_not_stop_the_next_turn() -> None:
    """An on_turn_end callback that raises is logged; routing goes on."""
    calls: list[str] = []

    def broken(end: TurnEnd) -> None:
        calls.append(end.turn.query)
        raise RuntimeError("callback bug")

    router = make_router(speaking("weather"), decisions=ScriptedDecisions("weather"))
    session: AgentSession[Any] = AgentSession()
    await session.start(RouterAgent(router, participant_id="alice", on_turn_end=broken))
    try:
        await run(session, "one")
        result = await run(session, "two")
    finally:
        await session.aclose()
    assert said(result) == ["weather answer"]
    assert calls == ["one", "two"]


async def test_a_held_patch_question_is_said_in_the_participants_session() -> None:
    """Control text outside any turn reaches the right session of a shared router."""
    router = make_router(speaking("weather"), decisions=ScriptedDecisions("weather"))
    asked = asyncio.Event()
    heard: dict[str, list[str]] = {"alice": [], "bob": []}
    async with session_for(router, "alice") as (alice, _), \
            session_for(router, "bob") as (bob, _):
        for name, session in (("alice", alice), ("bob", bob)):
            await run(session, "rain?")

            def record(event: Any, name: str = name) -> None:
                if event.item.role == "assistant":
                    heard[name].append(event.item.text_content or "")
                    asked.set()

            session.on("conversation_item_added", record)
        await router.apply_context_patch(
            "bob", ContextPatch(task_id="booking", digest=("Table for two at 8",)),
            "human_gated")
        with anyio.fail_after(5):
            await asked.wait()
    assert heard["alice"] == []
    assert len(heard["bob"]) == 1 and "Table for two at 8" in heard["bob"][0]


async def test_a_patch_question_without_a_session_stays_held() -> None:
    """With the participant's session closed, the question fails and the patch waits."""
    router = make_router(speaking("weather"), decisions=ScriptedDecisions("weather"))
    async with session_for(router, depart_on_close=False) as (session, _):
        await run(session, "rain?")
    held = await router.apply_context_patch(
        "alice", ContextPatch(task_id="booking", digest=("Table for two at 8",)),
        "human_gated")
    assert router.pending_patches("alice") == (held,)


# ---------------------------------------------------------------- acknowledgments


async def _acknowledged_run(gated: bool, weather: Slow | None = None,
                            **kwargs: Any) -> list[str]:
    """A turn of `weather` (gated: it waits past the acknowledgment's delay once
    `entered`); the assistant messages said."""
    clock = ManualClock()
    weather = weather or Slow("weather", gated=gated)
    router = make_router(weather, decisions=ScriptedDecisions("weather"), clock=clock,
                         acknowledgment_llm=ScriptedLLM("One moment."),
                         acknowledgment_delay_secs=0.5, **kwargs)
    async with session_for(router) as (session, ends):
        pending: RunResult[Any] = session.run(user_input="what's the forecast?")
        if gated:
            with anyio.fail_after(5):
                await weather.entered.wait()
                await clock.wait_for_sleepers()
            clock.advance(1.0)
            await clock.settle()                 # the acknowledgment is said
            weather.gate.set()
        with anyio.fail_after(5):
            result = await pending
        await ends.wait()
    return said(result)


async def test_an_acknowledgment_is_said_before_a_slow_answer() -> None:
    """A slow answer is preceded by the acknowledgment, in the turn's one reply."""
    texts = await _acknowledged_run(gated=True)
    assert texts == ["One moment. weather answer"]


async def test_no_acknowledgment_before_a_fast_answer() -> None:
    """An answer that starts before the acknowledgment is due is said alone."""
    texts = await _acknowledged_run(gated=False)
    assert texts == ["weather answer"]


class SaysWithoutStarted(Slow):
    """Says its answer with `speak()` but forgets `started=`, then takes a while."""

    def __init__(self, name: str) -> None:
        super().__init__(name, gated=True)

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        await speak("Light rain.")
        self.entered.set()
        await self.gate.wait()
        return DestinationResult("answer", "Light rain.")


async def test_an_acknowledgment_due_after_the_answer_was_said_is_not_said(
        caplog: pytest.LogCaptureFixture) -> None:
    """A destination that says its answer with `speak()` without `started=` leaves the
    acknowledgment pending: when it comes due, after the answer's text, it is not said
    (it played after the answer: voice17 F3) but counted as a failed acknowledgment
    and logged naming the fix."""
    with TelemetryCapture() as capture, caplog.at_level(logging.DEBUG, logger="turnrouter"):
        texts = await _acknowledged_run(True, SaysWithoutStarted("weather"),
                                        telemetry=capture.telemetry)
        assert capture.value("turnrouter_acknowledgments_total", route="weather",
                             outcome="failed", trigger="delay") == 1
    assert texts == ["Light rain."]
    assert any("started=started" in record.getMessage() for record in caplog.records)


# ---------------------------------------------------------------- interruptions


async def test_barge_in_before_the_answer_interrupts_the_turn() -> None:
    """A LiveKit interruption while the route admits cancels the router's turn."""
    weather = speaking("weather")
    weather.admit_gate = anyio.Event()
    router = make_router(weather, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        pending: RunResult[Any] = session.run(user_input="rain?")
        with anyio.fail_after(5):
            await weather.admit_entered.wait()
        await session.interrupt()
        end = (await ends.wait())[0]
        with anyio.fail_after(5):
            result = await pending
    assert end.interrupted and end.routed is None
    assert weather.cancelled == ["admit"]
    assert said(result) == []


async def test_barge_in_during_the_answer_cuts_it() -> None:
    """Interrupting the answer's speech cancels the destination mid-answer."""
    parts = TwoParts("weather")
    router = make_router(parts, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        speaking_now = asyncio.Event()

        def on_state(event: AgentStateChangedEvent) -> None:
            if event.new_state == "speaking":
                speaking_now.set()

        session.on("agent_state_changed", on_state)
        pending: RunResult[Any] = session.run(user_input="rain?")
        with anyio.fail_after(5):
            await parts.first_said.wait()
            await speaking_now.wait()
        await session.interrupt()
        end = (await ends.wait())[0]
        with anyio.fail_after(5):
            result = await pending
    assert end.interrupted
    assert parts.cancelled
    assert said(result) == ["Part one."]
    assert router.history_of("alice") == ()


async def test_a_new_turn_replaces_the_running_one() -> None:
    """A second user message cancels the first turn's answer; the second is said."""
    parts = TwoParts("weather")
    router = make_router(parts, speaking("music"),
                         decisions=ScriptedDecisions("weather", "music"))
    async with session_for(router) as (session, ends):
        session.generate_reply(user_input="rain?")
        with anyio.fail_after(5):
            await parts.first_said.wait()
        result = await run(session, "play jazz")
        first, second = await ends.wait(2)
    assert first.interrupted and parts.cancelled
    assert second.routed is not None and second.routed.route == "music"
    assert said(result) == ["music answer"]
    assert [exchange.user for exchange in router.history_of("alice")] == ["play jazz"]


async def test_the_replaced_turns_cut_speech_does_not_interrupt_its_successor() -> None:
    """Cutting the replaced turn's speech never interrupts the (slow) turn replacing it."""
    parts, music = TwoParts("weather"), Slow("music", gated=True)
    router = make_router(parts, music, decisions=ScriptedDecisions("weather", "music"))
    async with session_for(router) as (session, ends):
        session.generate_reply(user_input="rain?")
        with anyio.fail_after(5):
            await parts.first_said.wait()
        pending: RunResult[Any] = session.run(user_input="play jazz")
        with anyio.fail_after(5):
            await music.entered.wait()
        first = (await ends.wait())[0]
        await ManualClock.settle()                  # the cut speech's callbacks have run
        music.gate.set()
        with anyio.fail_after(5):
            result = await pending
        second = (await ends.wait(2))[1]
    assert first.interrupted and not second.interrupted
    assert said(result) == ["music answer"]


# ---------------------------------------------------------------- returned text


def assistant_said(session: AgentSession[Any]) -> list[str]:
    """The assistant messages of the session's history (what LiveKit recorded as said)."""
    return [item.text_content or "" for item in session.history.items
            if isinstance(item, llm.ChatMessage) and item.role == "assistant"]


async def test_a_returned_answer_is_said_once() -> None:
    """A README-style destination behind RouterAgent: its returned text is the turn's
    reply, said once, in LiveKit's history and the router's; a pending acknowledgment
    is suppressed by its started()."""
    clock = ManualClock()
    router = make_router(Reply("Sunny, 24 degrees."), decisions=ScriptedDecisions("weather"),
                         clock=clock, acknowledgment_llm=ScriptedLLM("One moment."),
                         acknowledgment_delay_secs=0.5)
    async with session_for(router) as (session, ends):
        result = await run(session, "rain?")
        end = (await ends.wait())[0]
        clock.advance(1.0)                        # past the acknowledgment's delay
        await ManualClock.settle()
        assert assistant_said(session) == ["Sunny, 24 degrees."]
        history = [exchange.assistant for exchange in router.history_of("alice")]
    assert said(result) == ["Sunny, 24 degrees."]
    assert history == ["Sunny, 24 degrees."]
    assert end.routed is not None and end.routed.route == "weather" and not end.interrupted


async def test_graceful_end_says_a_returned_answer_in_flight() -> None:
    """stop_gracefully while a README-style destination works: the turn finishes and
    its returned text is the reply the drained session plays."""
    gate = anyio.Event()
    reply = Reply("Sunny.", gate=gate)
    router = make_router(reply, decisions=ScriptedDecisions("weather"))
    async with session_for(router, depart_on_close=False) as (session, ends):
        pending: RunResult[Any] = session.run(user_input="rain?")
        with anyio.fail_after(5):
            await reply.entered.wait()
        stopping = asyncio.ensure_future(stop_gracefully(router, session))
        await ManualClock.settle()
        assert not stopping.done() and reply.outcome == []
        gate.set()
        with anyio.fail_after(5):
            await stopping
            result = await pending
        end = (await ends.wait())[0]
    assert not end.interrupted and reply.outcome == ["done"]
    assert said(result) == ["Sunny."]


async def test_a_destination_that_spoke_is_not_said_again() -> None:
    """A destination that said its answer with speak() and returned another text is
    heard once: its own speech."""

    class Both(Reply):
        async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
            await speak("Sunny.", started=started)
            return DestinationResult(text="It will be sunny all day.")

    router = make_router(Both(""), decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        result = await run(session, "rain?")
        await ends.wait()
        history = [exchange.assistant for exchange in router.history_of("alice")]
    assert said(result) == ["Sunny."]
    assert history == ["It will be sunny all day."]


async def test_a_barged_in_turns_returned_answer_is_not_said() -> None:
    """Interrupted while the destination works: its text is never said."""
    gate = anyio.Event()
    reply = Reply("Sunny.", gate=gate)
    router = make_router(reply, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        pending: RunResult[Any] = session.run(user_input="rain?")
        with anyio.fail_after(5):
            await reply.entered.wait()
        await session.interrupt()
        end = (await ends.wait())[0]
        gate.set()
        with anyio.fail_after(5):
            result = await pending
        assert assistant_said(session) == []
    assert end.interrupted and reply.outcome == ["CancelledError"]
    assert said(result) == []


async def test_a_replaced_turns_returned_answer_is_not_said() -> None:
    """A new user message while the destination works: the replaced turn's text is
    never said; the new turn's is, once."""
    reply = Reply("Sunny.", gate=anyio.Event())
    router = make_router(reply, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        session.generate_reply(user_input="rain?")
        with anyio.fail_after(5):
            await reply.entered.wait()
        result = await run(session, "rain tomorrow?")
        first, second = await ends.wait(2)
        assert assistant_said(session) == ["Sunny."]
    assert first.interrupted and not second.interrupted
    assert reply.outcome == ["CancelledError", "done"]
    assert said(result) == ["Sunny."]


@pytest.mark.parametrize("stop", ["interrupt", "close"])
async def test_an_answer_cut_after_it_returned_is_not_said(stop: str) -> None:
    """Interrupted (or the session closed) after the destination returned, while its
    turn still finishes (a release after the answer): the text is not said, not even
    once the turn completes."""
    agent = ScriptedAgent("weather", results=[DestinationResult("focus", "Booked."),
                                              DestinationResult("release", "Bye.")])
    router = make_router(agent, decisions=ScriptedDecisions("weather"))
    async with session_for(router, depart_on_close=False) as (session, ends):
        assert said(await run(session, "book a table")) == ["Booked."]
        gate = agent.release_gate = anyio.Event()
        session.generate_reply(user_input="that's all")
        with anyio.fail_after(5):
            await agent.release_entered.wait()  # answered; the release runs
        if stop == "interrupt":
            await session.interrupt()
        else:
            await session.aclose()
        await ManualClock.settle()               # LiveKit dropped the reply
        gate.set()
        second = (await ends.wait(2))[1]
        history = [exchange.assistant for exchange in router.history_of("alice")]
        assert assistant_said(session) == ["Booked."]
    assert second.routed is not None and second.routed.result.text == "Bye."
    assert second.error is None and not second.interrupted
    assert history == ["Booked.", "Bye."]


POLICY = OverloadPolicy(busy_lag_secs=0.1, shed_lag_secs=0.5, sample_secs=0.01,
                        busy_text="Busy, call back soon.")


async def test_the_busy_text_is_said_to_a_shed_turn(caplog: pytest.LogCaptureFixture) -> None:
    """A saturated router sheds a newcomer's turn: the busy text is its reply and the
    turn ends with RouterBusyError; the admitted caller still gets its answer. The
    refusal is no failure line of its own (a spike logged one per refused turn)."""
    clock = ManualClock()
    gate = anyio.Event()
    reply = Reply("Sunny.", gate=gate)
    router = make_router(reply, decisions=ScriptedDecisions("weather"), clock=clock,
                         overload=POLICY)
    async with session_for(router, "alice") as (alice, alice_ends), \
            session_for(router, "bob") as (bob, bob_ends):
        pending: RunResult[Any] = alice.run(user_input="rain?")
        with anyio.fail_after(5):
            await reply.entered.wait()
        for _ in range(2):                       # two lagging samples: busy
            with anyio.fail_after(5):
                await clock.wait_for_sleepers(1)
            clock.advance(POLICY.sample_secs + 0.2)
            await ManualClock.settle()
        assert router.busy
        shed = await run(bob, "hello?")
        (end,) = await bob_ends.wait()
        gate.set()
        with anyio.fail_after(5):
            answered = await pending
        await alice_ends.wait()
    assert said(shed) == ["Busy, call back soon."]
    assert isinstance(end.error, RouterBusyError) and end.routed is None
    assert said(answered) == ["Sunny."]
    assert not [r for r in caplog.records if "RouterBusyError" in r.getMessage()]


async def test_the_dropped_turn_text_is_said() -> None:
    """More turns wait behind a running one than max_waiting_turns: the oldest waiting
    turn is dropped and the router's dropped-turn text is said in its reply; the newest
    is answered (README-style: its returned text)."""
    agent = ScriptedAgent("weather", admissions=[Admission("release"), "accept"])
    agent.release_gate = gate = anyio.Event()
    router = make_router(agent, decisions=ScriptedDecisions("weather"), max_waiting_turns=1)
    async with session_for(router) as (session, ends):
        handles = [session.generate_reply(user_input="one")]
        with anyio.fail_after(5):
            await agent.release_entered.wait()  # turn one cannot be cut while it releases
        handles += [session.generate_reply(user_input=text) for text in ("two", "three")]
        await ends.wait(1)                      # turn two was dropped
        gate.set()
        items = await ends.wait(3)
        for handle in handles:
            with anyio.fail_after(5):
                await handle
        replies = assistant_said(session)
    assert [(end.turn.query, end.interrupted) for end in items] == [
        ("two", True), ("one", True), ("three", False)]
    assert len(replies) == 2 and "repeat" in replies[0]
    assert replies[1] == "weather answer"


# ---------------------------------------------------------------- failures and users


async def test_a_failing_destination_says_the_failure_text() -> None:
    """A destination failing before it spoke gets the router's failure text."""
    weather = speaking("weather", results=RuntimeError("backend down"))
    router = make_router(weather, decisions=ScriptedDecisions("weather"),
                         failure_text="Sorry, that failed.")
    async with session_for(router) as (session, ends):
        result = await run(session, "rain?")
        end = (await ends.wait())[0]
    assert said(result) == ["Sorry, that failed."]
    assert isinstance(end.error, RuntimeError) and end.routed is None


async def test_closing_the_session_interrupts_the_running_turn() -> None:
    """A session closed mid-turn cancels the turn (LiveKit cancels its reply)."""
    weather = Slow("weather", gated=True)
    router = make_router(weather, decisions=ScriptedDecisions("weather"))
    async with session_for(router, depart_on_close=False) as (session, ends):
        session.generate_reply(user_input="rain?")
        with anyio.fail_after(5):
            await weather.entered.wait()
    end = (await ends.wait())[0]
    assert end.interrupted and end.routed is None
    assert router.history_of("alice") == ()


async def test_speak_after_the_turn_ended_is_refused() -> None:
    """Text a destination tries to say after its turn ended raises LifecycleError."""
    late: list[BaseException] = []
    done = asyncio.Event()

    class Lingering(Slow):
        async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
            result = await super().answer(turn, started=started)
            asyncio.get_running_loop().create_task(self.later())
            return result

        async def later(self) -> None:
            await self.gate.wait()
            try:
                await speak("too late")
            except LifecycleError as exc:
                late.append(exc)
            done.set()

    router = make_router(Lingering("weather", gated=False),
                         decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, ends):
        result = await run(session, "rain?")
        await ends.wait()
        with anyio.fail_after(5):
            await done.wait()
    assert said(result) == ["weather answer"]
    assert len(late) == 1 and "ended" in str(late[0])


async def test_failure_logs_carry_no_user_text(caplog: pytest.LogCaptureFixture) -> None:
    """A failing destination's message (which may quote the user) stays out of warnings."""
    weather = speaking("weather", results=RuntimeError("secret: my card is 4242"))
    router = make_router(weather, decisions=ScriptedDecisions("weather"))
    caplog.set_level(logging.WARNING)
    async with session_for(router) as (session, ends):
        await run(session, "rain?")
        await ends.wait()
    assert "RuntimeError" in caplog.text
    assert "4242" not in caplog.text


async def test_two_users_in_two_sessions_run_concurrently() -> None:
    """Two sessions on one router: each participant's turn is its own and concurrent."""
    parts = TwoParts("weather")
    router = make_router(parts, decisions=ScriptedDecisions("weather"))
    async with session_for(router, "alice") as (alice, alice_ends), \
            session_for(router, "bob") as (bob, bob_ends):
        first: RunResult[Any] = alice.run(user_input="rain in Paris?")
        second: RunResult[Any] = bob.run(user_input="rain in Rome?")
        await parts.wait_speakers(2)                     # both answers are under way
        parts.gate.set()
        with anyio.fail_after(5):
            alice_result, bob_result = await first, await second
        await alice_ends.wait()
        await bob_ends.wait()
        assert [e.user for e in router.history_of("alice")] == ["rain in Paris?"]
        assert [e.user for e in router.history_of("bob")] == ["rain in Rome?"]
    assert sorted(parts.speakers) == ["alice", "bob"]
    assert said(alice_result) == said(bob_result) == ["Part one. Part two."]


async def test_closing_the_session_departs_the_participant() -> None:
    """The session's close releases the participant's state in the router."""
    weather = speaking("weather")
    router = make_router(weather, decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, _):
        await run(session, "rain?")
        assert router.participants == frozenset({"alice"})
    with anyio.fail_after(5):
        await weather.release_entered.wait()
    assert weather.calls[-1].method == "release"
    assert weather.calls[-1].participant_id == "alice"


async def test_graceful_end_lets_the_running_turn_finish() -> None:
    """stop_gracefully drains the turn in flight, then stops the router."""
    parts = TwoParts("weather")
    router = make_router(parts, decisions=ScriptedDecisions("weather"))
    async with session_for(router, depart_on_close=False) as (session, ends):
        pending: RunResult[Any] = session.run(user_input="rain?")
        with anyio.fail_after(5):
            await parts.first_said.wait()
        stopping = asyncio.ensure_future(stop_gracefully(router))
        await ManualClock.settle()                       # every task ran until blocked
        assert not stopping.done() and not parts.cancelled   # stop waits, cancels nothing
        parts.gate.set()
        with anyio.fail_after(5):
            await stopping
            result = await pending
        end = (await ends.wait())[0]
    assert not end.interrupted and not parts.cancelled
    assert said(result) == ["Part one. Part two."]
    with pytest.raises(LifecycleError):
        await router.route_turn(AgentTurn("alice", "late", "hello?"))


async def test_graceful_end_is_bounded() -> None:
    """Past its timeout, stop_gracefully stops anyway and the turn is interrupted."""
    parts = TwoParts("weather")
    router = make_router(parts, decisions=ScriptedDecisions("weather"))
    async with session_for(router, depart_on_close=False) as (session, ends):
        session.generate_reply(user_input="rain?")
        with anyio.fail_after(5):
            await parts.first_said.wait()
            await stop_gracefully(router, timeout_secs=0.01)
        end = (await ends.wait())[0]
    assert end.interrupted and parts.cancelled


async def test_a_session_sharing_the_router_ends_without_stopping_it() -> None:
    """Two sessions of one job on one router: `stop_gracefully(router, alice,
    owns_router=False)` lets alice depart (her destination released) and leaves the
    router running for bob, his history kept. Before, only stopping the router was
    possible: bob's next turn saw an empty history (newcomer20 F2)."""
    weather = speaking("weather")
    router = make_router(weather, decisions=ScriptedDecisions("weather"))
    async with session_for(router, "alice", depart_on_close=False) as (alice, _), \
            session_for(router, "bob") as (bob, _):
        await run(alice, "rain in Paris?")
        await run(bob, "rain in Rome?")
        with anyio.fail_after(5):
            await stop_gracefully(router, alice, timeout_secs=5, owns_router=False)
        assert [(call.method, call.participant_id) for call in weather.calls
                if call.method == "release"] == [("release", "alice")]
        assert router.participants == frozenset({"bob"})
        await run(bob, "and tomorrow?")
        assert [e.user for e in router.history_of("bob")] == ["rain in Rome?",
                                                               "and tomorrow?"]
    await router.stop()


async def test_a_shared_routers_session_ending_waits_for_its_own_turn_only() -> None:
    """`owns_router=False` waits for the given session's turn in flight, and past its
    timeout interrupts that one only: the other session's turn still running answers."""
    parts = TwoParts("weather")
    router = make_router(parts, decisions=ScriptedDecisions("weather"))
    async with session_for(router, "alice", depart_on_close=False) as (alice, alice_ends), \
            session_for(router, "bob") as (bob, bob_ends):
        alice.generate_reply(user_input="rain in Paris?")
        second: RunResult[Any] = bob.run(user_input="rain in Rome?")
        await parts.wait_speakers(2)
        with anyio.fail_after(5):
            await stop_gracefully(router, alice, timeout_secs=0.01, owns_router=False)
        assert (await alice_ends.wait())[0].interrupted
        parts.gate.set()
        with anyio.fail_after(5):
            bob_result = await second
        bob_end = (await bob_ends.wait())[0]
        assert not bob_end.interrupted
        assert said(bob_result) == ["Part one. Part two."]
    await router.stop()


@pytest.mark.parametrize("with_bob", [False, True])
async def test_stopping_a_router_other_sessions_use_is_warned_about(
        with_bob: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The default (`owns_router=True`) stops the router for every session: when another
    open session still routes through it, a WARNING names `owns_router=False`; stopped
    with all its sessions, nothing is said."""
    router = make_router(speaking("weather"), decisions=ScriptedDecisions("weather"))
    async with session_for(router, "alice", depart_on_close=False) as (alice, _), \
            session_for(router, "bob", depart_on_close=False) as (bob, _):
        await run(alice, "rain?")
        await run(bob, "rain?")
        with caplog.at_level(logging.WARNING, "turnrouter.integrations.livekit"):
            await stop_gracefully(router, *((alice, bob) if with_bob else (alice,)),
                                  timeout_secs=5)
    if with_bob:
        assert "owns_router" not in caplog.text
    else:
        assert "owns_router=False" in caplog.text and "1 other open" in caplog.text


# ---------------------------------------------------------------- destinations


async def test_llm_destination_streams_a_livekit_llm() -> None:
    """LLMDestination prompts a LiveKit LLM with history and says its stream."""
    model = FakeLLM("It will be sunny.")
    router = make_router(LLMDestination("weather", "forecasts", model,
                                        instructions="You forecast."),
                         decisions=ScriptedDecisions("weather"))
    async with session_for(router) as (session, _):
        await run(session, "first?")
        result = await run(session, "rain?")
    assert said(result) == ["It will be sunny."]
    prompt = [(m.role, m.text_content) for m in model.prompts[-1].messages()]
    assert prompt == [("system", "You forecast."), ("user", "first?"),
                      ("assistant", "It will be sunny."), ("user", "rain?")]


def test_llm_destination_names_its_arguments_at_construction() -> None:
    """Pipecat's order (llm, name, description), a model that is no LiveKit LLM, or a
    route name the router cannot use is refused at construction, naming the argument:
    each was accepted, and every turn failed in `routing_aid()` with only the error's
    type logged, the caller hearing the clarification text (voice17 F6)."""
    model = FakeLLM("x")
    with pytest.raises(ContractTypeError, match="the LLM comes third"):
        LLMDestination(model, "weather", "forecasts",  # type: ignore[arg-type]
                       instructions="You forecast.")
    with pytest.raises(ContractTypeError, match=r"model must be a LiveKit llm\.LLM"):
        LLMDestination("weather", "forecasts", object(),  # type: ignore[arg-type]
                       instructions="You forecast.")
    with pytest.raises(ContractValueError, match=r"RoutingAid\.name"):
        LLMDestination("", "forecasts", model, instructions="You forecast.")
    with pytest.raises(ContractTypeError, match="instructions"):
        LLMDestination("weather", "forecasts", model,
                       instructions=None)  # type: ignore[arg-type]


async def test_handoff_destination_hands_the_session_to_a_livekit_agent() -> None:
    """A handoff route says its text and makes another LiveKit agent current."""
    target = Agent(instructions="You are the billing agent.")
    handoff = HandoffDestination("billing", "billing questions", lambda turn: target,
                                 text="Passing you to billing.")
    router = make_router(handoff, decisions=ScriptedDecisions("billing"))
    async with session_for(router) as (session, ends):
        result = await run(session, "my invoice is wrong")
        await ends.wait()
        assert session.current_agent is target
    assert said(result) == ["Passing you to billing."]


async def test_speak_outside_a_routed_turn_is_refused() -> None:
    """speak() names its misuse instead of saying text nowhere."""
    with pytest.raises(LifecycleError, match="speak"):
        await speak("hello")


_JUNK = st.one_of(
    st.text(),                                               # any code point, surrogates too
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1),
    st.builds(lambda c, n: c * n, st.characters(), st.integers(10_000, 200_000)),  # huge
    st.binary().map(lambda b: b.decode("utf-8", "surrogateescape")),   # non-UTF-8 bytes
    st.recursive(st.just("[]"), lambda inner: inner.map(lambda t: f"[{t}]"), max_leaves=60),
)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(texts=st.lists(_JUNK, min_size=1, max_size=3))
def test_any_user_text_reaches_the_destination_unchanged(texts: list[str]) -> None:
    """Whatever LiveKit hands over as user text becomes the routed query, byte for byte
    (lone surrogates, which are not text, become U+FFFD), unless it is blank (no turn)
    or longer than `max_query_chars` (refused, counted)."""
    routed = [text for text in texts if text.strip() and len(text) <= 4096]

    async def scenario() -> list[str | None]:
        weather = speaking("weather")
        router = make_router(weather, decisions=ScriptedDecisions("weather"))
        async with session_for(router) as (session, ends):
            for text in texts:
                await run(session, text)
            await ends.wait(len(routed))
        return [call.query for call in weather.calls if call.method == "answer"]

    expected = [re.sub("[\ud800-\udfff]", "\ufffd", text) for text in routed]
    assert asyncio.run(scenario()) == expected


def test_the_example_app_runs_offline_and_exits_0() -> None:
    """examples/livekit_app.py routes its three turns and exits 0."""
    example = Path(__file__).parents[2] / "examples" / "livekit_app.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    (first_reply,) = lines[lines.index("user:      Will it rain today?") + 1:][:1]
    assert first_reply.startswith("assistant: ")              # the acknowledgment, then
    assert first_reply.endswith(". Sunny, 24 degrees, no rain today.")  # the answer
    assert 'acknowledgments_total{outcome="emitted",route="weather"' in done.stdout
    assert "invoke_agent billing <- turnrouter.turn" in done.stdout


def test_exports_are_pinned_sorted_and_importable() -> None:
    """turnrouter.integrations.livekit exports exactly the documented names."""
    import turnrouter.integrations.livekit as module

    names = list(module.__all__)
    assert set(names) == {"ROUTED_MESSAGE_MEMORY", "HandoffDestination", "LLMDestination",
                          "RouterAgent", "TurnEnd", "speak", "stop_gracefully"}
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
    assert all(hasattr(module, name) for name in names)


def test_router_agent_checks_its_arguments() -> None:
    """A wrong router, no participant, an LLM or a route named as the agent are refused."""
    router = make_router(speaking("weather"), decisions=ScriptedDecisions("weather"))
    with pytest.raises(ContractTypeError, match="AgentRouter"):
        RouterAgent(object(), participant_id="alice")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="participant_id"):
        RouterAgent(router, participant_id="")
    with pytest.raises(ConfigurationError, match="MAX_ID_CHARS"):
        RouterAgent(router, participant_id="a" * (MAX_ID_CHARS + 1))
    with pytest.raises(ContractTypeError, match="llm"):
        RouterAgent(router, participant_id="alice", llm=FakeLLM("x"))
    same_name = make_router(speaking("router_agent"), decisions=ScriptedDecisions("weather"))
    with pytest.raises(ConfigurationError, match="label"):
        RouterAgent(same_name, participant_id="alice")
    assert RouterAgent(same_name, participant_id="alice", id="front").label == "front"


# ---------------------------------------------------------------- telemetry


@asynccontextmanager
async def answered_unheard(router: AgentRouter) -> AsyncIterator[
        tuple[AgentSession[Any], GatedText, RunResult[Any]]]:
    """A session whose turn "rain?" was answered (at the clock's t=0) while its reply
    waits, not heard yet, behind a greeting the text output holds until `gate` opens."""
    text_out = GatedText()
    async with session_for(router) as (session, ends):
        session.output.transcription = text_out
        session.say("Welcome!")                      # holds LiveKit's speech queue
        with anyio.fail_after(5):
            await text_out.entered.wait()
        pending: RunResult[Any] = session.run(user_input="rain?")
        await ends.wait()                            # answered at t=0, not heard yet
        yield session, text_out, pending


@pytest.mark.parametrize("spoken_by", ["speak", "returned"])
async def test_silence_is_measured_to_the_speech_start(spoken_by: str) -> None:
    """First response and silence run until LiveKit starts the answer's speech, whether
    the destination said it with speak() or only returned it (README-style)."""
    clock = ManualClock()
    weather = speaking("weather") if spoken_by == "speak" else ScriptedAgent("weather")
    with TelemetryCapture() as capture:
        router = make_router(weather, decisions=ScriptedDecisions("weather"), clock=clock,
                             telemetry=capture.telemetry)
        async with answered_unheard(router) as (_, text_out, pending):
            assert weather.started_called.is_set()
            clock.advance(2.0)
            text_out.gate.set()
            with anyio.fail_after(5):
                await pending
        first_response = capture.value("turnrouter_first_response_seconds_sum",
                                       route="weather")
        silence = capture.value("turnrouter_silence_seconds_sum", route="weather")
    assert first_response == pytest.approx(2.0)
    assert silence == pytest.approx(2.0)


async def test_a_barge_in_before_the_answer_is_heard_records_no_silence() -> None:
    """The turn is over (answered at t=0) but its reply waits behind other speech; the
    user barges in at 1.5 s, before any of it was heard: no silence and no first
    response are recorded for it, only a first response interrupted at 1.5 s (a lower
    bound). Before, the turn being over, the router was not told, and the reply's
    measurement fell back to the answer's text (~0 s) for a caller who heard nothing
    (voice7)."""
    clock = ManualClock()
    with TelemetryCapture() as capture:
        router = make_router(speaking("weather"), decisions=ScriptedDecisions("weather"),
                             clock=clock, telemetry=capture.telemetry)
        async with answered_unheard(router) as (session, text_out, pending):
            clock.advance(1.5)
            await session.interrupt()
            text_out.gate.set()
            with anyio.fail_after(5):
                await pending
            await router.drain()
        value = capture.value
        interrupted = value("turnrouter_first_response_interrupted_seconds_sum",
                            route="weather")
        heard = value("turnrouter_first_response_seconds_count", route="weather")
        silence = value("turnrouter_silence_seconds_count", route="weather")
    assert interrupted == pytest.approx(1.5)
    assert (heard or 0) == 0 and (silence or 0) == 0


def _ancestors(span: Any, spans: list[Any]) -> list[Any]:
    by_id = {item.context.span_id: item for item in spans}
    chain = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        chain.append(span)
    return chain


async def test_the_turn_span_nests_under_livekits_agent_turn() -> None:
    """turnrouter's turn span nests under LiveKit's agent_turn without posing as an agent."""
    with TelemetryCapture() as capture:
        set_tracer_provider(capture.tracer_provider)
        try:
            router = make_router(speaking("weather"), decisions=ScriptedDecisions("weather"),
                                 telemetry=capture.telemetry)
            async with session_for(router) as (session, ends):
                await run(session, "rain?")
                await ends.wait()
        finally:
            set_tracer_provider(NoOpTracerProvider())
        spans = capture.spans()
        turn = capture.span("turnrouter.turn")
        answer = capture.span("invoke_agent weather")
    chain = _ancestors(turn, spans)
    names = [span.name for span in chain]
    assert names[:2] == ["llm_node", "agent_turn"]    # the reply LiveKit routes through
    agent_turn = chain[1]
    assert agent_turn.context.trace_id == turn.context.trace_id
    assert agent_turn.attributes is not None and turn.attributes is not None
    assert agent_turn.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert "gen_ai.operation.name" not in turn.attributes
    assert str(turn.attributes["turnrouter.turn.id"]).startswith("item_")
    # The router's invoke_agent is the destination's, one level below the turn span,
    # and names the route, not LiveKit's agent.
    assert answer.parent is not None and answer.parent.span_id == turn.context.span_id
    assert answer.attributes is not None
    assert answer.attributes["gen_ai.agent.name"] == "weather"
    assert agent_turn.attributes["gen_ai.agent.name"] != "weather"

