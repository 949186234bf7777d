"""One delivered input on an owned partition: checked, run, recorded, acknowledged.

A query's message is acknowledged only once a record says what became of its turn, so a
crash never loses it silently. A turn that reaches its end within `mark_after` is
acknowledged after its finished record (the exchange, and the answer in its outbox) is
written: until then the unacknowledged message itself is the mark, and a new owner gets
it again and ends it with the failure text. A longer turn is marked in flight in the
record (one write, reusing the last snapshot) and acknowledged then, so the partition's
next message (an interrupt, say) is not held behind it. Either way one record write
stands between a message's delivery and its acknowledgment, as the partition has one
message in flight at a time.

A query delivered more than `max_input_wait` after the stream stored it (a backlog) is
not run: it ends with the router's busy text, recorded like any ending (`_expire`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from ..._contracts import AgentTurn, DestinationResult, _query_turn
from ..._exceptions import (
    ContractValueError,
    LifecycleError,
    RouterBusyError,
    TurnInterrupted,
)
from ..._lifecycle import SUPERSEDED
from ..._limits import is_logged
from ..._logging import log_failure
from ..._redact import preview
from ..._router import AgentRouter, route_validated_turn
from .._messages import UserQuery
from ._ledger import (
    Ledger,
    Participant,
    SaveOutcome,
    await_previous_owner,
    change_made,
    recorded,
    unclaimed,
    unsaved,
)
from ._link import Link, RequestFailed, pub_ack
from ._metrics import RuntimeMetrics
from ._wire import (
    Ending,
    NatsConfig,
    Rejected,
    ack_info,
    decode_token,
    encode_token,
    parse_input,
    response_json,
    token_output_id,
    trace_context,
)

__all__ = ["Inputs", "save_soon"]

logger = logging.getLogger("turnrouter.runtime.nats")

_RECENT = 4096  # bound of the handled-input id memory (duplicates beyond it are re-run)


class _Recent:
    """The last `bound` handled inputs, by (participant, message id), each with its
    stream sequence: a message delivered again (its acknowledgment lost) is the same
    stream message, while one published again after the stream's deduplication window
    (a new session reusing `turn-1`, a reused `left` id) is a new one and is handled.
    Two participants may use the same message id. Duplicates older than the bound run
    again, unless their participant's record says their turn ended."""

    def __init__(self, bound: int) -> None:
        self._ids: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._bound = bound

    def seen(self, key: tuple[str, str], seq: int) -> bool:
        """Whether `key` was handled as stream message `seq` (0: unknown, any counts)."""
        handled = self._ids.get(key)
        return handled is not None and (handled == seq or not seq or not handled)

    def add(self, key: tuple[str, str], seq: int) -> None:
        self._ids[key] = seq
        if len(self._ids) > self._bound:
            self._ids.popitem(last=False)


class _TurnIndex:
    """Running turn tasks by participant (entries go when their last task ends). A turn
    task leaves it at its own end (`Inputs._turn`), without a done callback per turn;
    `of` skips a task that ended without running (cancelled before its first step)."""

    def __init__(self) -> None:
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}

    def of(self, pid: str) -> tuple[asyncio.Task[None], ...]:
        return tuple(t for t in self._tasks.get(pid, ()) if not t.done())

    def add(self, pid: str, task: asyncio.Task[None]) -> None:
        self._tasks.setdefault(pid, set()).add(task)

    def discard(self, pid: str, task: asyncio.Task[None] | None) -> None:
        tasks = self._tasks.get(pid)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[pid]


