"""The Pipecat adapter: a frame processor in front of an `AgentRouter`.

Only the router's public front-end seam is used (`route_turn`, `mark_heard`, `interrupt`,
`drain`, `stop`, `continue_trace`, `report_rejected`). Each user turn runs in a task of
its own: awaiting `route_turn()` inside `process_frame()` would hold Pipecat's frame
queue, so a new turn could not replace the running one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import re
import uuid
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    CancelFrame,
    ControlFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    FunctionCallResultFrame,
    FunctionCallsStartedFrame,
    InterruptionFrame,
    LLMContextFrame,
    LLMContextUserTurnFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMMessagesAppendFrame,
    LLMMessagesUpdateFrame,
    LLMRunFrame,
    LLMSetToolsFrame,
    LLMTextFrame,
    OutputAudioRawFrame,
    StartFrame,
    TextFrame,
    TranscriptionFrame,
    TTSSpeakFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import (
    FrameDirection,
    FrameProcessor,
    FrameProcessorSetup,
)
from pipecat.services.llm_service import LLMService as PipecatLLMService
from pipecat.transports.base_output import BaseOutputTransport

from turnrouter import (
    MAX_ID_CHARS,
    Admission,
    AgentRouter,
    AgentTurn,
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    DestinationResult,
    LifecycleError,
    LLMError,
    RouterBusyError,
    RoutingAid,
    TurnInterrupted,
)

__all__ = [
    "FrameAgent",
    "FrameOutput",
    "PipecatLLMDestination",
    "TurnRouterProcessor",
    "frame_output",
    "turn_from_frame",
]

logger = logging.getLogger("turnrouter.integrations.pipecat")

#: The live processors owning a router, by the router's id (an `AgentRouter` is not
#: weakly referenceable; the processors are held weakly, emptied entries dropped).
_OWNERS: dict[int, weakref.WeakSet[TurnRouterProcessor]] = {}


def _note_owner(processor: TurnRouterProcessor) -> None:
    """Remember `processor` as its router's owner (when it owns it); a WARNING when
    another processor not ended yet owns the same router: the first call to end stops the router for
    both, and the other call's participants lose their history and focus mid-call
    (voice17 F5)."""
    if not processor.owns_router:
        return
    for key in [key for key, owners in _OWNERS.items() if not owners]:
        del _OWNERS[key]
    router = processor.router
    owners = _OWNERS.setdefault(id(router), weakref.WeakSet())
    if any(other.router is router and not other._stopped for other in owners):
        logger.warning("turnrouter: two TurnRouterProcessors own one AgentRouter: the "
                       "first call to end stops it for both, the other call's "
                       "participants losing their history and focus; pass "
                       "owns_router=False to processors that share a router")
    owners.add(processor)

#: Rejection source (the `topic` label of turnrouter_runtime_rejected_messages_total).
SOURCE = "pipecat"
Started = Callable[[], Awaitable[None]]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str) -> str:
    """STT output as storable text: lone surrogates (not valid text) become U+FFFD."""
    return value if value.isascii() else _SURROGATE.sub("\ufffd", value)


def _timestamp_us(stamp: object) -> int | None:
    """A transcription's ISO-8601 timestamp in Unix microseconds (None if unreadable)."""
    if not isinstance(stamp, str) or len(stamp) > 64:
        return None
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    micros = int(when.timestamp() * 1_000_000)
    return micros if micros >= 0 else None


def _last_user_text(context: object) -> str | None:
    """The text of the newest user message of a Pipecat `LLMContext` (None if absent)."""
    try:
        messages = context.messages  # type: ignore[attr-defined]
    except Exception:  # not an LLMContext, or one whose messages cannot be read
        return None
    if not isinstance(messages, list):
        return None
    for message in reversed(messages):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [part.get("text") for part in content
                     if isinstance(part, Mapping) and part.get("type") == "text"]
            texts = [text for text in parts if isinstance(text, str)]
            return " ".join(texts) if texts else None
        return None
    return None


def turn_from_frame(
    frame: object, *, turn_id: str, participant_id: str = "user",
    max_query_chars: int = 4096,
) -> AgentTurn | None:
    """The routed turn a frame carries, or None when it carries no final user turn.

    A `TranscriptionFrame` (STT output) is a turn of its `user_id` (or `participant_id`
    when empty); a non-speculative `LLMContextFrame` (the user context aggregator's
    output) is a turn of `participant_id` whose query is the newest user message. Blank
    text is no turn; lone surrogates in the text or user id become U+FFFD. A query longer
    than `max_query_chars` raises `ContractValueError`, a transcription whose text is not
    a str `ContractTypeError`.
    """
    text: str | None
    if isinstance(frame, TranscriptionFrame):
        text = frame.text
        if not isinstance(text, str):  # (a speech-to-text service's bug: counted invalid)
            raise ContractTypeError(
                f"TranscriptionFrame.text must be a str, got {type(text).__name__}")
        user = frame.user_id if isinstance(frame.user_id, str) and frame.user_id else None
        stamp = _timestamp_us(frame.timestamp)
    elif isinstance(frame, LLMContextFrame) and frame.speculation is not True:
        text, user, stamp = _last_user_text(frame.context), None, None
    else:
        return None
    if text is None or not text.strip():
        return None
    if len(text) > max_query_chars:
        raise ContractValueError(
            f"user turn of {len(text)} characters exceeds max_query_chars={max_query_chars}")
    return AgentTurn(_text(user or participant_id), turn_id, _text(text.strip()),
                     timestamp_us=stamp)


def _carrier_of(otel_context: object) -> dict[str, str]:
    """W3C headers of the span held in an OpenTelemetry `Context` (duck-typed, so this
    module needs no OpenTelemetry import)."""
    if not isinstance(otel_context, Mapping):
        return {}
    for value in otel_context.values():
        get = getattr(value, "get_span_context", None)
        if not callable(get):
            continue
        span = get()
        if getattr(span, "is_valid", False):
            return {"traceparent": f"00-{span.trace_id:032x}-{span.span_id:016x}-"
                                   f"{int(span.trace_flags):02x}"}
    return {}


def _span_context_of(otel_context: object) -> object | None:
    """The span context held in an OpenTelemetry `Context` (duck-typed), if valid."""
    if not isinstance(otel_context, Mapping):
        return None
    for value in otel_context.values():
        get = getattr(value, "get_span_context", None)
        if callable(get):
            span: object = get()
            if getattr(span, "is_valid", False):
                return span
    return None


def _current_span_context() -> object | None:
    """The current span's context (the destination's `invoke_agent` span inside
    `answer()`), through the OpenTelemetry API Pipecat's tracing already uses."""
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - Pipecat without tracing
        return None
    span: object = trace.get_current_span().get_span_context()
    return span if getattr(span, "is_valid", False) else None


