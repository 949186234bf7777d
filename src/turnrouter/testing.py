"""Fakes for every seam of turnrouter, for your tests and ours.

Like httpx's `MockTransport`: scripted decisions, scripted agents that record every
call, an output recorder, an in-memory observer, and `TelemetryCapture`: the real
telemetry recorded in memory (needs `opentelemetry-sdk`, the `testing` extra). They are
deterministic and never sleep; gate them with events to test cancellation.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from ._contracts import (
    Admission,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RoutingAid,
)
from ._observer import (
    AcknowledgmentFinished,
    AcknowledgmentGenerated,
    AdmissionFinished,
    AnswerAfterAcknowledgment,
    AnswerFinished,
    AnswerStarted,
    Clarification,
    ContextPatchEvent,
    DecisionFinished,
    DefaultFallback,
    Failure,
    FirstResponse,
    FocusChanged,
    Heard,
    LimitExceeded,
    LoadSampled,
    MessageRejected,
    ParticipantChanged,
    ReleaseFinished,
    Rerouted,
    RouteIneligible,
    RouterObserver,
    SilenceMeasured,
    TurnFinished,
    TurnObserver,
    TurnOutcome,
    TurnShed,
    TurnStarted,
)
from .telemetry._capture import TelemetryCapture

__all__ = [
    "Call",
    "DecisionScript",
    "ManualClock",
    "OutputRecorder",
    "RecordingObserver",
    "ScriptedAgent",
    "ScriptedDecisions",
    "ScriptedDepartingAgent",
    "ScriptedLLM",
    "Spoken",
    "TelemetryCapture",
]

DecisionScript = (
    RouteDecision | str | BaseException | Callable[[RouteRequest], RouteDecision | str]
)


class ScriptedDecisions:
    """A `DecisionService` that answers from a script and records every request.

    Each entry is a `RouteDecision`, a route name (or "clarify"), an exception to raise,
    or a callable of the request. Entries are used in order; the last one repeats.
    """

    def __init__(self, *script: DecisionScript) -> None:
        if not script:
            raise ValueError("ScriptedDecisions needs at least one scripted decision")
        self._script = list(script)
        self.requests: list[RouteRequest] = []

    async def decide(self, request: RouteRequest) -> RouteDecision:
        self.requests.append(request)
        entry = self._script.pop(0) if len(self._script) > 1 else self._script[0]
        if isinstance(entry, BaseException):
            raise entry
        if callable(entry) and not isinstance(entry, RouteDecision):
            entry = entry(request)
        if isinstance(entry, str):
            return RouteDecision(entry)
        return entry


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded call on a scripted agent."""

    method: str
    """`"routing_aid"`, `"admit"`, `"answer"`, `"release"` or `"participant_left"`."""
    participant_id: str
    """The participant the call was for."""
    turn_id: str | None = None
    """The turn's id (admit and answer)."""
    query: str | None = None
    """The turn's query (admit and answer)."""
    focused: bool | None = None
    """`admit(..., focused=)`."""
    history: tuple[Any, ...] = ()
    """The turn's history as the agent received it."""


AdmitScript = Admission | str | BaseException | Callable[[AgentTurn, bool], Admission]
AnswerScript = DestinationResult | str | BaseException


