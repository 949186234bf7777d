"""What each adapter records as first response and silence, against the audio played.

    PYTHONPATH=src python benchmarks/bench_adapters_heard.py

Four turns per adapter: an acknowledged turn (the answer is slower than the
acknowledgment delay), one whose answer goes out after the acknowledgment but before the
acknowledgment's audio plays, a fast turn (no acknowledgment) and a call's last turn (the
call ends right after the answer went out). The speech path is real: Pipecat with a
`TTSService` subclass and an output transport playing in (virtual) real time on a
`ManualClock`, so its figures are exact; LiveKit with a TTS and an audio output playing
in real time, so its figures carry the machine's scheduling noise (a few ms). "played"
is when the output started playing the acknowledgment and the answer, measured from the
turn's start; "recorded" is what turnrouter recorded (silence, first response). Run it
with another tree on PYTHONPATH to compare. Results: benchmarks/README or the report.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Callable
from typing import Any

from turnrouter import Admission, AgentRouter, AgentTurn, DestinationResult, RoutingAid
from turnrouter.testing import ManualClock, RecordingObserver, ScriptedDecisions, ScriptedLLM

RATE = 16000
ACK_DELAY = 0.5
TTFB = 0.2
SLOW = 1.0   # the acknowledged turn's answer starts after this long
FAST = 0.1   # the fast turn's
CLOSE = 0.6  # an answer right behind the acknowledgment, before its audio plays


def recorded(observer: RecordingObserver) -> tuple[float | None, float | None]:
    """(silence, first response) of the one turn the observer saw."""
    heard = [event for event in observer.events if event[0] == "heard"]
    silences = [event[2] for turn in observer.turns.values() for event in turn
                if event[0] == "silence"]
    first = heard[0][2] if heard else None
    silence = heard[0][3] if heard and heard[0][3] is not None else (
        silences[0] if silences else None)
    return silence, first


# -- Pipecat ----------------------------------------------------------------------------

def pipecat_scenario(delay: float, last: bool) -> dict[str, float | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from loguru import logger
        from pipecat.frames.frames import (
            EndFrame,
            OutputAudioRawFrame,
            StartFrame,
            TranscriptionFrame,
            TTSAudioRawFrame,
        )
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.worker import PipelineParams, PipelineWorker
        from pipecat.services.settings import TTSSettings
        from pipecat.services.tts_service import TTSService
        from pipecat.transports.base_output import BaseOutputTransport
        from pipecat.transports.base_transport import TransportParams
        from pipecat.workers.runner import WorkerRunner

        from turnrouter.integrations.pipecat import FrameAgent, FrameOutput, TurnRouterProcessor
    logger.remove()
    clock = ManualClock()

    class Tts(TTSService):
        def __init__(self) -> None:
            super().__init__(sample_rate=RATE, push_start_frame=True, push_stop_frames=True,
                             settings=TTSSettings(model=None, voice=None, language=None))
            self.tags: dict[str, int] = {}

        async def run_tts(self, text: str, context_id: str) -> Any:
            tag = self.tags.setdefault(text.strip(), len(self.tags) + 1)
            await clock.sleep(TTFB)
            for _ in range(3):
                yield TTSAudioRawFrame(bytes([tag, 0]) * (RATE // 10), RATE, 1,
                                       context_id=context_id)

    class Output(BaseOutputTransport):
        def __init__(self) -> None:
            super().__init__(TransportParams(audio_out_enabled=True,
                                             audio_out_sample_rate=RATE))
            self.played: dict[int, float] = {}

        async def start(self, frame: StartFrame) -> None:
            await super().start(frame)
            await self.set_transport_ready(frame)

        async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
            if frame.audio and frame.audio[0]:
                self.played.setdefault(frame.audio[0], clock.now())
            await clock.sleep(len(frame.audio) / 2 / RATE)
            return True

    class Agent(FrameAgent):
        async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
            await clock.sleep(delay)
            await output.say("Here is the answer.")
            answered.set()
            return "Here is the answer."

    observer = RecordingObserver()
    router = AgentRouter({"a": Agent("a", "anything")}, ScriptedDecisions("a"), clock=clock,
                         telemetry=observer, acknowledgment_delay_secs=ACK_DELAY,
                         acknowledgment_llm=ScriptedLLM("One moment."))
    tts, out = Tts(), Output()
    worker = PipelineWorker(Pipeline([TurnRouterProcessor(router), tts, out]),
                            cancel_on_idle_timeout=False, params=PipelineParams())
    answered = asyncio.Event()

    async def drive(until: Callable[[], bool]) -> None:
        for _ in range(100_000):
            await ManualClock.settle()
            if until():
                return
            deadline = clock.next_deadline
            if deadline is not None:
                clock.advance_to(deadline)
            else:
                await asyncio.sleep(0.001)  # Pipecat's own (real-time) work
        raise RuntimeError("the scenario did not finish")

    async def main() -> None:
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        run = asyncio.create_task(runner.run())
        await asyncio.sleep(0.2)  # the pipeline starts (real time, once)
        await worker.queue_frame(TranscriptionFrame("question", "", "2026-12-01T08:00:00Z"))
        if last:
            await drive(answered.is_set)
        else:
            await drive(lambda: tts.tags.get("Here is the answer.") in out.played)
        await worker.queue_frame(EndFrame())
        await drive(run.done)
        await run

    asyncio.run(main())
    silence, first = recorded(observer)
    return {"ack": out.played.get(tts.tags.get("One moment.", -1)),
            "answer": out.played.get(tts.tags.get("Here is the answer.", -1)),
            "silence": silence, "first": first}


# -- LiveKit ----------------------------------------------------------------------------

def livekit_scenario(delay: float, last: bool) -> dict[str, float | None]:
    from livekit import rtc
    from livekit.agents import AgentSession, tts
    from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions
    from livekit.agents.voice.io import AudioOutput, AudioOutputCapabilities

    from turnrouter.integrations.livekit import RouterAgent, speak, stop_gracefully

    texts: dict[str, float] = {}

    class Stream(tts.ChunkedStream):
        async def _run(self, output_emitter: tts.AudioEmitter) -> None:
            output_emitter.initialize(request_id="t", sample_rate=RATE, num_channels=1,
                                      mime_type="audio/pcm")
            await asyncio.sleep(TTFB)
            output_emitter.push(b"\x01\x00" * int(RATE * 0.3))
            output_emitter.flush()

    class Tone(tts.TTS[Any]):
        def __init__(self) -> None:
            super().__init__(capabilities=tts.TTSCapabilities(streaming=False),
                             sample_rate=RATE, num_channels=1)

        def synthesize(self, text: str, *, conn_options: APIConnectOptions = (
                DEFAULT_API_CONNECT_OPTIONS)) -> tts.ChunkedStream:
            return Stream(tts=self, input_text=text, conn_options=conn_options)

    class Speaker(AudioOutput):
        def __init__(self) -> None:
            super().__init__(label="speaker",
                             capabilities=AudioOutputCapabilities(pause=False),
                             sample_rate=RATE)
            self.starts: list[float] = []
            self.queue: asyncio.Queue[rtc.AudioFrame | None] = asyncio.Queue()
            self.task: asyncio.Task[None] | None = None
            self.playing = False
            self.position = 0.0

        async def capture_frame(self, frame: rtc.AudioFrame) -> None:
            await super().capture_frame(frame)
            if self.task is None:
                self.task = asyncio.create_task(self.play())
            self.queue.put_nowait(frame)

        def flush(self) -> None:
            super().flush()
            self.queue.put_nowait(None)

        def clear_buffer(self) -> None:
            while not self.queue.empty():
                self.queue.get_nowait()
            if self.playing:
                self.playing = False
                self.on_playback_finished(playback_position=self.position, interrupted=True)

        async def play(self) -> None:
            while True:
                frame = await self.queue.get()
                if frame is None:
                    if self.playing:
                        self.playing = False
                        self.on_playback_finished(playback_position=self.position,
                                                  interrupted=False)
                    continue
                if not self.playing:
                    self.playing, self.position = True, 0.0
                    self.starts.append(time.monotonic())
                    self.on_playback_started(created_at=time.time())
                await asyncio.sleep(frame.duration)
                self.position += frame.duration

    class Dest:
        name = "a"

        def routing_aid(self, participant_id: str) -> RoutingAid:
            return RoutingAid("a", "anything")

        async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
            texts["t0"] = time.monotonic()
            return Admission("accept")

        async def answer(self, turn: AgentTurn, *, started: Any) -> DestinationResult:
            await asyncio.sleep(delay)
            return DestinationResult("answer", await speak("Here is the answer.",
                                                           started=started))

        async def release(self, participant_id: str) -> None:
            return None

    observer = RecordingObserver()
    router = AgentRouter({"a": Dest()}, ScriptedDecisions("a"), telemetry=observer,
                         acknowledgment_delay_secs=ACK_DELAY,
                         acknowledgment_llm=ScriptedLLM("One moment."))
    speaker = Speaker()

    async def main() -> None:
        session: AgentSession[Any] = AgentSession(tts=Tone())
        session.output.audio = speaker
        await session.start(RouterAgent(router, participant_id="caller"))
        if last:  # the call ends (drained) right after the answer went out
            closed = asyncio.Event()
            session.on("close", lambda event: closed.set())
            session.generate_reply(user_input="question")
            await asyncio.sleep(delay + 0.05)
            session.shutdown(drain=True)
            await asyncio.wait_for(closed.wait(), 10)
            await stop_gracefully(router, timeout_secs=5)
        else:
            await session.run(user_input="question")
            await asyncio.sleep(0.6)  # the audio plays out
            await session.aclose()
        if speaker.task is not None:
            speaker.task.cancel()

    asyncio.run(main())
    t0 = texts.get("t0", 0.0)
    starts = [start - t0 for start in speaker.starts]
    acked = delay > ACK_DELAY
    silence, first = recorded(observer)
    return {"ack": starts[0] if acked and starts else None,
            "answer": (starts[1] if acked else starts[0]) if len(starts) > int(acked) else None,
            "silence": silence, "first": first}


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    print("| adapter | turn | ack played | answer played | silence recorded (should be "
          "the first played) | first response recorded (should be the answer played) |")
    print("|---|---|---|---|---|---|")
    for adapter, scenario in (("Pipecat", pipecat_scenario), ("LiveKit", livekit_scenario)):
        for name, delay, last in (("acknowledged", SLOW, False),
                                  ("acknowledged, answer before its audio", CLOSE, False),
                                  ("fast", FAST, False), ("last of the call", FAST, True)):
            try:
                row = scenario(delay, last)
            except Exception as exc:  # a tree where the scenario cannot run
                print(f"| {adapter} | {name} | failed: {type(exc).__name__}: {exc} | | | |")
                continue
            print(f"| {adapter} | {name} | {fmt(row['ack'])} | {fmt(row['answer'])} | "
                  f"{fmt(row['silence'])} | {fmt(row['first'])} |")


if __name__ == "__main__":
    main()