@contextlib.contextmanager
def _framework_spans_under_current(tracing: Any) -> Iterator[None]:
    """While a routed answer runs in the pipeline, Pipecat's service spans (its `llm`
    span) are children of the current span (the destination's `invoke_agent`), not
    siblings of it under Pipecat's `turn` span. Pipecat's turn context is put back
    afterwards, unless Pipecat moved on to another turn meanwhile."""
    span = _current_span_context() if tracing is not None else None
    if span is None:
        yield
        return
    before = tracing.get_turn_context()
    tracing.set_turn_context(span)
    ours = tracing.get_turn_context()
    try:
        yield
    finally:
        if tracing.get_turn_context() is ours:
            tracing.set_turn_context(_span_context_of(before))


@dataclass(eq=False)
class _TurnSink:
    """Where one turn's frames go: the processor routing it, while the turn runs."""

    processor: TurnRouterProcessor
    turn: AgentTurn
    context: LLMContext | None = None
    closed: bool = False
    #: The mark of this turn's answer in the speech path, once its speech went out.
    answer_mark: _Mark | None = None
    #: Answered by the LLM service downstream: the speaker ends its answer's speech
    #: after the final response (`llm_done`) passes it.
    via_llm: bool = False
    llm_done: bool = False
    #: The destination said something through the pipeline (speech, or a frame asking
    #: the LLM downstream to answer): its returned text is then not said again.
    spoke: bool = False
    #: An interruption (or the call's end) came while the turn ran: nothing more of it
    #: is said, its returned text included.
    cut: bool = False


_CURRENT: contextvars.ContextVar[_TurnSink | None] = contextvars.ContextVar(
    "turnrouter_pipecat_turn", default=None)


#: Frames meant for the LLM service downstream of the processor, not for the TTS: a
#: destination's `push()` sends them from the processor itself.
_FOR_THE_LLM = (LLMContextFrame, LLMMessagesAppendFrame, LLMMessagesUpdateFrame, LLMRunFrame,
                LLMSetToolsFrame)


def _is_speech(frame: Frame) -> bool:
    """Whether the user hears `frame`: text the TTS speaks (a `TTSSpeakFrame`, a text
    frame with text not marked `skip_tts`) or audio. LLM response boundaries, context
    and control frames are not speech."""
    if isinstance(frame, TTSSpeakFrame | OutputAudioRawFrame):
        return True
    if isinstance(frame, TextFrame) and not isinstance(frame, TranscriptionFrame):
        text = frame.text
        return isinstance(text, str) and bool(text.strip()) and frame.skip_tts is not True
    return False


def _is_heard(frame: Frame) -> bool:
    """Whether `frame` ends up heard: speech (whatever `push(speech=...)` said) or a
    frame that asks the LLM downstream to answer."""
    if isinstance(frame, LLMContextFrame | LLMRunFrame):
        return True
    if isinstance(frame, LLMMessagesAppendFrame | LLMMessagesUpdateFrame):
        return frame.run_llm is True
    return _is_speech(frame)


class FrameOutput:
    """Pushes a destination's frames downstream of the `TurnRouterProcessor` routing the
    current turn (toward the TTS and the output transport), with no back reference.

    The first speech frame pushed awaits `started()` first, so the router suppresses a
    pending acknowledgment and records the first response. Once the turn ended (answered,
    interrupted or replaced) pushing raises `LifecycleError`: no stale audio after a
    barge-in.
    """

    __slots__ = ("_begun", "_sink", "_started", "frames_pushed")

    def __init__(self, sink: _TurnSink, started: Started) -> None:
        self._sink = sink
        self._started = started
        self._begun = False
        self.frames_pushed = 0

    @property
    def turn(self) -> AgentTurn:
        """The turn these frames answer."""
        return self._sink.turn

    @property
    def context(self) -> LLMContext | None:
        """The Pipecat `LLMContext` the turn came in (the user context aggregator's:
        system prompt, tools, conversation); None for a turn from a transcription."""
        return self._sink.context

    async def begin(self) -> None:
        """The answer's first speech is on its way: await `started()` (once). `push()`
        calls it for the first speech frame; call it yourself when the speech comes
        from elsewhere (an LLM downstream)."""
        if self._begun:
            return
        self._begun = True
        await self._started()

    async def push(self, frame: Frame, *, speech: bool | None = None) -> None:
        """Push one frame downstream.

        Speech (when `speech` is None: a `TTSSpeakFrame`, text the TTS speaks, audio)
        calls `begin()` first. Frames for the LLM service downstream (`LLMContextFrame`,
        `LLMMessagesAppendFrame`, ...), an `InterruptionFrame` and frames pushed with
        `speech=False` leave the processor itself; everything else (speech, and
        `LLMFullResponseStartFrame`/`...EndFrame`, which are not speech) enters at the
        processor's `speaker` when it is in the pipeline, in the order pushed.
        """
        if not isinstance(frame, Frame):
            raise ContractTypeError(
                f"FrameOutput.push() takes a pipecat Frame, got {type(frame).__name__}")
        if self._sink.closed:
            raise LifecycleError(f"turn {self._sink.turn.turn_id!r} has ended; its frames "
                                 "can no longer be pushed")
        self.frames_pushed += 1
        processor = self._sink.processor
        if isinstance(frame, InterruptionFrame):
            await processor._push_through(frame)
            return
        if speech is True or _is_heard(frame):
            self._sink.spoke = True
        if isinstance(frame, _FOR_THE_LLM) or speech is False:
            await processor.push_frame(frame, FrameDirection.DOWNSTREAM)
            return
        if speech is None:
            speech = _is_speech(frame)
        if speech:
            await self.begin()
            if self._sink.closed:  # interrupted while waiting for an acknowledgment
                raise LifecycleError(f"turn {self._sink.turn.turn_id!r} has ended")
            await processor._push_answer(self._sink, frame)
        else:
            await processor._push_speech(frame)

    async def say(self, text: str, *, append_to_context: bool = True) -> None:
        """Speak `text` (a `TTSSpeakFrame`)."""
        if not isinstance(text, str):
            raise ContractTypeError(f"FrameOutput.say() takes a str, got {type(text).__name__}")
        await self.push(TTSSpeakFrame(text, append_to_context=append_to_context))


def frame_output(started: Started) -> FrameOutput:
    """The frame output of the turn being answered, for a destination's `answer()`.

    Call it inside `answer(turn, started=...)` with that `started`; raises
    `LifecycleError` outside a turn routed by a `TurnRouterProcessor`.
    """
    sink = _CURRENT.get()
    if sink is None:
        raise LifecycleError("frame_output() is only available while a TurnRouterProcessor "
                             "routes a turn (inside a destination's answer())")
    if not callable(started):
        raise ContractTypeError("frame_output() takes the started() callback of answer()")
    return FrameOutput(sink, started)