class _Running:
    """A turn started from a query message, and when that message may be acknowledged.

    `gate` resolves first: None when `mark_after` passed before the turn began to
    finish (mark it in flight), else the finished write's result; `written()` is that
    result (True: recorded, acknowledge; False: fenced, leave it to the new owner). Its
    future is made only for a turn that outlasted `mark_after` (one future less on the
    usual turn).

    The `mark_after` deadline's timer is armed only for a turn that has not begun to
    finish after its task's first step (`arm`, called right after that step): a
    destination that answers without waiting on anything (or fails at once) has begun
    to finish by then, so the usual short turn puts no timer on the loop's heap (a timer
    armed and cancelled costs its push, pop and comparisons there on every turn).

    What every turn starts with is a class-level default (no `__slots__`, as the
    router's `Turn`): a new one stores only its gate and what `Inputs._start` sets."""

    finishing = False
    _written: asyncio.Future[bool] | None = None
    result: bool | None = None  # the finished write's, once settled
    held: Ending | None = None
    output: _Output | None = None
    task: asyncio.Task[None] | None = None
    deadline = 0.0  # loop time at which it is due (`mark_after` after its start)
    timer: asyncio.TimerHandle | None = None
    # Order among the participant's turns (`Participant.answering`): the turn whose
    # held answer goes out before this one's, and whether this one's went out (or
    # never will); `_out` made for the first output waiting on it.
    turn_id = ""
    seq = 0
    prior: _Running | None = None
    out = False
    _out: asyncio.Event | None = None

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.gate: asyncio.Future[bool | None] = loop.create_future()

    def said(self) -> None:
        """Its held answer was handed to the connection, or never will be."""
        self.out = True
        self.prior = None
        if self._out is not None:
            self._out.set()

    async def wait_said(self) -> None:
        """Until `said()` (an output of a later turn of the participant waits here)."""
        if not self.out:
            if self._out is None:
                self._out = asyncio.Event()
            await self._out.wait()

    def arm(self) -> None:
        """Right after the turn's first step: due now, or a timer for its deadline,
        unless it began to finish (or was settled) already."""
        if self.finishing or self.gate.done():
            return
        loop = self.gate.get_loop()
        if loop.time() >= self.deadline:
            self.due()
        else:
            self.timer = loop.call_at(self.deadline, self.due)

    def due(self) -> None:
        if not self.finishing and not self.gate.done():
            self.gate.set_result(None)

    def settle(self, ok: bool) -> None:
        if self.result is None:
            self.result = ok
            if self._written is not None and not self._written.done():
                self._written.set_result(ok)
        if not self.gate.done():
            self.gate.set_result(ok)

    async def written(self) -> bool:
        if self.result is not None:
            return self.result
        if self._written is None:
            self._written = self.gate.get_loop().create_future()
        return await self._written


Spawn = Callable[[Awaitable[Any], str], "asyncio.Task[Any]"]
_Output = tuple[str, bytes, dict[str, str]]  # subject, body, headers


def _refused_query(msg: Msg) -> tuple[str, str] | None:
    """(participant, turn id) of a query refused unread, from its subject
    (`...<token>.query`) and its `Nats-Msg-Id` (`<token>.<message id>`, as
    `NatsFrontEnd.publish` sets it), None when they do not agree."""
    parts = msg.subject.split(".")
    head, _, turn_id = ((msg.headers or {}).get("Nats-Msg-Id") or "").partition(".")
    if len(parts) < 2 or parts[-1] != "query" or not turn_id or head != parts[-2]:
        return None
    try:
        return decode_token(head), turn_id
    except ValueError:
        return None


