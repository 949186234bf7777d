"""A running Pipecat pipeline for the adapter tests, built from Pipecat's own test parts.

`Pipe` is Pipecat's `run_test` (its `QueuedFrameProcessor` at both ends, a
`PipelineWorker` on a `WorkerRunner`) kept open, so a test can send frames, wait for
what comes out, and end the pipeline when it chooses. Import only after Pipecat was
found (the test modules skip without it).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

with warnings.catch_warnings():  # pipecat imports the deprecated audioop on 3.11-3.12
    warnings.simplefilter("ignore", DeprecationWarning)
    from pipecat.frames.frames import (
        BotStartedSpeakingFrame,
        BotStoppedSpeakingFrame,
        CancelFrame,
        EndFrame,
        Frame,
        TTSAudioRawFrame,
        TTSSpeakFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.tests.utils import QueuedFrameProcessor
    from pipecat.workers.runner import WorkerRunner

from turnrouter import AgentTurn
from turnrouter.integrations.pipecat import FrameAgent, FrameOutput
from turnrouter.testing import ManualClock

F = TypeVar("F", bound=Frame)
BOUND = 10.0


class Pipe:
    """source -> processors -> sink, running until `end()` (or the context exits)."""

    def __init__(self, *processors: FrameProcessor, enable_tracing: bool = False) -> None:
        self.down: asyncio.Queue[Frame] = asyncio.Queue()
        self.up: asyncio.Queue[Frame] = asyncio.Queue()
        self.seen: list[Frame] = []
        source = QueuedFrameProcessor(queue=self.up, queue_direction=FrameDirection.UPSTREAM)
        sink = QueuedFrameProcessor(queue=self.down, queue_direction=FrameDirection.DOWNSTREAM)
        self.worker = PipelineWorker(
            Pipeline([source, *processors, sink]), cancel_on_idle_timeout=False,
            enable_tracing=enable_tracing, params=PipelineParams())
        self._started = asyncio.Event()
        self._run: asyncio.Task[None] | None = None

        @self.worker.event_handler("on_pipeline_started")
        async def _started(worker: Any, frame: Frame) -> None:
            self._started.set()

    async def __aenter__(self) -> Pipe:
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(self.worker)
        self._run = asyncio.create_task(runner.run())
        with anyio.fail_after(BOUND):
            await self._started.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._run is not None
        if not self._run.done():
            await self.worker.queue_frame(CancelFrame())
            with anyio.fail_after(BOUND):
                await self._run

    async def send(self, *frames: Frame) -> None:
        """Queue frames downstream at the pipeline's start."""
        for frame in frames:
            await self.worker.queue_frame(frame)

    async def next_down(self, kind: type[F]) -> F:
        """The next frame of `kind` reaching the sink (others are kept in `seen`)."""
        with anyio.fail_after(BOUND):
            while True:
                frame = await self.down.get()
                self.seen.append(frame)
                if isinstance(frame, kind):
                    return frame

    async def end_wait(self) -> None:
        """Wait for the pipeline to finish (an EndFrame or CancelFrame already sent)."""
        assert self._run is not None
        with anyio.fail_after(BOUND):
            await self._run

    async def end(self) -> list[Frame]:
        """Send EndFrame, wait for the pipeline to finish; every frame that reached the
        sink since the last `next_down`, EndFrame included."""
        await self.worker.queue_frame(EndFrame())
        assert self._run is not None
        with anyio.fail_after(BOUND):
            await self._run
        rest: list[Frame] = []
        while not self.down.empty():
            rest.append(self.down.get_nowait())
        self.seen.extend(rest)
        return rest


def spoken(frames: list[Frame]) -> list[str]:
    """Texts of the TTSSpeakFrames among `frames`, in order."""
    return [frame.text for frame in frames if isinstance(frame, TTSSpeakFrame)]


Respond = Callable[[AgentTurn, FrameOutput], Awaitable[str]]


class Agent(FrameAgent):
    """A `FrameAgent` that says `text`, optionally after a gate or a clock sleep, and
    records what happened."""

    def __init__(self, name: str, text: str = "", *, decline: bool = False,
                 gate: anyio.Event | None = None, before_first: anyio.Event | None = None,
                 clock: ManualClock | None = None, delay: float = 0.0,
                 error: BaseException | None = None, second: str = "") -> None:
        super().__init__(name, f"the {name} agent")
        self.text = text or f"{name} answer"
        self.decline = decline
        self.gate = gate
        self.before_first = before_first
        self.clock = clock
        self.delay = delay
        self.error = error
        self.second = second
        self.entered = anyio.Event()
        self.pushed_first = anyio.Event()
        self.outcome: list[str] = []
        self.released: list[str] = []
        self.release_seen = anyio.Event()
        self.output: FrameOutput | None = None

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Any:
        from turnrouter import Admission

        return Admission("decline" if self.decline else "accept")

    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        self.output = output
        self.entered.set()
        try:
            if self.error is not None:
                raise self.error
            if self.clock is not None and self.delay:
                await self.clock.sleep(self.delay)
            if self.before_first is not None:
                await self.before_first.wait()
            await output.say(self.text)
            self.pushed_first.set()
            if self.gate is not None:
                await self.gate.wait()
            if self.second:
                await output.say(self.second)
        except BaseException as exc:
            self.outcome.append(type(exc).__name__)
            raise
        self.outcome.append("done")
        return self.text

    async def release(self, participant_id: str) -> None:
        self.released.append(participant_id)
        self.release_seen.set()


