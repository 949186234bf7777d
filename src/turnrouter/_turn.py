"""One turn, top down: wait in line, decide, admit, answer, history, focus, finish.

A `Turn` holds everything one turn needs (the router's settings, the participant's
state, the output callback, the observer, the cancel handle, what happened so far), so
the steps below take at most a route and an admission. The turn runs in the caller's
task (no task per turn: an interrupt cancels that task and takes the cancellation back,
as `asyncio.timeout` does). The acknowledgment runs beside the answer as a sidecar;
its `Answer` alone measures silence.
"""

from __future__ import annotations

import asyncio
import logging
import math
from asyncio import current_task
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from inspect import isawaitable
from typing import TYPE_CHECKING, Any

import anyio

from ._config import (
    CLARIFY_ROUTE,
    DROPPED_TURN_TEXT,
    OutputCallback,
    ResultCheck,
    RouterConfig,
)
from ._context import _current
from ._contracts import (
    NO_ROUTE,
    POLICY_RATIONALE,
    Admission,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RoutingAid,
    _exchange,
    _request,
    _turn_with_history,
    checked_shape,
    say_through,
    unset_field,
)
from ._exceptions import DestinationContractError, TurnInterrupted
from ._lifecycle import DROPPED, SUPERSEDED, OwnedOperation, TurnRun
from ._limits import is_logged
from ._logging import log_failure
from ._observer import (
    NULL_TURN_OBSERVER,
    AdmissionFinished,
    AdmissionStarted,
    AnswerFinished,
    AnswerStarted,
    Clarification,
    ClarificationReason,
    DecisionFinished,
    DefaultFallback,
    Failure,
    FirstResponse,
    FocusChanged,
    Heard,
    ReleaseFinished,
    ReleaseReason,
    ReleaseStarted,
    Rerouted,
    RouteIneligible,
    SilenceMeasured,
    TurnFinished,
    TurnObserver,
    TurnOutcome,
    TurnStarted,
)

if TYPE_CHECKING:
    from ._acknowledgment import AcknowledgmentSidecar
    from ._history import History
    from ._participants import Participant

__all__ = ["Answer", "Turn", "bounded_release"]

logger = logging.getLogger("turnrouter")

_CLARIFY_RESULT = DestinationResult("clarify")
_TIMED_OUT = Admission("decline")
_NOTHING_EXCLUDED: frozenset[str] = frozenset()
_cancelled_exc = anyio.get_cancelled_exc_class
#: Builds an event without NamedTuple's keyword handling: events are built on every turn.
_new = tuple.__new__


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, _cancelled_exc())


