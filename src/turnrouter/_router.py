"""`AgentRouter`: route a turn, check admission before speech, keep explicit focus.

The per-turn path runs in the caller's task (no task per turn: an interrupt cancels that
task and takes the cancellation back, as `asyncio.timeout` does), reports to a
`RouterObserver` (telemetry lives behind it), and keeps validation at the
boundary: contract objects coming in are checked once, internal copies are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ._acknowledgment import AcknowledgmentPolicy, TimingEngine, TurnTiming
from ._clock import Clock, SystemClock
from ._context import _current
from ._contracts import (
    CLARIFY,
    Admission,
    AgentExchange,
    AgentTurn,
    DecisionService,
    DestinationResult,
    RoutableAgent,
    RouteDecision,
    RouteRequest,
    RoutingAid,
    _exchange,
    _request,
    _turn_with_history,
)
from ._exceptions import (
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    DestinationContractError,
    LifecycleError,
    TurnInterrupted,
)
from ._frontend import Departure, ParticipantSnapshot, RoutedResult
from ._history import History, view_items
from ._lifecycle import OwnedOperation, TurnRun
from ._llm import LLMService
from ._observer import (
    ClarificationReason,
    PatchOutcome,
    ReleaseReason,
    RouterObserver,
    TurnObserver,
    TurnOutcome,
)
from ._participants import Participant, Phase, restore, snapshot_of
from ._patches import (
    AppliedContextPatch,
    ContextPatch,
    ContextState,
    MergeStrategy,
    PatchExchangeId,
    PendingContextPatch,
    PendingPatchLimitError,
    UnknownPatchError,
    context_hash,
    patch_user_text,
)
from ._timing import RouteTimingPredictor, TimingPredictor, TimingSink

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .runtime import RouterSubscriber

__all__ = ["AgentRouter", "OutputCallback"]

logger = logging.getLogger("turnrouter")

OutputCallback = Callable[[AgentTurn, str, str], Awaitable[None]]
StatusCallback = Callable[[Literal["processing", "idle"], str], Awaitable[None]]
ParticipantCallback = Callable[[str], Awaitable[None]]

_DEFAULT_CONTEXT_BUDGET_BYTES = 8192
_DEFAULT_MAX_PENDING_PATCHES = 8
#: Route name passed to `output` for the router's questions about human-gated patches.
PATCH_ROUTE = "background"
#: Route name passed to `output` for the router's own clarification questions.
CLARIFY_ROUTE = CLARIFY
DEFAULT_CLARIFICATION_TEXT = "Sorry, I didn't catch that. Could you say it another way?"
DEFAULT_FAILURE_TEXT = "Sorry, something went wrong. Please try again."

_CLARIFY_RESULT = DestinationResult("clarify")
_TIMED_OUT = Admission("decline")
_cancelled_exc = anyio.get_cancelled_exc_class
_NOTHING_EXCLUDED: frozenset[str] = frozenset()


class _DefaultRoute(str):
    """The default `default_destination`, recognisable by identity.

    A router whose destinations have no "conversation" route and that was not given a
    default explicitly simply has no default available (the contract's "clarification
    is also used when the configured default is unavailable"); naming an unknown
    default explicitly is a configuration error.
    """

    __slots__ = ()


_CONVERSATION = _DefaultRoute("conversation")


class _TurnRecord:
    """What one turn did so far, for the observer and the failure rule."""

    __slots__ = ("answered_by", "attempts", "focus_before", "output_failed", "route",
                 "started")

    def __init__(self, focus_before: str | None) -> None:
        self.focus_before = focus_before
        self.route: str | None = None
        #: The route whose answer or admission clarification ended the turn.
        self.answered_by: str | None = None
        self.attempts = 0
        self.started = False
        self.output_failed = False


class _StartSignal:
    """The `started()` callable handed to `answer()`.

    The first call records the first-response time and, when nothing was said since
    admission, the silence the participant heard (`silent_since`); later calls, and
    calls after `answer()` returned, do nothing more.
    """

    __slots__ = ("_clock", "_obs", "_record", "_route", "_t0", "_token", "closed",
                 "silent_since")

    def __init__(
        self, obs: TurnObserver, token: object, route: str, record: _TurnRecord,
        clock: Callable[[], float], t0: float, silent_since: float | None = None,
    ) -> None:
        self._obs, self._token, self._route, self._record = obs, token, route, record
        self._clock, self._t0 = clock, t0
        self.silent_since = silent_since
        self.closed = False

    async def __call__(self) -> None:
        if self.closed or self._record.started:
            return
        self._record.started = True
        now = self._clock()
        self._obs.first_response(self._token, self._route, now - self._t0)
        if self.silent_since is not None:
            self._obs.silence(self._route, now - self.silent_since)


class _TimedStartSignal(_StartSignal):
    """`started()` when timing is on: also suppresses or awaits the acknowledgment.

    The first call records the sample and suppresses a pending acknowledgment; every
    call (until `answer()` returns) waits for a committed acknowledgment's delivery.
    """

    __slots__ = ("_timing",)

    def __init__(
        self, obs: TurnObserver, token: object, route: str, record: _TurnRecord,
        clock: Callable[[], float], t0: float, timing: TurnTiming,
    ) -> None:
        super().__init__(obs, token, route, record, clock, t0)
        self._timing = timing

    async def __call__(self) -> None:
        if self.closed:
            return
        if not self._record.started:
            self._record.started = True
            now = self._clock()
            seconds = now - self._t0
            self._obs.first_response(self._token, self._route, seconds)
            self._timing.started(now, seconds)
        await self._timing.wait_delivered()


def _check_callable(name: str, value: object, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not callable(value):
        raise ContractTypeError(f"AgentRouter {name} must be callable, got {type(value).__name__}")


def _check_positive(name: str, value: object, *, integer: bool = False) -> None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if not isinstance(value, int | float) or not isinstance(value, kinds) or isinstance(
        value, bool
    ):
        kind = "an int" if integer else "a number"
        raise ContractTypeError(f"AgentRouter {name} must be {kind}, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigurationError(f"AgentRouter {name} must be finite and positive, got {value!r}")


def _best_scored(candidates: tuple[RoutingAid, ...], scores: Mapping[str, float]) -> str | None:
    """Highest-scoring candidate with a finite score; priority breaks ties, then order."""
    best: RoutingAid | None = None
    best_score = -math.inf
    for aid in candidates:
        score = scores.get(aid.name)
        if score is None or not math.isfinite(score):
            continue
        if best is None or score > best_score or (
            score == best_score and aid.priority > best.priority
        ):
            best, best_score = aid, score
    return None if best is None else best.name


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, _cancelled_exc())


class AgentRouter:
    """Route a turn, check admission before speech, and retain explicit focus.

    See `docs/router.md` for the full contract. In short: a focused destination gets the
    next turn first; otherwise the decision service chooses, the destination admits (or
    declines, clarifies, releases) before any output, at most two routed choices are
    tried, then the eligible default answers once without admission, else the router asks
    the participant to clarify.
    """

    def __init__(
        self,
        destinations: Mapping[str, RoutableAgent],
        decisions: DecisionService,
        *,
        output: OutputCallback | None = None,
        default_destination: str = _CONVERSATION,
        context_budget_bytes: int = _DEFAULT_CONTEXT_BUDGET_BYTES,
        acknowledgment_llm: LLMService | None = None,
        acknowledgment_delay_secs: float | None = None,
        query_topic: Any = None,
        output_topic: Any = None,
        participant_joined_topic: Any = None,
        participant_left_topic: Any = None,
        interrupted_topic: Any = None,
        initialize_participant: ParticipantCallback | None = None,
        cleanup_participant: ParticipantCallback | None = None,
        set_status: StatusCallback | None = None,
        admission_timeout_secs: float | None = None,
        telemetry: RouterObserver | None = None,
        clarification_text: str = DEFAULT_CLARIFICATION_TEXT,
        failure_text: str = DEFAULT_FAILURE_TEXT,
        acknowledgment_policy: AcknowledgmentPolicy | None = None,
        timing_predictor: TimingPredictor | None = None,
        timing_sink: TimingSink | None = None,
        clock: Clock | None = None,
        max_pending_patches: int = _DEFAULT_MAX_PENDING_PATCHES,
    ) -> None:
        if not isinstance(destinations, Mapping):
            raise ContractTypeError(
                f"AgentRouter destinations must be a mapping of route name to agent, "
                f"got {type(destinations).__name__}"
            )
        if not destinations:
            raise ConfigurationError("AgentRouter destinations must not be empty")
        agents: dict[str, RoutableAgent] = {}
        for name, agent in destinations.items():
            if not isinstance(name, str) or not name:
                raise ConfigurationError(
                    f"AgentRouter destination names must be non-empty str, got {name!r}"
                )
            for method in ("routing_aid", "admit", "answer", "release"):
                if not callable(getattr(agent, method, None)):
                    raise ContractTypeError(
                        f"AgentRouter destination {name!r} has no {method}() method: "
                        "it is not a RoutableAgent"
                    )
            agents[name] = agent
        if not callable(getattr(decisions, "decide", None)):
            raise ContractTypeError(
                f"AgentRouter decisions must have an async decide(request) method, "
                f"got {type(decisions).__name__}"
            )
        if not isinstance(default_destination, str):
            raise ContractTypeError("AgentRouter default_destination must be a str")
        if default_destination not in agents and default_destination is not _CONVERSATION:
            raise ConfigurationError(
                f"AgentRouter default_destination {default_destination!r} is not a registered "
                f"destination (registered: {sorted(agents)})"
            )
        _check_positive("context_budget_bytes", context_budget_bytes, integer=True)
        _check_positive("max_pending_patches", max_pending_patches, integer=True)
        if (acknowledgment_llm is None) != (acknowledgment_delay_secs is None):
            raise ConfigurationError(
                "AgentRouter acknowledgment_llm and acknowledgment_delay_secs must be "
                "supplied together"
            )
        if acknowledgment_delay_secs is not None:
            _check_positive("acknowledgment_delay_secs", acknowledgment_delay_secs)
            if not callable(getattr(acknowledgment_llm, "complete", None)):
                raise ContractTypeError(
                    "AgentRouter acknowledgment_llm must have an async complete() method"
                )
        if admission_timeout_secs is not None:
            _check_positive("admission_timeout_secs", admission_timeout_secs)
        _check_callable("output", output)
        _check_callable("initialize_participant", initialize_participant)
        _check_callable("cleanup_participant", cleanup_participant)
        _check_callable("set_status", set_status)
        for name, text in (("clarification_text", clarification_text),
                           ("failure_text", failure_text)):
            if not isinstance(text, str) or not text:
                raise ConfigurationError(f"AgentRouter {name} must be a non-empty str")
        topics = {
            "query_topic": query_topic, "output_topic": output_topic,
            "participant_joined_topic": participant_joined_topic,
            "participant_left_topic": participant_left_topic,
            "interrupted_topic": interrupted_topic,
        }
        self._runtime_config: dict[str, Any] | None = None
        if any(topic is not None for topic in topics.values()):
            self._runtime_config = self._check_topics(topics)
        if telemetry is None:
            from .telemetry import Telemetry

            telemetry = Telemetry()
        elif not isinstance(telemetry, RouterObserver):
            raise ContractTypeError(
                f"AgentRouter telemetry must be a Telemetry or RouterObserver, "
                f"got {type(telemetry).__name__}"
            )

        self._agents = agents
        self._routes = tuple(agents)
        self._decisions = decisions
        self._output = output
        #: Publishes control text on the output topic once a runtime delivered to us.
        self._runtime_output: OutputCallback | None = None
        #: None when the implicit "conversation" default is not registered: unavailable.
        self._default: str | None = (
            str(default_destination) if default_destination in agents else None)
        self._budget = context_budget_bytes
        self._ack_llm = acknowledgment_llm
        self._ack_delay = acknowledgment_delay_secs
        self._initialize = initialize_participant
        self._cleanup = cleanup_participant
        self._set_status = set_status
        self._admission_timeout = admission_timeout_secs
        self._observer = telemetry
        self._clarification_text = clarification_text
        self._failure_text = failure_text
        self._clock: Callable[[], float] = time.perf_counter
        self._timed: TimingEngine | None = None
        self._timing_sink = timing_sink
        if acknowledgment_policy is not None and not isinstance(
            acknowledgment_policy, AcknowledgmentPolicy
        ):
            raise ContractTypeError("AgentRouter acknowledgment_policy must be an "
                                    "AcknowledgmentPolicy")
        for name, value, method in (("timing_predictor", timing_predictor, "predict"),
                                    ("timing_sink", timing_sink, "record"),
                                    ("clock", clock, "sleep_until")):
            if value is not None and not callable(getattr(value, method, None)):
                raise ContractTypeError(
                    f"AgentRouter {name} has no {method}() method, got {type(value).__name__}")
        if clock is not None:
            self._clock = clock.now
        if acknowledgment_llm is not None or timing_predictor is not None or (
            timing_sink is not None
        ):
            if timing_predictor is None and acknowledgment_llm is not None:
                timing_predictor = RouteTimingPredictor()
            self._timed = TimingEngine(
                llm=acknowledgment_llm, delay=acknowledgment_delay_secs,
                policy=acknowledgment_policy or AcknowledgmentPolicy(),
                predictor=timing_predictor, sink=timing_sink, clock=clock or SystemClock(),
                observer=telemetry,
            )
            if clock is None:
                self._clock = self._timed.clock.now
        self._participants: dict[str, Participant] = {}
        #: With runtime topics, departed participants stay closed until they rejoin.
        self._departed: set[str] = set()
        self._stopping: OwnedOperation | None = None
        self._max_pending = max_pending_patches
        #: Every held patch, by id, with the participant state holding it.
        self._pending: dict[str, Participant] = {}
        self._stop_failed = False
        telemetry.configured(
            routes=self._routes, acknowledgment_delay_secs=acknowledgment_delay_secs
        )
        if self._timed is not None:
            self._timed.publish_estimates(self._routes)

    @staticmethod
    def _check_topics(topics: dict[str, Any]) -> dict[str, Any]:
        import importlib

        runtime = importlib.import_module("turnrouter.runtime")
        checked: dict[str, Any] = runtime.validate_topics(topics)
        return checked

    # ------------------------------------------------------------------ public API

    def runtime_subscriber(self) -> RouterSubscriber:
        """The runtime agent that delivers the configured topics to this router.

        Register it once with the application's `turnrouter.runtime.AgentRuntime`.
        Requires `query_topic` and `output_topic` on the constructor.
        """
        if self._runtime_config is None:
            raise ConfigurationError(
                "runtime_subscriber() requires query_topic and output_topic on AgentRouter"
            )
        from .runtime import RouterSubscriber

        return RouterSubscriber(self, self._runtime_config)

    @property
    def destinations(self) -> Mapping[str, RoutableAgent]:
        """Registered destinations by route name (read-only view)."""
        from types import MappingProxyType

        return MappingProxyType(self._agents)

    def focus_of(self, participant_id: str) -> str | None:
        """The route holding `participant_id`'s focus, if any."""
        state = self._participants.get(participant_id)
        return None if state is None else state.focus

    def history_of(self, participant_id: str) -> tuple[AgentExchange, ...]:
        """The participant's retained completed exchanges, oldest first."""
        state = self._participants.get(participant_id)
        return () if state is None else state.history.exchanges

    @property
    def participants(self) -> frozenset[str]:
        """Participants the router currently holds state for."""
        return frozenset(self._participants)

    async def handle(self, turn: AgentTurn) -> DestinationResult:
        """Route one turn while emitting only router-owned control text.

        Raises `TurnInterrupted` (an `asyncio.CancelledError`) when the turn is cancelled
        by `interrupt()`, a newer turn of the same participant, a departure or `stop()`;
        `LifecycleError` (a `RuntimeError`) while a departure or shutdown is pending or
        after a cleanup failed; destination exceptions propagate unchanged.
        """
        if not isinstance(turn, AgentTurn):
            raise ContractTypeError(f"handle() takes an AgentTurn, got {type(turn).__name__}")
        output = self._output
        if output is None:
            raise LifecycleError(
                "handle() needs the output callback: pass output=... to AgentRouter "
                "(runtime queries publish through output_topic instead)"
            )
        return (await self._handle(turn, output))[0]

    # ------------------------------------------------------------ front-end seam

    async def route_turn(
        self, turn: AgentTurn, *, output: OutputCallback | None = None
    ) -> RoutedResult:
        """Run one turn as `handle()` does, for a front end (runtime, framework adapter).

        `output` receives this turn's control text (acknowledgments, preambles,
        clarification, release and failure text) instead of the constructor's. The
        result also names the route that answered. Same errors as `handle()`; a refused
        turn is counted (outcome `refused`) and traced before `LifecycleError` is raised.
        """
        if not isinstance(turn, AgentTurn):
            raise ContractTypeError(
                f"route_turn() takes an AgentTurn, got {type(turn).__name__}")
        emit = output if output is not None else self._output
        if emit is None:
            raise LifecycleError(
                "route_turn() needs an output callback: pass output=... to it or to "
                "AgentRouter")
        _check_callable("route_turn output", emit)
        result, route = await self._handle(turn, emit)
        return RoutedResult(result, route)

    def begin_departure(self, participant_id: str) -> Departure:
        """Close the participant's admission now and start its departure.

        Synchronous, so a turn offered right after it is refused, and a `readmit()` that
        follows it is applied after it, not before. `await departure.join()` waits for
        the releases and cleanup (an `ExceptionGroup` of failures, as
        `participant_left()` raises). While the router stops, the departure runs after
        `stop()` ends.
        """
        _check_pid(participant_id)
        if self._stopping is not None and not self._stopping.done:
            self._close_departed(participant_id)
            return Departure(self.participant_left(participant_id))
        operation = self._start_departure(participant_id)
        if operation is None:
            return Departure(None)
        return Departure(operation.join())

    def readmit(self, participant_id: str) -> None:
        """A participant joined (again): reopen admission after a departure."""
        _check_pid(participant_id)
        self._departed.discard(participant_id)

    async def drain(self) -> None:
        """Wait, cancelling nothing, until no turn is running or queued.

        New turns are still accepted (a front end stops feeding first): call it before
        `stop()` for a graceful end.
        """
        while True:
            runs = [run for state in self._participants.values()
                    for run in state.queue.runs()]
            if not runs:
                return
            for run in runs:
                await run.wait_finished()

    def set_control_output(self, output: OutputCallback) -> None:
        """Where control text outside any turn goes (a held context patch's question)
        when the constructor had no `output`."""
        _check_callable("control output", output, optional=False)
        self._runtime_output = output

    def report_rejected(self, source: str, reason: str) -> None:
        """Count an input a front end refused before the router saw it.

        `turnrouter_runtime_rejected_messages_total{topic=source, reason=reason}`: keep
        both low-cardinality (a topic or subject name, a reason word).
        """
        if not isinstance(source, str) or not isinstance(reason, str):
            raise ContractTypeError("report_rejected() takes two str")
        self._observer.message_rejected(source, reason)

    async def report_status(
        self, status: Literal["processing", "idle"], participant_id: str
    ) -> None:
        """Call the configured `set_status` callback; its failures are logged only."""
        callback = self._set_status
        if callback is None:
            return
        try:
            await callback(status, participant_id)
        except Exception:
            logger.exception("turnrouter: set_status(%r, %r) failed", status, participant_id)

    def trace_carrier(self) -> dict[str, str]:
        """W3C trace headers of the current span, for a message a front end publishes."""
        return self._observer.inject_context()

    @contextlib.contextmanager
    def continue_trace(self, carrier: Mapping[str, str]) -> Iterator[None]:
        """Turns started inside the block are children of the remote span in `carrier`."""
        token = self._observer.enter_context(carrier)
        try:
            yield
        finally:
            self._observer.exit_context(token)

    def export_participant(self, participant_id: str) -> ParticipantSnapshot | None:
        """The participant's movable state, or None when the router holds none."""
        _check_pid(participant_id)
        state = self._participants.get(participant_id)
        if state is None:
            if participant_id in self._departed:
                return ParticipantSnapshot(participant_id=participant_id, departed=True)
            return None
        return snapshot_of(state, participant_id in self._departed)

    def import_participant(self, snapshot: ParticipantSnapshot) -> None:
        """Install a participant's state taken from another replica.

        Replaces what this router holds for the participant, unless a turn is in flight
        or a departure runs (`LifecycleError`). Routes the snapshot names that are not
        registered here are refused (`ContractValueError`).
        """
        if not isinstance(snapshot, ParticipantSnapshot):
            raise ContractTypeError(
                f"import_participant() takes a ParticipantSnapshot, "
                f"got {type(snapshot).__name__}")
        pid = snapshot.participant_id
        unknown = {route for route in (*snapshot.used, snapshot.focus)
                   if route is not None and route not in self._agents}
        if unknown:
            raise ContractValueError(
                f"participant snapshot of {pid!r} names unregistered routes {sorted(unknown)}")
        for held in snapshot.pending:
            if held.participant_id != pid:
                raise ContractValueError(
                    f"participant snapshot of {pid!r} holds a patch of {held.participant_id!r}")
        current = self._participants.get(pid)
        if current is not None and (current.queue.runs() or current.phase is not Phase.OPEN):
            raise LifecycleError(
                f"participant {pid!r} has a turn in flight or is departing here; "
                "import_participant() refused")
        state = restore(snapshot, self._budget)
        if current is not None:
            self._drop_pending(current, outcome=None)
        else:
            self._observer.participant_added(pid)
        self._participants[pid] = state
        for held in snapshot.pending:
            self._pending[held.patch_id] = state
        if snapshot.departed:
            self._departed.add(pid)
        else:
            self._departed.discard(pid)

    async def evict_participant(self, participant_id: str) -> ParticipantSnapshot | None:
        """Hand a participant over to another replica.

        Cancels its turns (drained), then drops its state without calling `release()`
        or cleanup (its destinations go on serving it elsewhere). Returns the final
        snapshot, None when the router held nothing.
        """
        _check_pid(participant_id)
        state = self._participants.get(participant_id)
        if state is not None and state.departure is not None and not state.departure.done:
            with contextlib.suppress(Exception):
                await state.departure.join()
            state = self._participants.get(participant_id)
        if state is None:
            return self.export_participant(participant_id)
        while state.queue.runs():
            await self._drain(state, "handed over to another replica")
        snapshot = snapshot_of(state, participant_id in self._departed)
        if self._participants.get(participant_id) is state and not state.queue.runs():
            self._drop_pending(state, outcome=None)
            self._forget(state)
            self._departed.discard(participant_id)
        return snapshot

    async def interrupt(self, participant_id: str | None = None) -> None:
        """Cancel active (and queued) turns, keeping completed history and focus.

        With `participant_id=None`, every participant's turns. Returns once the cancelled
        turns have drained.
        """
        if participant_id is None:
            states: Iterable[Participant] = list(self._participants.values())
        else:
            _check_pid(participant_id)
            state = self._participants.get(participant_id)
            states = () if state is None else (state,)
        runs: list[TurnRun] = []
        for state in states:
            for run in state.queue.runs():
                run.cancel("interrupted")
                runs.append(run)
        for run in runs:
            await run.wait_finished()

    async def participant_left(self, participant_id: str) -> None:
        """Release one participant's state and history (an owned operation).

        Calls each used destination's `participant_left()` hook when present, otherwise
        `release()`. Failures stay tracked for a retry and are raised together in an
        ExceptionGroup; until a retry succeeds, `handle()` raises for that participant.
        """
        _check_pid(participant_id)
        if self._stopping is not None and not self._stopping.done:
            try:
                await self._stopping.join()
            except Exception:
                logger.debug("shutdown failed while %s left", participant_id, exc_info=True)
        departure = self._start_departure(participant_id)
        if departure is not None:
            await departure.join()

    def _start_departure(self, participant_id: str) -> OwnedOperation | None:
        """Close admission at once and start (or return) the participant's departure.

        Synchronous, so a `handle()` issued right after `participant_left()` was called is
        refused, and a runtime participant-joined event that follows a participant-left
        event is applied after it, not before.
        """
        self._close_departed(participant_id)
        state = self._participants.get(participant_id)
        if state is None:
            return None
        if state.departure is None or state.departure.done:
            state.phase = Phase.DEPARTING
            state.departure = OwnedOperation(self._depart(state))
        return state.departure

    def _close_departed(self, participant_id: str) -> None:
        """With a participant-joined topic, a departure closes admission until it fires."""
        if self._runtime_config is not None and (
            "participant_joined_topic" in self._runtime_config
        ):
            self._departed.add(participant_id)

    async def stop(self) -> None:
        """Drain responses and release all participant state in one owned operation."""
        if self._stopping is None or self._stopping.done:
            self._stopping = OwnedOperation(self._shutdown())
        await self._stopping.join()

    # ------------------------------------------------------------ context patches

    def context_state(self, participant_id: str) -> ContextState:
        """The participant's context version and hash, to stamp background work with.

        Call it when the work starts (typically inside `answer()`, passing
        `spawned_from_event_id=turn.turn_id` on the patch). A participant the router
        holds no state for has version 0 and the hash of an empty context.
        """
        _check_pid(participant_id)
        state = self._participants.get(participant_id)
        if state is None:
            return ContextState(0, History().context_hash())
        history = state.history
        return ContextState(history.version, history.context_hash())

    def pending_patches(self, participant_id: str) -> tuple[PendingContextPatch, ...]:
        """The participant's human-gated patches awaiting approval, oldest first."""
        _check_pid(participant_id)
        state = self._participants.get(participant_id)
        if state is None or not state.pending:
            return ()
        return tuple(state.pending.values())

    def context_patches_of(self, participant_id: str) -> tuple[AppliedContextPatch, ...]:
        """The applied patches whose exchanges the participant's history retains."""
        _check_pid(participant_id)
        state = self._participants.get(participant_id)
        if state is None:
            return ()
        return tuple(item.applied for item in state.history.ids
                     if isinstance(item, PatchExchangeId))

    async def apply_context_patch(
        self, participant_id: str, patch: ContextPatch,
        strategy: MergeStrategy | str = MergeStrategy.APPEND,
    ) -> AppliedContextPatch | PendingContextPatch:
        """Merge a background result into the participant's context, or hold it.

        `append` and `replace` take effect at once and return the `AppliedContextPatch`:
        a running turn keeps the history it started with, every turn that starts later
        sees the patch. `human_gated` holds the patch (at most `max_pending_patches` per
        participant, else `PendingPatchLimitError`), asks the participant through
        `output`, and returns the `PendingContextPatch`; settle it with `approve_patch` /
        `reject_patch`. A patch whose stamp no longer matches the context is marked
        diverged and still merged or held. Raises `LifecycleError` for a participant the
        router holds no state for, one that is leaving or left, and while stopping.
        """
        _check_pid(participant_id)
        if not isinstance(patch, ContextPatch):
            raise ContractTypeError(
                f"apply_context_patch() takes a ContextPatch, got {type(patch).__name__}")
        try:
            strategy = MergeStrategy(strategy)
        except ValueError:
            raise ContractValueError(
                f"apply_context_patch() strategy must be one of "
                f"{[item.value for item in MergeStrategy]}, got {strategy!r}") from None
        state, refusal = self._patch_target(participant_id)
        if state is None:
            self._observer.context_patch(strategy.value, "refused")
            raise LifecycleError(
                f"context patch {patch.task_id!r} refused for participant "
                f"{participant_id!r}: {refusal}")
        diverged = patch.context_diverged or _diverged(state.history, patch)
        if diverged and not patch.context_diverged:
            patch = patch.model_copy(update={"context_diverged": True})
        patch_id = uuid.uuid4().hex
        if strategy is not MergeStrategy.HUMAN_GATED:
            return self._merge(state, patch_id, patch, strategy,
                               "diverged" if diverged else "applied")
        pending = state.pending
        if pending is None:
            pending = state.pending = {}
        if len(pending) >= self._max_pending:
            self._observer.context_patch(strategy.value, "refused")
            raise PendingPatchLimitError(
                f"context patch {patch.task_id!r} refused: participant {participant_id!r} "
                f"already holds {len(pending)} pending patches (max_pending_patches="
                f"{self._max_pending}); approve or reject some first")
        held = PendingContextPatch(
            patch_id=patch_id, participant_id=participant_id, task_id=patch.task_id,
            patch=patch, strategy=strategy, created_at=time.time(),
        )
        pending[patch_id] = held
        self._pending[patch_id] = state
        self._patch_event(state.pid, patch_id, patch, strategy, "pending")
        await self._ask(held)
        return held

    async def approve_patch(self, patch_id: str) -> AppliedContextPatch:
        """Merge a held patch (appended, with its divergence as detected when held).

        Takes effect at once, like `append`. Raises `UnknownPatchError` (a
        `LifecycleError` and a `LookupError`) when no patch with this id is pending:
        never held, already approved or rejected, or dropped by a departure or `stop()`.
        """
        state, held = self._take_pending(patch_id, "approve")
        _, refusal = self._patch_target(state.pid)
        if refusal or self._participants.get(state.pid) is not state:
            self._patch_event(state.pid, held.patch_id, held.patch, held.strategy, "dropped")
            raise LifecycleError(
                f"context patch {patch_id!r} dropped, not approved: "
                f"{refusal or 'the participant left'}")
        return self._merge(state, held.patch_id, held.patch, MergeStrategy.HUMAN_GATED,
                           "approved")

    async def reject_patch(self, patch_id: str) -> PendingContextPatch:
        """Discard a held patch; its context is never merged. Errors as `approve_patch`."""
        state, held = self._take_pending(patch_id, "reject")
        self._patch_event(state.pid, held.patch_id, held.patch, held.strategy, "rejected")
        return held

    def _patch_target(self, pid: str) -> tuple[Participant | None, str]:
        """The open participant a patch may reach, or None and why not."""
        if self._stopping is not None and not self._stopping.done:
            return None, "the router is shutting down"
        if self._stop_failed:
            return None, "the router's last stop() failed"
        if pid in self._departed:
            return None, "the participant left"
        state = self._participants.get(pid)
        if state is None:
            return None, ("the router holds no state for this participant (it never had "
                          "a turn, or it left)")
        if state.phase is not Phase.OPEN:
            return None, f"the participant's departure {state.phase.value}"
        return state, ""

    def _take_pending(
        self, patch_id: str, verb: str
    ) -> tuple[Participant, PendingContextPatch]:
        if not isinstance(patch_id, str):
            raise ContractTypeError(f"patch_id must be a str, got {type(patch_id).__name__}")
        state = self._pending.pop(patch_id, None)
        if state is None or state.pending is None or patch_id not in state.pending:
            raise UnknownPatchError(
                f"cannot {verb} context patch {patch_id!r}: no such patch is pending (never "
                "held, already approved or rejected, or dropped when its participant left "
                "or the router stopped)")
        return state, state.pending.pop(patch_id)

    def _merge(
        self, state: Participant, patch_id: str, patch: ContextPatch,
        strategy: MergeStrategy, outcome: PatchOutcome,
    ) -> AppliedContextPatch:
        diverged = patch.context_diverged
        applied = AppliedContextPatch(
            patch_id=patch_id, participant_id=state.pid, task_id=patch.task_id,
            strategy=strategy, diverged=diverged, patch=patch,
            exchange_id=f"patch:{patch.task_id}",
        )
        stamp = int(patch.completed_at.timestamp() * 1_000_000)
        state.history.add_background(
            _exchange(patch_user_text(patch.task_id, diverged), "\n".join(patch.digest)),
            PatchExchangeId(applied), max(stamp, 0), self._budget,
            replace=strategy is MergeStrategy.REPLACE,
        )
        self._patch_event(state.pid, patch_id, patch, strategy, outcome)
        return applied

    def _patch_event(
        self, pid: str, patch_id: str, patch: ContextPatch, strategy: MergeStrategy,
        outcome: PatchOutcome,
    ) -> None:
        observer = self._observer
        observer.context_patch(strategy.value, outcome)
        observer.context_patch_event(pid, patch_id, patch.task_id, strategy.value, outcome,
                                     patch.context_diverged)

    def _drop_pending(
        self, state: Participant, outcome: PatchOutcome | None = "dropped"
    ) -> None:
        """A departure or shutdown drops the participant's held patches (counted).

        `outcome=None`: the patches moved with the participant (nothing reported).
        """
        pending = state.pending
        if not pending:
            return
        state.pending = None
        for held in pending.values():
            self._pending.pop(held.patch_id, None)
            if outcome is not None:
                self._patch_event(state.pid, held.patch_id, held.patch, held.strategy,
                                  outcome)

    async def _ask(self, held: PendingContextPatch) -> None:
        """Ask the participant about a held patch through `output` (failures logged)."""
        output = self._output or self._runtime_output
        if output is None:
            logger.info("turnrouter: no output callback; context patch %s waits for "
                        "approval without a question", held.patch_id)
            return
        digest = held.patch.digest
        what = f"A background task finished: {digest[0]}" if digest else (
            "A background task finished")
        text = f"{what.rstrip('.')}. Should I add this to our conversation?"
        turn = AgentTurn(held.participant_id, f"patch:{held.patch_id}", "")
        try:
            await output(turn, PATCH_ROUTE, text)
        except Exception:
            logger.exception("turnrouter: could not ask about context patch %s",
                             held.patch_id)

    # ------------------------------------------------------------------ one turn

    def _admit_state(self, pid: str) -> Participant:
        if self._stopping is not None and not self._stopping.done:
            raise LifecycleError(
                "the router is shutting down; handle() is closed until stop() ends"
            )
        if self._stop_failed:
            raise LifecycleError(
                "the router's last stop() failed; handle() is closed until stop() succeeds"
            )
        if pid in self._departed:
            raise LifecycleError(
                f"participant {pid!r} left; handle() is closed until a participant-joined "
                "event readmits them"
            )
        state = self._participants.get(pid)
        if state is None:
            state = self._participants[pid] = Participant(pid)
            self._observer.participant_added(pid)
        elif state.phase is not Phase.OPEN:
            raise LifecycleError(
                f"participant {pid!r}: departure {state.phase.value}; "
                "handle() is closed until participant_left() completes"
            )
        return state

    async def _handle(
        self, turn: AgentTurn, emit: OutputCallback
    ) -> tuple[DestinationResult, str | None]:
        pid = turn.participant_id
        try:
            state = self._admit_state(pid)
        except LifecycleError as exc:
            self._observer.turn_started(turn, None).finished("refused", None, None, None, 0,
                                                              exc)
            raise
        queue = state.queue
        run = TurnRun(turn.turn_id)
        running = queue.running
        if running is not None:  # the participant spoke again: the running turn is stale
            running.cancel("superseded by a newer turn")
        if not await queue.enter(run):
            self._observer.turn_started(turn, state.focus).finished(
                "interrupted", None, state.focus, state.focus, 0, None)
            raise TurnInterrupted(pid, turn.turn_id, run.reason)
        record = _TurnRecord(state.focus)
        obs = self._observer.turn_started(turn, state.focus)
        task = asyncio.current_task()
        assert task is not None, "turnrouter runs on asyncio"
        run.attach(task)
        try:
            result = await self._run_turn(state, turn, emit, obs, record, run)
        except BaseException as exc:
            run.protected = True
            cancelled = _is_cancel(exc)
            if cancelled and run.reason and not run.consume_cancel():
                obs.finished("interrupted", record.route, record.focus_before, state.focus,
                             record.attempts, None)
                raise TurnInterrupted(pid, turn.turn_id, run.reason) from None
            if not cancelled and not record.started and not record.output_failed:
                await self._emit_failure(turn, record, emit)
            obs.finished(
                "interrupted" if cancelled else "failed", record.route, record.focus_before,
                state.focus, record.attempts, None if cancelled else exc,
            )
            raise
        finally:
            run.protected = True
            run.consume_cancel()  # a request that arrived as the turn completed
            queue.leave(run)
        outcome: TurnOutcome = result.disposition
        obs.finished(outcome, record.route, record.focus_before, state.focus, record.attempts,
                     None)
        return result, record.answered_by

    async def _emit_failure(
        self, turn: AgentTurn, record: _TurnRecord, emit: OutputCallback
    ) -> None:
        try:
            await emit(turn, record.route or "none", self._failure_text)
        except Exception:
            logger.exception("turnrouter: could not deliver the failure message of turn %s",
                             turn.turn_id)

    async def _run_turn(
        self, state: Participant, turn: AgentTurn, emit: OutputCallback, obs: TurnObserver,
        record: _TurnRecord, run: TurnRun,
    ) -> DestinationResult:
        pid = turn.participant_id
        if not state.initialized:
            if self._initialize is not None:
                await self._initialize(pid)
            state.initialized = True
        history = state.history
        if not history.exchanges and turn.history:
            history.seed(turn.history, self._budget)
        if turn.history is not history.exchanges:
            turn = _turn_with_history(turn, history.exchanges)
        token = _current.set((turn.turn_id, history.view()))
        try:
            return await self._route(state, turn, emit, obs, record, run)
        finally:
            _current.reset(token)

    async def _route(
        self, state: Participant, turn: AgentTurn, emit: OutputCallback, obs: TurnObserver,
        record: _TurnRecord, run: TurnRun,
    ) -> DestinationResult:
        pid = turn.participant_id
        excluded: set[str] = set()
        agents = self._agents

        # 1. Focus first: the owner's admission is not a routing attempt.
        owner = state.focus
        if owner is not None:
            if not agents[owner].routing_aid(pid).eligible:
                state.focus = None
                obs.focus_transition(owner, "lost")
                await self._release_in_turn(state, owner, "ineligible", obs, run)
            else:
                # A decline keeps focus with the owner and does not call release().
                result = await self._offer(state, turn, owner, True, excluded, emit, obs,
                                           record, run)
                if result is not None:
                    return result

        # 2. At most two routed choices, each excluding every route that declined.
        aids = {name: _named(agent.routing_aid(pid), name) for name, agent in agents.items()}
        default = self._default
        for _ in range(2):
            candidates = tuple(
                aid for name, aid in aids.items() if aid.eligible and name not in excluded
            )
            if not candidates:
                break
            record.attempts += 1
            request = _request(turn, candidates,
                               frozenset(excluded) if excluded else _NOTHING_EXCLUDED)
            chosen, reason = await self._choose(request, aids, excluded, obs)
            if chosen is None:
                assert reason is not None
                return await self._clarify(turn, CLARIFY_ROUTE, "", reason, emit, obs, record)
            result = await self._offer(state, turn, chosen, state.focus == chosen, excluded,
                                       emit, obs, record, run)
            if result is not None:
                return result

        # 3. Exhausted: the eligible default answers once without admission.
        if (record.attempts and default is not None and aids[default].eligible
                and default not in excluded):
            obs.default_fallback(default)
            return await self._answer(state, turn, default, None, emit, obs, record, run)
        reason_: ClarificationReason = (
            "default_unavailable" if record.attempts else "no_eligible_route"
        )
        return await self._clarify(turn, CLARIFY_ROUTE, "", reason_, emit, obs, record)

    async def _offer(
        self, state: Participant, turn: AgentTurn, route: str, focused: bool,
        excluded: set[str], emit: OutputCallback, obs: TurnObserver, record: _TurnRecord,
        run: TurnRun,
    ) -> DestinationResult | None:
        """Ask `route` to admit the turn; the turn's result, or None to route on without it.

        A decline or release excludes the route for the rest of this turn; a release also
        says its text, clears the route's focus and calls its `release()`.
        """
        admission = await self._admit(state, turn, route, focused, obs)
        disposition = admission.disposition
        if disposition == "accept":
            return await self._answer(state, turn, route, admission, emit, obs, record, run)
        if disposition == "clarify":
            return await self._clarify(turn, route, admission.text, "destination", emit, obs,
                                       record)
        excluded.add(route)
        obs.reroute(route)
        if disposition == "release":
            await self._say(turn, route, admission.text, emit, record)
            if state.focus == route:
                state.focus = None
                obs.focus_transition(route, "released")
            await self._release_in_turn(state, route, "reroute", obs, run)
        return None

    async def _choose(
        self, request: RouteRequest, aids: dict[str, RoutingAid], excluded: set[str],
        obs: TurnObserver,
    ) -> tuple[str | None, ClarificationReason | None]:
        token = obs.decision_started(request)
        try:
            decision = await self._decisions.decide(request)
            if not isinstance(decision, RouteDecision):
                raise DestinationContractError(
                    f"decision service returned {type(decision).__name__}, not a RouteDecision"
                )
        except Exception as exc:
            obs.decision_finished(token, request, None, exc)
            logger.warning("turnrouter: decision service failed: %r", exc)
            # A classifier outage must not silence the assistant.
            default = self._default
            if default is not None and aids[default].eligible and default not in excluded:
                return default, None
            return None, "decision_failed"
        obs.decision_finished(token, request, decision, None)
        choice = decision.choice
        for aid in request.candidates:
            if aid.name == choice:
                return choice, None
        best = _best_scored(request.candidates, decision.scores)
        if best is not None:
            return best, None
        return None, "low_confidence"

    async def _admit(
        self, state: Participant, turn: AgentTurn, route: str, focused: bool,
        obs: TurnObserver,
    ) -> Admission:
        state.used.add(route)
        agent = self._agents[route]
        token = obs.admission_started(route, focused)
        try:
            timeout = self._admission_timeout
            if timeout is None:
                admission = await agent.admit(turn, focused=focused)
            else:
                with anyio.move_on_after(timeout) as scope:
                    admission = await agent.admit(turn, focused=focused)
                if scope.cancelled_caught:
                    obs.admission_finished(token, route, focused, "decline", None, timed_out=True)
                    logger.warning("turnrouter: %s.admit() timed out after %ss; counted as a "
                                   "decline", route, timeout)
                    return _TIMED_OUT
            if not isinstance(admission, Admission):
                raise DestinationContractError(
                    f"destination {route!r} admit() returned {type(admission).__name__}, "
                    "not an Admission"
                )
        except BaseException as exc:
            obs.admission_finished(token, route, focused, None,
                                   None if _is_cancel(exc) else exc)
            raise
        obs.admission_finished(token, route, focused, admission.disposition, None)
        return admission

    async def _answer(
        self, state: Participant, turn: AgentTurn, route: str, admission: Admission | None,
        emit: OutputCallback, obs: TurnObserver, record: _TurnRecord, run: TurnRun,
    ) -> DestinationResult:
        state.used.add(route)
        record.route = record.answered_by = route
        timed = self._timed
        admitted_at = self._clock()
        preamble = admission.preamble if admission is not None else ""
        if preamble:
            obs.silence(route, self._clock() - admitted_at)
            await self._say(turn, route, preamble, emit, record)
        token = obs.answer_started(route, admission is None)
        timing: TurnTiming | None = None
        if timed is None:
            # Without acknowledgments the answer (or the preamble) is the first thing heard.
            signal = _StartSignal(obs, token, route, record, self._clock, self._clock(),
                                  None if preamble else admitted_at)
        else:
            timing = timed.turn(obs, self._agents[route], route, turn, emit, admitted_at,
                                heard=bool(preamble))
            signal = _TimedStartSignal(obs, token, route, record, self._clock, self._clock(),
                                       timing)
        try:
            if timing is None:
                result = await self._agents[route].answer(turn, started=signal)
            else:
                result = await timing.answer(signal)
            if not isinstance(result, DestinationResult) or result.disposition == "clarify":
                raise DestinationContractError(
                    f"destination {route!r} answer() must return DestinationResult answer, "
                    f"focus or release, got {result!r:.80}"
                )
        except BaseException as exc:
            signal.closed = True
            cancelled = _is_cancel(exc)
            if timing is not None and cancelled and not record.started:
                timing.interrupted()  # a censored sample: a lower bound, not a fast answer
            obs.answer_finished(token, route, None, None if cancelled else exc, cancelled)
            raise
        signal.closed = True
        obs.answer_finished(token, route, result, None, False)
        # The answer is complete: its bookkeeping must not be torn by an interrupt.
        run.protected = True
        state.history.append(
            _exchange(turn.query, result.text),
            turn.turn_id, turn.timestamp_us, self._budget,
        )
        owner = state.focus
        if result.disposition == "focus":
            if owner != route:
                state.focus = route
                obs.focus_transition(route, "taken")
                if owner is not None:
                    obs.focus_transition(owner, "lost")
                    await self._release_in_turn(state, owner, "focus_taken", obs, run)
        elif result.disposition == "release" and owner == route:
            state.focus = None
            obs.focus_transition(route, "released")
            await self._release_in_turn(state, route, "post_answer", obs, run)
        return result

    async def _clarify(
        self, turn: AgentTurn, route: str, text: str, reason: ClarificationReason,
        emit: OutputCallback, obs: TurnObserver, record: _TurnRecord,
    ) -> DestinationResult:
        obs.clarification(reason)
        if route != CLARIFY_ROUTE:
            record.answered_by = route
        await self._say(turn, route, text or self._clarification_text, emit, record)
        return _CLARIFY_RESULT

    @staticmethod
    async def _say(
        turn: AgentTurn, route: str, text: str, emit: OutputCallback, record: _TurnRecord
    ) -> None:
        if not text:
            return
        try:
            await emit(turn, route, text)
        except Exception:
            record.output_failed = True
            raise

    async def _release_in_turn(
        self, state: Participant, route: str, reason: ReleaseReason, obs: TurnObserver,
        run: TurnRun,
    ) -> None:
        """Release during a turn, protected from interrupts; failures are logged only.

        An interrupt that arrives meanwhile takes effect once the release is done, unless
        the answer already completed (then there is nothing left to cancel).
        """
        was_protected = run.protected
        run.protected = True
        token = obs.release_started(route, reason)
        try:
            with anyio.CancelScope(shield=True):
                await self._agents[route].release(state.pid)
        except Exception as exc:
            obs.release_finished(token, route, reason, exc)
            logger.exception("turnrouter: %s.release(%r) failed (%s)", route, state.pid, reason)
        else:
            obs.release_finished(token, route, reason, None)
        if not was_protected:
            run.protected = False
            if run.reason:
                raise asyncio.CancelledError(run.reason)

    # ------------------------------------------------------------------ lifecycle

    async def _drain(self, state: Participant, reason: str) -> None:
        runs = state.queue.runs()
        for run in runs:
            run.cancel(reason)
        for run in runs:
            await run.wait_finished()

    async def _release_all(self, state: Participant, reason: ReleaseReason) -> list[Exception]:
        """Departure-style release of every used destination, then application cleanup."""
        pid = state.pid
        if state.unreleased is None:
            state.unreleased = set(state.used)
            state.cleanup_pending = self._cleanup is not None and (
                state.initialized or bool(state.used)
            )
        errors: list[Exception] = []
        for route in [name for name in self._routes if name in state.unreleased]:
            agent = self._agents[route]
            token = self._observer.release_started(route, reason)
            try:
                hook = getattr(agent, "participant_left", None)
                if callable(hook):
                    await hook(pid)
                else:
                    await agent.release(pid)
            except Exception as exc:
                self._observer.release_finished(token, route, reason, exc)
                errors.append(exc)
                continue
            self._observer.release_finished(token, route, reason, None)
            state.unreleased.discard(route)
        if state.cleanup_pending:  # idempotent: runs once turns drained, whatever releases did
            assert self._cleanup is not None
            try:
                await self._cleanup(pid)
            except Exception as exc:
                self._observer.failure(None, "cleanup", exc)
                errors.append(exc)
            else:
                state.cleanup_pending = False
        return errors

    def _forget(self, state: Participant) -> None:
        if self._participants.get(state.pid) is state:
            del self._participants[state.pid]
            self._observer.participant_removed(state.pid)

    async def _depart(self, state: Participant) -> None:
        state.phase = Phase.DEPARTING
        self._drop_pending(state)
        await self._drain(state, "ended by the participant's departure")
        errors = await self._release_all(state, "departure")
        if errors:
            state.phase = Phase.FAILED
            raise ExceptionGroup(
                f"participant {state.pid!r} departure: {len(errors)} cleanup failure(s); "
                "call participant_left() again to retry",
                errors,
            )
        self._forget(state)

    async def _shutdown(self) -> None:
        for state in list(self._participants.values()):
            self._drop_pending(state)
        for state in list(self._participants.values()):
            if state.departure is not None and not state.departure.done:
                try:
                    await state.departure.join()
                except Exception:
                    logger.debug("departure of %s failed before shutdown", state.pid)
        states = list(self._participants.values())
        for state in states:
            for run in state.queue.runs():
                run.cancel("ended by stop()")
        for state in states:
            await self._drain(state, "ended by stop()")
        errors: list[Exception] = []
        for state in states:
            state.phase = Phase.DEPARTING
            failures = await self._release_all(state, "shutdown")
            if failures:
                state.phase = Phase.FAILED
                errors.extend(failures)
            else:
                self._forget(state)
        if errors:
            self._stop_failed = True
            raise ExceptionGroup(
                f"stop(): {len(errors)} cleanup failure(s); call stop() again to retry", errors
            )
        self._stop_failed = False
        self._departed.clear()  # a fresh lifecycle for everyone
        flush = getattr(self._timing_sink, "flush", None)
        if callable(flush):  # a restarted router must find every sample on disk
            flush()


def _diverged(history: History, patch: ContextPatch) -> bool:
    """Whether the participant's conversation moved on since the patch's stamp.

    Matches when the stamp equals the context now, or equals the context just before the
    newest conversation exchange and that exchange is the turn that spawned the task.
    Fields the patch leaves unset are not compared.
    """
    version, digest = patch.source_context_version, patch.source_context_hash
    if version is None and digest is None:
        return False
    if (version is None or version == history.version) and (
        digest is None or digest == history.context_hash()
    ):
        return False
    spawned = patch.spawned_from_event_id
    if spawned is None or history.version == 0 or history.last_conversation_id() != spawned:
        return True
    return not ((version is None or version == history.version - 1) and (
        digest is None or digest == context_hash(
            history.prev_exchanges, [item[0] for item in view_items(history.prev_view)])
    ))


def _named(aid: RoutingAid, name: str) -> RoutingAid:
    """The aid under its registered route name (the name decisions and labels use)."""
    if aid.name == name:
        return aid
    if not isinstance(aid, RoutingAid):
        raise DestinationContractError(
            f"destination {name!r} routing_aid() returned {type(aid).__name__}, "
            "not a RoutingAid"
        )
    return RoutingAid(name, aid.description, aid.priority, aid.eligible, aid.eligibility)


def _check_pid(participant_id: object) -> None:
    if not isinstance(participant_id, str):
        raise ContractTypeError(
            f"participant_id must be a str, got {type(participant_id).__name__}"
        )
    if not participant_id:
        raise ContractValueError("participant_id must not be empty")