class Inputs:
    """Runs the inputs of the partitions a worker owns on its router."""

    def __init__(self, config: NatsConfig, router: AgentRouter, ledger: Ledger, link: Link,
                 metrics: RuntimeMetrics | None, spawn: Spawn,
                 stopping: Callable[[], bool], tasks: set[asyncio.Task[Any]]) -> None:
        self._config, self._router, self._ledger, self._link = config, router, ledger, link
        self._metrics, self._spawn, self._stopping = metrics, spawn, stopping
        #: The worker's background tasks: a turn's task is added at its start and leaves
        #: at its own end (no done callback per turn, as `spawn` would add).
        self._tasks = tasks
        self._running: dict[tuple[str, str], _Running] = {}  # by (participant, turn)
        self._seq = 0
        self._recent = _Recent(_RECENT)
        self.turns_of = _TurnIndex()
        self._out_prefix = f"{config.prefix}.out."
        #: Refused inputs by reason (a few), and busy texts not stored ("unsaid").
        self._rejections: dict[str, int] = {}
        #: Participants whose departure (releases, then their record) is running: at
        #: most one task each, gone when it ends.
        self._departing: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ inputs
    def _reject(self, subject: str, reason: str, detail: str) -> None:
        """Count a refused input; logged the first time per reason and at every power
        of ten (a publisher sending junk cannot grow the log one line per message)."""
        count = self._rejections[reason] = self._rejections.get(reason, 0) + 1
        if is_logged(count):
            # (the subject quoted: a publisher chooses its bytes, terminal escapes too)
            logger.warning("turnrouter: rejected input on %s (%s, %d so far): %s",
                           preview(subject[:200]), reason, count, detail)
        self._router.report_rejected("nats_input", reason)

    def _known_turn(self, pid: str, turn_id: str) -> bool:
        """Whether `turn_id` runs or ended for `pid` here: a refused message naming it
        (its header read stripped by nats-py, so the stream took it for another id) is
        no ending of that turn, which a decoy would otherwise end with the failure text
        while its answer went unheard (redteam22 F3)."""
        return (pid, turn_id) in self._running or turn_id in getattr(
            self._ledger.people.get(pid), "ended", ())

    async def handle(self, n: int, msg: Msg, owned: bool, received: float) -> None:
        """Check and run one message delivered on partition `n` (owned: this replica
        holds its pin; received: its arrival, `time.monotonic()`), then acknowledge it
        when its outcome is recorded."""
        try:
            partition, pid, kind, message = parse_input(
                self._config, msg.subject, msg.data,
                msg.headers.get("Nats-Msg-Id", "") if msg.headers else "")
            if partition != n:
                raise Rejected("not_owned", f"partition {partition} delivered on {n}")
        except Rejected as exc:
            self._reject(msg.subject, exc.reason, str(exc))
            await self._ack(msg, b"+TERM")
            if exc.reason == "oversized" and (turn := _refused_query(msg)) is not None \
                    and not self._known_turn(*turn):
                # Its turn ends audibly: a front end whose max_message_bytes exceeds the
                # workers' let it through, and its participant would hear nothing.
                await self.publish_output(*turn, "none", self._config.failure_text,
                                          final=True, carrier={}, in_order=False)
            return
        if kind == "probe" or pid is None or message is None:
            await self._ack(msg)
            return
        if not owned:
            self._reject(msg.subject, "not_owned", f"partition {n} is not owned here")
            return  # not acknowledged: the owner gets it
        delivered, seq, stored_ns = ack_info(msg.reply)
        # How long the stream held it (0 when unknown: then it is never too old).
        waited = max(0.0, time.time() - stored_ns / 1e9) if stored_ns else 0.0
        metrics = self._metrics
        if metrics is not None:
            if delivered > 1:
                metrics.redeliveries.inc()
            metrics.wait_queued.observe(time.monotonic() - received)
            if stored_ns:
                metrics.wait_delivery.observe(waited)
        message_id = message.message_id
        key = (pid, message_id)
        if self._recent.seen(key, seq) or key in self._running:
            if metrics is not None:
                metrics.duplicate_inputs.inc()
            await self._ack(msg)
            return
        if kind == "query" and (departing := self._departing.get(pid)) is not None:
            # The participant left just before: the router refuses their turns while
            # they depart, so the query waits for the departure (its releases, then its
            # record) and starts their next session, however long the releases take.
            await asyncio.wait((departing,), timeout=self._config.drain_timeout)
        if kind == "query" and delivered == 1 and (
                self._config.max_input_wait < waited < self._config.dedup_window) and not (
                self.turns_of.of(pid) or message_id in getattr(
                    self._ledger.people.get(pid), "ended", ())) and (
                verdict := await unclaimed(self._ledger, pid, n, message_id)) != "claim":
            # A backlog's query, refused before its participant is claimed (or, its
            # record says, ended already: a publish repeated after the stream's window).
            if verdict == "ended":
                if metrics is not None:
                    metrics.duplicate_inputs.inc()
            elif not await self._refuse_unclaimed(msg, pid, message_id, waited):
                return
            self._recent.add(key, seq)
            await self._ack(msg)
            return
        if kind != "query" and await _nobody(self._ledger, pid, n, kind):
            # No claim (it writes a record): a flood of made-up ids left one each, for
            # good (redteam9 N2).
            self._recent.add(key, seq)
            await self._ack(msg)
            return
        if kind == "query" and not self._ledger.serves(pid):  # (served: the common case)
            await await_previous_owner(self._ledger, pid, n, message_id, delivered > 1)
        state = self._ledger.people.get(pid)  # (served here: the common case, no claim)
        if state is None:
            state = await self._ledger.claim(pid, n)
            if state is None:
                return  # fenced: another replica owns the participant
        state.active = received
        router = self._router
        if kind == "query":
            assert isinstance(message, UserQuery)
            if message_id in state.ended:
                # The record says this turn ended (its answer or failure text is out, or
                # in the outbox the claim published): it never runs again, whatever the
                # delivery count (after a server crash a message delivered and not
                # acknowledged comes back as delivery 1).
                if metrics is not None:
                    metrics.duplicate_inputs.inc()
            elif delivered > 1:
                # A previous owner received it and may have started answering: end it
                # the way a turn in flight on a dead owner ends, recorded (ended, and
                # the failure text in the outbox) before it is said and acknowledged,
                # so it never runs after all.
                if metrics is not None:
                    metrics.inflight_failed.inc()
                ending = (message_id, "none", self._config.failure_text, time.time())
                state.outbox.append(ending)
                state.end(message_id)
                if not await self._ledger.write(pid, state, fresh=False):
                    return  # fenced meanwhile: the message is the new owner's now
                await self.publish_ending(  # in its trace: its spans died with the owner
                    pid, state, ending, input_carrier(msg.headers, message))
            elif waited > self._config.max_input_wait:
                if not await self._expire(msg, pid, state, message_id, waited):
                    return  # fenced meanwhile: the message is the new owner's now
            elif waited >= self._config.failover_timeout and self._ledger.heard(
                    self._ledger.replica) is False and not (
                    await self._ledger.write(pid, state, fresh=False)):
                # Held that long (a pin moves no sooner) by a replica not hearing itself
                # (frozen, cut off): a new owner may have ended the turn; the record,
                # written first, says so (fenced) before the destination runs (chaos11 D3).
                return
            elif not await self._start(pid, state, message, msg):
                return  # fenced meanwhile: the message is the new owner's now
        elif kind == "joined":
            # A new session: its turn ids may be the last one's again (`turn-1`). Every
            # message before this one was handled (a partition delivers in order, also
            # again after a crash), so only turns with an ending still to say are kept.
            unsaid = {ending[0] for ending in state.outbox} | set(state.inflight)
            state.ended = {turn: held for turn, held in state.ended.items() if turn in unsaid}
            router.readmit(pid)
            self._spawn(self._ledger.write(pid, state), "state write")
        elif kind == "left":
            departure = router.begin_departure(pid)
            task = self._spawn(self._after(departure.join(), pid, state), "departure")
            self._departing[pid] = task
            task.add_done_callback(
                lambda done: self._departing.pop(pid) if self._departing.get(pid) is done
                else None)
        elif kind == "interrupt":
            await router.interrupt(pid)
        self._recent.add(key, seq)
        if msg.reply:  # (`_ack`, inline: every input's path)
            await self._link.send(msg.reply, b"+ACK")

    async def _refuse_unclaimed(self, msg: Msg, pid: str, message_id: str,
                                waited: float) -> bool:
        """`_stored_final`: True once the busy text is stored (then acknowledged)."""
        error = await _stored_final(self._link, self._output(
            pid, message_id, "none", self._router.busy_text, True, {}))
        if error is not None:
            count = self._rejections["unsaid"] = self._rejections.get("unsaid", 0) + 1
            if is_logged(count):
                logger.warning("turnrouter: a refused query's busy text was not stored (%d "
                               "so far; the query comes back): %.200r", count, error)
            return False
        self._reject(msg.subject, "expired", _expired(waited, self._config.max_input_wait))
        return True

    async def _expire(self, msg: Msg, pid: str, state: Participant, message_id: str,
                      waited: float) -> bool:
        """A query past `max_input_wait` whose participant is claimed: its busy text
        recorded (ended, in the outbox) before it is said and acknowledged; False when
        fenced meanwhile. A turn of theirs still running is stale (they spoke again since):
        cut, and its end awaited, so nothing they hear follows the busy text."""
        running = self.turns_of.of(pid)
        if running:
            await self._router.interrupt(pid)
            await asyncio.wait(running, timeout=self._config.drain_timeout)
        self._reject(msg.subject, "expired", _expired(waited, self._config.max_input_wait))
        ending = (message_id, "none", self._router.busy_text, time.time())
        state.outbox.append(ending)
        state.end(message_id)
        if not await self._ledger.write(pid, state, fresh=False):
            return False
        await self.publish_ending(pid, state, ending)
        return True

    async def _start(self, pid: str, state: Participant, query: UserQuery, msg: Msg) -> bool:
        """Start the turn; True once its message may be acknowledged (module doc)."""
        carrier = input_carrier(msg.headers, query)  # bounded, never echoed raw
        loop = asyncio.get_running_loop()
        run = self._running[(pid, query.message_id)] = _Running(loop)
        self._seq += 1
        run.seq = self._seq
        run.deadline = loop.time() + self._config.mark_after
        task = run.task = loop.create_task(self._turn(pid, state, query, carrier, run),
                                           name=f"turn {query.message_id}")
        self._tasks.add(task)
        self.turns_of.add(pid, task)
        loop.call_soon(run.arm)  # (after the task's first step: `_Running`)
        try:
            outcome = await run.gate
        finally:
            if run.timer is not None:
                run.timer.cancel()
        if outcome is not None:
            return outcome
        if run.finishing:  # it began to finish since the deadline: no mark needed
            return await run.written()
        state.inflight.append(query.message_id)
        if self._metrics is not None:
            self._metrics.inflight_marks.inc()
        return await self._ledger.write(pid, state, fresh=False)

    def changed(self, pid: str) -> SaveOutcome:
        """The router changed a participant outside its turns (a context patch): save
        its record soon, off any turn's path (one save for changes close together); the
        patch call awaits the outcome (`change_made`)."""
        outcome = change_made(self._ledger, pid)
        save_soon(self, pid)
        return outcome

    async def _after(self, work: Awaitable[None], pid: str, state: Participant) -> None:
        try:
            await work
        except Exception as exc:  # user text may be in it: its type only (_logging)
            log_failure("departure", exc, log=logger)
        await self._ledger.write(pid, state)

    async def _ack(self, msg: Msg, how: bytes = b"+ACK") -> None:
        if msg.reply:
            await self._link.send(msg.reply, how)

    # ------------------------------------------------------------------ turns
    async def _turn(self, pid: str, state: Participant, query: UserQuery,
                    carrier: dict[str, str], run: _Running) -> None:
        router = self._router
        turn = turn_of(query)  # (what `AgentTurn` checks, its message's model checked)
        status = router.reports_status
        try:
            with router.continue_trace(carrier):
                if status:
                    await router.report_status("processing", pid)
                try:
                    # A destination answering without `ctx.answer` (written for the
                    # in-process router) has its returned text held by `_say_returned`.
                    await route_validated_turn(
                        router, turn, output=self._emit, ending=self._end,
                        result_check=functools.partial(_say_returned, self._hold, run, carrier))
                finally:
                    if status:
                        await router.report_status("idle", pid)
        except (TurnInterrupted, LifecycleError) as exc:
            closed = isinstance(exc, LifecycleError) and not isinstance(exc, RouterBusyError)
            if closed and not self._stopping():
                # Refused by the router (max_participants held, or a record that says the
                # participant left, until `joined`): counted and logged, and said.
                self._reject(f"{self._config.prefix}.in.{encode_token(pid)}.query",
                             "closed", str(exc))
            superseded = getattr(exc, "reason", None) == SUPERSEDED  # (silent, always)
            if closed or (self._stopping() and run.held is None and not superseded):
                # Every turn ends audibly, also one cut short by a graceful end that
                # outlasted drain_timeout. (A barge-in or a newer turn ends it silently;
                # a turn shed for load heard the router's busy text.)
                await self.publish_output(pid, turn.turn_id, "none",
                                          self._config.failure_text, final=True,
                                          carrier=carrier)
        except Exception as exc:  # user text may be in it: its type only (_logging)
            log_failure("turn %s", exc, turn.turn_id, log=logger)
            # Every turn ends audibly: the failure text under the terminal id is dropped
            # by the output stream when the router or the destination already ended it.
            await self.publish_output(pid, turn.turn_id, "none", self._config.failure_text,
                                      final=True, carrier=carrier)
        finally:
            run.finishing = True
            del self._running[(pid, query.message_id)]
            try:
                if state.inflight:  # only a turn that outlasted mark_after is there
                    with contextlib.suppress(ValueError):
                        state.inflight.remove(query.message_id)
                state.end(query.message_id)
                held = run.held
                if held is not None:
                    state.outbox.append(held)
                    state.answered = True  # (its exchange: in the next write's snapshot)
                if state.fenced:
                    run.settle(False)
                else:
                    # Not shielded: the task is cancelled only when the worker goes down,
                    # and a record write cut then is a crash like any other (module doc).
                    await _finish(self._ledger, self._link, pid, state, run)
            finally:  # a hand-over waits for the turn's write and answer (`turns_of`)
                run.said()
                if state.answering is run:
                    state.answering = None
                self.turns_of.discard(pid, run.task)
                self._tasks.discard(run.task)  # (nothing is awaited after this)

    async def answer(self, turn: AgentTurn, route: str, text: str) -> None:
        """A destination's answer: held until the turn's record is written (running
        turn), else published at once."""
        run = self._running.get((turn.participant_id, turn.turn_id))
        if run is not None and run.held is None:
            # Checked now, so a text that cannot go out fails the destination's answer()
            # (the router then says its failure text) instead of ending nothing later.
            self._hold(run, turn, route, text, self._router.trace_carrier())  # turn's span
            return
        await self.publish_output(turn.participant_id, turn.turn_id, route, text, final=True)

    def _hold(self, run: _Running, turn: AgentTurn, route: str, text: str,
              carrier: dict[str, str]) -> None:
        """Hold `text` as the running turn's answer until its finished record is written
        (`ContractValueError` for text that cannot go out)."""
        run.output = self._output(turn.participant_id, turn.turn_id, route, text, True,
                                  carrier)
        run.held = (turn.turn_id, route, text, time.time())
        state = self._ledger.people.get(turn.participant_id)
        if state is not None:  # the participant's later outputs wait for this answer
            run.turn_id, run.prior, state.answering = turn.turn_id, state.answering, run

    # ------------------------------------------------------------------ outputs
    async def _emit(self, turn: AgentTurn, route: str, text: str) -> None:
        # Control text along the way: acknowledgment, preamble, release text.
        await self.publish_output(turn.participant_id, turn.turn_id, route, text,
                                  final=False)

    async def _end(self, turn: AgentTurn, route: str, text: str) -> None:
        # The router ends the turn itself (clarification, failure, busy or dropped text):
        # the turn's one final output.
        await self.publish_output(turn.participant_id, turn.turn_id, route, text,
                                  final=True)

    async def control_output(self, turn: AgentTurn, route: str, text: str) -> None:
        # A context patch's question: not held behind a running turn's answer (that
        # turn's own destination may be the one waiting for the patch call).
        await self.publish_output(turn.participant_id, turn.turn_id, route, text,
                                  final=False, in_order=False)

    async def publish_output(self, pid: str, turn_id: str, route: str, text: str, *,
                             final: bool, carrier: dict[str, str] | None = None,
                             confirmed: Callable[[], None] | None = None,
                             in_order: bool = True) -> None:
        """Publish one output to the output stream under its deduplication id, with the
        W3C context of `carrier` (default: the current span's). Not waited for: the
        connection keeps it ahead of the participant's next record write; `confirmed`
        is called once the stream acknowledged it. `in_order`: after the answer another
        turn of the participant holds until its record is written
        (`Participant.answering`): a participant hears their turns in order."""
        if in_order:
            ahead = _earlier_answer(self, pid, turn_id)
            if ahead is not None:
                await ahead.wait_said()
        if carrier is None:
            carrier = self._router.trace_carrier()
        try:
            output = self._output(pid, turn_id, route, text, final, carrier)
        except ContractValueError as exc:
            logger.warning("turnrouter: %s", exc)
            failure = self._config.failure_text
            if not final or text == failure:
                return
            # A final that cannot go out (an answer held by a replica of a larger bound,
            # say): the turn still ends audibly, with the failure text.
            output = self._output(pid, turn_id, "none", failure, final, carrier)
        await self._link.publish_stored(*output, confirmed=confirmed)

    async def publish_ending(self, pid: str, state: Participant, ending: Ending,
                             carrier: dict[str, str] | None = None) -> None:
        """Publish an ending of `state`'s outbox (in its query's trace, `carrier`, when at
        hand); it leaves the outbox once the stream acknowledged it."""
        turn_id, route, text, _ = ending
        await self.publish_output(pid, turn_id, route, text, final=True, carrier=carrier,
                                  confirmed=functools.partial(_forget, state.outbox, ending),
                                  in_order=False)  # (an ending written already)

    def _output(self, pid: str, turn_id: str, route: str, text: str, final: bool,
                carrier: dict[str, str]) -> _Output:
        return _output_of(self._config, self._out_prefix, pid, turn_id, route, text, final,
                          carrier)