class Turn(TurnRun):
    """One routed turn of one participant; see the module docstring.

    A turn is its own place in the participant's queue (a `TurnRun`): one object per
    turn, not two. Its attributes that start out the same on every turn are class-level
    defaults (no `__slots__`), so a new turn stores only what differs.
    """

    #: Where the text the router itself ends the turn with goes (clarification, failure,
    #: dropped-turn text): a front end marks it as the turn's ending
    #: (`route_turn(ending=...)` sets it; `emit` otherwise).
    end: OutputCallback
    #: The focus when the turn began routing (read only when telemetry listens).
    focus_before: str | None = None
    #: The route that answered (for telemetry), and the one that ended the turn.
    route: str | None = None
    answered_by: str | None = None
    attempts = 0
    declined = False  # a routed choice (not the focus owner) declined this turn
    started = False
    output_failed = False
    obs: TurnObserver = NULL_TURN_OBSERVER
    answer: Answer | None = None
    #: `route_turn(result_check=...)`: sees the result before it is recorded.
    result_check: ResultCheck | None = None

    def __init__(self, cfg: RouterConfig, state: Participant, turn: AgentTurn,
                 emit: OutputCallback, report_heard: bool | str) -> None:
        self.turn_id = turn.turn_id
        self.cfg, self.state, self.turn, self.emit, self.end = cfg, state, turn, emit, emit
        self.report_heard = report_heard
        #: Whether telemetry listens (else no event is built).
        self.observing = cfg.observer.enabled

    # ------------------------------------------------------------------ the whole turn

    async def execute(self) -> DestinationResult:
        """Wait for the participant's earlier turns, run this one, report its outcome.

        Counted in flight from here to its end (the load sampler reads the count)."""
        state, turn, run, cfg = self.state, self.turn, self, self.cfg
        queue = state.queue
        load = cfg.load
        if load.task is None:
            load.ensure_sampling()
        load.in_flight += 1
        if queue.running is None and not queue.waiting:
            queue.running = run  # the participant's only turn: no wait, nothing measured
        else:
            await _wait_in_line(self)
        try:
            if state.unheard is not None:  # the previous answer was never reported heard
                state.unheard.spoken_over()
            if self.observing:
                self.focus_before = state.focus
                self.obs = cfg.observer.turn_started(_new(TurnStarted, (turn, state.focus)))
            task = current_task()
            assert task is not None, "turnrouter runs on asyncio"
            run.task = task
            run.base = task.cancelling()
        except BaseException:  # e.g. an observer's error: the turn leaves no trace
            load.in_flight -= 1
            queue.leave(run)
            raise
        if self.report_heard:  # mark_heard() may look for this turn's answer
            state.current = self
        try:
            # One coroutine layer less than a `_prepare_and_route()` call (every turn).
            if not state.initialized:
                await self._initialize()
            history = state.history
            # Seeded only while the router has completed no exchange of its own (version
            # 0): one it completed and the budget dropped is still its history.
            if not history.exchanges and turn.history and not history.version:
                _seed(self, history)
            if turn.history is not history.exchanges:
                self.turn = turn = _turn_with_history(turn, history.exchanges)
            token = _current.set((turn.turn_id, history.view()))
            try:
                result = await self._route()
            finally:
                _current.reset(token)
        except BaseException as exc:
            run.protected = True
            cancelled = _is_cancel(exc)
            if cancelled and run.reason and not run.consume_cancel():
                self._finish("interrupted", None)
                raise TurnInterrupted(turn.participant_id, turn.turn_id, run.reason) from None
            if not cancelled and not self.started and not self.output_failed:
                await self._emit_failure()
            self._finish("interrupted" if cancelled else "failed", None if cancelled else exc)
            raise
        finally:
            load.in_flight -= 1
            run.protected = True
            if run.cancel_sent:
                run.consume_cancel()  # a request that arrived as the turn completed
            if state.current is self:
                state.current = None
            # Answer and turn point at each other: unlinked, both are freed at once
            # instead of waiting for the cyclic collector (thousands of turns a second).
            self.answer = None
            queue.leave(run)
        if self.observing:
            self._finish(result.disposition, None)
        return result

    def _finish(self, outcome: TurnOutcome, error: BaseException | None) -> None:
        if self.observing:
            self.obs.finished(_new(TurnFinished, (
                outcome, self.route, self.focus_before, self.state.focus, self.attempts,
                error)))

    async def _emit_failure(self) -> None:
        try:
            await say_through(self.end, self.turn, self.route or NO_ROUTE, self.cfg.failure_text)
        except Exception as exc:
            log_failure("delivering the failure message of turn %s", exc, self.turn.turn_id)

    async def _initialize(self) -> None:
        """The participant's first turn: the router's `initialize` callback, once."""
        initialize = self.cfg.initialize
        if initialize is not None:
            try:
                await initialize(self.turn.participant_id)
            except BaseException:
                # it may have allocated something before failing or being interrupted:
                # the (idempotent) cleanup runs at departure even if no retry succeeds
                self.state.cleanup_pending = True
                raise
        self.state.initialized = True

    # ------------------------------------------------------------------ routing

    async def _route(self) -> DestinationResult:
        state, cfg = self.state, self.cfg
        excluded: set[str] = set()

        # 1. Focus first: the owner's admission is not a routing attempt.
        if state.focus is not None:
            result = await _focus_first(self, state.focus, excluded)
            if result is not None:
                return result

        # 2. At most two routed choices, each excluding every route that declined.
        aids: dict[str, RoutingAid] = {}
        eligible: list[RoutingAid] = []
        aid = None
        try:
            for name, agent in cfg.agents.items():
                aid = _aid_of(self, name, agent)
                if aid is _SAT_OUT:  # out of this turn's choices, counted
                    continue
                if aid.name != name:
                    aid = _named(aid, name)
                aids[name] = aid
                if aid.eligible:
                    if name not in excluded:
                        eligible.append(aid)
                elif self.observing:
                    self.obs.route_ineligible(RouteIneligible(name, aid.eligibility))
        except AttributeError:  # (checked only then: nothing per turn)
            _named(aid, name)  # a routing_aid() that returned no RoutingAid is named
            raise
        candidates = tuple(eligible)
        for attempt in range(2):
            if attempt:
                candidates = tuple(aid for name, aid in aids.items()
                                   if aid.eligible and name not in excluded)
            if not candidates:
                break
            self.attempts += 1
            request = _request(self.turn, candidates,
                               frozenset(excluded) if excluded else _NOTHING_EXCLUDED)
            chosen, reason = await self._choose(request, aids, excluded)
            if chosen is None:
                if self.declined and reason == "low_confidence":
                    break  # declined, then nothing chosen: the default's answer (step 3)
                assert reason is not None
                return await self._clarify(CLARIFY_ROUTE, "", reason)
            result = await self._offer(chosen, state.focus == chosen, excluded)
            if result is not None:
                return result

        # 3. Exhausted declines (contract18 F1): the default answers once, unadmitted.
        default = cfg.default
        if (self.attempts and default in aids and aids[default].eligible
                and default not in excluded):
            self.obs.default_fallback(DefaultFallback(default))
            return await self._answering(default).run(None)
        reason_: ClarificationReason = (
            "default_unavailable" if self.attempts else "no_eligible_route"
        )
        return await self._clarify(CLARIFY_ROUTE, "", reason_)

    async def _choose(
        self, request: RouteRequest, aids: dict[str, RoutingAid], excluded: set[str]
    ) -> tuple[str | None, ClarificationReason | None]:
        obs, cfg = self.obs, self.cfg
        token = obs.decision_started(request) if self.observing else None
        try:
            pending = cfg.decisions.decide(request)
            try:
                decision = await pending
            except TypeError:  # (a plain `def decide`: newcomer14)
                _refuse_not_awaitable("decision service", "decide", pending)
                raise
            decision = _checked_decision(decision)
        except (Exception, asyncio.CancelledError) as raised:
            exc = self.stray(raised, "decision service decide()")
            if not isinstance(exc, Exception):
                raise
            obs.decision_finished(token, DecisionFinished(request, None, exc))
            _decision_failed(cfg, exc)
            # A classifier outage must not silence the assistant.
            default = cfg.default
            if default in aids and aids[default].eligible and default not in excluded:
                return default, None
            return None, "decision_failed"
        if self.observing:
            obs.decision_finished(token, _new(DecisionFinished, (request, decision, None)))
        choice = decision.choice
        for aid in request.candidates:
            if aid.name == choice:
                return choice, None
        best = _best_scored(request.candidates, decision.scores)
        if best is not None:
            return best, None
        # A routing policy asked for it (the rationale prefix PolicyDecisions writes):
        # not a decision-service confidence problem, so not counted as one.
        if decision.rationale.startswith(POLICY_RATIONALE):
            return None, "policy"
        return None, "low_confidence"

    async def _offer(
        self, route: str, focused: bool, excluded: set[str]
    ) -> DestinationResult | None:
        """Ask `route` to admit the turn; the turn's result, or None to route on without it.

        A decline or release excludes the route for the rest of this turn; a release also
        says its text, clears the route's focus and calls its `release()` (the admission
        call inline: one coroutine layer less a turn)."""
        cfg, state = self.cfg, self.state
        if route not in state.used:
            state.used += (route,)
        observing = self.observing
        token = self.obs.admission_started(_new(AdmissionStarted, (route, focused))) if (
            observing) else None
        try:
            if cfg.admission_timeout is None:
                pending = cfg.agents[route].admit(self.turn, focused=focused)
                try:
                    admission = await pending
                except TypeError:
                    _refuse_not_awaitable(f"destination {route!r}", "admit", pending)
                    raise
            else:
                admission = await self._admit_within(route, focused, token)
            if not isinstance(admission, Admission):
                raise DestinationContractError(
                    f"destination {route!r} admit() returned {type(admission).__name__}, "
                    "not an Admission"
                )
            try:
                admission.__post_init__()  # again: object.__new__ skips validation
            except AttributeError as missing:
                raise unset_field(admission, missing) from None
        except BaseException as raised:
            exc = self.stray(raised, f"destination {route!r} admit()")
            self.obs.admission_finished(token, AdmissionFinished(
                route, focused, None, None if _is_cancel(exc) else exc, False))
            if exc is raised:
                raise
            raise exc from raised
        disposition = admission.disposition
        if observing and admission is not _TIMED_OUT:  # a timeout was reported as such
            self.obs.admission_finished(token, _new(AdmissionFinished, (
                route, focused, disposition, None, False)))
        if disposition == "accept":
            return await self._answering(route).run(admission)
        if disposition == "clarify":
            return await self._clarify(route, admission.text, "destination")
        excluded.add(route)
        self.obs.reroute(Rerouted(route))
        if disposition == "decline":
            self.declined = self.declined or not focused
        else:
            await self.say(route, admission.text)
            if state.focus == route:
                state.focus = None
                self.obs.focus_transition(FocusChanged(route, "released"))
            await self._release(route, "reroute")
        return None

    async def _admit_within(self, route: str, focused: bool, token: object) -> Admission:
        """`admit()` within `admission_timeout_secs`: a slower one is cancelled, reported
        as timed out and counted as a decline (`_TIMED_OUT`)."""
        timeout = self.cfg.admission_timeout
        with anyio.move_on_after(timeout) as scope:
            pending = self.cfg.agents[route].admit(self.turn, focused=focused)
            try:
                admission = await pending
            except TypeError:
                _refuse_not_awaitable(f"destination {route!r}", "admit", pending)
                raise
        if scope.cancel_called:  # (an admit() that swallowed the cancel: too late too)
            self.obs.admission_finished(token, AdmissionFinished(
                route, focused, "decline", None, True))
            logger.warning("turnrouter: %s.admit() timed out after %ss; counted as a "
                           "decline", route, timeout)
            return _TIMED_OUT
        return admission

    # ------------------------------------------------------------------ answering

    def _answering(self, route: str) -> Answer:
        """`route` answers this turn: its `Answer` (whose `run()` is awaited directly,
        one coroutine layer less per turn; it completes the turn's bookkeeping)."""
        state = self.state
        if route not in state.used:
            state.used += (route,)
        self.route = self.answered_by = route
        self.answer = answer = Answer(self, route)
        return answer

    async def answered(self, route: str, result: DestinationResult) -> DestinationResult:
        """The answer is complete: history, focus and the release it calls for."""
        # Its bookkeeping must not be torn by an interrupt.
        self.protected = True
        released = self.complete(route, result)
        if released is not None:
            await self._release(*released)
        return result

    def complete(
        self, route: str, result: DestinationResult
    ) -> tuple[str, ReleaseReason] | None:
        """History and focus after a complete answer; the release it calls for, if any."""
        state, obs = self.state, self.obs
        turn = self.turn
        dropped = state.history.append(
            _exchange(turn.query, result.text), turn.turn_id, turn.timestamp_us)
        if dropped:
            self.cfg.overflows.report(
                "history_exchanges", f"{turn.participant_id!r} holds max_history_exchanges "
                "exchanges: the oldest was dropped")
        owner = state.focus
        if result.disposition == "focus":
            if owner != route:
                state.focus = route
                obs.focus_transition(FocusChanged(route, "taken"))
                if owner is not None:
                    obs.focus_transition(FocusChanged(owner, "lost"))
                    return owner, "focus_taken"
        elif result.disposition == "release" and owner is not None:
            # "consumes this turn and clears focus": whoever held it (the owner may have
            # declined this turn and another destination answered) is released
            state.focus = None
            obs.focus_transition(FocusChanged(owner, "released"))
            return owner, "post_answer"
        return None

    # ------------------------------------------------------------------ speaking, releasing

    async def _clarify(
        self, route: str, text: str, reason: ClarificationReason
    ) -> DestinationResult:
        self.obs.clarification(Clarification(reason))
        if route != CLARIFY_ROUTE:  # a destination asked: the turn is counted on its route
            self.route = self.answered_by = route
        await self.say(route, text or self.cfg.clarification_text, ending=True)
        return _CLARIFY_RESULT

    async def say(self, route: str, text: str, *, ending: bool = False) -> None:
        if not text:
            return
        try:
            await say_through(self.end if ending else self.emit, self.turn, route, text)
        except Exception:  # (the failure text is not tried again on `end` if it failed)
            self.output_failed = ending or self.end is self.emit
            raise

    async def _release(self, route: str, reason: ReleaseReason) -> None:
        """Release during a turn, protected from interrupts; failures are logged only.

        An interrupt that arrives meanwhile takes effect once the release is done, unless
        the answer already completed (then there is nothing left to cancel).
        """
        run, obs = self, self.obs
        was_protected = run.protected
        run.protected = True
        token = obs.release_started(ReleaseStarted(route, reason))
        pid = self.turn.participant_id
        error, cancelled = await _settled(
            bounded_release(self.cfg, self.cfg.agents[route].release, pid))
        if isinstance(error, Exception):
            obs.release_finished(token, ReleaseFinished(route, reason, error))
            log_failure("%s.release(%r) (%s)", error, route, pid, reason)
        else:
            obs.release_finished(token, ReleaseFinished(route, reason, None))
        if cancelled is not None:
            raise cancelled
        if not was_protected:
            run.protected = False
            if run.reason:
                raise asyncio.CancelledError(run.reason)