class ScriptedAgent:
    """A `RoutableAgent` that admits and answers from scripts and records every call.

    - `admissions`: what `admit()` returns, in order (the last repeats): an `Admission`,
      a disposition string, an exception to raise, or a callable `(turn, focused)`.
    - `results`: what `answer()` returns (a `DestinationResult`, a disposition string or
      an exception to raise); `answer_text` is kept as the result text.
    - `call_started`: whether `answer()` awaits `started()` before finishing (and
      before raising a scripted exception when `fail_after_started`).
    - the attribute `answer_gate` (not an argument: set it on the agent): when set,
      `answer()` waits for it (after `started()` if `call_started`), so tests can
      interrupt a running answer; `answer_entered` is set when `answer()` begins,
      `started_called` once `started()` returned.
    - `output`: optional callback `answer()` uses to speak `answer_text` itself.

    Args:
        name: The route name of its routing aid.
        description: The routing aid's description.
        priority: The routing aid's priority.
        eligible: Whether the routing aid says it is eligible.
        answer_text: The result text (default: "<name> answer").
        fail_after_started: Raise a scripted exception only after `started()`.
        release_error: An exception `release()` raises (after recording the call).
    """

    def __init__(
        self,
        name: str,
        description: str = "",
        *,
        priority: int = 0,
        eligible: bool = True,
        admissions: AdmitScript | Sequence[AdmitScript] = "accept",
        results: AnswerScript | Sequence[AnswerScript] = "answer",
        answer_text: str | None = None,
        call_started: bool = True,
        fail_after_started: bool = False,
        release_error: BaseException | None = None,
        output: Callable[[AgentTurn, str, str], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self.description = description or f"handles {name} requests"
        self.priority = priority
        self.eligible = eligible
        self._admissions = _as_script(admissions)
        self._results = _as_script(results)
        self.answer_text = answer_text if answer_text is not None else f"{name} answer"
        self.call_started = call_started
        self.fail_after_started = fail_after_started
        self.release_error = release_error
        self.output = output
        self.calls: list[Call] = []
        self.admit_gate: anyio.Event | None = None
        self.answer_gate: anyio.Event | None = None
        self.release_gate: anyio.Event | None = None
        self.admit_entered = anyio.Event()
        self.answer_entered = anyio.Event()
        self.started_called = anyio.Event()
        self.release_entered = anyio.Event()
        self.cancelled: list[str] = []

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid(self.name, self.description, self.priority, self.eligible,
                          "available" if self.eligible else "unavailable")

    def methods(self) -> list[str]:
        """The recorded method names, in call order."""
        return [call.method for call in self.calls]

    def count(self, method: str) -> int:
        """How many times `method` was called."""
        return sum(1 for call in self.calls if call.method == method)

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        self.calls.append(Call("admit", turn.participant_id, turn.turn_id, turn.query, focused,
                               turn.history))
        self.admit_entered.set()
        try:
            if self.admit_gate is not None:
                await self.admit_gate.wait()
        except BaseException:
            self.cancelled.append("admit")
            raise
        entry = _next(self._admissions)
        if isinstance(entry, BaseException):
            raise entry
        if callable(entry) and not isinstance(entry, Admission):
            admission: Admission = entry(turn, focused)
            return admission
        if isinstance(entry, str):
            return Admission(entry)  # type: ignore[arg-type]
        scripted: Admission = entry
        return scripted

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        self.calls.append(Call("answer", turn.participant_id, turn.turn_id, turn.query, None,
                               turn.history))
        self.answer_entered.set()
        entry = _next(self._results)
        try:
            if isinstance(entry, BaseException) and not self.fail_after_started:
                raise entry
            if self.call_started:
                await started()
                self.started_called.set()
            if self.answer_gate is not None:
                await self.answer_gate.wait()
            if self.output is not None:
                await self.output(turn, self.name, self.answer_text)
        except BaseException:
            self.cancelled.append("answer")
            raise
        if isinstance(entry, BaseException):
            raise entry
        if isinstance(entry, str):
            return DestinationResult(entry, text=self.answer_text)  # type: ignore[arg-type]
        result: DestinationResult = entry
        return result

    async def release(self, participant_id: str) -> None:
        self.calls.append(Call("release", participant_id))
        self.release_entered.set()
        if self.release_gate is not None:
            await self.release_gate.wait()
        if self.release_error is not None:
            raise self.release_error


class ScriptedDepartingAgent(ScriptedAgent):
    """A `ScriptedAgent` with the optional `participant_left()` departure hook.

    Args:
        name: As `ScriptedAgent`.
        description: As `ScriptedAgent`.
        departure_error: An exception `participant_left()` raises (after recording it).
    """

    def __init__(self, name: str, description: str = "", *,
                 departure_error: BaseException | None = None, **kwargs: Any) -> None:
        super().__init__(name, description, **kwargs)
        self.departure_error = departure_error

    async def participant_left(self, participant_id: str) -> None:
        self.calls.append(Call("participant_left", participant_id))
        self.release_entered.set()
        if self.release_gate is not None:
            await self.release_gate.wait()
        if self.departure_error is not None:
            raise self.departure_error


@dataclass(frozen=True, slots=True)
class Spoken:
    """One piece of router control text delivered through `output`."""

    participant_id: str
    """The participant it was said to."""
    turn_id: str
    """The turn it belongs to."""
    route: str
    """The route it was said for (`"clarify"` for the router's own questions, `"none"`
    for the failure or busy text when no destination answered)."""
    text: str
    """What was said."""


@dataclass
class OutputRecorder:
    """An `output` callback that records what the router said, in order."""

    spoken: list[Spoken] = field(default_factory=list)
    """Everything said so far, in delivery order."""
    error: BaseException | None = None
    """When set, every call raises it (a failing speaker)."""
    gate: anyio.Event | None = None
    """When set, every call waits for it first (a slow speaker)."""

    async def __call__(self, turn: AgentTurn, route: str, text: str) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        self.spoken.append(Spoken(turn.participant_id, turn.turn_id, route, text))

    @property
    def texts(self) -> list[str]:
        """Just the texts, in delivery order."""
        return [item.text for item in self.spoken]

    def for_participant(self, participant_id: str) -> list[str]:
        """Texts delivered to one participant."""
        return [item.text for item in self.spoken if item.participant_id == participant_id]


class ScriptedLLM:
    """An `LLMService` returning scripted completions (or raising) and recording prompts."""

    def __init__(self, *replies: str | BaseException) -> None:
        if not replies:
            raise ValueError("ScriptedLLM needs at least one reply")
        self._replies = list(replies)
        self.prompts: list[tuple[str, int, bool]] = []

    async def complete(self, prompt: str, *, max_tokens: int, reasoning: bool = False) -> str:
        self.prompts.append((prompt, max_tokens, reasoning))
        reply = self._replies.pop(0) if len(self._replies) > 1 else self._replies[0]
        if isinstance(reply, BaseException):
            raise reply
        return reply


class _RecordingTurn(TurnObserver):
    __slots__ = ("_events", "_owner")

    def __init__(self, events: list[tuple[Any, ...]], owner: RecordingObserver) -> None:
        self._events = events
        self._owner = owner

    def decision_started(self, request: RouteRequest) -> object:
        return ("decision", request.candidate_names)

    def decision_finished(self, token: object, event: DecisionFinished) -> None:
        decision = event.decision
        self._events.append(("decision", None if decision is None else decision.choice,
                             _name(event.error)))

    def admission_finished(self, token: object, event: AdmissionFinished) -> None:
        self._events.append(("admission", event.route, event.disposition, event.focused,
                             event.timed_out, _name(event.error)))

    def answer_started(self, event: AnswerStarted) -> object:
        self._events.append(("answer_started", event.route, event.fallback))
        return event.route

    def first_response(self, token: object, event: FirstResponse) -> None:
        self._events.append(("first_response", event.route))

    def output_started(self, token: object, event: FirstResponse) -> None:
        self._events.append(("output_started", event.route))

    def answer_finished(self, token: object, event: AnswerFinished) -> None:
        result = event.result
        self._events.append(("answer_finished", event.route,
                             None if result is None else result.disposition,
                             _name(event.error), event.interrupted))

    def release_finished(self, token: object, event: ReleaseFinished) -> None:
        self._events.append(("release", event.route, event.reason, _name(event.error)))

    def reroute(self, event: Rerouted) -> None:
        self._events.append(("reroute", event.route))

    def default_fallback(self, event: DefaultFallback) -> None:
        self._events.append(("default_fallback", event.route))

    def clarification(self, event: Clarification) -> None:
        self._events.append(("clarification", event.reason))

    def focus_transition(self, event: FocusChanged) -> None:
        self._events.append(("focus", event.route, event.transition))

    def acknowledgment(self, event: AcknowledgmentFinished) -> None:
        self._events.append(("acknowledgment", event.route, event.outcome, event.trigger))

    def acknowledgment_generated(self, event: AcknowledgmentGenerated) -> None:
        self._events.append(("acknowledgment_generated", event.route, event.seconds))

    def answer_after_acknowledgment(self, event: AnswerAfterAcknowledgment) -> None:
        self._events.append(("answer_after_acknowledgment", event.route, event.trigger,
                             event.seconds))

    def route_ineligible(self, event: RouteIneligible) -> None:
        self._events.append(("route_ineligible", event.route, event.reason))

    def silence(self, event: SilenceMeasured) -> None:
        self._events.append(("silence", event.route, event.seconds))

    def failure(self, event: Failure) -> None:
        self._events.append(("failure", event.route, event.stage, _name(event.error)))

    def finished(self, event: TurnFinished) -> None:
        self._owner.in_flight -= 1
        self._events.append(("finished", event.outcome, event.route, event.focus_before,
                             event.focus_after, event.attempts, _name(event.error)))


def _name(error: BaseException | None) -> str | None:
    return None if error is None else type(error).__name__


class RecordingObserver(RouterObserver):
    """In-memory telemetry: every observer event as a tuple, per turn and router-wide.

    `turns[turn_id]` lists a turn's events in order; `events` holds router-level ones
    (participants added/removed, departure and shutdown releases, cleanup failures).
    """

    enabled = True

    def __init__(self) -> None:
        self.turns: dict[str, list[tuple[Any, ...]]] = {}
        self.events: list[tuple[Any, ...]] = []
        self.in_flight = 0
        self.active_participants = 0
        #: Every saturation sample, oldest first.
        self.load_samples: list[LoadSampled] = []

    def turn_started(self, event: TurnStarted) -> TurnObserver:
        self.in_flight += 1
        turn = event.turn
        events = self.turns.setdefault(turn.turn_id, [])
        events.append(("started", turn.participant_id, event.focus))
        return _RecordingTurn(events, self)

    def turn_shed(self, event: TurnShed) -> None:
        turn = event.turn
        self.turns.setdefault(turn.turn_id, []).append(
            ("finished", "busy", None, None, None, 0, None))
        self.events.append(("shed", turn.participant_id, event.reason))

    def load_sampled(self, event: LoadSampled) -> None:
        self.load_samples.append(event)

    def outcome(self, turn_id: str) -> TurnOutcome:
        """The recorded outcome of a finished turn."""
        for event in reversed(self.turns[turn_id]):
            if event[0] == "finished":
                outcome: TurnOutcome = event[1]
                return outcome
        raise KeyError(f"turn {turn_id!r} has not finished")

    def kinds(self, turn_id: str) -> list[str]:
        """Event kinds of one turn, in order."""
        return [event[0] for event in self.turns[turn_id]]

    def participant_added(self, event: ParticipantChanged) -> None:
        self.active_participants += 1
        self.events.append(("participant_added", event.participant_id))

    def participant_removed(self, event: ParticipantChanged) -> None:
        self.active_participants -= 1
        self.events.append(("participant_removed", event.participant_id))

    def release_finished(self, token: object, event: ReleaseFinished) -> None:
        self.events.append(("release", event.route, event.reason, _name(event.error)))

    def focus_transition(self, event: FocusChanged) -> None:
        self.events.append(("focus", event.route, event.transition))

    def failure(self, event: Failure) -> None:
        self.events.append(("failure", event.route, event.stage, _name(event.error)))

    def message_rejected(self, event: MessageRejected) -> None:
        self.events.append(("message_rejected", event.topic, event.reason))

    def limit_exceeded(self, event: LimitExceeded) -> None:
        self.events.append(("limit_exceeded", event.limit))

    def heard(self, event: Heard) -> None:
        if event.interrupted:  # a barge-in before anything was heard: a lower bound
            self.events.append(("heard_interrupted", event.route, event.first_response_seconds))
            return
        self.events.append(("heard", event.route, event.first_response_seconds,
                            event.silence_seconds))

    def enter_context(self, carrier: Mapping[str, str]) -> object:
        self.events.append(("enter_context", dict(carrier)))
        return None

    def context_patch(self, event: ContextPatchEvent) -> None:
        self.events.append(("context_patch", event.strategy, event.outcome))
        if event.patch_id is not None:
            self.events.append(("context_patch_event", event.participant_id, event.task_id,
                                event.strategy, event.outcome, event.diverged))

    def patch_outcomes(self) -> list[tuple[str, str]]:
        """(strategy, outcome) of every counted context-patch event, in order."""
        return [(event[1], event[2]) for event in self.events if event[0] == "context_patch"]


def _as_script(value: Any) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        return [value]
    items = list(value)
    if not items:
        raise ValueError("a script needs at least one entry")
    return items


def _next(script: list[Any]) -> Any:
    return script.pop(0) if len(script) > 1 else script[0]


class ManualClock:
    """A `Clock` that only moves when told: `advance()` wakes sleepers deterministically.

    Sleepers whose deadline is reached are woken in deadline order (ties: in the order
    they went to sleep). Woken tasks run at the caller's next checkpoint; tests usually
    `await clock.settle()` after advancing (it lets every other task run until all are
    blocked, without anyio's 0.1 s polling). `run_until(event)` drives virtual time: it
    repeatedly settles, then jumps to the next deadline. asyncio only (as turnrouter).

    Args:
        start: The clock's initial reading, in seconds.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._busy = 0.0
        self._seq = 0
        self._sleepers: list[list[Any]] = []  # heap of [deadline, seq, event, alive]
        self._changed = anyio.Event()

    def now(self) -> float:
        return self._now

    def busy_time(self) -> float:
        """Seconds the event loop was told busy (`work()`): what admission control
        measures the loop's busy fraction from (`OverloadPolicy.max_busy_fraction`)."""
        return self._busy

    def work(self, seconds: float) -> None:
        """The loop worked `seconds`: busy time and time move forward together (sleepers
        due are woken, as by `advance()`)."""
        if seconds < 0:
            raise ValueError("ManualClock cannot work a negative time")
        self._busy += seconds
        self.advance(seconds)

    @property
    def sleepers(self) -> int:
        """How many tasks are sleeping on this clock."""
        return sum(1 for entry in self._sleepers if entry[3])

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline a task sleeps until, if any."""
        heap = self._sleepers
        while heap and not heap[0][3]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= self._now:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        entry: list[Any] = [deadline, self._seq, event, True]
        self._seq += 1
        heapq.heappush(self._sleepers, entry)
        self._changed.set()
        self._changed = anyio.Event()
        try:
            await event.wait()
        finally:
            entry[3] = False

    async def sleep(self, seconds: float) -> None:
        """Sleep `seconds` of this clock's time."""
        await self.sleep_until(self._now + seconds)

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` (>= 0) and wake every sleeper now due."""
        if seconds < 0:
            raise ValueError("ManualClock cannot go backwards")
        self.advance_to(self._now + seconds)

    def advance_to(self, when: float) -> None:
        """Move time forward to `when` (never backwards) and wake every sleeper due."""
        if when > self._now:
            self._now = when
        heap = self._sleepers
        while heap and heap[0][0] <= self._now:
            entry = heapq.heappop(heap)
            if entry[3]:
                entry[3] = False
                entry[2].set()

    @staticmethod
    async def settle(max_rounds: int = 100_000) -> None:
        """Let every other task of the loop run until all of them are blocked."""
        this = asyncio.current_task()
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)
        for _ in range(max_rounds):
            # Pending loop callbacks (e.g. anyio delivering a cancellation) count as work.
            if getattr(loop, "_ready", None):
                await asyncio.sleep(0)
                continue
            for task in asyncio.all_tasks():
                if task is this:
                    continue
                waiter = getattr(task, "_fut_waiter", None)
                if waiter is None or waiter.done():
                    break
            else:
                return
            await asyncio.sleep(0)
        raise RuntimeError("ManualClock.settle: tasks kept running")

    async def wait_for_sleepers(self, count: int = 1) -> None:
        """Wait until at least `count` tasks sleep on this clock. A router given this
        clock adds one sleeper of its own once it has handled a turn (its load sampler,
        `OverloadPolicy`): count it, or build the router with `overload=None`."""
        while self.sleepers < count:
            await self._changed.wait()

    async def run_until(self, done: anyio.Event, *, limit: float = 3600.0) -> None:
        """Virtual time: until `done` is set, let all tasks run, then jump to the next
        deadline. Raises RuntimeError when nothing sleeps (a deadlock) or past `limit`."""
        while not done.is_set():
            await self.settle()
            if done.is_set():
                return
            deadline = self.next_deadline
            if deadline is None or deadline > limit:
                raise RuntimeError(f"ManualClock.run_until: stuck at t={self._now} "
                                   f"(next deadline {deadline})")
            self.advance_to(deadline)