async def _finish(ledger: Ledger, link: Link, pid: str, state: Participant,
                  run: _Running) -> None:
    """Write the finished exchange, then publish the answer it holds (if any)."""
    ok = False
    try:
        ok = await ledger.write(pid, state)
        # Settled before the answer is published: the message's acknowledgment then
        # joins the answer in the connection's next flush (one socket write, not
        # two), still behind it. Were it sent first and the replica died, the answer
        # is in the record's outbox, which the next owner publishes.
        run.settle(ok)
        held, output = run.held, run.output
        if ok and held is not None and output is not None:
            prior = run.prior  # the participant's previous answer goes out first
            if prior is not None:
                await prior.wait_said()
            # Kept in the outbox until the stream acknowledged it (then the next
            # write drops it from the record): lost with a server crash, it is
            # published again on reconnect (`republish`).
            await link.publish_stored(
                *output, confirmed=functools.partial(_forget, state.outbox, held))
    except Exception as exc:
        log_failure("finishing a turn", exc, log=logger)
    finally:
        run.settle(ok)


def _output_of(config: NatsConfig, out_prefix: str, pid: str, turn_id: str, route: str,
               text: str, final: bool, carrier: dict[str, str]) -> _Output:
    """An output's subject, body (a `ResponseOutput`'s JSON, checked as the model
    checks it: `response_json`) and headers (`ContractValueError` for text that is
    not valid output, e.g. holding a lone surrogate, or a body over
    `max_message_bytes`)."""
    body = response_json(pid, turn_id, route, text, final=final, carrier=carrier)
    if len(body) > config.max_message_bytes:
        # It would also make the record holding it (the outbox) unwritable on a
        # server's default 1 MiB payload bound: refused here, named.
        raise ContractValueError(
            f"output of turn {preview(turn_id)} is {len(body)} bytes, over "
            f"max_message_bytes {config.max_message_bytes}")
    token = encode_token(pid)
    headers = {"Nats-Msg-Id": token_output_id(token, turn_id, route, text, final), **carrier}
    return f"{out_prefix}{token}", body, headers