class _Done:
    """An awaitable that is done at once (`started()` with nothing to wait for)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # (a generator: awaiting it returns at once)


_DONE = _Done()


class _Started:
    """What `started()` returns: awaiting it waits for a committed acknowledgment's
    delivery (made only then, so one left un-awaited leaves no never-awaited coroutine
    behind), and tells the answer it was awaited (`_unawaited`)."""

    __slots__ = ("_answer",)

    def __init__(self, answer: Answer) -> None:
        self._answer = answer

    def __await__(self) -> Generator[Any, None, None]:
        answer = self._answer
        answer.awaited = True
        sidecar = answer._sidecar
        if sidecar is not None and not answer.closed:
            return sidecar.wait_delivered().__await__()
        return _DONE.__await__()


def _unawaited(cfg: RouterConfig, route: str) -> None:
    """`route`'s answer() called started() without awaiting it: said once per route,
    as its output may overlap an acknowledgment being said (where one is configured)."""
    if route in cfg.unawaited:
        return
    cfg.unawaited.add(route)
    logger.warning("turnrouter: destination %r called started() without awaiting it: "
                   "use `await started()` (it waits until an acknowledgment being said "
                   "is heard, so the answer does not talk over it; said once per route)",
                   route)


def _unstarted(cfg: RouterConfig, route: str) -> None:
    """`route`'s answer() returned a text without calling started(): said once per
    route (an answer with no text may have said nothing, a silent release), as
    its first responses go unmeasured (no timing sample, no first-response metric), and
    an acknowledgment committed meanwhile may have overlapped its output."""
    if route in cfg.unstarted:
        return
    cfg.unstarted.add(route)
    logger.warning("turnrouter: destination %r answer() returned without calling "
                   "started(): its first response is not measured (call `await "
                   "started()` just before its first output; said once per route)", route)


class Answer:
    """The admitted (or fallback) destination's answer within a turn.

    Calls `answer()` with the acknowledgment sidecar beside it and checks the result.
    It is also the `started()` callable handed to `answer()`: the first call marks the
    answer started (first response, a pending acknowledgment suppressed); every call
    until `answer()` returns waits for a committed acknowledgment's delivery; calls
    after that do nothing. And it is the one owner of the silence measurement: whatever
    is heard first (the preamble, a delivered acknowledgment, the answer's start or the
    audio a front end reports) ends it.
    """

    #: What every answer starts with, as class-level defaults (no `__slots__`): a new
    #: answer stores only what differs (one is built per answered turn).
    _t0 = 0.0
    _token: object = None
    _sidecar: AcknowledgmentSidecar | None = None
    _started_at: float | None = None
    _heard_at: float | None = None
    #: With heard reports: when control text (a preamble, an acknowledgment) was first
    #: said, the silence's end when no report says when it was heard.
    _said_at: float | None = None
    closed = False
    #: started() was called while the answer ran / what it returned was awaited.
    called = awaited = False

    def __init__(self, owner: Turn, route: str) -> None:
        self.owner, self.route = owner, route
        #: When the silence began (admission); None once something was heard.
        self._silent_since: float | None = owner.cfg.clock()

    async def run(self, admission: Admission | None) -> DestinationResult:
        owner, route = self.owner, self.route
        cfg, obs = owner.cfg, owner.obs
        clock = cfg.clock
        preamble = admission.preamble if admission is not None else ""
        if preamble:
            self.hear(clock())
            await owner.say(route, preamble)
        if owner.observing:
            self._token = obs.answer_started(_new(AnswerStarted, (route, admission is None)))
        timed = cfg.timed
        sidecar = None if timed is None else timed.sidecar(self)
        if sidecar is not None:
            self._sidecar = sidecar
        self._t0 = clock()
        try:
            if sidecar is None:  # the common case, without a coroutine layer more
                pending = cfg.agents[route].answer(owner.turn, started=self)
                try:
                    result = await pending
                except TypeError:
                    _refuse_not_awaitable(f"destination {route!r}", "answer", pending)
                    raise
            else:
                result = await self._call_beside_sidecar(sidecar)
            try:
                if not isinstance(result, DestinationResult) or result.disposition == "clarify":
                    raise DestinationContractError(
                        f"destination {route!r} answer() must return DestinationResult "
                        f"answer, focus or release, got {type(result).__name__}"
                        + ("(clarify)" if isinstance(result, DestinationResult) else ""))
                result.__post_init__()  # again: object.__new__ skips validation
            except AttributeError as missing:
                raise unset_field(result, missing) from None
            if owner.result_check is not None:
                checked = owner.result_check(owner.turn, route, result)
                if checked is not None:
                    _refuse_async_check(checked)
            if owner.reason:  # interrupted, and answer() swallowed the cancellation
                raise asyncio.CancelledError(owner.reason)
        except BaseException as raised:
            exc = owner.stray(raised, f"destination {route!r} answer()")
            self.closed = True
            cancelled = _is_cancel(exc)
            if not cancelled:  # (cut short: what was said but not reported, unheard)
                self._close_silence()
            if cancelled and not owner.started:
                # A censored first response: a lower bound, not a fast answer (the
                # timing samples and the metrics count it alike).
                seconds = clock() - self._t0
                obs.interrupted_before_response(self._token,
                                                _new(FirstResponse, (route, seconds)))
                if timed is not None:
                    timed.record(route, seconds, True, owner.turn)
            obs.answer_finished(self._token, AnswerFinished(
                route, None, None if cancelled else exc, cancelled))
            if exc is raised:
                raise
            raise exc from raised
        self.closed = True
        if not owner.started and result.text:  # (it answered: history holds its text)
            _unstarted(cfg, route)
        elif self.called and not self.awaited:
            _unawaited(cfg, route)
        if self._said_at is not None:
            self._close_silence()
        if owner.observing:
            obs.answer_finished(self._token, _new(AnswerFinished, (route, result, None, False)))
        if result.disposition == "answer":  # no focus change, nothing to release
            owner.protected = True  # the bookkeeping must not be torn by an interrupt
            owner.complete(route, result)
            return result
        return await owner.answered(route, result)

    async def _call_beside_sidecar(self, sidecar: AcknowledgmentSidecar) -> DestinationResult:
        owner = self.owner
        agent = owner.cfg.agents[self.route]
        error: Exception | None = None
        result: DestinationResult | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(sidecar.run)
            try:
                pending = agent.answer(owner.turn, started=self)
                try:
                    result = await pending
                except TypeError:
                    _refuse_not_awaitable(f"destination {self.route!r}", "answer", pending)
                    raise
            except Exception as exc:  # re-raised below, unwrapped by the task group
                error = exc
            sidecar.answer_finished()
        if error is not None:
            raise error
        return result  # type: ignore[return-value]  # checked by the caller

    def __call__(self) -> Awaitable[None]:
        """`started()`: the start is marked at the call, what it returns waits for a
        committed acknowledgment's delivery (a call left un-awaited by mistake still
        measures the first response and suppresses a pending acknowledgment)."""
        if self.closed:
            return _DONE
        if not self.owner.started:
            self._start()
        self.called = True
        return _Started(self)

    # What the acknowledgment sidecar reads (`_acknowledgment.Answering`).

    @property
    def turn(self) -> AgentTurn:
        return self.owner.turn

    @property
    def obs(self) -> TurnObserver:
        return self.owner.obs

    @property
    def emit(self) -> OutputCallback:
        return self.owner.emit

    def hear(self, at: float) -> None:
        """Control text (a preamble, a delivered acknowledgment) was said at `at`: the
        silence ends (once). With heard reports the front end says when it was heard
        (`control_heard`); `at` is then only the fallback."""
        if self.owner.report_heard:
            if self._said_at is None:
                self._said_at = at
            return
        self._silence_at(at)

    def control_heard(self, at: float) -> None:
        """The front end reports this turn's control text heard at `at` (its audio
        began): that ends the silence if nothing was heard before."""
        self.owner.state.reports_heard = True
        self.owner.cfg.control_reports = True
        self._silence_at(at)

    def _silence_at(self, at: float) -> None:
        seconds = self._take_silence(at)
        if seconds is not None and self.owner.observing:
            self.owner.obs.silence(_new(SilenceMeasured, (self.route, seconds)))

    def _close_silence(self) -> None:
        """The answer ended without starting (not cut short): control text said but
        never reported heard ends the silence when it was said."""
        if self._started_at is None and not self.owner.started and self._said_at is not None:
            self._silence_at(self._said_at)

    def _take_silence(self, at: float) -> float | None:
        since = self._silent_since
        if since is None:
            return None
        self._silent_since = None
        return at - since

    def _start(self) -> None:
        """The destination's first `started()` call."""
        owner = self.owner
        owner.started = True
        sidecar, timed = self._sidecar, owner.cfg.timed
        if sidecar is None and timed is None and not (owner.observing or owner.report_heard):
            # Nothing measures the first response: only the silence ends (see `hear`).
            self._silent_since = None
            return
        now = owner.cfg.clock()
        if sidecar is not None:
            sidecar.answer_started(now)
        if owner.report_heard:
            self._started_at = now
            if owner.observing:
                owner.obs.output_started(self._token,
                                         _new(FirstResponse, (self.route, now - self._t0)))
            owner.state.unheard = self
            if timed is not None:
                # The timing sample ends here, not at the audio: the acknowledgment it
                # predicts for is suppressed by `started()`, and its own audio waits for
                # the same text-to-speech. Learned at the audio, a slow TTS taught the
                # predictor that every answer is slow, so quick answers got an
                # acknowledgment (itself delaying them) every turn (voice17 F1).
                timed.record(self.route, now - self._t0, False, owner.turn)
            if self._heard_at is not None:
                self.resolve_heard(self._heard_at)
            return
        seconds = now - self._t0
        observing = owner.observing
        if observing:
            owner.obs.first_response(self._token, _new(FirstResponse, (self.route, seconds)))
        since = self._silent_since
        if since is not None and (sidecar is None or not sidecar.committed):
            self._silent_since = None  # the answer is heard first (see `hear`)
            if observing:
                owner.obs.silence(_new(SilenceMeasured, (self.route, now - since)))
        if timed is not None:
            timed.record(self.route, seconds, False, owner.turn)

    def mark_heard(self, at: float) -> None:
        """The front end reports the first audio of this answer heard at `at`."""
        self.owner.state.reports_heard = True
        if self.owner.started:
            self.resolve_heard(at)
        else:
            self._heard_at = at

    def _take_measure(self) -> float | None:
        """The `started()` time of this answer's open heard measurement, taken once
        (None: none open)."""
        owner = self.owner
        if owner.state.unheard is self:
            owner.state.unheard = None
        started_at, self._started_at = self._started_at, None
        return started_at

    def resolve_heard(self, at: float | None) -> None:
        """Record first response and silence to `at` (None: to `started()`), once."""
        owner = self.owner
        started_at = self._take_measure()
        if started_at is None:
            return
        at = started_at if at is None else max(at, started_at)
        seconds = at - self._t0
        silence_seconds = None
        said_at = self._said_at
        if said_at is not None:
            # Control text was said before the answer was heard, and no report said it
            # was heard. A front end that reports control text heard would have reported
            # it first (an output plays in order): its audio never began (a TTS error on
            # it, a dropped utterance), so the silence ran until the answer's audio
            # (voice22 F2). From a front end that never reports it, it ended the silence
            # when it was said.
            self._silence_at(at if owner.report_heard == "all" or owner.cfg.control_reports
                             else min(said_at, at))
        elif self._sidecar is None or not self._sidecar.committed:
            silence_seconds = self._take_silence(at)
        owner.cfg.observer.heard(Heard(self.route, seconds, silence_seconds))

    def spoken_over(self) -> None:
        """The participant's next turn began (or they left, or moved to another
        replica, or the router stopped) before this answer was reported heard: by a
        front end that reports, it was not heard yet (no interruption sent: a barge-in
        all the same, voice11; a call ended before the audio began, voice13); else
        measured at `started()`."""
        if self.owner.state.reports_heard:
            self.resolve_unheard(self.owner.cfg.clock())
        else:
            self.resolve_heard(None)

    def resolve_unheard(self, at: float) -> None:
        """A barge-in at `at` before any of this answer was reported heard: its first
        response is a lower bound (censored, as for a turn interrupted before
        `started()`), and the silence is not recorded, unless control text reported
        heard ended it. (Falling back to `started()` recorded the fastest turn of the
        call for one whose caller heard nothing; so did control text said and never
        reported heard, whose audio the barge-in cut before it began: voice11.)"""
        owner = self.owner
        started_at = self._take_measure()
        if started_at is None:
            return
        seconds = max(at, started_at) - self._t0
        owner.cfg.observer.heard(Heard(self.route, seconds, None, True))


