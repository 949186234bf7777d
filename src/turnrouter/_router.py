"""`AgentRouter`: route a turn, check admission before speech, keep explicit focus.

The facade over the router's parts (see `docs/architecture.md`): `RouterConfig` (the
validated constructor arguments), `Registry` (participants, and why anyone is closed),
`Turn` (one turn, top down), `PatchDesk` (background context patches) and `Departures`
(departure and shutdown). It validates what comes in at the boundary and delegates.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from ._acknowledgment import AcknowledgmentPolicy
from ._clock import Clock
from ._config import (
    CLARIFY_ROUTE,
    CONVERSATION,
    DEFAULT_CLARIFICATION_TEXT,
    DEFAULT_CONTEXT_BUDGET_BYTES,
    DEFAULT_FAILURE_TEXT,
    DEFAULT_MAX_PENDING_PATCHES,
    PATCH_ROUTE,
    OutputCallback,
    ParticipantCallback,
    ParticipantChange,
    ResultCheck,
    RouterConfig,
    StatusCallback,
    check_callable,
)
from ._contracts import (
    AgentExchange,
    AgentTurn,
    DecisionService,
    DestinationResult,
    RoutableAgent,
    unset_field,
)
from ._departures import Departures
from ._exceptions import ConfigurationError, ContractTypeError, ContractValueError, LifecycleError
from ._frontend import (
    Departure,
    ParticipantSnapshot,
    RoutedResult,
    checked_snapshot,
)
from ._lifecycle import OwnedOperation
from ._limits import (
    DEFAULT_MAX_DEPARTED_PARTICIPANTS,
    DEFAULT_MAX_HISTORY_EXCHANGES,
    DEFAULT_MAX_PARTICIPANTS,
    DEFAULT_MAX_PATCH_BYTES,
    DEFAULT_MAX_WAITING_TURNS,
    DEFAULT_RELEASE_TIMEOUT_SECS,
)
from ._llm import LLMService
from ._load import OverloadPolicy, RouterLoad
from ._logging import log_failure
from ._numbers import finite, is_number
from ._observer import MessageRejected, RouterObserver, TurnFinished, TurnStarted
from ._participants import Phase, Registry, RouterPhase, note_turn, refuse_lossy
from ._patch_desk import PatchDesk
from ._patches import (
    AppliedContextPatch,
    ContextPatch,
    ContextState,
    MergeStrategy,
    PendingContextPatch,
)
from ._redact import preview
from ._timing import TimingPredictor, TimingSink
from ._turn import Turn

if TYPE_CHECKING:
    from .runtime import RouterSubscriber

__all__ = [
    "CLARIFY_ROUTE",
    "DEFAULT_CLARIFICATION_TEXT",
    "DEFAULT_FAILURE_TEXT",
    "PATCH_ROUTE",
    "AgentRouter",
    "OutputCallback",
]

logger = logging.getLogger("turnrouter")

_DEFAULT_OVERLOAD = OverloadPolicy()


class AgentRouter:
    """Route a turn, check admission before speech, and retain explicit focus.

    See `docs/router.md` for the full contract. In short: a focused destination gets the
    next turn first; otherwise the decision service chooses, the destination admits (or
    declines, clarifies, releases) before any output, at most two routed choices are
    tried, then the eligible default answers once without admission, else the router asks
    the participant to clarify.

    Args:
        destinations: Route name -> destination (a `RoutableAgent`, e.g. a `Destination`
            subclass). The names are the routes of decisions, metrics and traces.
        decisions: The `DecisionService` choosing a route per turn (`LexicalDecisions`,
            `ClassifierDecisions`, `PolicyDecisions`, or your own `decide()`).
        output: `async output(turn, route, text)`: speaks the router's own words
            (admission preambles, clarification questions, acknowledgments, failure
            messages). Destinations deliver their answers themselves. Required by
            `handle()`; runtime use publishes through `output_topic` instead.
        default_destination: The route that answers once, without admission, when the
            routed choices declined (default `"conversation"`; with no such route there
            is simply no default, naming another unregistered one is an error).
        context_budget_bytes: UTF-8 bytes of completed exchanges a destination gets as
            `AgentTurn.history` (newest whole exchanges first; default 8192).
        acknowledgment_llm: The `LLMService` that words a short "let me check" while a
            slow destination works (`turnrouter.llm.TemplateAcknowledger` needs no
            model). Give it together with `acknowledgment_delay_secs`.
        acknowledgment_delay_secs: Seconds of silence after admission before the
            acknowledgment is said (earlier when the route is predicted slow);
            None (default) turns acknowledgments off; at most 60 s (a larger value
            is refused as milliseconds given as seconds). docs/acknowledgments.md.
        acknowledgment_route_delays: Route name -> its own fallback delay in seconds,
            for routes whose answers are routinely slower (`turnrouter tune --route`
            recommends one); other routes keep `acknowledgment_delay_secs`.
        query_topic: Runtime topic of `UserQuery` messages to route (with
            `output_topic`; register `runtime_subscriber()` with an `AgentRuntime`).
        output_topic: Runtime topic the router publishes its `ResponseOutput` to.
        participant_joined_topic: Optional runtime topic of `ParticipantJoined` messages.
        participant_left_topic: Optional runtime topic of `ParticipantLeft` messages
            (each ends that participant's state, as `participant_left()` does).
        interrupted_topic: Optional runtime topic of `Interrupted` messages (barge-in:
            cancels the participant's running turn, as `interrupt()` does).
        initialize_participant: `async f(participant_id)`, awaited once before a
            participant's first turn (retried on the next turn if it fails).
        cleanup_participant: `async f(participant_id)`, awaited when a participant leaves,
            after its destinations released it; also for one whose initialization began
            but failed or was interrupted (it may have allocated something).
        set_status: `async f("processing" | "idle", participant_id)` around each turn
            (e.g. a "thinking" indicator); its failures are logged, never raised.
        admission_timeout_secs: Longest `admit()` call; a slower one is cancelled and
            counted as a decline (default None: no limit).
        decision_timeout_secs: Longest `decide()` call of the decision service; a slower
            one is cancelled and counted as a decision failure (a `TimeoutError`), so the
            turn goes to the eligible default, as for any classifier outage (default None:
            no limit).
        telemetry: The `RouterObserver` reporting every step; default `Telemetry()`
            (global tracer provider, prometheus_client's default registry).
            `Telemetry.disabled()` reports nothing. docs/telemetry.md.
        clarification_text: What the router says when no destination can take the turn,
            whether the query was unclear or out of every route's scope (default "Sorry,
            I'm not sure I can help with that. Could you say it another way?").
        failure_text: What the router says when a turn fails before its destination
            started answering (default "Sorry, something went wrong. Please try again.").
        acknowledgment_policy: Budget, timeouts and early moment of acknowledgments
            (`AcknowledgmentPolicy`; default values when None).
        timing_predictor: Predicts each route's first-response time, so slow routes are
            acknowledged early (default `RouteTimingPredictor()` when acknowledging).
        timing_sink: Receives every first-response `TimingSample` (e.g.
            `JsonLinesSink("samples.jsonl")` for `turnrouter tune`).
        clock: Time source (default `SystemClock()`; tests use
            `turnrouter.testing.ManualClock`).
        max_pending_patches: Held (human-gated) context patches per participant
            (default 8); one more raises `PendingPatchLimitError`. docs/limits.md.
        max_history_exchanges: Completed exchanges kept per participant (default 256;
            the oldest is dropped and counted).
        max_waiting_turns: Turns queued behind a participant's running turn (default 8;
            the oldest waiting one is dropped: its caller gets `TurnInterrupted`).
        max_departed_participants: Departed participant ids remembered as closed
            (default 100,000; the oldest is forgotten).
        max_participants: Participants held at once (default 100,000; a new
            participant's turn past it raises `LifecycleError`).
        max_patch_bytes: Largest serialized context patch (default 64 KiB).
        release_timeout_secs: Longest `release()` / `participant_left()` call of a
            destination (default 10 s; a slower one is counted as a failed release).
        overload: Admission control when the event loop saturates (`OverloadPolicy`;
            busy: new participants refused with the busy text, shedding: new turns
            too); None switches it off. docs/limits.md, "Overload".

    Raises:
        ConfigurationError: A value out of range or inconsistent (e.g. an
            acknowledgment LLM without its delay), naming the argument.
        ContractTypeError: A destination or service without the methods it needs.
    """

    __slots__ = ("_cfg", "_departures", "_patches", "_registry")

    def __init__(
        self,
        destinations: Mapping[str, RoutableAgent],
        decisions: DecisionService,
        *,
        output: OutputCallback | None = None,
        default_destination: str = CONVERSATION,
        context_budget_bytes: int = DEFAULT_CONTEXT_BUDGET_BYTES,
        acknowledgment_llm: LLMService | None = None,
        acknowledgment_delay_secs: float | None = None,
        acknowledgment_route_delays: Mapping[str, float] | None = None,
        query_topic: Any = None,
        output_topic: Any = None,
        participant_joined_topic: Any = None,
        participant_left_topic: Any = None,
        interrupted_topic: Any = None,
        initialize_participant: ParticipantCallback | None = None,
        cleanup_participant: ParticipantCallback | None = None,
        set_status: StatusCallback | None = None,
        admission_timeout_secs: float | None = None,
        decision_timeout_secs: float | None = None,
        telemetry: RouterObserver | None = None,
        clarification_text: str = DEFAULT_CLARIFICATION_TEXT,
        failure_text: str = DEFAULT_FAILURE_TEXT,
        acknowledgment_policy: AcknowledgmentPolicy | None = None,
        timing_predictor: TimingPredictor | None = None,
        timing_sink: TimingSink | None = None,
        clock: Clock | None = None,
        max_pending_patches: int = DEFAULT_MAX_PENDING_PATCHES,
        max_history_exchanges: int = DEFAULT_MAX_HISTORY_EXCHANGES,
        max_waiting_turns: int = DEFAULT_MAX_WAITING_TURNS,
        max_departed_participants: int = DEFAULT_MAX_DEPARTED_PARTICIPANTS,
        max_participants: int = DEFAULT_MAX_PARTICIPANTS,
        max_patch_bytes: int = DEFAULT_MAX_PATCH_BYTES,
        release_timeout_secs: float = DEFAULT_RELEASE_TIMEOUT_SECS,
        overload: OverloadPolicy | None = _DEFAULT_OVERLOAD,
    ) -> None:
        cfg = self._cfg = RouterConfig(
            destinations, decisions, output=output, default_destination=default_destination,
            context_budget_bytes=context_budget_bytes, acknowledgment_llm=acknowledgment_llm,
            acknowledgment_delay_secs=acknowledgment_delay_secs,
            acknowledgment_route_delays=acknowledgment_route_delays,
            topics={
                "query_topic": query_topic, "output_topic": output_topic,
                "participant_joined_topic": participant_joined_topic,
                "participant_left_topic": participant_left_topic,
                "interrupted_topic": interrupted_topic,
            },
            initialize_participant=initialize_participant,
            cleanup_participant=cleanup_participant, set_status=set_status,
            timeouts=(admission_timeout_secs, decision_timeout_secs),
            telemetry=telemetry, clarification_text=clarification_text, failure_text=failure_text,
            acknowledgment_policy=acknowledgment_policy, timing_predictor=timing_predictor,
            timing_sink=timing_sink, clock=clock, max_pending_patches=max_pending_patches,
            limits={
                "max_history_exchanges": max_history_exchanges,
                "max_waiting_turns": max_waiting_turns,
                "max_departed_participants": max_departed_participants,
                "max_participants": max_participants, "max_patch_bytes": max_patch_bytes,
                "release_timeout_secs": release_timeout_secs,
            }, overload=overload)
        self._registry = Registry(cfg)
        self._patches = PatchDesk(cfg, self._registry)
        self._departures = Departures(cfg, self._registry, self._patches)

    # ------------------------------------------------------------------ the contract

    def runtime_subscriber(self) -> RouterSubscriber:
        """The runtime agent that delivers the configured topics to this router.

        Register it once with the application's `turnrouter.runtime.AgentRuntime`.
        Requires `query_topic` and `output_topic` on the constructor.
        """
        topics = self._cfg.runtime_topics
        if topics is None:
            raise ConfigurationError(
                "runtime_subscriber() requires query_topic and output_topic on AgentRouter"
            )
        from .runtime import RouterSubscriber

        return RouterSubscriber(self, topics, self._cfg.load)

    @property
    def destinations(self) -> Mapping[str, RoutableAgent]:
        """Registered destinations by route name (read-only view)."""
        return MappingProxyType(self._cfg.agents)

    def focus_of(self, participant_id: str) -> str | None:
        """The route holding `participant_id`'s focus, if any."""
        state = self._registry.get(_pid(participant_id))
        return None if state is None else state.focus

    def history_of(self, participant_id: str) -> tuple[AgentExchange, ...]:
        """The participant's retained completed exchanges, oldest first."""
        state = self._registry.get(_pid(participant_id))
        return () if state is None else state.history.exchanges

    @property
    def participants(self) -> frozenset[str]:
        """Participants the router currently holds state for."""
        return frozenset(self._registry.participants)

    async def handle(self, turn: AgentTurn) -> DestinationResult:
        """Route one turn while emitting only router-owned control text.

        Raises `TurnInterrupted` (an `asyncio.CancelledError`) when the turn is cancelled
        by `interrupt()`, a newer turn of the same participant, a departure or `stop()`;
        `LifecycleError` (a `RuntimeError`) while a departure or shutdown is pending or
        after a cleanup failed; destination exceptions propagate unchanged.
        """
        turn = _checked_turn(turn, "handle()")
        output = self._cfg.output
        if output is None:
            raise LifecycleError(
                "handle() needs the output callback: pass output=... to AgentRouter "
                "(runtime queries publish through output_topic instead)"
            )
        if (load := self._cfg.load).gate or load.in_flight >= load.cap:  # (admission)
            await _shed(self._cfg, self._registry, turn, output)
        return await _new_turn(self._cfg, self._registry, turn, (output, output), False).execute()

    async def interrupt(self, participant_id: str | None = None) -> None:
        """Cancel active (and queued) turns, keeping completed history and focus (with
        `participant_id=None`, every participant's turns); returns once they drained."""
        if participant_id is not None:
            _check_pid(participant_id)
        await self._departures.interrupt(participant_id)

    async def participant_left(self, participant_id: str) -> None:
        """Release one participant's state and history (an owned operation).

        Calls each used destination's `participant_left()` hook when present, otherwise
        `release()`. Failures stay tracked for a retry and are raised together in an
        ExceptionGroup; until a retry succeeds, `handle()` raises for that participant.
        """
        _check_pid(participant_id)
        await self._departures.leave(participant_id)

    async def stop(self) -> None:
        """Drain responses and release all participant state in one owned operation."""
        await self._departures.stop()

    # ------------------------------------------------------------ context patches

    def context_state(self, participant_id: str) -> ContextState:
        """The participant's context version and hash, to stamp background work with.

        Call it when the work starts (typically inside `answer()`, passing
        `spawned_from_event_id=turn.turn_id` on the patch). A participant the router
        holds no state for has version 0 and the hash of an empty context.
        """
        _check_pid(participant_id)
        return self._patches.context_state(participant_id)

    def pending_patches(self, participant_id: str) -> tuple[PendingContextPatch, ...]:
        """The participant's human-gated patches awaiting approval, oldest first."""
        _check_pid(participant_id)
        return self._patches.pending_of(participant_id)

    def context_patches_of(self, participant_id: str) -> tuple[AppliedContextPatch, ...]:
        """The applied patches whose exchanges the participant's history retains."""
        _check_pid(participant_id)
        return self._patches.applied_of(participant_id)

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
        router holds no state for, one that is leaving or left, and while stopping. In a
        NATS worker it returns once the record holding the change is written, else
        raises `PatchNotSavedError` naming why (docs/distributed.md).
        """
        _check_pid(participant_id)
        return await self._patches.apply(participant_id, patch, strategy)

    async def approve_patch(self, patch_id: str, *,
                            participant_id: str | None = None) -> AppliedContextPatch:
        """Merge a held patch at once (appended, its divergence as detected when held).
        `UnknownPatchError` (a `LifecycleError`, `LookupError`) when none of this id is
        pending (of `participant_id`, when given; an id two imported snapshots hold is
        refused without it): never held, settled, or dropped by a departure or `stop()`."""
        return await self._patches.approve(patch_id, participant_id)

    async def reject_patch(self, patch_id: str, *,
                           participant_id: str | None = None) -> PendingContextPatch:
        """Discard a held patch; its context is never merged. Errors as `approve_patch`."""
        return await self._patches.reject(patch_id, participant_id)

    # ------------------------------------------------------------ front-end seam

    async def route_turn(
        self, turn: AgentTurn, *, output: OutputCallback | None = None,
        report_heard: bool | Literal["all"] = False, ending: OutputCallback | None = None,
        result_check: ResultCheck | None = None,
    ) -> RoutedResult:
        """Run one turn as `handle()` does, for a front end (runtime, framework adapter).

        `output` gets the turn's control text instead of the constructor's; `ending`
        (default: `output`) the text the router ends the turn with (clarification,
        failure, busy, dropped). Same errors as `handle()`. `result_check(turn, route,
        result)` sees a destination's result before it is recorded: raising there fails
        the turn as `answer()` raising would. With `report_heard=True` the front end
        reports the answer's first audio (`mark_heard`; `"all"`: its control text's too):
        first response and silence end then (else at `started()`, which still
        suppresses a pending acknowledgment)."""
        turn = _checked_turn(turn, "route_turn()")
        cfg = self._cfg
        emit, end = _turn_outputs(cfg, output, ending, result_check)
        if (load := cfg.load).gate or load.in_flight >= load.cap:
            await _shed(cfg, self._registry, turn, end)
        running = _new_turn(cfg, self._registry, turn, (emit, end), report_heard)
        if result_check is not None:
            running.result_check = result_check
        return RoutedResult(await running.execute(), running.answered_by)

    def mark_heard(self, participant_id: str, turn_id: str, at: float | None = None, *,
                   control: bool = False) -> bool:
        """The participant started hearing turn `turn_id`'s answer (`control=True`: its
        control text, an acknowledgment or preamble, which ends the silence only) at
        `at`, a reading of the router's clock (now when None or later). True when it
        matched a turn routed with `report_heard=True` whose measurement was open."""
        _check_pid(participant_id)
        if not isinstance(turn_id, str):
            raise ContractTypeError(f"turn_id must be a str, got {type(turn_id).__name__}")
        _check_heard_at(at)
        answer = self._registry.heard_answer(participant_id, turn_id)
        if answer is not None:
            when = self._cfg.clock() if at is None else min(float(at), self._cfg.clock())
            (answer.control_heard if control else answer.mark_heard)(when)
        return answer is not None

    def begin_departure(self, participant_id: str) -> Departure:
        """Close the participant's admission now and start its departure.

        Synchronous, so a turn offered right after it is refused, and a `readmit()` that
        follows it is applied after it, not before. `await departure.join()` waits for
        the releases and cleanup (an `ExceptionGroup` of failures, as
        `participant_left()` raises). While the router stops, the departure runs after
        `stop()` ends.
        """
        _check_pid(participant_id)
        if self._registry.phase is RouterPhase.STOPPING:
            self._departures.close(participant_id)
            return Departure(OwnedOperation(self._departures.leave(participant_id)))
        return Departure(self._departures.start(participant_id))

    def readmit(self, participant_id: str) -> None:
        """A participant joined (again): reopen admission after a departure."""
        _check_pid(participant_id)
        self._registry.departed.pop(participant_id, None)

    async def drain(self) -> None:
        """Wait, cancelling nothing, until no turn is running or queued.

        New turns are still accepted (a front end stops feeding first): call it before
        `stop()` for a graceful end.
        """
        await self._departures.wait_idle()

    def set_control_output(self, output: OutputCallback) -> None:
        """Where control text outside any turn goes (a held context patch's question)
        when the constructor had no `output`."""
        check_callable("control output", output, optional=False)
        self._patches.control_output = output

    def on_participant_changed(self, callback: ParticipantChange | None) -> None:
        """`callback(pid)` after a context patch changed a participant's state (merged,
        held, approved or rejected); its errors are logged; None removes it. The patch
        call awaits an awaitable it returns (a `LifecycleError` it raises propagates)."""
        self._patches.watch(callback)

    def report_rejected(self, source: str, reason: str) -> None:
        """Count an input a front end refused before the router saw it.

        `turnrouter_runtime_rejected_messages_total{topic=source, reason=reason}`: keep
        both low-cardinality (a topic or subject name, a reason word).
        """
        if not isinstance(source, str) or not isinstance(reason, str):
            raise ContractTypeError("report_rejected() takes two str")
        self._cfg.observer.message_rejected(MessageRejected(source, reason))

    @property
    def failure_text(self) -> str:
        """What the router says when a turn fails before its answer (so does a front end)."""
        return self._cfg.failure_text

    @property
    def busy_text(self) -> str:
        """What the router says refusing a turn for load (so does a front end refusing one)."""
        return self._cfg.load.busy_text

    @property
    def reports_status(self) -> bool:
        """Whether a `set_status` callback is set (else `report_status` may be skipped)."""
        return self._cfg.set_status is not None

    async def report_status(
        self, status: Literal["processing", "idle"], participant_id: str
    ) -> None:
        """Call the configured `set_status` callback; its failures are logged only."""
        callback = self._cfg.set_status
        if callback is None:
            return
        try:
            await callback(status, participant_id)
        except Exception as exc:
            log_failure("set_status(%r, %r)", exc, status, participant_id)

    def trace_carrier(self) -> dict[str, str]:
        """W3C trace headers of the current span, for a message a front end publishes."""
        return self._cfg.observer.inject_context()

    def continue_trace(self, carrier: Mapping[str, str]) -> AbstractContextManager[None]:
        """Turns started inside the block are children of the remote span in `carrier`
        (an empty carrier changes nothing)."""
        if not _checked_carrier(carrier):
            return _NO_TRACE
        return _ContinuedTrace(self._cfg.observer, carrier)

    def export_participant(self, participant_id: str) -> ParticipantSnapshot | None:
        """The participant's movable state, or None when the router holds none."""
        _check_pid(participant_id)
        return self._registry.export(participant_id)

    def export_participant_json(self, participant_id: str) -> bytes | None:
        """`export_participant(pid).to_json()` as UTF-8, each retained exchange
        serialized once across calls (for a front end saving state every exchange)."""
        _check_pid(participant_id)
        return self._registry.export_json(participant_id)

    def import_participant(self, snapshot: ParticipantSnapshot) -> None:
        """Install a participant's state taken from another replica.

        Replaces what this router holds for the participant, unless a turn is in flight
        or a departure runs (`LifecycleError`). Unregistered routes, or an export of what
        it installs (its newest `max_history_exchanges` exchanges) past
        `MAX_SNAPSHOT_BYTES` (no replica could import it), are a `ContractValueError`."""
        if not isinstance(snapshot, ParticipantSnapshot):
            raise ContractTypeError(
                f"import_participant() takes a ParticipantSnapshot, "
                f"got {type(snapshot).__name__}")
        # Validated again (model_construct() skips it), then exported and read back: a
        # field set past validation is caught, and the next replica imports what is here.
        snapshot = checked_snapshot(snapshot)
        refuse_lossy(snapshot)  # a NaN the export would make null
        _check_patch_owners(snapshot)
        replaced = self._registry.install(snapshot, self._cfg.agents)
        if replaced is not None:
            self._patches.drop(replaced, outcome=None)
        state = self._registry.get(snapshot.participant_id)
        assert state is not None
        self._patches.hold(state)

    async def evict_participant(self, participant_id: str) -> ParticipantSnapshot | None:
        """Hand a participant over to another replica.

        Cancels its turns (drained), then drops its state without calling `release()`
        or cleanup (its destinations go on serving it elsewhere). Returns the final
        snapshot, None when the router held nothing.
        """
        _check_pid(participant_id)
        return await self._departures.hand_over(participant_id)

    @property
    def load(self) -> RouterLoad:
        """Saturation as last sampled: status, loop lag, turns in flight, longest wait."""
        return self._cfg.load.snapshot()

    @property
    def busy(self) -> bool:
        """Whether new participants are refused now: the readiness signal."""
        return self._cfg.load.busy

    @property
    def refusing(self) -> bool:
        """Whether some turns may be refused now (`sheds` says whose): busy, or new
        participants held back (admission budget, projected busy fraction) while the
        lag is still low (`busy` stays False then), or `max_turns_in_flight` reached."""
        return (load := self._cfg.load).gate or load.in_flight >= load.cap

    def sheds(self, participant_id: str) -> bool:
        """Whether a new turn of `participant_id` would be shed now (no task needed)."""
        return self._cfg.load.refusal(participant_id in self._registry.participants) is not None

    async def wait_ready(self) -> None:
        """Return once the router is not busy (a front end's backpressure)."""
        await self._cfg.load.wait_ready()


def prepared_import(router: AgentRouter, snapshot: ParticipantSnapshot) -> ParticipantSnapshot:
    """The steps of `router.import_participant(snapshot)` that touch no router state
    (validation, the NaN and infinity check, the export read back: a patch-heavy 1 MB
    snapshot cost ~200 ms of them), for a thread: `import_participant` of what it
    returns skips them, installing the same state. `ContractValueError` as the import
    would raise. A NATS worker runs it off the event loop for a big record."""
    return router._registry.prepare(snapshot)


def _check_patch_owners(snapshot: ParticipantSnapshot) -> None:
    """A snapshot's pending patches are its participant's: one naming another
    participant is refused. An id another participant holds too is no reason to refuse
    (patch ids are scoped per participant): a forged record imported first must not
    cost the real owner her state."""
    pid = snapshot.participant_id
    for held in snapshot.pending:
        if held.participant_id not in (None, pid):
            raise ContractValueError(
                f"snapshot pending patch {preview(held.patch_id)} belongs to another "
                f"participant; nothing installed")


async def route_validated_turn(router: AgentRouter, turn: AgentTurn, *,
                               output: OutputCallback, ending: OutputCallback,
                               result_check: ResultCheck | None) -> RoutedResult:
    """`router.route_turn(turn, output=..., ending=..., result_check=...)` for a turn a
    runtime built itself (`_query_turn`) from a message its validating model parsed
    (`UserQuery`: what `AgentTurn` checks, checked by pydantic): not checked a second
    time (`AgentTurn.__post_init__` again is about 1% of a NATS worker's turn)."""
    cfg = router._cfg
    emit, end = _turn_outputs(cfg, output, ending, result_check)
    if (load := cfg.load).gate or load.in_flight >= load.cap:
        await _shed(cfg, router._registry, turn, end)
    running = _new_turn(cfg, router._registry, turn, (emit, end), False)
    if result_check is not None:
        running.result_check = result_check
    return RoutedResult(await running.execute(), running.answered_by)


def _checked_turn(turn: object, caller: str) -> AgentTurn:
    """`turn`, validated again: `object.__new__` / copy tricks skip validation."""
    if not isinstance(turn, AgentTurn):
        raise ContractTypeError(f"{caller} takes an AgentTurn, got {type(turn).__name__}")
    try:
        turn.__post_init__()
    except AttributeError as exc:
        raise unset_field(turn, exc) from None
    return turn


def _turn_outputs(cfg: RouterConfig, output: OutputCallback | None,
                  ending: OutputCallback | None, result_check: ResultCheck | None,
                  ) -> tuple[OutputCallback, OutputCallback]:
    """`route_turn()`'s control-text and ending callbacks, checked (with its check)."""
    emit = output if output is not None else cfg.output
    if emit is None:
        raise LifecycleError(
            "route_turn() needs an output callback: pass output=... to it or to "
            "AgentRouter")
    if not callable(emit):  # (tested inline first: the runtimes call this every turn)
        check_callable("route_turn output", emit)
    if ending is not None and not callable(ending):
        check_callable("route_turn ending", ending)
    if result_check is not None and not callable(result_check):
        check_callable("route_turn result_check", result_check)
    return emit, emit if ending is None else ending


async def _shed(cfg: RouterConfig, registry: Registry, turn: AgentTurn,
                ending: OutputCallback) -> None:
    """Admission control, only while the router is busy: a turn the load calls for
    shedding is told so through `ending`, counted and refused (`RouterBusyError`)."""
    await cfg.load.refuse(turn, ending, turn.participant_id in registry.participants)


def _new_turn(cfg: RouterConfig, registry: Registry, turn: AgentTurn,
              outputs: tuple[OutputCallback, OutputCallback], report_heard: bool | str) -> Turn:
    """A new turn of an open participant; a refusal is reported, then raised.
    `outputs`: where control text goes, and where the text that ends the turn goes."""
    pid = turn.participant_id
    state = registry.participants.get(pid)
    # The common case, an open participant of a running router, tested inline (every
    # turn); anything else gets `admit()`'s refusal or the new participant's state.
    if (state is None or state.phase is not Phase.OPEN
            or registry.phase is not RouterPhase.RUNNING or pid in registry.departed):
        new = state is None
        try:
            state = registry.admit(pid)
        except LifecycleError as exc:
            cfg.observer.turn_started(TurnStarted(turn, None)).finished(
                TurnFinished("refused", None, None, None, 0, exc))
            raise
        if new and cfg.load.policy is not None:
            cfg.load.admitted_new()  # (a crowd is admitted a budget at a time)
    note_turn(state, turn.turn_id)  # (a patch it spawns is of this session)
    running = Turn(cfg, state, turn, outputs[0],  # ("all": control text reported too)
                   "all" if report_heard == "all" else bool(report_heard))
    running.end = outputs[1]
    return running


_NO_TRACE: AbstractContextManager[None] = contextlib.nullcontext()


class _ContinuedTrace:
    """`continue_trace()`'s block: the carrier's context is current inside it."""

    __slots__ = ("_carrier", "_observer", "_token")

    def __init__(self, observer: RouterObserver, carrier: Mapping[str, str]) -> None:
        self._observer, self._carrier = observer, carrier
        self._token: object = None

    def __enter__(self) -> None:
        self._token = self._observer.enter_context(self._carrier)

    def __exit__(self, *exc_info: object) -> None:
        self._observer.exit_context(self._token)


def _check_heard_at(at: object) -> None:
    """`ContractTypeError` / `ContractValueError` for a `mark_heard` time that is not a
    finite number (or None): a NaN there made the latency histograms' sums NaN for the
    process' life and the samples file unloadable (bounds17 H2)."""
    if at is None or finite(at):
        return
    if not is_number(at):
        raise ContractTypeError(f"mark_heard: at must be a number (a reading of the "
                                f"router's clock) or None, got {type(at).__name__}")
    raise ContractValueError(f"mark_heard: at must be a finite reading of the router's "
                             f"clock, got {preview(at)}")


def _pid(participant_id: str) -> str:
    """`participant_id`, checked (`focus_of([])` raised a bare unhashable TypeError,
    `history_of(5)` answered `()`: bounds17 L3)."""
    _check_pid(participant_id)
    return participant_id


def _checked_carrier(carrier: object) -> Mapping[str, str]:
    """`carrier` when it is a mapping of str to str (`ContractTypeError` else: junk
    raised a bare TypeError or AttributeError from inside the propagator)."""
    if not isinstance(carrier, Mapping) or not all(
            isinstance(key, str) and isinstance(value, str)
            for key, value in carrier.items()):
        raise ContractTypeError(f"continue_trace takes a mapping of str to str (W3C "
                                f"trace headers), got {type(carrier).__name__}")
    return carrier


def _check_pid(participant_id: object) -> None:
    if not isinstance(participant_id, str):
        raise ContractTypeError(
            f"participant_id must be a str, got {type(participant_id).__name__}"
        )
    if not str.__len__(participant_id):  # (the text's own length, not a subclass's)
        raise ContractValueError("participant_id must not be empty")
