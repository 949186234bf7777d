"""The LiveKit adapter as a native part: a routed turn is LiveKit's own reply (drain,
greetings), measured against the audio an output actually played."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest

pytest.importorskip("livekit.agents", reason="needs the livekit extra")

from livekit import rtc
from livekit.agents import AgentSession, RunResult, llm, tts
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions
from livekit.agents.voice.io import AudioOutput, AudioOutputCapabilities

from turnrouter import Admission, AgentRouter, AgentTurn, DestinationResult, RoutingAid
from turnrouter.integrations.livekit import RouterAgent, TurnEnd, speak, stop_gracefully
from turnrouter.testing import RecordingObserver, ScriptedDecisions, ScriptedLLM

pytestmark = pytest.mark.anyio

RATE = 16000


class ToneStream(tts.ChunkedStream):
    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id="tone", sample_rate=RATE, num_channels=1,
                                  mime_type="audio/pcm")
        assert isinstance(self._tts, ToneTTS)
        await asyncio.sleep(self._tts.ttfb)  # the provider's time to first byte
        output_emitter.push(b"\x01\x00" * int(RATE * self._tts.seconds))
        output_emitter.flush()


class ToneTTS(tts.TTS[Any]):
    """A LiveKit TTS whose audio comes `ttfb` seconds after the text, `seconds` long."""

    def __init__(self, ttfb: float, seconds: float) -> None:
        super().__init__(capabilities=tts.TTSCapabilities(streaming=False), sample_rate=RATE,
                         num_channels=1)
        self.ttfb = ttfb
        self.seconds = seconds

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS,
    ) -> tts.ChunkedStream:
        return ToneStream(tts=self, input_text=text, conn_options=conn_options)


class Speaker(AudioOutput):
    """An audio output that plays what it captures in real time, one segment after the
    other, and records when each segment started playing (`time.monotonic()`)."""

    def __init__(self) -> None:
        super().__init__(label="speaker", capabilities=AudioOutputCapabilities(pause=False),
                         sample_rate=RATE)
        self.starts: list[float] = []
        self._started = asyncio.Event()
        self._queue: asyncio.Queue[rtc.AudioFrame | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._playing = False
        self._position = 0.0

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._task is None:
            self._task = asyncio.create_task(self._play())
        self._queue.put_nowait(frame)

    def flush(self) -> None:
        super().flush()
        self._queue.put_nowait(None)

    def clear_buffer(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
        self._finish(interrupted=True)

    def _finish(self, *, interrupted: bool) -> None:
        if self._playing:
            self._playing = False
            self.on_playback_finished(playback_position=self._position,
                                      interrupted=interrupted)

    async def _play(self) -> None:
        while True:
            frame = await self._queue.get()
            if frame is None:
                self._finish(interrupted=False)
                continue
            if not self._playing:
                self._playing, self._position = True, 0.0
                self.starts.append(time.monotonic())
                self._started.set()
                self.on_playback_started(created_at=time.time())
            await asyncio.sleep(frame.duration)  # playing it
            self._position += frame.duration

    async def wait_starts(self, count: int) -> None:
        """Wait (bounded) until `count` segments started playing."""
        with anyio.fail_after(10):
            while len(self.starts) < count:
                self._started.clear()
                await self._started.wait()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self._task


class Slow:
    """Answers after `gate` opens (or at once), saying `text`."""

    def __init__(self, name: str, text: str, *, gated: bool = True) -> None:
        self.name, self.text = name, text
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.entered = asyncio.Event()
        self.queries: list[str] = []

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid(self.name, f"handles {self.name}")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
        self.queries.append(turn.query)
        self.entered.set()
        await self.gate.wait()
        return DestinationResult("answer", await speak(self.text, started=started))

    async def release(self, participant_id: str) -> None:
        return None


def assistant_texts(session: AgentSession[Any]) -> list[str]:
    return [item.text_content or "" for item in session.history.items
            if isinstance(item, llm.ChatMessage) and item.role == "assistant"]


async def test_acknowledged_turn_is_measured_to_each_utterances_audio() -> None:
    """With a TTS and an audio output: silence ends when the acknowledgment's audio
    starts playing (its TTS time included), the first response when the answer's own
    audio does, not its neighbour's."""
    observer = RecordingObserver()
    agent = Slow("research", "Here is the report.")
    router = AgentRouter({"research": agent}, ScriptedDecisions("research"),
                         telemetry=observer, acknowledgment_delay_secs=0.3,
                         acknowledgment_llm=ScriptedLLM("One moment."))
    speaker = Speaker()
    session: AgentSession[Any] = AgentSession(tts=ToneTTS(ttfb=0.2, seconds=0.5))
    session.output.audio = speaker
    await session.start(RouterAgent(router))
    try:
        pending: RunResult[Any] = session.run(user_input="research this")
        await speaker.wait_starts(1)
        agent.gate.set()
        with anyio.fail_after(10):
            await pending
        await speaker.wait_starts(2)
    finally:
        await session.aclose()
        await speaker.aclose()
    (heard,) = [event for event in observer.events if event[0] == "heard"]
    (turn_id,) = observer.turns
    (silence,) = [event[2] for event in observer.turns[turn_id] if event[0] == "silence"]
    first_response = heard[2]
    ack_start, answer_start = speaker.starts
    assert answer_start - ack_start >= 0.5  # the acknowledgment played first, whole
    # The recorded gap between silence's end and the first response is the gap between
    # the two utterances' audio: each is measured to its own audio.
    assert abs((first_response - silence) - (answer_start - ack_start)) < 0.15
    assert silence >= 0.3 + 0.15  # the acknowledgment's TTS time is in the silence