class FrameAgent:
    """A destination that answers by pushing Pipecat frames: implement `respond()`.

    It accepts every admission (override `admit()` to decline), and keeps no state per
    participant (override `release()` when it does).
    """

    def __init__(self, name: str, description: str, *, priority: int = 0) -> None:
        self._aid = RoutingAid(name, description, priority)

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return self._aid

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *, started: Started) -> DestinationResult:
        text = await self.respond(turn, frame_output(started))
        return DestinationResult("answer", text)

    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        """Push the answer's frames through `output`; return its text (kept in history,
        and spoken for you when nothing was pushed as speech)."""
        raise NotImplementedError

    async def release(self, participant_id: str) -> None:
        return None


class _Response:
    """One LLM turn the destination waits for (in-pipeline mode): one or more LLM
    responses, the later ones after tool calls."""

    def __init__(self, output: FrameOutput) -> None:
        self.output = output
        self.begun = False
        self.texts: list[str] = []
        self.error: str | None = None
        #: Tool calls of the current response, then results still awaited.
        self.calls = 0
        self.results = 0
        self.rerun = False
        self.done = asyncio.Event()

    def finish(self) -> None:
        """The turn's final response ended (its end frame is about to leave the LLM)."""
        self.output._sink.llm_done = True
        self.done.set()


class PipecatLLMDestination(FrameAgent):
    """A destination answered by a Pipecat LLM service.

    The turn's history and query become an `LLMContext` (after `system_instruction`);
    in the pipeline, a turn that came from the user context aggregator keeps the app's own
    context (its system prompt, tools and conversation) instead.
    - `in_pipeline=False` (default): `run_inference()` out of band (the service need not
      be in the pipeline); the reply is spoken as one `TTSSpeakFrame`.
    - `in_pipeline=True`: the service sits downstream of the `TurnRouterProcessor` (where
      it was before turnrouter) and answers only the turns routed here: the destination
      pushes the `LLMContextFrame` and follows the service's frames (its
      `on_before_push_frame` event), so the reply streams to the TTS, `started()` is
      awaited before the first token leaves the service (a pending acknowledgment is
      spoken first) and the text of the full response is the result. One response at a
      time (a second turn waits for the first); an error frame from the service raises
      `LLMError`, and so does no response within `response_timeout_secs`. A cancelled
      answer pushes an `InterruptionFrame` downstream so the service and TTS drop the
      rest of it.
    """

    def __init__(self, llm: PipecatLLMService, name: str, description: str, *,
                 system_instruction: str | None = None, max_tokens: int | None = None,
                 in_pipeline: bool = False, response_timeout_secs: float = 60.0,
                 priority: int = 0) -> None:
        if not isinstance(llm, PipecatLLMService):
            raise ContractTypeError(
                f"PipecatLLMDestination needs a Pipecat LLMService, got {type(llm).__name__}")
        if not isinstance(response_timeout_secs, int | float) or not (
                0 < response_timeout_secs < float("inf")):
            raise ConfigurationError(
                "PipecatLLMDestination response_timeout_secs must be finite and positive")
        super().__init__(name, description, priority=priority)
        self.llm = llm
        self.system_instruction = system_instruction
        self.max_tokens = max_tokens
        self.in_pipeline = bool(in_pipeline)
        self.response_timeout_secs = float(response_timeout_secs)
        self._lock = asyncio.Lock()
        self._response: _Response | None = None
        self._warned = False
        if self.in_pipeline:
            llm.add_event_handler("on_before_push_frame", self._on_llm_frame)

    def context_for(self, turn: AgentTurn, *, system: bool = False) -> LLMContext:
        """The LLM context of a turn: its history, then its query (after the system
        instruction when `system`)."""
        messages: list[Any] = []
        if system and self.system_instruction:
            messages.append({"role": "system", "content": self.system_instruction})
        for exchange in turn.history:
            messages.append({"role": "user", "content": exchange.user})
            messages.append({"role": "assistant", "content": exchange.assistant})
        messages.append({"role": "user", "content": turn.query})
        return LLMContext(messages)

    async def respond(self, turn: AgentTurn, output: FrameOutput) -> str:
        if self.in_pipeline:
            return await self._respond_in_pipeline(turn, output)
        reply = await self.llm.run_inference(
            self.context_for(turn), max_tokens=self.max_tokens,
            system_instruction=self.system_instruction)
        text = (reply or "").strip()
        if text:
            await output.say(text)
        return text

    async def _on_llm_frame(self, llm: Any, frame: Frame) -> None:
        """Every frame the service pushes (Pipecat's on_before_push_frame event).

        A response that calls tools is not the end of the turn: the service runs them
        and answers again (its context aggregator asks for another inference); the
        turn ends with the response after the last results, or with results that ask
        for no more inference.
        """
        response = self._response
        if response is None:
            return
        if isinstance(frame, LLMFullResponseStartFrame):
            response.begun = True
            response.calls = 0
            response.rerun = False
        elif isinstance(frame, FunctionCallsStartedFrame):
            count = len(frame.function_calls) if isinstance(frame.function_calls, list) else 1
            response.calls += count
            response.results += count
        elif isinstance(frame, FunctionCallResultFrame):
            if getattr(frame.properties, "is_final", True) is not False:
                response.results = max(0, response.results - 1)
                rerun = frame.run_llm
                if frame.properties is not None and frame.properties.run_llm is not None:
                    rerun = frame.properties.run_llm
                response.rerun = response.rerun or rerun is not False
                if not response.results and not response.rerun and not response.calls:
                    response.finish()  # no inference follows the results
        elif not response.begun:
            return
        elif isinstance(frame, LLMTextFrame):
            if not response.texts and frame.text.strip():
                # In the service's task, before the first token leaves it: the first
                # response is timed here and a pending acknowledgment goes out first.
                await response.output.begin()
            if response.texts or frame.text.strip():
                response.texts.append(frame.text)
        elif isinstance(frame, ErrorFrame):
            response.error = type(getattr(frame, "exception", None) or frame).__name__
        elif isinstance(frame, LLMFullResponseEndFrame):
            response.begun = False
            if response.calls and response.error is None:
                response.calls = 0  # tools run now; the answer comes in the next response
                if not response.results and not response.rerun:
                    response.finish()
                return
            response.finish()

    async def _respond_in_pipeline(self, turn: AgentTurn, output: FrameOutput) -> str:
        if not self._warned and output._sink.processor.speaker.next is None:
            self._warned = True
            logger.warning("PipecatLLMDestination(in_pipeline=True) without the processor's "
                           "speaker in the pipeline: acknowledgments wait behind the LLM")
        async with self._lock:
            response = self._response = _Response(output)
            processor = output._sink.processor
            processor._llm_turn = output._sink
            output._sink.via_llm = True
            try:
                context = output.context
                if context is not None:
                    _heard_first(context)
                else:
                    context = self.context_for(turn, system=True)
                if processor.speaker.next is None:  # else the speaker marks each response
                    await processor._open_answer(output._sink)
                with _framework_spans_under_current(processor._tracing()):
                    await output.push(LLMContextFrame(context), speech=False)
                    async with asyncio.timeout(self.response_timeout_secs):
                        await response.done.wait()
            except TimeoutError as exc:
                raise LLMError(f"Pipecat LLM service {self.llm.name} gave no complete "
                               f"response within {self.response_timeout_secs:g} s") from exc
            except asyncio.CancelledError:
                if not response.done.is_set():
                    with contextlib.suppress(LifecycleError):
                        await output.push(InterruptionFrame(), speech=False)
                raise
            finally:
                self._response = None
                if processor._llm_turn is output._sink:
                    processor._llm_turn = None
        if response.error is not None:
            raise LLMError(f"Pipecat LLM service {self.llm.name} failed: {response.error}")
        return "".join(response.texts).strip()