class FakeSpeech(FrameProcessor):
    """Fake TTS plus output transport: each TTSSpeakFrame becomes, after `ttfb` seconds
    of `clock`, a TTSAudioRawFrame downstream, with BotStarted/StoppedSpeaking broadcast
    (upstream too, as Pipecat's output transport does)."""

    def __init__(self, clock: ManualClock | None = None, ttfb: float = 0.0) -> None:
        super().__init__()
        self.clock = clock
        self.ttfb = ttfb
        self.spoken: list[str] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSSpeakFrame):
            if self.clock is not None and self.ttfb:
                await self.clock.sleep(self.ttfb)
            self.spoken.append(frame.text)
            await self.broadcast_frame(BotStartedSpeakingFrame)
            await self.push_frame(TTSAudioRawFrame(b"\0\0" * 160, 16000, 1))
            await self.broadcast_frame(BotStoppedSpeakingFrame)
        await self.push_frame(frame, direction)


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from pipecat.frames.frames import OutputAudioRawFrame, StartFrame
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TTSService
    from pipecat.transports.base_output import BaseOutputTransport
    from pipecat.transports.base_transport import TransportParams

RATE = 16000


class ClockTTS(TTSService):
    """A real Pipecat `TTSService`: each text becomes `chunks` chunks of `chunk_secs`
    audio after `ttfb` seconds of `clock` (`ttfb_for` per text). Every sample of a
    text's audio carries the text's number in `tags`, so the output can tell whose audio
    it plays."""

    def __init__(self, clock: ManualClock, *, ttfb: float = 0.2, chunk_secs: float = 0.1,
                 chunks: int = 3, ttfb_for: dict[str, float] | None = None) -> None:
        super().__init__(sample_rate=RATE, push_start_frame=True, push_stop_frames=True,
                         settings=TTSSettings(model=None, voice=None, language=None))
        self.clock = clock
        self.ttfb = ttfb
        self.ttfb_for = ttfb_for or {}
        self.chunk_secs = chunk_secs
        self.chunks = chunks
        self.tags: dict[str, int] = {}

    def tag(self, text: str) -> int:
        return self.tags.setdefault(text.strip(), len(self.tags) + 1)

    async def run_tts(self, text: str, context_id: str) -> Any:
        tag = self.tag(text)
        await self.clock.sleep(self.ttfb_for.get(text.strip(), self.ttfb))
        samples = int(RATE * self.chunk_secs)
        for _ in range(self.chunks):
            yield TTSAudioRawFrame(bytes([tag, 0]) * samples, RATE, 1, context_id=context_id)


class PlayingOutput(BaseOutputTransport):
    """A real Pipecat output transport that plays audio in (clock) real time: writing a
    chunk takes its duration on `clock`. `played` records when each utterance's audio
    (by its tag) first started playing."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_sample_rate=RATE))
        self.clock = clock
        self.played: dict[int, float] = {}

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        tag = frame.audio[0] if frame.audio else 0
        if tag:
            self.played.setdefault(tag, self.clock.now())
        await self.clock.sleep(len(frame.audio) / 2 / RATE)
        return True


async def run_clock(clock: ManualClock, until: Callable[[], bool], *,
                    limit: float = 30.0) -> None:
    """Let the pipeline run on `clock`'s time: settle, then jump to the next sleeper's
    deadline, until `until()` holds (bounded by `limit` clock seconds)."""
    start = clock.now()
    while True:
        await ManualClock.settle()
        if until():
            return
        deadline = clock.next_deadline
        if deadline is None or deadline - start > limit:
            await asyncio.sleep(0.01)  # real-time work of Pipecat (its own timers)
            if clock.now() - start > limit:
                raise TimeoutError("the pipeline did not get there in time")
            continue
        clock.advance_to(deadline)


async def end_on_clock(pipe: Pipe, clock: ManualClock, *, send: bool = True) -> None:
    """Send EndFrame (`send=False`: sent already) and run `clock` until the pipeline
    finished (an output transport plays its closing silence on the clock)."""
    if send:
        await pipe.worker.queue_frame(EndFrame())
    run = pipe._run
    assert run is not None
    with anyio.fail_after(BOUND):
        await run_clock(clock, run.done)
        await run