def _earlier_answer(inputs: Inputs, pid: str, turn_id: str) -> _Running | None:
    """The turn of `pid` whose held answer an output of turn `turn_id` waits for
    (`Participant.answering`), never a newer turn than the output's own (turns are
    numbered as they start): None when there is none, or it went out."""
    state = inputs._ledger.people.get(pid)
    ahead: _Running | None = None if state is None else state.answering
    if ahead is None or ahead.turn_id == turn_id:
        return None
    own = inputs._running.get((pid, turn_id))
    if own is not None:  # never behind a later turn of the participant
        while ahead is not None and ahead.seq >= own.seq:
            ahead = ahead.prior
    return ahead


def _say_returned(hold: Callable[[_Running, AgentTurn, str, str, dict[str, str]], None],
                  run: _Running, carrier: dict[str, str], turn: AgentTurn, route: str,
                  result: DestinationResult) -> None:
    """`route_turn`'s result check (`hold`: `Inputs._hold`): a destination that returned
    its text without `ctx.answer` (written for the in-process router) has it held as the
    turn's answer now, before the router records the exchange, so a text that cannot go
    out (`ContractValueError`: over `max_message_bytes`, say) fails the turn with nothing
    recorded, as it would through `ctx.answer`."""
    if run.held is None:
        try:
            hold(run, turn, route, result.text, carrier)
        except ContractValueError as exc:
            logger.warning("turnrouter: %s", exc)  # (sizes and the turn id only)
            raise