def _heard_first(context: LLMContext) -> None:
    """Put back before the turn's user message (the context's last) the assistant text
    the app's assistant aggregator added after it while the turn was routed: what the
    user heard before speaking again (an acknowledgment, the start of an answer),
    flushed at the interruption. Else the LLM got a context ending with its own words
    and answered those, not the user (voice13 D1)."""
    messages = context.get_messages()
    last = len(messages)
    while last and _role(messages[last - 1]) == "assistant":
        last -= 1
    if last == len(messages) or not last or _role(messages[last - 1]) != "user":
        return
    heard = messages[last:]
    context.set_messages([*messages[:last - 1], *heard, messages[last - 1]])


def _role(message: object) -> object:
    return message.get("role") if isinstance(message, dict) else None


@dataclass(eq=False)
class _Mark(ControlFrame):
    """Rides the speech path just before one utterance of a routed turn (`end=False`)
    or after it (`end=True`), so the processor can tell, from the frames an output
    transport sends on once it played them, whose audio the user is hearing. Pipecat
    processors pass unknown frames on in order (the TTS queues them behind the audio
    of earlier speech), and an interruption drops them with the speech they mark."""

    owner: int = 0
    seq: int = 0
    participant_id: str = ""
    turn_id: str = ""
    kind: str = "answer"
    end: bool = False


class _Ledger:
    """The marked utterances of one processor not yet heard nor ended at the output,
    and the heard reports to the router."""

    def __init__(self, router: AgentRouter) -> None:
        self._router = router
        self._seq = itertools.count(1)
        self._pending: dict[int, _Mark] = {}
        self._changed = asyncio.Event()
        self._cut_seq = 0

    def mark(self, owner: int, turn: AgentTurn, kind: str) -> _Mark:
        mark = _Mark(owner=owner, seq=next(self._seq), participant_id=turn.participant_id,
                     turn_id=turn.turn_id, kind=kind)
        self._pending[mark.seq] = mark
        return mark

    def heard(self, mark: _Mark) -> None:
        """The output started speaking `mark`'s utterance (an observer call)."""
        if self._pending.pop(mark.seq, None) is None:
            return
        self._changed.set()
        with contextlib.suppress(Exception):  # an unknown participant or a stopped router
            self._router.mark_heard(mark.participant_id, mark.turn_id,
                                    control=mark.kind != "answer")

    def resolved(self, mark: _Mark) -> None:
        """`mark`'s utterance passed the output with no audio."""
        if self._pending.pop(mark.seq, None) is not None:
            self._changed.set()

    @property
    def pending(self) -> bool:
        """Whether a marked utterance is neither heard nor resolved yet."""
        return bool(self._pending)

    def flush(self, owner: int) -> _Mark:
        """A mark for the end of the call, after every utterance marked so far: once it
        passed the output (or reached the pipeline's end), what was marked before it
        that is still pending was played with no audio, or never will be."""
        return _Mark(owner=owner, seq=next(self._seq), kind="flush", end=True)

    def flushed(self, flush: _Mark) -> None:
        """`flush` passed the output, or the end of the pipeline: everything marked
        before it is resolved (an output plays in order: its audio would have come)."""
        for seq in [seq for seq in self._pending if seq < flush.seq]:
            del self._pending[seq]
        self._changed.set()

    def unheard(self) -> set[str]:
        """The participants with an answer marked and not heard yet."""
        return {mark.participant_id for mark in self._pending.values()
                if mark.kind == "answer"}

    def cut(self) -> None:
        """An interruption leaves the processor: what was marked so far is dropped."""
        self._cut_seq = next(self._seq)

    def cut_at_output(self) -> None:
        """An interruption reached the output: what was marked before it is gone."""
        for seq in [seq for seq in self._pending if seq <= self._cut_seq]:
            del self._pending[seq]
        self._changed.set()

    async def wait_empty(self) -> None:
        """Until every marked utterance was heard or passed the output with no audio."""
        while self._pending:
            self._changed.clear()
            await self._changed.wait()


#: Marked utterances an output may hold open at once (passed on, neither heard nor
#: ended); beyond it the oldest is forgotten (its turn falls back to `started()`).
_MAX_OPEN_MARKS = 32


class _Ears(BaseObserver):
    """Watches the pipeline's frames (a Pipecat observer the processor adds to its
    worker) and reports marked utterances heard when the output transport that passed
    their marks on starts speaking (`BotStartedSpeakingFrame`, sent as it writes an
    utterance's first audio). An output plays its queue in order and stops speaking at
    the end of each TTS utterance (`TTSStoppedFrame`), so each start of speech belongs
    to the newest marked utterance it passed on that is neither heard nor ended: an
    acknowledgment marked after an answer's mark is heard first, and the answer's audio
    that follows it is the answer's. (Audio chunks themselves are no guide: the output
    holds back the tail of an utterance's audio, which a mark may overtake.)"""

    def __init__(self, owner: int, ledger: _Ledger) -> None:
        super().__init__()
        self._owner = owner
        self._ledger = ledger
        #: Per processor (by id): the start marks it passed on, neither heard nor ended.
        self._open: dict[int, list[_Mark]] = {}
        #: Processors known to play audio (they sent a BotStartedSpeakingFrame).
        self._outputs: set[int] = set()
        #: The latest BotStartedSpeakingFrames counted (a broadcast sends two copies).
        self._started_ids: deque[int] = deque(maxlen=8)

    def _is_output(self, source: FrameProcessor) -> bool:
        if isinstance(source, BaseOutputTransport):
            return True
        return source.id in self._outputs

    async def reached_end(self, worker: object, frame: Frame) -> None:
        """A frame reached the end of the whole pipeline (the worker's
        `on_frame_reached_downstream` event): this processor's end-of-call flush
        resolves what is still pending, also where no output transport was seen (a
        pipeline with no audio; an output the processor cannot see, a call whose
        first audio has not played yet)."""
        if isinstance(frame, _Mark) and frame.owner == self._owner and frame.kind == "flush":
            self._ledger.flushed(frame)

    async def on_push_frame(self, data: FramePushed) -> None:
        frame = data.frame
        if isinstance(frame, _Mark):
            if frame.owner != self._owner:
                return
            source = data.source
            if frame.kind == "flush":
                if self._is_output(source):
                    self._open.pop(source.id, None)
                    self._ledger.flushed(frame)
                return
            marks = self._open.setdefault(source.id, [])
            if not frame.end:
                marks.append(frame)
                if len(marks) > _MAX_OPEN_MARKS:
                    del marks[0]
                return
            for index, mark in enumerate(marks):
                if mark.seq == frame.seq:
                    del marks[index]
                    if self._is_output(source):
                        self._ledger.resolved(mark)  # ended without audio
                    break
        elif isinstance(frame, BotStartedSpeakingFrame):
            if not data.first_push or frame.id in self._started_ids or getattr(
                    frame, "broadcast_sibling_id", None) in self._started_ids:
                return  # passed on, or the other copy of a broadcast: counted once
            self._started_ids.append(frame.id)
            self._outputs.add(data.source.id)
            started = self._open.get(data.source.id)
            if started:
                self._ledger.heard(started.pop())
        elif isinstance(frame, InterruptionFrame) and self._is_output(data.source):
            self._open.pop(data.source.id, None)
            self._ledger.cut_at_output()