async def _wait_in_line(run: Turn) -> None:
    """Wait behind the participant's earlier turns (a running one is superseded),
    measuring the wait for the load sampler; a turn cancelled or dropped meanwhile
    is reported and raises `TurnInterrupted` (no longer counted in flight)."""
    state, turn, cfg = run.state, run.turn, run.cfg
    load, queue = cfg.load, state.queue
    running = queue.running
    if running is not None:  # the participant spoke again: the running turn is stale
        running.cancel(SUPERSEDED)
    since = cfg.clock()
    try:
        entered = await queue.enter(run, cfg.max_waiting_turns)
        if not entered:
            if run.observing:
                cfg.observer.turn_started(_new(TurnStarted, (turn, state.focus))).finished(
                    TurnFinished("interrupted", None, state.focus, state.focus, 0, None))
            if run.reason == DROPPED:
                await _dropped(run)
            raise TurnInterrupted(turn.participant_id, turn.turn_id, run.reason)
    except BaseException:
        load.in_flight -= 1
        raise
    load.waited(cfg.clock() - since)


async def _dropped(run: Turn) -> None:
    """Count a turn dropped from a full queue and tell the participant."""
    turn, cfg = run.turn, run.cfg
    cfg.overflows.report(
        "waiting_turns", f"turn {turn.turn_id!r} of {turn.participant_id!r} dropped: "
        f"more than max_waiting_turns ({cfg.max_waiting_turns}) waiting")
    try:
        await say_through(run.end, turn, CLARIFY_ROUTE, DROPPED_TURN_TEXT)
    except Exception as exc:
        log_failure("telling %r that turn %s was dropped", exc, turn.participant_id,
                    turn.turn_id)