def turn_of(query: UserQuery) -> AgentTurn:
    """`AgentTurn(query.participant_id, query.message_id, query.text,
    timestamp_us=query.timestamp_us)` without the constructor's check: a delivered query
    is parsed by its validating model (`parse_input`), which checks what `AgentTurn`
    does (strict types, non-empty ids of at most `MAX_ID_CHARS`, no lone surrogate, the
    timestamp's range), so the turn is routed unchecked (`route_validated_turn`)."""
    return _query_turn(query.participant_id, query.message_id, query.text,
                       query.timestamp_us)


def input_carrier(headers: dict[str, str] | None, query: UserQuery) -> dict[str, str]:
    """The trace context a query's turn continues (`trace_context`): its message's
    headers when they hold either W3C header, else the query's own fields.
    (`trace_context` reads only those two headers: the rest are never looked at.)"""
    if headers and ("traceparent" in headers or "tracestate" in headers):
        return trace_context(headers)
    return trace_context(query.trace_carrier())


def _expired(waited: float, bound: float) -> str:
    return f"a query waited {waited:.1f} s in the stream > max_input_wait {bound:g} s"


async def _stored_final(link: Link, output: _Output) -> object:
    """Publish a refused query's final output and wait for the output stream: None once
    stored (or found stored: the turn's final id is deduplicated), else what failed.

    A backlog's query (past `max_input_wait`, delivered once, no turn of its participant
    running, its record read and holding nothing unended: `Inputs._unclaimed`) is
    refused so, without a claim or a write: a backlog of new participants was refused at
    a claim and two writes each, one at a time per partition, slower than it grew.
    Nothing needs recording: a delivery of the query again (a crash before its
    acknowledgment) is refused again, its wait only longer, and the stream drops its
    busy text as the turn's second final; a final said for it before is in its record's
    ended ids (checked), or, said a crash ago, still in the stream's deduplication
    window, since the query was stored less than `dedup_window` ago (an older one is
    claimed)."""
    try:
        seq, error = pub_ack(await link.request(*output))
    except (RequestFailed, ValueError) as exc:
        return exc
    return None if seq is not None else (error or "no sequence")