async def test_drain_speaks_the_answer_in_flight() -> None:
    """session.shutdown(drain=True) while a turn answers: the answer is said (the reply
    is LiveKit's own) and the turn ends answered, not failed."""
    agent = Slow("weather", "Sunny all day.")
    router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"))
    ends: list[TurnEnd] = []
    session: AgentSession[Any] = AgentSession()
    closed = asyncio.Event()
    session.on("close", lambda event: closed.set())
    await session.start(RouterAgent(router, on_turn_end=ends.append))
    session.generate_reply(user_input="rain?")
    with anyio.fail_after(5):
        await agent.entered.wait()
    session.shutdown(drain=True)
    agent.gate.set()
    with anyio.fail_after(10):
        await closed.wait()
    assert "Sunny all day." in assistant_texts(session)
    assert [(end.routed is not None, end.error) for end in ends] == [(True, None)]


async def test_a_greeting_reply_is_routed() -> None:
    """session.generate_reply(instructions=...) (the usual greeting) is routed with the
    instructions as its query, and its answer is said."""
    agent = Slow("conversation", "Hello, how can I help?", gated=False)
    router = AgentRouter({"conversation": agent}, ScriptedDecisions("conversation"))
    session: AgentSession[Any] = AgentSession()
    await session.start(RouterAgent(router))
    try:
        with anyio.fail_after(5):
            await session.generate_reply(instructions="Greet the caller warmly.")
        assert agent.queries == ["Greet the caller warmly."]
        assert assistant_texts(session) == ["Hello, how can I help?"]
    finally:
        await session.aclose()


async def test_agents_without_an_id_never_share_a_participant() -> None:
    """Two sessions on one router, no participant_id: each agent is a participant of its
    own, so the second caller's turn carries none of the first caller's history."""
    agent = Slow("conversation", "Noted.", gated=False)
    router = AgentRouter({"conversation": agent}, ScriptedDecisions("conversation"))
    first, second = RouterAgent(router), RouterAgent(router)
    assert first.participant_id != second.participant_id
    for routed_agent, text in ((first, "my PIN is 4321"), (second, "what did I say?")):
        session: AgentSession[Any] = AgentSession()
        await session.start(routed_agent)
        try:
            with anyio.fail_after(5):
                await session.run(user_input=text)
        finally:
            await session.aclose()
    assert router.history_of(second.participant_id)[0].user == "what did I say?"
    assert all("4321" not in exchange.user
               for exchange in router.history_of(second.participant_id))