def _seed(run: Turn, history: History) -> None:
    """Seed the participant's history with the caller's (counting what is dropped)."""
    turn = run.turn
    dropped = history.seed(turn.history)
    if dropped:
        run.cfg.overflows.report("seeded_history", f"{dropped} caller-supplied exchanges "
                                 f"beyond max_history_exchanges of {turn.participant_id!r}")


def _checked_decision(decision: object) -> RouteDecision:
    """`decision` if it is a valid `RouteDecision`, else `DestinationContractError`."""
    if not isinstance(decision, RouteDecision):
        raise DestinationContractError(
            f"decision service returned {type(decision).__name__}, not a RouteDecision")
    try:
        if not checked_shape(decision):  # built around its constructor
            decision.__post_init__()
    except AttributeError as missing:  # a field never set (`object.__new__`)
        raise unset_field(decision, missing) from None
    return decision


def _decision_failed(cfg: RouterConfig, exc: Exception) -> None:
    """Log a decision-service failure at the 1st, 10th, 100th... (an outage fails every
    turn; each is counted in telemetry)."""
    cfg.decision_failures += 1
    if is_logged(cfg.decision_failures):
        if isinstance(exc, DestinationContractError):  # its text is ours, never user text
            logger.warning("turnrouter: the decision service failed (%d so far): %s",
                           cfg.decision_failures, exc)
        else:
            log_failure("the decision service (%d failures so far)", exc,
                        cfg.decision_failures)