def engaged(inputs: Inputs, pid: str) -> bool:
    """Whether a turn of `pid` runs here or their departure does."""
    return bool(inputs.turns_of.of(pid)) or pid in inputs._departing


def save_soon(inputs: Inputs, pid: str) -> None:
    """Write `pid`'s record soon, off any turn's path, unless a save is due."""
    state = inputs._ledger.people.get(pid)
    if state is None or state.fenced or state.saving:
        return
    state.saving = True
    inputs._spawn(_save(inputs._ledger, pid, state), "state save")


async def _save(ledger: Ledger, pid: str, state: Participant) -> None:
    """`Inputs.changed`'s save of a participant's record. One that fails (the server
    unreachable, or another replica took the participant meanwhile) leaves the change
    to `lose` (the partition moved: it writes it while this replica is still the
    record's last writer), else its callers hear it was not saved (`unsaved`, from the
    fence)."""
    state.saving = False  # a change after this point schedules another save
    try:
        await ledger.write(pid, state)
    except BaseException:  # its callers are not left waiting for the bound
        unsaved(state, "the participant's record write failed")
        raise


def _forget(outbox: list[Ending], ending: Ending) -> None:
    """The stream acknowledged `ending`: the participant's next write drops it."""
    try:  # noqa: SIM105 (no context manager: every answer's acknowledgment comes here)
        outbox.remove(ending)
    except ValueError:
        pass