class _Speaker(FrameProcessor):
    """Where a `TurnRouterProcessor`'s speech enters the pipeline: place it right before
    the TTS when an LLM service sits downstream of the processor, so speech (an
    acknowledgment above all) never waits in the LLM's queue behind a response being
    generated. Passes every frame through; marks the responses of the LLM that answer a
    routed turn (for the heard reports)."""

    def __init__(self, owner: TurnRouterProcessor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._owner = owner
        #: Frames (by id) whose passage someone waits for; at most one per waiter.
        self._awaited: dict[int, asyncio.Event] = {}
        #: The routed turn whose LLM response passes here.
        self._llm_sink: _TurnSink | None = None

    def expect(self, frame: Frame) -> asyncio.Event:
        """An event set once `frame` has passed this processor."""
        event = self._awaited[frame.id] = asyncio.Event()
        return event

    def forget(self, frame: Frame) -> None:
        self._awaited.pop(frame.id, None)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        downstream = direction == FrameDirection.DOWNSTREAM
        if isinstance(frame, LLMFullResponseStartFrame) and downstream:
            sink = self._owner._llm_turn
            if sink is not None and not sink.closed:
                self._llm_sink = sink
                await self._owner._open_answer(sink, here=True)
        await self.push_frame(frame, direction)
        if isinstance(frame, LLMFullResponseEndFrame) and downstream:
            sink, self._llm_sink = self._llm_sink, None
            if sink is not None and sink.llm_done:
                await self._owner._end_answer(sink, here=True)
            elif sink is not None:
                self._llm_sink = sink  # tools run: the answer comes in a later response
        event = self._awaited.pop(frame.id, None)
        if event is not None:
            event.set()


#: How many linked processors the processor looks through for an output transport.
_MAX_WALK = 1000

#: How long an interruption may take to travel from the processor to its speaker.
_PASSAGE_BOUND_SECS = 2.0


#: Distinct participants a processor sharing its router remembers, to let them depart at
#: the call's end (one call: its users; far more than any call has).
MAX_CALL_PARTICIPANTS = 1024


def _power_of_ten(count: int) -> bool:
    """1, 10, 100, ...: when a repeated overflow is logged again."""
    while count % 10 == 0:
        count //= 10
    return count == 1


def _walk(node: FrameProcessor | None, upstream: bool) -> Iterator[FrameProcessor]:
    """The processors linked after `node` (before it, `upstream`), at most `_MAX_WALK`."""
    for _ in range(_MAX_WALK):
        node = None if node is None else (node.previous if upstream else node.next)
        if node is None:
            return
        yield node


def _warn_of_layout(processor: TurnRouterProcessor) -> None:
    """One WARNING for each of `_layout_problems`."""
    for problem in _layout_problems(processor):
        logger.warning("turnrouter: %s", problem)


def _layout_problems(processor: TurnRouterProcessor) -> list[str]:
    """What is wrong with where the processor, its speaker and its routes' in-pipeline
    LLM services sit in the pipeline, each naming the fix (checked at `StartFrame`).
    Each of these failed silently (voice17 F4): an LLM before the processor answered
    every turn itself; a speaker before it lost the first utterance and held each
    interruption 2 s; a speaker after the output transport was never heard; an
    in-pipeline LLM that is not downstream left the caller in silence for 60 s."""
    problems = []
    upstream = list(_walk(processor, upstream=True))
    downstream = list(_walk(processor, upstream=False))
    if any(isinstance(node, PipecatLLMService) for node in upstream):
        problems.append(
            "an LLM service sits before the TurnRouterProcessor: it answers every turn "
            "itself and turnrouter routes none; put the processor in the LLM's place "
            "(after the user context aggregator) and the LLM after it")
    speaker = processor.speaker
    if speaker.next is not None:
        if speaker in upstream:
            problems.append(
                "processor.speaker sits before the TurnRouterProcessor: put it after the "
                "processor (right before the TTS)")
        elif not any(isinstance(node, BaseOutputTransport) for node in _walk(speaker, False)) \
                and any(isinstance(node, BaseOutputTransport)
                        for node in _walk(speaker, upstream=True)):
            problems.append(
                "processor.speaker sits after the output transport: nothing it says is "
                "heard; put it right before the TTS")
    # Only where the walk reached the output transport: a nested pipeline's links end
    # at its sink, and what follows it is not seen.
    complete = any(isinstance(node, BaseOutputTransport) for node in downstream)
    for name, destination in processor.router.destinations.items():
        if (complete and isinstance(destination, PipecatLLMDestination)
                and destination.in_pipeline and destination.llm not in downstream):
            problems.append(
                f"route {name!r}: PipecatLLMDestination(in_pipeline=True) needs its LLM "
                "service after the TurnRouterProcessor in the pipeline (else each of its "
                "turns waits response_timeout_secs in silence); add it there, or pass "
                "in_pipeline=False")
    return problems


class _Interrupts:
    """A processor's router interrupts, draining beside the pipeline.

    When `start()` returns, each interrupt's cancellation has run (its first step), so
    a turn offered next is not cancelled by it; its draining goes on in a task of its
    own. The interruption then goes downstream at once: a destination slow to end on
    cancellation (a cleanup, a swallowed cancel) or a slow `release()` no longer keeps
    the bot talking over the user, nor holds up another participant's barge-in
    (voice22 F1)."""

    def __init__(self, processor: FrameProcessor, router: AgentRouter) -> None:
        self._processor, self._router = processor, router
        #: The interrupt still draining, per participant (cancelled at the processor's
        #: cleanup): at most one each, a newer one taking over the wait of the one
        #: before (whose cancellation has run), so barge-ins repeated while a
        #: destination is slow to end start no pile of waiting tasks.
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self, participants: list[str]) -> None:
        for participant_id in participants:
            task = self._processor.create_task(self._router.interrupt(participant_id),
                                               name="turnrouter-interrupt")
            before = self.tasks.get(participant_id)
            self.tasks[participant_id] = task
            task.add_done_callback(functools.partial(self._done, participant_id))
            if before is not None:
                before.cancel()  # (after the new one: its wait covers the same turns)
        if participants:
            await asyncio.sleep(0)  # the new tasks' first steps run before we resume

    def _done(self, participant_id: str, task: asyncio.Task[None]) -> None:
        if self.tasks.get(participant_id) is task:
            del self.tasks[participant_id]

    async def wait(self) -> None:
        while self.tasks:
            await asyncio.wait(list(self.tasks.values()))