async def _settled(
    call: Coroutine[Any, Any, None],
) -> tuple[BaseException | None, asyncio.CancelledError | None]:
    """Run `call` to its end in a task of its own, shielded: its error, and the caller's
    cancellation if one came meanwhile (to raise once the outcome is recorded). For a
    release (rare, not per turn): a caller's native `task.cancel()`, which anyio's shield
    does not stop, must not tear it half-way."""
    operation = OwnedOperation(call)
    cancelled = None
    try:
        with anyio.CancelScope(shield=True):
            await operation.settle()
    except asyncio.CancelledError as exc:
        cancelled = exc
    return await operation.settle(), cancelled


async def bounded_release(
    cfg: RouterConfig, call: Callable[[str], Awaitable[None]], pid: str
) -> None:
    """`await call(pid)` within `release_timeout_secs` (else `TimeoutError`, counted).

    `asyncio.timeout` rather than an anyio cancel scope: a departure releases every
    route a participant used, and a scope costs several times more.
    """
    deadline = asyncio.timeout(cfg.release_timeout)
    try:
        async with deadline:
            await call(pid)
    except TimeoutError:
        if not deadline.expired():
            raise  # the release's own TimeoutError
        cfg.overflows.report("release_timeout", f"a release for {pid!r} took longer than "
                             f"release_timeout_secs ({cfg.release_timeout}s)")
        raise TimeoutError(f"release did not return within {cfg.release_timeout}s") from None


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