async def republish(inputs: Inputs, *, reconnected: bool = True) -> int:
    """After a reconnect (or a stream back from 503, `reconnected` False): publish
    again the endings written records hold that the stream did not acknowledge (the
    stream drops what it already holds); how many."""
    if reconnected:  # the replies of before never come
        inputs._link.forget_unconfirmed()
        inputs._link.fail_waiting()
    count = 0
    for pid, state, ending in _unacknowledged(inputs):
        await inputs.publish_ending(pid, state, ending)
        count += 1
    return count


def _unacknowledged(inputs: Inputs) -> list[tuple[str, Participant, Ending]]:
    """The endings written records hold that the stream did not acknowledge, younger
    than half the deduplication window (older ones could be heard twice): of the
    participants served here, and of those served elsewhere now (`Ledger.unheard`,
    dropped once nothing of theirs is left to say)."""
    horizon = time.time() - inputs._config.dedup_window / 2
    ledger = inputs._ledger
    found = []
    for pid, state in list(ledger.people.items()):
        if not state.outbox or state.fenced:
            continue
        found += [(pid, state, ending) for ending in state.outbox
                  if ending[3] >= horizon and ending[0] in state.recorded]
    for pid, state in list(ledger.unheard.items()):  # participants served elsewhere
        fresh = [ending for ending in state.outbox if ending[3] >= horizon]
        if not fresh or pid in ledger.people:  # (a claim here published them)
            if ledger.unheard.get(pid) is state:
                del ledger.unheard[pid]
            continue
        found += [(pid, state, ending) for ending in fresh]
    return found


#: Seconds between two looks of `resend` at the endings not acknowledged.
RESEND_AFTER = 5.0
#: Seconds between two log lines of `resend` (the count goes on).
_RESEND_LOG_SECS = 60.0


async def resend(inputs: Inputs, every: float = RESEND_AFTER) -> None:
    """Publish again the endings the output stream has not acknowledged for a while.
    The server drops a publish it refuses for the user's permissions (a reload that
    took the output subject away for a while) or could not store, with no reply:
    without this, such an answer stayed in its outbox unheard until a reconnect, and
    the participant's next turns ran with it in their history.

    Every `every` seconds it looks: an ending found unacknowledged at two looks in a
    row (5-10 s) is published again, and again at the 4th, 8th... look (a stream that
    is only slow gets few copies; the stream drops copies of what it holds, by id).
    The callbacks of copies never acknowledged are dropped two looks later (bounded)."""
    link = inputs._link
    marks = [link.mark()]
    waiting: dict[tuple[str, str], int] = {}  # (participant, turn) -> looks unacknowledged
    resent, logged = 0, -_RESEND_LOG_SECS
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        if len(marks) == 2:
            link.forget_before(marks.pop(0))
        marks.append(link.mark())
        seen: dict[tuple[str, str], int] = {}
        count = 0
        for pid, state, ending in _unacknowledged(inputs):
            key = (pid, ending[0])
            looks = seen[key] = waiting.get(key, 0) + 1
            if looks >= 2 and looks & (looks - 1) == 0:  # 2, 4, 8...
                await inputs.publish_ending(pid, state, ending)
                count += 1
        waiting = seen  # (only what is still unacknowledged: bounded by the outboxes)
        if count:
            resent += count
            if loop.time() - logged >= _RESEND_LOG_SECS:
                logged = loop.time()
                logger.warning("turnrouter: published again %d outputs the output stream "
                               "had not acknowledged for %g s or more (%d so far; a "
                               "publish refused for the permissions, or a slow stream)",
                               count, every, resent)


async def _nobody(ledger: Ledger, pid: str, n: int, kind: str) -> bool:
    """Whether a `joined`, `left` or `interrupt` of `pid`, not served here, has nothing
    to act on: no record (nothing to reopen, release or close, nothing of theirs runs),
    or, for an interrupt, a record with no turn in flight. A record the server cannot
    read now takes the claim, as before."""
    if ledger.serves(pid):
        return False
    try:
        record = await recorded(ledger, pid, n)
    except (NatsError, ValueError):
        return False
    return record is None or (kind == "interrupt" and not record.inflight)
