"""The runtime side of `AgentRouter`: topics in, router calls and control output out."""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from .._contracts import AgentTurn
from .._exceptions import (
    ConfigurationError,
    ContractTypeError,
    ContractValueError,
    LifecycleError,
    RouterBusyError,
    TurnInterrupted,
)
from .._logging import log_failure
from ._messages import Interrupted, ParticipantJoined, ParticipantLeft, ResponseOutput, UserQuery
from ._runtime import AgentRuntime, Topic

if TYPE_CHECKING:
    from .._frontend import Departure
    from .._load import LoadMonitor, ShedReason
    from .._router import AgentRouter

__all__ = ["RouterSubscriber", "validate_topics"]

logger = logging.getLogger("turnrouter.runtime")

_PAYLOADS: dict[str, type[Any]] = {
    "query_topic": UserQuery,
    "output_topic": ResponseOutput,
    "participant_joined_topic": ParticipantJoined,
    "participant_left_topic": ParticipantLeft,
    "interrupted_topic": Interrupted,
}


def validate_topics(topics: dict[str, Any]) -> dict[str, Topic[Any]]:
    """Check the router's runtime configuration; return the configured topics by role.

    Incomplete configuration raises ValueError; a wrong payload class raises TypeError.
    """
    if (topics.get("query_topic") is None) != (topics.get("output_topic") is None):
        raise ConfigurationError("query_topic and output_topic must be supplied together")
    if topics.get("query_topic") is None:
        raise ConfigurationError(
            "runtime topics need query_topic and output_topic (lifecycle topics alone "
            "deliver nothing)"
        )
    if topics.get("participant_left_topic") is not None and topics.get(
        "participant_joined_topic"
    ) is None:
        raise ConfigurationError(
            "participant_left_topic requires participant_joined_topic, so a departed "
            "participant can be readmitted"
        )
    checked: dict[str, Topic[Any]] = {}
    for role, topic in topics.items():
        if topic is None:
            continue
        expected = _PAYLOADS[role]
        if not isinstance(topic, Topic):
            raise ContractTypeError(
                f"{role} must be a turnrouter.runtime.Topic, got {type(topic).__name__}"
            )
        if topic.payload is not expected:
            raise ContractTypeError(
                f"{role} must carry exactly {expected.__name__}, "
                f"got {getattr(topic.payload, '__name__', topic.payload)!r}"
            )
        checked[role] = topic
    names = [topic.name for topic in checked.values()]
    if len(names) != len(set(names)):
        raise ConfigurationError(f"runtime topic names must be distinct, got {names}")
    return checked