class TurnRouterProcessor(FrameProcessor):
    """Routes each final user turn through an `AgentRouter`; put it where the LLM was.

    - `TranscriptionFrame`s (place it after the STT) or the user context aggregator's
      user turns (place it after the aggregator: the `LLMContextFrame` that follows its
      `LLMContextUserTurnFrame`) become turns and are consumed. Other context frames
      (`LLMRunFrame`, messages appended with `run_llm`) pass through to the LLM
      downstream, speculative ones (eager end of turn) are dropped, and everything else
      passes through.
    - One call, one participant: without `participant_id` the processor gets an id of
      its own (`call-<uuid>`), so calls sharing a router never share a history or
      replace each other's turns. A transcription's non-empty `user_id` (the transport's
      id of that user) is its participant instead.
    - Each turn runs in its own task (`route_turn`), so a newer turn of the same
      participant replaces the running one, and different participants run concurrently.
      At most `max_turns` turn tasks run: over it, the oldest is cancelled for the new
      one (not for a turn a busy router refuses: that one only says the busy text) and
      the overflow counted
      (`turnrouter_runtime_rejected_messages_total{topic="pipecat", reason="overflow"}`),
      as are oversized (`oversized`) and malformed (`invalid`) turns, which are refused.
    - Control text (acknowledgments, preambles, clarifications, failure, busy and
      dropped-turn text) is pushed downstream as `TTSSpeakFrame`s; destinations push
      frames through `frame_output()`. A destination that pushed no speech for a turn
      answered with a non-empty `DestinationResult.text` (one written for the
      in-process router) has that text spoken as the turn's answer, once, unless an
      interruption or the call's cancel came while the turn ran.
      With an LLM service downstream, put `processor.speaker` right before the TTS: the
      speech then enters there, not behind the LLM's queue.
    - `InterruptionFrame` interrupts this processor's participants (before it is
      forwarded); `EndFrame` waits for the turns in flight and for the audio of what
      they said to start playing (at most `end_timeout_secs`, 30 s, in all; then they
      are interrupted), then stops the router (`drain()`, `stop()`); `CancelFrame`
      stops it at once. With `owns_router=False` (a router shared by several
      pipelines) they wait for, or interrupt, this processor's own turns only, and its
      participants depart (`begin_departure`).
    - With `report_heard` (default), each utterance (acknowledgment, other control
      text, answer) is reported heard when its own first audio leaves the output
      transport: silence ends at the first of them, first response at the answer's.
    - With Pipecat tracing on, turn spans are children of Pipecat's `turn` span.

    Events (Pipecat event handlers): `on_turn_routed(processor, turn, routed)`,
    `on_turn_failed(processor, turn, error)`.
    """

    def __init__(self, router: AgentRouter, *, participant_id: str | None = None,
                 report_heard: bool = True, owns_router: bool = True, max_turns: int = 64,
                 max_query_chars: int = 4096, end_timeout_secs: float = 30.0,
                 **kwargs: Any) -> None:
        if not isinstance(router, AgentRouter):
            raise ContractTypeError(
                f"TurnRouterProcessor needs an AgentRouter, got {type(router).__name__}")
        if participant_id is None:
            participant_id = f"call-{uuid.uuid4().hex}"
        if not isinstance(participant_id, str) or not 0 < len(participant_id) <= MAX_ID_CHARS:
            raise ConfigurationError(
                "TurnRouterProcessor participant_id must be a non-empty str of at most "
                f"MAX_ID_CHARS ({MAX_ID_CHARS}) characters")
        for name, value in (("max_turns", max_turns), ("max_query_chars", max_query_chars)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"TurnRouterProcessor {name} must be an int >= 1")
        if not isinstance(end_timeout_secs, int | float) or isinstance(end_timeout_secs, bool) \
                or not 0 < end_timeout_secs < float("inf"):
            raise ConfigurationError(
                "TurnRouterProcessor end_timeout_secs must be finite and positive")
        super().__init__(**kwargs)
        self.router = router
        self.participant_id = participant_id
        self.report_heard = bool(report_heard)
        self.owns_router = bool(owns_router)
        self.max_turns = max_turns
        self.max_query_chars = max_query_chars
        self.end_timeout_secs = float(end_timeout_secs)
        self._count = 0
        self._tasks: dict[asyncio.Task[None], _TurnSink] = {}
        self._interrupts = _Interrupts(self, router)
        #: Participants this processor routed turns for, sharing the router (at most
        #: MAX_CALL_PARTICIPANTS), in arrival order.
        self._callers: dict[str, None] = {}
        self._refusals: dict[str, int] = {}
        self._stopped = False
        _note_owner(self)
        #: The user aggregator announced a user turn: its next context frame is routed.
        self._user_turn_pending = False
        self._speaker = _Speaker(self, name=f"{self.name}::speaker")
        #: The turn an LLM service downstream is answering (PipecatLLMDestination).
        self._llm_turn: _TurnSink | None = None
        # Heard reports: marks in the speech path, watched at the output transport.
        self._ledger = _Ledger(router)
        self._ears = _Ears(self.id, self._ledger)
        self._stream_mark: _Mark | None = None
        self._register_event_handler("on_turn_routed")
        self._register_event_handler("on_turn_failed")

    @property
    def speaker(self) -> FrameProcessor:
        """Put this in the pipeline right before the TTS when an LLM service follows the
        processor: the router's speech (acknowledgments, clarifications, destinations'
        frames) then enters there instead of queueing behind the LLM."""
        return self._speaker

    @property
    def turns_in_flight(self) -> int:
        """Turn tasks of this processor still running."""
        return len(self._tasks)

    async def setup(self, setup: FrameProcessorSetup) -> None:  # type: ignore[override]
        await super().setup(setup)
        if self.report_heard:
            worker = setup.pipeline_worker
            worker.add_observer(self._ears)
            # The end-of-call flush reaching the pipeline's end (see `_drain_audio`).
            worker.add_reached_downstream_filter((_Mark,))
            worker.add_event_handler("on_frame_reached_downstream", self._ears.reached_end)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        downstream = direction == FrameDirection.DOWNSTREAM
        if downstream and isinstance(frame, TranscriptionFrame):
            self._offer(frame)
            return
        if downstream and isinstance(frame, LLMContextFrame):
            if frame.speculation is True:
                return  # eager inference is not routed: the confirmed turn is
            if self._user_turn_pending:
                self._user_turn_pending = False
                self._offer(frame)
                return
            # Not a user turn (LLMRunFrame, messages appended with run_llm): the LLM
            # downstream answers it as it did before turnrouter.
        elif downstream and isinstance(frame, LLMContextUserTurnFrame):
            self._user_turn_pending = True
        if isinstance(frame, InterruptionFrame):
            await self._start_interrupts()
            if downstream:
                await self._push_through(frame)
                return
        elif isinstance(frame, EndFrame):
            await self._end()
        elif isinstance(frame, CancelFrame):
            await self._cancel()
        elif isinstance(frame, StartFrame):
            self._stopped = False
            _warn_of_layout(self)
        await self.push_frame(frame, direction)

    async def cleanup(self) -> None:
        """Cancel turn tasks still running when the pipeline is torn down."""
        for task in [*self._tasks, *self._interrupts.tasks.values()]:
            await self.cancel_task(task)
        with contextlib.suppress(Exception):  # no worker (never set up)
            await self.pipeline_worker.remove_observer(self._ears)
        await super().cleanup()  # type: ignore[no-untyped-call]

    # -- turns ---------------------------------------------------------------------

    def _offer(self, frame: Frame) -> None:
        self._count += 1
        try:
            turn = turn_from_frame(frame, turn_id=f"pipecat-{self.id}-{self._count}",
                                   participant_id=self.participant_id,
                                   max_query_chars=self.max_query_chars)
        except ContractValueError as exc:
            self._reject("oversized" if "max_query_chars" in str(exc) else "invalid")
            return
        except (ContractTypeError, TypeError, ValueError):
            self._reject("invalid")
            return
        if turn is None:
            return
        if not self.owns_router:
            self._track_caller(turn.participant_id)
        router = self.router
        if router.refusing and router.sheds(turn.participant_id):
            # Refused at once with the busy text (a short task): it takes no admitted
            # caller's place, which would go unanswered for a turn that cannot run.
            running = []
        else:
            running = [task for task in self._tasks if not task.cancelling()]
        if len(running) >= self.max_turns:
            # The newest utterance wins: the oldest running turn makes way for it.
            self._reject("overflow")
            running[0].cancel("turn bound: the oldest turn made way for a newer one")
        sink = _TurnSink(self, turn, frame.context if isinstance(frame, LLMContextFrame)
                         else None)
        task = self.create_task(self._run(sink, self._pipecat_carrier()),
                                name=f"turn-{turn.turn_id}")
        self._tasks[task] = sink
        # Also when cancelled before it ran (the turn bound): `_run` never starts then.
        task.add_done_callback(self._forget_task)

    def _track_caller(self, pid: str) -> None:
        """Remember a participant of this call, to depart at its end (the router is
        shared). Past MAX_CALL_PARTICIPANTS a newcomer is routed but not remembered
        (counted as an overflow): its state stays until it departs otherwise."""
        if pid in self._callers:
            return
        if len(self._callers) >= MAX_CALL_PARTICIPANTS:
            self._reject("overflow")
            return
        self._callers[pid] = None

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    def _reject(self, reason: str) -> None:
        """Count a refused (or, for `overflow`, evicted) turn; logged the first time
        and at every power of ten of its count."""
        if (count := self._counted(reason)) is not None:
            logger.warning("pipecat turn %s (%d so far in this pipeline)",
                           "bound overflowed" if reason == "overflow" else
                           f"refused: {reason}", count)
        self.router.report_rejected(SOURCE, reason)

    def _counted(self, reason: str) -> int | None:
        """Count one more `reason` in this pipeline: the count when it is to be logged
        (the 1st, 10th, 100th...), else None."""
        count = self._refusals[reason] = self._refusals.get(reason, 0) + 1
        return count if _power_of_ten(count) else None

    def _tracing(self) -> Any:
        """Pipecat's tracing context (None without tracing, or before setup)."""
        try:
            return self.processor_setup.tracing_context
        except Exception:  # not set up (no StartFrame yet)
            return None

    def _pipecat_carrier(self, *, call: bool = False) -> dict[str, str]:
        """Trace headers of Pipecat's current turn span (`call`: its conversation span,
        the call's) with its tracing on, else none."""
        tracing = self._tracing()
        if tracing is None:
            return {}
        if call:
            return _carrier_of(tracing.get_conversation_context())
        return _carrier_of(tracing.get_turn_context() or tracing.get_conversation_context())

    async def _run(self, sink: _TurnSink, carrier: dict[str, str]) -> None:
        token = _CURRENT.set(sink)
        turn = sink.turn
        try:
            scope = (self.router.continue_trace(carrier) if carrier
                     else contextlib.nullcontext())
            with scope:
                routed = await self.router.route_turn(
                    turn, output=self._speak, report_heard="all" if self.report_heard else False)
            await self._say_result(sink, routed.result)
            sink.closed = True
            await self._close_answer(sink)
            await self._call_event_handler("on_turn_routed", turn, routed)
        except TurnInterrupted:
            sink.closed = True
        except Exception as exc:
            sink.closed = True
            await self._close_answer(sink)
            if not isinstance(exc, RouterBusyError):
                logger.warning("pipecat turn %s failed: %s", turn.turn_id,
                               type(exc).__name__)
            elif (count := self._counted("busy")) is not None:
                # Said (the busy text) and counted by the router: logged sparsely.
                logger.warning("pipecat turns refused by a busy router: %d so far in "
                               "this pipeline", count)
            await self._call_event_handler("on_turn_failed", turn, exc)
        finally:
            sink.closed = True
            _CURRENT.reset(token)
            task = asyncio.current_task()
            if task is not None:
                self._tasks.pop(task, None)

    async def _say_result(self, sink: _TurnSink, result: DestinationResult) -> None:
        """A destination that said nothing through the pipeline (one written for the
        in-process router, which returns its answer's text): its text is said as the
        turn's answer, the way its own speech would be (marked as the answer, cut by an
        interruption, in the Pipecat context), once. Not after an interruption or the
        call's end, nor for a turn the router ended itself (it said its text already)."""
        text = result.text
        if (sink.spoke or sink.cut or self._stopped or result.disposition == "clarify"
                or not text.strip()):
            return
        sink.spoke = True
        try:
            await self._open_answer(sink)
            if not sink.cut:  # an interruption meanwhile: it went out ahead, say nothing
                await self._push_speech(TTSSpeakFrame(text))
        except Exception as exc:  # the pipeline is being torn down
            logger.warning("pipecat turn %s: its answer could not be said: %s",
                           sink.turn.turn_id, type(exc).__name__)

    async def _speak(self, turn: AgentTurn, route: str, text: str) -> None:
        """The router's control text for a turn: spoken downstream, between marks."""
        frame = TTSSpeakFrame(text)
        if not self.report_heard:
            await self._push_speech(frame)
            return
        mark = self._mark(turn, "control")
        await self._push_speech(mark)
        await self._push_speech(frame)
        await self._push_speech(_Mark(owner=self.id, seq=mark.seq, end=True))

    # -- heard reports -----------------------------------------------------------------

    def _mark(self, turn: AgentTurn, kind: str) -> _Mark:
        mark = self._ledger.mark(self.id, turn, kind)
        self._stream_mark = mark if kind == "answer" else None
        return mark

    async def _open_answer(self, sink: _TurnSink, *, here: bool = False) -> None:
        """Mark the answer's speech in the speech path (again if other speech went out
        since), so its first audio is reported as the answer's. `here`: called by the
        speaker while it passes the LLM's response on."""
        if not self.report_heard or (
                sink.answer_mark is not None and self._stream_mark is sink.answer_mark):
            return
        mark = sink.answer_mark = self._mark(sink.turn, "answer")
        if here:
            await self._speaker.push_frame(mark, FrameDirection.DOWNSTREAM)
        else:
            await self._push_speech(mark)

    async def _push_answer(self, sink: _TurnSink, frame: Frame) -> None:
        await self._open_answer(sink)
        await self._push_speech(frame)

    async def _close_answer(self, sink: _TurnSink) -> None:
        """The turn is over: its answer's speech ends in the speech path (for an LLM
        service's answer, the speaker does that once the final response passed it)."""
        if not sink.via_llm or self._speaker.next is None:
            await self._end_answer(sink)

    async def _end_answer(self, sink: _TurnSink, *, here: bool = False) -> None:
        mark = sink.answer_mark
        if mark is None or self._stream_mark is not mark:
            return
        self._stream_mark = None
        end = _Mark(owner=self.id, seq=mark.seq, end=True)
        with contextlib.suppress(Exception):  # the pipeline is being torn down
            if here:
                await self._speaker.push_frame(end, FrameDirection.DOWNSTREAM)
            else:
                await self._push_speech(end)

    async def _drain_audio(self) -> None:
        """Wait until every marked utterance was heard, or passed the output with no
        audio (bounded by the caller). Also for a call whose first audio has not played
        yet and whose output the processor cannot see (in a pipeline of its own, an
        output that is no `BaseOutputTransport`): a flush mark follows the speech, and
        when it reaches the output, or the end of a pipeline that has none, the rest is
        resolved. (The wait was skipped before any audio was seen: the router stopped
        at once and measured that turn at `started()`: newcomer20 F1.)"""
        if not self._ledger.pending:
            return
        await self._push_speech(self._ledger.flush(self.id))
        await self._ledger.wait_empty()

    async def _push_through(self, frame: Frame) -> None:
        """Push a frame downstream and, with the speaker linked, wait (bounded) until it
        passed the speaker: speech pushed afterwards at the speaker then follows it, so
        an interruption never drops the speech of the turn that replaced the cut one."""
        if isinstance(frame, InterruptionFrame):
            self._ledger.cut()
            self._stream_mark = None
        if self._speaker.next is None:
            await self.push_frame(frame, FrameDirection.DOWNSTREAM)
            return
        passed = self._speaker.expect(frame)
        try:
            await self.push_frame(frame, FrameDirection.DOWNSTREAM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_PASSAGE_BOUND_SECS):
                    await passed.wait()
        finally:
            self._speaker.forget(frame)

    async def _push_speech(self, frame: Frame) -> None:
        """Speech goes out at the speaker when it is linked into the pipeline."""
        if self._speaker.next is not None:
            await self._speaker.push_frame(frame, FrameDirection.DOWNSTREAM)
        else:
            await self.push_frame(frame, FrameDirection.DOWNSTREAM)

    # -- interruptions and the end ----------------------------------------------------

    async def _start_interrupts(self) -> None:
        """Nothing more of the running turns is said; the router interrupts them without
        our waiting for them to end (`_Interrupts`), and the answers not heard yet too
        (the router ends their measurement here: a lower bound, no silence)."""
        participants = self._ledger.unheard()
        for sink in self._tasks.values():
            sink.cut = True
            participants.add(sink.turn.participant_id)
        await self._interrupts.start(sorted(participants))

    async def _wait_own_turns(self) -> None:
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def _end(self) -> None:
        """EndFrame: let the turns in flight finish and their speech start playing (at
        most `end_timeout_secs` in all, then they are interrupted), then stop the
        router (or, sharing it, let this call's participants depart)."""
        try:
            async with asyncio.timeout(self.end_timeout_secs):
                if self.owns_router:
                    await self.router.drain()
                await self._wait_own_turns()
                await self._drain_audio()
        except TimeoutError:
            logger.warning("pipecat end: turns or their audio still pending after %g s",
                           self.end_timeout_secs)
            # Unheard answers end at this moment, a lower bound, not started(); the
            # interruption goes out before the turns ended, so nothing is heard later
            # (voice17 F9), even of a destination slow to end on cancellation.
            await self._start_interrupts()
            await self._push_through(InterruptionFrame())
            await self._interrupts.wait()
        await self._finish()

    async def _finish(self) -> None:
        """Stop the router, or let this call's participants depart: their release
        spans are children of Pipecat's conversation span (the call's) when traced."""
        if self._stopped:
            return
        self._stopped = True
        with self.router.continue_trace(self._pipecat_carrier(call=True)):
            if self.owns_router:
                await self.router.stop()
                return
            callers, self._callers = list(self._callers), {}
            for participant_id in callers:
                try:
                    self.router.begin_departure(participant_id)
                except Exception as exc:  # the router stopped meanwhile
                    logger.debug("pipecat end: departure of a participant: %s",
                                 type(exc).__name__)

    async def _cancel(self) -> None:
        """CancelFrame: stop now (turns in flight and answers not heard yet are
        interrupted: a lower bound at the cancel, not their text's push; voice17 F2)."""
        await self._start_interrupts()  # (it cuts the turns first)
        await self._interrupts.wait()
        await self._finish()