async def _focus_first(run: Turn, owner: str, excluded: set[str]
                       ) -> DestinationResult | None:
    """The focus owner's admission (not a routing attempt): its result, or None when
    the turn is to be routed (it declined, released, or lost the focus, ineligible or
    its `routing_aid()` raising)."""
    owned = _aid_of(run, owner, run.cfg.agents[owner])
    if owned is _SAT_OUT:  # broken: the focus is lost, as if ineligible
        owned = None
    if owned is not None and type(owned) is not RoutingAid:
        owned = _named(owned, owner)
    if owned is None or not owned.eligible:
        run.state.focus = None
        run.obs.focus_transition(FocusChanged(owner, "lost"))
        await run._release(owner, "ineligible")
        return None
    # A decline keeps focus with the owner and does not call release().
    return await run._offer(owner, True, excluded)


def _aid_failed(run: Turn, route: str, exc: Exception) -> None:
    """A destination's `routing_aid()` raised: counted as a failure of the decision
    stage (routing aids are its input) and logged at the 1st, 10th, 100th...; the
    route sits this turn out, so one broken destination does not fail every turn."""
    if run.observing:
        run.obs.failure(Failure(route, "decision", exc))
    cfg = run.cfg
    cfg.aid_failures += 1
    if is_logged(cfg.aid_failures):
        log_failure("destination %r routing_aid() (%d failures so far)", exc, route,
                    cfg.aid_failures)