class RouterSubscriber:
    """Delivers configured topics to an `AgentRouter` (see `AgentRouter.runtime_subscriber`).

    Queries run as runtime-owned background tasks, so one participant's turn never
    blocks delivery for another; per-participant order is the router's. A query whose
    task has not started when a newer query of the same participant arrives is dropped
    before any work, as the router would supersede it anyway: counted as
    `rejected{reason="superseded"}`, as the NATS worker does (a publisher may deliver
    several at once, e.g. a burst from a speech recogniser; running each stale one costs
    a turn for nothing). Malformed messages are logged, counted and dropped; background failures
    are logged once.

    Args:
        router: The router the messages are delivered to.
        topics: Role (`query_topic`, `output_topic`, ...) -> topic, as the router was
            configured.
        load: The router's admission control (`AgentRouter.runtime_subscriber` passes
            it): a query the router sheds is then refused in the publisher's call
            without running a turn; without it, such a query runs through `route_turn`.
    """

    def __init__(self, router: AgentRouter, topics: dict[str, Topic[Any]],
                 load: LoadMonitor | None = None) -> None:
        self._router = router
        #: What `AgentRuntime.register` refuses twice: one subscriber per router.
        self._registers_as = router
        self._load = load
        self._topics = topics
        self._output = topics["output_topic"]
        self._roles = {topic.name: role for role, topic in topics.items()
                       if role != "output_topic"}
        self._control_output_set = False
        #: The output callbacks (control text, turn endings) of the runtime last
        #: delivering here (one pair per runtime).
        self._emit: tuple[AgentRuntime, Any] | None = None
        #: The departures the runtime last delivering here waits for.
        self._departures: _Departing | None = None
        #: Per participant with query tasks not started yet (of the runtime last
        #: delivering here): its newest query and how many of those tasks wait. An entry
        #: lives while its tasks wait; a new runtime starts a new map, so tasks a runtime
        #: cancelled before they began leave nothing behind.
        self._queued: tuple[AgentRuntime, dict[str, _Waiting]] | None = None

    @property
    def subscriptions(self) -> tuple[Topic[Any], ...]:
        return tuple(topic for role, topic in self._topics.items() if role != "output_topic")

    def _emitter(self, runtime: AgentRuntime) -> Any:
        """The `output` and `ending` callbacks publishing router text on `runtime`'s
        output topic: control text, and the text that ends a turn (`final=True`); made
        once per runtime, not per turn."""
        cached = self._emit
        if cached is not None and cached[0] is runtime:
            return cached[1]
        router, output = self._router, self._output

        async def publish(turn: AgentTurn, route: str, text: str, final: bool) -> None:
            carrier = router.trace_carrier()
            await runtime.publish(output, ResponseOutput(
                participant_id=turn.participant_id, request_id=turn.turn_id, route=route,
                text=text, final=final, traceparent=carrier.get("traceparent"),
                tracestate=carrier.get("tracestate"),
            ))

        async def emit(turn: AgentTurn, route: str, text: str) -> None:
            await publish(turn, route, text, False)

        async def end(turn: AgentTurn, route: str, text: str) -> None:
            await publish(turn, route, text, True)

        self._emit = (runtime, (emit, end))
        return emit, end

    def _queued_of(self, runtime: AgentRuntime) -> dict[str, _Waiting]:
        queued = self._queued
        if queued is None or queued[0] is not runtime:
            queued = self._queued = (runtime, {})
        return queued[1]

    def _departing(self, runtime: AgentRuntime) -> _Departing:
        departing = self._departures
        if departing is None or departing.runtime is not runtime:
            departing = self._departures = _Departing(runtime)
        return departing

    async def deliver(self, topic: Topic[Any], message: Any, runtime: AgentRuntime) -> None:
        router = self._router
        if not self._control_output_set:
            # Control text outside turns (a held context patch's question) goes here too.
            self._control_output_set = True
            router.set_control_output(self._emitter(runtime)[0])
        role = self._roles.get(topic.name)
        if role is None:
            return
        expected = self._topics[role]
        try:
            payload = expected.coerce(message)
        except (TypeError, ValueError) as exc:
            reason = "wrong_type" if isinstance(exc, TypeError) else "invalid"
            log_failure("a message on topic %r (rejected)", exc, topic.name, log=logger)
            router.report_rejected(topic.name, reason)
            return
        if role == "query_topic":
            if router.refusing and router.sheds(payload.participant_id):
                # Shed at once, in the publisher's call: a task per refused query would
                # cost more than the refusal itself.
                await self._shed_query(payload, runtime)
                return
            queued = self._queued_of(runtime)
            waiting = queued.get(payload.participant_id)
            if waiting is None:
                queued[payload.participant_id] = _Waiting(payload)
            else:
                waiting.newest = payload
                waiting.tasks += 1
            runtime.start_soon(self._start_query, payload, runtime,
                               name=f"turnrouter query {payload.message_id}")
        elif role == "participant_joined_topic":
            router.readmit(payload.participant_id)
        elif role == "participant_left_topic":
            # Admission closes now, so a joined event published after this one wins. The
            # departure runs in the router's own task: the runtime waits for its end (no
            # task of ours joins it) and its failure is logged.
            departure = router.begin_departure(payload.participant_id)
            if not departure.done:
                self._departing(runtime).add(payload.participant_id, departure)
        elif role == "interrupted_topic":
            runtime.start_soon(self._guard, "interrupt", router.interrupt,
                               payload.participant_id)

    async def _guard(self, what: str, fn: Any, *args: Any) -> None:
        try:
            await fn(*args)
        except Exception as exc:
            log_failure("runtime %s%r", exc, what, args, log=logger)

    async def _start_query(self, query: UserQuery, runtime: AgentRuntime) -> None:
        """A query's task: dropped unrun if a newer query of its participant arrived
        before it started, else run."""
        queued = self._queued_of(runtime)
        pid = query.participant_id
        waiting = queued.get(pid)
        if waiting is not None:
            waiting.tasks -= 1
            if not waiting.tasks:
                del queued[pid]
            if waiting.newest is not query:  # superseded before any work
                self._router.report_rejected(self._topics["query_topic"].name,
                                             "superseded")
                return
        await self._run_query(query, runtime)

    async def _shed_query(self, query: UserQuery, runtime: AgentRuntime) -> None:
        """A query the router sheds now: told the busy text and counted (outcome busy),
        without the turn's path (its checks, and a `RouterBusyError` raised through its
        frames only to be caught here). With status reports configured, or without the
        router's admission control, it runs as any query does."""
        load, router = self._load, self._router
        if load is None or router.reports_status:
            await self._run_query(query, runtime)
            return
        turn = self._turn_of(query)
        if turn is None:
            return
        # `sheds()` was True: whatever refuses a known participant's turn, else busy.
        reason: ShedReason = load.refusal(True) or "new_participant"
        with router.continue_trace(query.trace_carrier()):
            await load.shed(turn, self._emitter(runtime)[1], reason)

    def _turn_of(self, query: UserQuery) -> AgentTurn | None:
        """The query's turn; None, rejected and counted, when the query was changed
        after its validation (`object.__setattr__` on the publisher's instance): its
        contract error raised in the runtime's task would cancel every turn there."""
        try:
            return AgentTurn(query.participant_id, query.message_id, query.text,
                             timestamp_us=query.timestamp_us)
        except (ContractTypeError, ContractValueError) as exc:
            name = self._topics["query_topic"].name
            log_failure("a message on topic %r (rejected)", exc, name, log=logger)
            self._router.report_rejected(name, "invalid")
            return None

    async def _run_query(self, query: UserQuery, runtime: AgentRuntime) -> None:
        router = self._router
        turn = self._turn_of(query)
        if turn is None:
            return
        pid = turn.participant_id
        emit, end = self._emitter(runtime)
        reports = router.reports_status
        with router.continue_trace(query.trace_carrier()):
            if reports:
                await router.report_status("processing", pid)
            try:
                await router.route_turn(turn, output=emit, ending=end)
            except TurnInterrupted:
                pass  # the participant spoke again, or barged in: not a failure
            except RouterBusyError:
                pass  # shed for load: counted (outcome busy) and told by the router
            except LifecycleError as exc:
                # Refused by the router (a participant who left, or one past
                # max_participants): it counted the turn (outcome refused) already; a
                # second count here made one query two (the demo's "lost -2").
                logger.warning("turnrouter: dropped query %s: %s", query.message_id, exc)
            except Exception as exc:
                log_failure("runtime turn %s of %s", exc, turn.turn_id, pid, log=logger)
            finally:
                if reports:
                    with anyio.CancelScope(shield=True):  # idle even when cancelled
                        await router.report_status("idle", pid)