def _speaking(ttfb: float) -> tuple[RecordingObserver, Slow, AgentRouter, Speaker,
                                    AgentSession[Any]]:
    """A router with one destination answering "Sunny." at once, and a session whose
    TTS starts its audio `ttfb` seconds after the text, played by a `Speaker`."""
    observer = RecordingObserver()
    agent = Slow("weather", "Sunny.", gated=False)
    router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"), telemetry=observer)
    speaker = Speaker()
    session: AgentSession[Any] = AgentSession(tts=ToneTTS(ttfb=ttfb, seconds=0.2))
    session.output.audio = speaker
    return observer, agent, router, speaker, session


async def test_last_turn_drained_is_measured_to_its_audio() -> None:
    """The call ends (shutdown(drain=True)) right after the answer went out: the answer
    plays, and its first response is measured to its audio (the TTS's 0.4 s included),
    not to the moment it was handed over."""
    observer, agent, router, speaker, session = _speaking(ttfb=0.4)
    closed = asyncio.Event()
    session.on("close", lambda event: closed.set())
    await session.start(RouterAgent(router))
    session.generate_reply(user_input="rain?")
    with anyio.fail_after(5):
        await agent.entered.wait()
    session.shutdown(drain=True)
    with anyio.fail_after(10):
        await closed.wait()
    await speaker.aclose()
    assert len(speaker.starts) == 1  # the answer played
    (heard,) = [event for event in observer.events if event[0] == "heard"]
    assert heard[2] >= 0.4  # its audio, after the TTS's time to first byte


async def test_a_graceful_stop_timing_out_before_late_audio_records_a_lower_bound() -> None:
    """stop_gracefully's timeout passes before the answer's audio (a TTS 2 s to its
    first byte): nothing was heard, so the first response is a lower bound at the
    timeout and no silence is recorded. Before, `stop()` measured it at the text's
    hand-over (about 0 s) for a call that ended before its audio (voice13)."""
    observer, agent, router, speaker, session = _speaking(ttfb=2.0)
    await session.start(RouterAgent(router))
    try:
        session.generate_reply(user_input="rain?")
        with anyio.fail_after(5):
            await agent.entered.wait()
        with anyio.fail_after(10):
            await stop_gracefully(router, session, timeout_secs=0.3)
    finally:
        await session.aclose()
        await speaker.aclose()
    assert speaker.starts == []  # the call ended before its audio
    heard = [event for event in observer.events if event[0].startswith("heard")]
    assert [event[0] for event in heard] == ["heard_interrupted"]
    assert heard[0][2] >= 0.3  # the timeout's moment at least: a lower bound
    assert not [event for events in observer.turns.values() for event in events
                if event[0] == "silence"]


async def test_graceful_stop_with_the_session_speaks_the_answer_in_flight() -> None:
    """stop_gracefully(router, session) (a job's shutdown callback) while a turn
    answers: the session plays the answer to its end, then the router stops; the turn
    ends answered."""
    agent = Slow("weather", "Sunny all day.")
    router = AgentRouter({"weather": agent}, ScriptedDecisions("weather"))
    ends: list[TurnEnd] = []
    session: AgentSession[Any] = AgentSession()
    await session.start(RouterAgent(router, on_turn_end=ends.append))
    try:
        session.generate_reply(user_input="rain?")
        with anyio.fail_after(5):
            await agent.entered.wait()
        stopping = asyncio.ensure_future(stop_gracefully(router, session, timeout_secs=5))
        agent.gate.set()
        with anyio.fail_after(10):
            await stopping
        assert "Sunny all day." in assistant_texts(session)
        assert [(end.routed is not None, end.error) for end in ends] == [(True, None)]
    finally:
        await session.aclose()