#: What `_aid_of` returns for a destination that sits the turn out.
_SAT_OUT = object()


def _aid_of(run: Turn, name: str, agent: Any) -> Any:
    """The destination's routing aid for the turn's participant (`_checked_aid`);
    `_SAT_OUT` when `routing_aid()` raised (a stray `CancelledError` too, as a
    `DestinationContractError`: bounds17 M3), counted by `_aid_failed`."""
    try:
        return _checked_aid(agent.routing_aid(run.turn.participant_id))
    except (Exception, asyncio.CancelledError) as raised:
        exc = run.stray(raised, f"destination {name!r} routing_aid()")
        if not isinstance(exc, Exception):
            raise
        _aid_failed(run, name, exc)
        return _SAT_OUT


def _checked_aid(aid: Any) -> Any:
    """`aid`, a `RoutingAid` checked again (`object.__new__` and `object.__setattr__`
    skip validation: an `eligible="no"` counted as eligible, bytes reached the decision
    service; bounds17 M1), or anything else as it is (`_named` names it). A field never
    set is a `ContractTypeError` naming it."""
    if type(aid) is RoutingAid:
        try:
            aid.__post_init__()
        except AttributeError as missing:
            raise unset_field(aid, missing) from None
    return aid


def _named(aid: object, name: str) -> RoutingAid:
    """The aid under its registered route name (the name decisions and labels use)."""
    if not isinstance(aid, RoutingAid):
        raise DestinationContractError(
            f"destination {name!r} routing_aid() returned {type(aid).__name__}, "
            "not a RoutingAid" + (" (routing_aid is synchronous: def, not async def)"
                                  if _closed_unawaited(aid) else ""))
    return RoutingAid(name, aid.description, aid.priority, aid.eligible, aid.eligibility)


def _closed_unawaited(value: object) -> bool:
    """Whether `value` is awaitable (what an `async def` returns where a plain function
    was expected); a coroutine is closed, never to be awaited, so not warned of."""
    if not isawaitable(value):
        return False
    if hasattr(value, "close"):
        value.close()
    return True


def _refuse_async_check(returned: object) -> None:
    """What a `result_check` returned, when not None: an `async def` check returns a
    coroutine, which would check nothing (closed here, and refused: the turn fails,
    nothing is recorded); any other value is ignored, as documented."""
    if _closed_unawaited(returned):
        raise DestinationContractError(
            "route_turn result_check returned an awaitable: it must be a plain function "
            "(def, not async def) that raises for a result the front end cannot carry")


def _refuse_not_awaitable(who: str, method: str, returned: object) -> None:
    """After a TypeError awaiting `who`'s `method()` (a destination, the decision
    service): when what it returned is not awaitable (a plain `def answer`), raise an
    error that says so instead of Python's "object DestinationResult can't be used in
    'await' expression". Checked only on that error, so a correct turn pays nothing."""
    if not isawaitable(returned):
        error = DestinationContractError(
            f"{who} {method}() returned {type(returned).__name__}, not an "
            f"awaitable: it must be an async method (async def {method}(...))")
        error.own_message = True
        raise error from None