class _Waiting:
    """A participant's query tasks not started yet: its newest query and how many of
    those tasks wait."""

    __slots__ = ("newest", "tasks")

    def __init__(self, newest: UserQuery) -> None:
        self.newest = newest
        self.tasks = 1


class _Departing:
    """The departures one runtime waits for on exit, as one future it tracks while any
    runs (not a future and a callback chain per departure: a crowd may leave at once).
    Each departure's failure is logged when it ends.
    """

    __slots__ = ("_count", "_ended", "_on_departed", "runtime")

    def __init__(self, runtime: AgentRuntime) -> None:
        self.runtime = runtime
        self._ended: asyncio.Future[None] | None = None
        self._count = 0
        self._on_departed = self._departed  # bound once, not per departure

    def add(self, pid: str, departure: Departure) -> None:
        ended = self._ended
        if ended is None or ended.done():  # none running, or cancelled by the runtime
            ended = self._ended = asyncio.get_running_loop().create_future()
            self._count = 0
            self.runtime.track(ended)
        self._count += 1
        departure.add_done_callback(partial(self._on_departed, pid, ended))

    def _departed(self, pid: str, ended: asyncio.Future[None],
                  error: BaseException | None) -> None:
        if error is not None:
            log_failure("runtime participant_left(%r)", error, pid, log=logger)
        if ended is self._ended:
            self._count -= 1
            if not self._count and not ended.done():
                ended.set_result(None)
