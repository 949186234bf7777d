"""One router replica on NATS JetStream (see docs/distributed.md).

Ownership: every partition has a durable pull consumer with a `pinned_client` priority
group and `max_ack_pending=1`; every replica pulls from every partition and the server
delivers each partition to one pinned replica at a time, moving the pin when the owner
stops pulling for `failover_timeout`. No lease or election of our own.

State: each participant's record (`<partition>.<token>` in the bucket) holds the router
snapshot and the ids of the turns in flight. A query is marked in flight (a
revision-checked write) before its message is acknowledged, and the record is rewritten
after the exchange finished. A new owner's first write to a participant (its claim) moves
the revision, so every later write of the previous owner is refused: the previous owner
stops serving that participant (fencing). Turns found in flight on takeover end with the
failure text, published under the turn's terminal output id, so the output stream keeps
either the old owner's answer or the failure text, never both.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from ..._contracts import AgentTurn
from ..._exceptions import ContractValueError, LifecycleError
from ..._logging import log_failure
from ..._redact import preview
from ..._router import AgentRouter
from ..._timing import TimingPredictor, TimingSample
from ._backpressure import backpressure
from ._cancel import cancel_and_wait
from ._connection import Connection, Readiness
from ._fleet import (
    Fleet,
    fleet_limits,
    fleet_topic,
    forget_shed,
    hang_up,
    hold_off,
    owner_heard,
    previous_owner_alive,
    unowned,
    valid_replica,
)
from ._idle import IdleSweep
from ._inputs import Inputs, engaged, republish, resend, save_soon
from ._interrupts import FleetInterrupts
from ._ledger import Ledger, Participant, unsaved
from ._link import Link, deliver_directly
from ._mailbox import Mailbox
from ._metrics import RuntimeMetrics, runtime_metrics
from ._mirror import watch_mirror
from ._repin import Letting, lose_pin, repinned
from ._setup import GROUP, api_request
from ._stall import STALL_SECS, StallWatch
from ._takeover import Takeover
from ._wire import Ending, NatsConfig, server_status

__all__ = ["NatsWorker", "WorkerContext"]

logger = logging.getLogger("turnrouter.runtime.nats")

#: Messages one pull request may deliver. The consumer still hands out one at a time
#: (`max_ack_pending=1`): a request waits at the server, and the next message goes to it
#: as soon as the previous one is acknowledged, so a busy partition needs no pull per
#: message.
_BATCH = 256
#: How often a partition whose connection heard nothing lately looks again (`_answering`).
_SILENT_POLL = 0.1


class WorkerContext:
    """What a router factory receives: publish answers, share timing samples.

    `answer(turn, route, text)` publishes a destination's answer as the turn's terminal
    output (deduplicated against the failure text of a replica taking over). Pass
    `timing_sink` to `AgentRouter(timing_sink=...)` and `learn_from_fleet(predictor)` the
    predictor, so every replica's predictor learns every replica's samples.
    """

    def __init__(self, worker: NatsWorker, registry: Any) -> None:
        self._worker = worker
        self.registry = registry
        self.replica = worker.replica
        self.timing_sink = _FleetTimingSink(worker)

    async def answer(self, turn: AgentTurn, route: str, text: str) -> None:
        """The turn's answer: published once the participant's state (with this
        exchange) is written, so a replica taking over publishes it, or the failure text,
        never neither and never both. Outside a running turn it is published at once."""
        await self._worker.inputs.answer(turn, route, text)  # (one coroutine, every turn)

    def learn_from_fleet(self, predictor: TimingPredictor) -> None:
        self._worker._predictors.append(predictor)


class _FleetTimingSink:
    """A `TimingSink` publishing each local sample to the fleet."""

    def __init__(self, worker: NatsWorker) -> None:
        self._worker = worker

    def record(self, sample: TimingSample) -> None:
        fleet = self._worker._fleet  # (none before the worker runs, or after)
        if fleet is not None:
            fleet.send_sample(sample)


RouterFactory = Callable[[WorkerContext], "AgentRouter | Awaitable[AgentRouter]"]


class NatsWorker:
    """One replica: pulls its partitions, runs turns on the factory's router."""

    def __init__(self, factory: RouterFactory, config: NatsConfig, *,
                 registry: Any = None, replica: str | None = None) -> None:
        self.config = config
        self.replica = replica or uuid.uuid4().hex[:12]
        if not valid_replica(self.replica):
            raise ContractValueError("replica must be 1..64 characters of A-Za-z0-9_.:-")
        self._factory = factory
        self._registry = registry
        self._metrics: RuntimeMetrics | None = (
            runtime_metrics(registry) if registry is not None else None)
        self._nc: Client | None = None
        self._connection: Connection | None = None
        self._router: AgentRouter | None = None
        self._pins: dict[int, str] = {}
        self._letting_go: dict[int, Letting] = {}  # pins lost, turns finishing (`_repin`)
        self._ledger: Ledger | None = None
        self._takeover: Takeover | None = None
        self._idle: IdleSweep | None = None
        self._fleet: Fleet | None = None
        self._inputs: Inputs | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._predictors: list[TimingPredictor] = []
        self._stop = asyncio.Event()
        self._pulling = True
        self._inboxes: list[_Inbox] = []
        #: Whether the connection heard from its server lately (every partition's pulls
        #: and `_keep_pins` ask it).
        self._hearing = _Hearing(config.pull_expires + 2 * config.probe_interval)
        self._recovering = False  # a `_recovered` runs (or paces the next one)
        self._recover_again = False  # another came meanwhile: run once more after it
        self.ready = asyncio.Event()  # set once, when it first serves
        self.readiness = Readiness(self._metrics)  # serving now (see `Connection`)

    # ------------------------------------------------------------------ lifecycle
    @property
    def router(self) -> AgentRouter:
        if self._router is None:
            raise LifecycleError("the worker has not built its router yet")
        return self._router

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            raise LifecycleError("the worker is not running")
        return self._ledger

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise LifecycleError("the worker is not running")
        return self._fleet

    @property
    def inputs(self) -> Inputs:
        if self._inputs is None:
            raise LifecycleError("the worker is not running")
        return self._inputs

    @property
    def owned_partitions(self) -> frozenset[int]:
        return frozenset(self._pins)

    def request_stop(self) -> None:
        """Begin the graceful end (SIGTERM): drain, hand partitions over, exit."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until `request_stop()`; then drain and hand the partitions over."""
        config = self.config
        lost = asyncio.Event()
        graceful = False

        async def closed() -> None:
            if not self._stop.is_set():
                lost.set()
                self._stop.set()

        connection = self._connection = Connection(
            config, closed, self._reconnected, dropped=self._dropped,
            readiness=self.readiness, metrics=self._metrics, spawn=self._spawn,
            recovered=self._recovered)
        self._nc = nc = await connection.connect(self.replica)
        loops: list[asyncio.Task[None]] = []
        helpers: list[asyncio.Task[None]] = []
        try:
            bucket = await connection.set_up()
            self._router = router = await _build(self._factory,
                                                 WorkerContext(self, self._registry))
            # The router's own failure text is what a takeover says for a lost turn.
            config = self.config = dataclasses.replace(config,
                                                       failure_text=router.failure_text)
            if self._metrics is not None:
                self._metrics.partitions.set(config.partitions)
            link = Link(nc, self._duplicate_output, connection.suspect)
            await link.start()
            self._ledger = Ledger(bucket, link, config, self.replica, lambda: self.router,
                                  self._publish_ending, self._metrics)
            self._ledger.on_unsure = self._settle_soon
            self._ledger.health.report = functools.partial(self.readiness.update, "writes")
            self._ledger.alive = functools.partial(_owner_alive, self)
            self._ledger.heard = functools.partial(_owner_heard, self)
            self._takeover = Takeover(
                bucket, link, config, self._ledger, lambda: not self._pulling)
            inputs = self._inputs = Inputs(config, router, self._ledger, link,
                                           self._metrics, self._spawn, self._stop.is_set,
                                           self._tasks)
            router.set_control_output(inputs.control_output)
            router.on_participant_changed(inputs.changed)
            listen = await connection.connect_fleet(self.replica)
            self._fleet = Fleet(nc, config, self.replica, lambda: self._pins,
                                lambda: len(self._pins), self._metrics, self._spawn,
                                router.report_rejected, listen=listen,
                                probe=connection.probe)
            self._fleet.predictors = self._predictors
            self._fleet.routes = lambda: router.destinations
            await listen.subscribe(config.interrupt_all_subject, **fleet_limits(config),
                                   cb=FleetInterrupts(config, router, self._spawn).on_message)
            helpers = await self._fleet.start()
            helpers.append(asyncio.create_task(
                _keep_pins(nc, self._inboxes, self._pins, config, lambda: self._pulling,
                           self._hearing),
                name="pins"))
            # The front ends' mirror of the output stream, restarted when it stalls.
            helpers.append(asyncio.create_task(watch_mirror(nc, config, bucket),
                                               name="mirror"))
            helpers.append(asyncio.create_task(resend(inputs), name="resend"))
            if config.replicas > 1:  # a cluster's consumers may stall (`_stall`)
                helpers.append(asyncio.create_task(_stall_watch(self).run(), name="stalls"))
            self._idle = IdleSweep(self._ledger, config.idle_after, config.dedup_window / 2,
                                   functools.partial(engaged, inputs),
                                   router.export_participant_json,
                                   functools.partial(save_soon, inputs),
                                   self._metrics.idle.inc if self._metrics else lambda: None)
            helpers.append(asyncio.create_task(self._idle.run(), name="idle"))
            loops = [asyncio.create_task(self._partition_loop(n), name=f"partition {n}")
                     for n in range(config.partitions)]
            # Our SUBs are on the server (see below) once a request is answered.
            await connection.settle("start-up", nc.jetstream().account_info)
            await connection.settle("start-up", listen.jetstream().account_info)
            self.ready.set()
            self.readiness.update("start", None)
            await self._stop.wait()
            if lost.is_set():
                raise LifecycleError(connection.why_lost())
            await self._shutdown(loops, helpers)
            graceful = True
        finally:
            # (what start-up began too: a start that failed, say its last check of the
            # server, left the presence, probe and partition loops running)
            background = [*self._tasks, *loops, *helpers]
            if self._fleet is not None:
                self._fleet.abandon()
            await _to_the_end(self._release(nc, background, lost.is_set(), graceful))

    async def _release(self, nc: Client, background: list[asyncio.Task[Any]],
                       lost: bool, graceful: bool) -> None:
        """The end of `run`: background tasks cancelled, the router stopped (unless a
        graceful stop did: its tasks, the load sampler say, end with it), the connection
        closed (drained after a start that finished and a server still there)."""
        await cancel_and_wait(background)
        for state in self._ledger.people.values() if self._ledger is not None else ():
            unsaved(state, "the worker stopped first")  # (patch calls still waiting)
        if self._router is not None and not graceful:
            with contextlib.suppress(Exception):
                await self._router.stop()
        if self._fleet is not None:
            await hang_up(self._fleet)
        with contextlib.suppress(Exception):
            if lost or not self.ready.is_set():
                await nc.close()  # nothing to drain to, or nothing served yet
            else:
                await nc.drain()

    async def _shutdown(self, loops: list[asyncio.Task[None]],
                        helpers: list[asyncio.Task[None]]) -> None:
        self.readiness.update("stop", "stopping")  # --ready-file and /ready say so now
        self._pulling = False
        for task in helpers:  # no more presence nor probes
            task.cancel()
        assert self._nc is not None
        # The pins are held from now on: the loops end once every request they sent
        # ended (what those deliver is still run), and until then the server hears no
        # new pull of theirs (it moves a partition after failover_timeout without one).
        holder = asyncio.create_task(_hold_pins(self._nc, self._pins, self.config,
                                                self.inputs.handle), name="holding pins")
        try:
            await asyncio.gather(*loops, return_exceptions=True)
            await self._drain_and_hand_over()
        finally:
            await cancel_and_wait((holder,))
        await self.router.stop()
        await self.fleet.close()
        self._pins.clear()
        self._set_owned()

    async def _drain_and_hand_over(self) -> None:
        await _drain_and_hand_over(self)

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _set_owned(self) -> None:
        if self._metrics is not None:
            self._metrics.partitions_owned.set(len(self._pins))

    # ------------------------------------------------------------------ pulling
    async def _partition_loop(self, n: int) -> None:
        assert self._nc is not None
        nc, config = self._nc, self.config
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(n)}"
        inbox = _Inbox(n, next_subject, nc.new_inbox(), config.pull_expires,
                       self._hearing)
        sub = await nc.subscribe(f"{inbox.reply_prefix}.*", cb=inbox.receive)
        deliver_directly(sub, inbox.take)
        self._inboxes.append(inbox)
        try:
            while self._pulling:
                try:
                    if inbox.renew:  # its pulls went unanswered (`_stall`)
                        sub = await _renewed(nc, inbox, sub)
                    await self._pull_once(n, nc, inbox)
                except Exception as exc:
                    # The loop outlives any one failure: a message not acknowledged
                    # comes back (and ends with the failure text if it was a query).
                    log_failure("partition %d: pull", exc, n, log=logger)
                    await asyncio.sleep(0.1)
            # A graceful stop: what the requests still waiting at the server deliver
            # (a keep-alive pull's) is run here, not left to come back to the next
            # owner as a redelivery (a redelivered query ends with the failure text).
            while (left := inbox.waiting_for()) > 0:
                got = await inbox.get(left)
                if got is not None:
                    await self._take(n, inbox, *got)
        finally:
            self._inboxes.remove(inbox)
            await sub.unsubscribe()

    async def _pull_once(self, n: int, nc: Client, inbox: _Inbox) -> None:
        """One pull request on partition `n` and the messages it delivers (one at a
        time: the next comes once this one is acknowledged), or a wait while balance
        says not to pull (reading what earlier requests still deliver)."""
        config = self.config
        inbox.holding = False
        idle = self._idle
        if idle is not None and n in idle.due and n in self._pins:  # (between messages)
            await idle.let_go(n)
        share = self.fleet.fair_share()
        # Only once no request of ours is waiting at the server, nor anything they
        # delivered unread: a message arriving after the handover would sit here unread
        # while its acknowledgment's time ran out (ack_wait), and the next owner, seeing
        # delivery 2, ends it with the failure text unrun.
        if (n in self._pins and len(self._pins) > share and inbox.quiet()
                and await self._shed(n)):
            return
        if n not in self._pins and n not in self._letting_go and await self.fleet.leave_alone(
                n, len(self._pins)):  # (a lost pin is asked again at once: `_repin`)
            got = await inbox.get(config.probe_interval)
            if got is not None:  # (a request sent before: it may have been pinned)
                await self._take(n, inbox, *got)
            return
        if not nc.is_connected:
            # A pull now would wait in the client's buffer, reach a restarted server
            # first and take a partition its previous owner asks for again (`_repin`).
            await _answering(self, n, nc, inbox)
            return
        if not self._pulling or (inbox.hearing.silent(nc)
                                 and not await _answering(self, n, nc, inbox)):
            return  # stopping (SIGTERM during a slow check above), or nothing heard
        pin = self._pins.get(n)
        token, reply = inbox.request(pin)
        inbox.current = token  # (a status of another request costs no pause, `_status`)
        await nc.publish(inbox.next_subject, inbox.pull_body(pin), reply=reply)
        inbox.pulled = time.monotonic()
        delivered = 0
        while delivered < _BATCH:
            inbox.holding = False
            got = await inbox.get(inbox.reply_wait())
            if got is None:
                return  # a lost reply (reconnect): ask again
            # `_keep_pins` pulls while a message is handled, not a status (a pull answered
            # 503 paused here while keep-alives, each answered 503, queued faster than
            # the loop read them: minutes of stale replies, no pull of its own).
            inbox.holding, inbox.held_since = server_status(got[0]) is None, time.monotonic()
            ended = await self._take(n, inbox, *got)
            if ended is None:
                delivered += 1
            elif ended == token:
                return
        inbox.forget(token)  # its whole batch delivered: it waits no more

    async def _take(self, n: int, inbox: _Inbox, msg: Msg, received: float) -> str | None:
        """One reply to a pull request of partition `n`: a message is run (the pin it
        carries taken first), a status ends its request. Returns the token of the
        request a status ended (None for a message)."""
        headers = msg.headers
        if headers:
            status = headers.get("Status")
            if status is not None and not msg.reply:  # (a stream's message has its ack)
                token, pin = inbox.ended(msg.subject)
                await _status(self, n, status, pin, pause=token == inbox.current)
                return token
            new_pin = headers.get("Nats-Pin-Id")
            if new_pin is not None and new_pin != self._pins.get(n):
                await repinned(self, n, new_pin)  # (its participants kept if still ours)
        nc, config = self._nc, self.config
        assert nc is not None
        if self.router.busy and n in self._pins and await backpressure(
                nc, config, self.router, self._metrics, msg):
            return None
        await self.inputs.handle(n, msg, n in self._pins, received)
        return None

    async def _shed(self, n: int) -> bool:
        return await _shed(self, n)

    async def _hand_over(self, n: int, wait: float | None = None) -> bool:
        """Give partition `n` away without failure text: let its turns finish (their
        state is written; within `wait` seconds, else keep it: False; `drain_timeout`
        without `wait`), drop its participants, then unpin it for the next puller."""
        pids = self.ledger.of_partition(n)
        turns = [t for p in pids for t in self.inputs.turns_of.of(p) if not t.done()]
        if turns:
            _, pending = await asyncio.wait(
                turns, timeout=self.config.drain_timeout if wait is None else wait)
            if pending and wait is not None:
                return False
        self._pins.pop(n, None)
        self._set_owned()
        self.ledger.partition_lost(n)
        for pid in self.ledger.of_partition(n):  # with any claimed meanwhile
            await self.ledger.drop(pid)
        assert self._nc is not None
        with contextlib.suppress(Exception):
            await api_request(self._nc, f"$JS.API.CONSUMER.UNPIN.{self.config.stream}."
                              f"{self.config.consumer(n)}", {"group": GROUP})
        if self._metrics is not None:
            self._metrics.partitions_lost.labels("handed_over").inc()
        return True

    # ------------------------------------------------------------------ ownership
    async def _lose(self, n: int, how: str) -> None:
        """The pin of partition `n` moved away: stop serving its participants once
        their turns ended, unless it comes back first (`_repin`)."""
        await lose_pin(self, n, how)

    def _take_over(self, n: int) -> None:
        """End the turns a previous owner left unfinished on partition `n`, beside the
        partition's loop: a scan of thousands of records must not stop the pulls, or the
        server moves the pin again (`failover_timeout`) and the takeover repeats."""
        if self._metrics is not None:
            self._metrics.takeovers.inc()
        self.ledger.grace.pop(n, None)  # a new wait for its live previous owners
        self.ledger.arrived[n] = asyncio.get_running_loop().time()
        assert self._takeover is not None
        self._spawn(self._takeover.scan(n), f"takeover {n}")

    # ------------------------------------------------------------------ outputs
    async def _publish_ending(self, pid: str, state: Participant, ending: Ending) -> None:
        await self.inputs.publish_ending(pid, state, ending)

    def _duplicate_output(self) -> None:
        if self._metrics is not None:
            self._metrics.duplicates.labels("output").inc()

    def _reconnected(self) -> None:
        """Back on a server that may have lost what was sent before it went away: publish
        again what it did not acknowledge, pull every partition at once."""
        _back(self, reconnected=True)

    def _recovered(self) -> None:
        """JetStream answers again after "no responders" on a live connection (a
        cluster's leader election): the same, but nothing sent before is forgotten (the
        connection and the replies it awaits stayed); at most once a second (a stream
        still without a leader answers the republish with another 503): one asked for
        meanwhile runs after that second, not never (what the stream refused during
        the last one would wait for a reconnect)."""
        if self._recovering:
            self._recover_again = True
        else:
            self._recovering = True
            _back(self, reconnected=False)

    def _settle_soon(self, pid: str, n: int) -> None:
        self._spawn(self.ledger.settle_unsure(pid, n), "unsure")

    # ------------------------------------------------------------------ fleet-wide
    def _dropped(self, subject: str) -> None:
        """nats-py dropped a message of a fleet subject whose queue was full (a flood,
        `NatsConfig.fleet_backlog`): counted as `dropped` under the subject's topic."""
        if self._router is not None:
            self._router.report_rejected(fleet_topic(self.config, subject), "dropped")


def _stall_watch(worker: NatsWorker) -> StallWatch:
    """The watch of the partitions whose consumer may have stalled (`_stall`)."""
    assert worker._nc is not None and worker._fleet is not None
    fleet = worker._fleet

    def unanswered(secs: float) -> list[int]:
        now = time.monotonic()
        return [inbox.partition for inbox in worker._inboxes
                if inbox.pulled > inbox.replied and now - inbox.replied > secs]

    def nudge(n: int) -> str:
        inbox = next((i for i in worker._inboxes if i.partition == n), None)
        forget_shed(fleet, n)
        if inbox is None:
            return "this replica has no loop for it"
        now = time.monotonic()
        silent = now - inbox.replied
        inbox.renew = inbox.pulled > inbox.replied and silent > STALL_SECS
        inbox.wake()
        return (f"this replica pulled it {now - inbox.pulled:.1f} s ago, heard a reply "
                f"{silent:.1f} s ago, {'holds' if n in worker._pins else 'holds no'} "
                f"pin{', pulls on a new reply subject' if inbox.renew else ''}")

    return StallWatch(worker._nc, worker.config, unanswered=unanswered,
                      owned=lambda: worker._pins, unowned=lambda: unowned(fleet),
                      nudge=nudge, metrics=worker._metrics)


def _back(worker: NatsWorker, *, reconnected: bool) -> None:
    """`_reconnected` / `_recovered`: endings the streams did not acknowledge published
    again (a crash may have lost them, a leaderless stream refused them), unsure
    participants settled, every partition pulled at once."""
    if worker._inputs is not None:
        worker._spawn(_republish(worker, worker._inputs, reconnected), "republish")
    else:
        worker._recovering = False
    if worker._ledger is not None:
        for pid, n in list(worker._ledger.unsure.items()):
            worker._settle_soon(pid, n)
    for inbox in worker._inboxes:
        inbox.reconnected()


async def _republish(worker: NatsWorker, inputs: Inputs, reconnected: bool) -> None:
    again = False
    try:
        await republish(inputs, reconnected=reconnected)
        if not reconnected:
            await asyncio.sleep(1.0)  # the pace of `_recovered`
            again, worker._recover_again = worker._recover_again, False
    finally:
        if not reconnected:
            worker._recovering = False
    if again:
        worker._recovered()


async def _build(factory: RouterFactory, ctx: WorkerContext) -> AgentRouter:
    """The router `factory` makes (sync or async), or an error of the start-up."""
    try:
        built = factory(ctx)
        router = await built if inspect.isawaitable(built) else built
    except (SystemExit, KeyboardInterrupt) as exc:
        # `sys.exit("missing setting")` in a factory (or its argparse): an error of the
        # start-up, not a stop of the event loop with a traceback.
        raise LifecycleError(f"the router factory raised {type(exc).__name__}"
                             f"({preview(exc.args[0]) if exc.args else ''})") from None
    if not isinstance(router, AgentRouter):
        raise ContractValueError(
            f"the router factory must return an AgentRouter, got {type(router).__name__}")
    registry = ctx.registry
    if registry is not None and registry.get_sample_value(_ROUTER_GAUGE) is None:
        # Said once at start: /metrics then serves only turnrouter_nats_*, and the
        # router's own families (turns, latency, overload) are missing without a word.
        logger.warning("turnrouter: the router's metrics are not in this worker's registry: "
                       "its /metrics serves only turnrouter_nats_*; build the router's "
                       "Telemetry with registry=ctx.registry (ignore this if its telemetry "
                       "is off on purpose)")
    return router


#: A family every router with metrics registers (at construction, value 0).
_ROUTER_GAUGE = "turnrouter_active_participants"


async def _to_the_end(work: Awaitable[None]) -> None:
    """Await `work` to its end even when cancelled meanwhile, then re-raise the
    cancellation. A start-up cancelled by SIGTERM is cancelled again and again until it
    ends (`turnrouter worker`): cancelling the connection's close or drain half-way left
    nats-py's futures to log an InvalidStateError and a never-retrieved exception."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


_NO_BODY = object()


class _Inbox(Mailbox[tuple[Msg, float]]):
    """What one partition's pull requests deliver, in order, with when each arrived
    (filled by the subscription's callback, read by the partition's loop).

    Each request has its own reply subject (`request`), so a status names the request it
    ends and the pin that request carried: several may wait at the server at once (the
    loop's and `_keep_pins`' pulls; after a reconnect, those sent while the server was
    away as well), and a 423 answers one of them, maybe made with a pin since replaced.
    `live` holds the requests not yet ended, each with when it surely expired."""

    __slots__ = ("_body", "_body_pin", "back", "current", "expires", "given_up", "hearing",
                 "held_since", "holding", "lifetime", "live", "next_subject", "partition",
                 "pulled", "renew", "replied", "reply_prefix", "tokens")

    def __init__(self, partition: int, next_subject: str, reply_prefix: str,
                 expires: float, hearing: _Hearing | None = None) -> None:
        super().__init__()
        #: Whether the connection hears from the server (the worker's, shared).
        self.hearing = hearing if hearing is not None else _Hearing(expires + 1.0)
        self.partition, self.next_subject, self.reply_prefix = (
            partition, next_subject, reply_prefix)
        #: How long after it went out a request may still deliver: its `expires` and a
        #: margin for the way there and the server's own lag.
        self.lifetime = 2 * expires + 1.0
        self.expires = expires
        self._body = b""  # the last pull request's body, and the pin it names
        self._body_pin: object = _NO_BODY
        self.pulled = time.monotonic()  # when the partition's last pull request went out
        #: When the last reply arrived (a message, a status other than 503 "no
        #: responders", which says no consumer leader got the pull).
        self.replied = self.pulled
        self.renew = False  # pull on a new reply subject from the next pull on
        self.holding = False  # its loop is busy with one message and pulls no more
        self.held_since = 0.0  # since when
        self.given_up = -1.0  # the `held_since` of a message held too long to keep the pin
        self.live: dict[str, tuple[str | None, float]] = {}  # token -> (pin, expired by)
        self.tokens = 0
        self.back = -math.inf  # when the connection last came back (`reply_wait`)
        self.current = ""  # the token of the loop's own last request

    async def receive(self, msg: Msg) -> None:
        self.take(msg)

    def take(self, msg: Msg) -> None:
        now = time.monotonic()
        headers = msg.headers
        if not (headers and headers.get("Status") == "503"):  # (503: no leader got it)
            self.replied = now
        self.put((msg, now))

    def request(self, pin: str | None) -> tuple[str, str]:
        """A new request's token and reply subject; it is live until a status ends it
        or its time passed. A request may end without a status (a keep-alive pull that
        delivered its one message, one lost with a restarted server): those past their
        time are dropped here, so `live` holds only requests of the last few seconds."""
        now = self._prune()
        self.tokens += 1
        token = str(self.tokens)
        self.live[token] = (pin, now + self.lifetime)
        return token, f"{self.reply_prefix}.{token}"

    def pull_body(self, pin: str | None) -> bytes:
        """The body of a pull request of up to `_BATCH` messages lasting `expires`, in
        the priority group, with `pin` (if any): the same bytes for every pull with the
        same pin, so made again only when the pin changes (40 pulls a second idle)."""
        if pin != self._body_pin:
            request: dict[str, Any] = {"batch": _BATCH, "expires": int(self.expires * 1e9),
                                       "group": GROUP}
            if pin is not None:
                request["id"] = pin
            self._body, self._body_pin = json.dumps(request).encode(), pin
        return self._body

    def ended(self, subject: str) -> tuple[str, str | None]:
        """The request a status arrived on (its reply `subject`) ended: its token and
        the pin it carried (None: none, or a request already forgotten)."""
        token = subject.rsplit(".", 1)[-1]
        pin, _ = self.live.pop(token, (None, 0.0))
        return token, pin

    def forget(self, token: str) -> None:
        self.live.pop(token, None)

    def _prune(self) -> float:
        """Forget the requests past their time; the current time. `live` is in the order
        of those times (a request is added with now + `lifetime`; `reconnected` moves
        every one to the same later time), so the expired ones lead: each pull reads one
        live request past them, not all."""
        now = time.monotonic()
        live = self.live
        while live:
            token = next(iter(live))
            if live[token][1] > now:
                break
            del live[token]
        return now

    def waiting_for(self) -> float:
        """Seconds until every live request surely expired (0: none live)."""
        now = self._prune()
        return max((until for _, until in self.live.values()), default=now) - now

    def quiet(self) -> bool:
        """No request of ours may deliver any more, and nothing delivered is unread."""
        return not self.waiting_for() and not self._items

    def reconnected(self) -> None:
        """Back on a server: what was published while it was away went out just now
        (their time starts again), and the loop asks again at once."""
        self.back = time.monotonic()
        until = self.back + self.lifetime
        self.live = {token: (pin, max(end, until)) for token, (pin, end) in self.live.items()}
        self.wake()

    def reply_wait(self) -> float:
        """How long the loop waits for a reply to its pull before it asks again: its
        `expires` and 2 s (a loaded server replies late); 0.5 s past `expires` within a
        request's lifetime of a reconnect (a restarted server drops, without a reply, a
        pull that comes before its JetStream is up: the previous owner of a partition,
        its pin refused, asked again 2.4 s later, after the others had taken the
        partition, `_repin`)."""
        return self.expires + (0.5 if time.monotonic() - self.back < self.lifetime else 2.0)


async def _renewed(nc: Client, inbox: _Inbox, sub: Any) -> Any:
    """`inbox`'s subscription made again on a new reply subject (its pulls went
    unanswered: a server that lost the interest of the old subject drops them without
    a word); the requests sent on the old one are forgotten."""
    prefix = nc.new_inbox()
    renewed = await nc.subscribe(f"{prefix}.*", cb=inbox.receive)  # (raises: again)
    deliver_directly(renewed, inbox.take)
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
    inbox.reply_prefix, inbox.renew = prefix, False
    inbox.live.clear()
    return renewed


def _heard(nc: Client) -> tuple[int, int]:
    """What the connection heard so far: (messages received, reconnects)."""
    stats = nc.stats
    return int(stats.get("in_msgs", 0)), int(stats.get("reconnects", 0))


class _Hearing:
    """Whether a connection heard from its server lately: a message (a pull's reply,
    the answer to the fleet's echo every `probe_interval`) within `pull_expires` plus two
    probe periods, or a reconnect. Sampled by every pull and every `_keep_pins` tick."""

    __slots__ = ("_at", "_seen", "quiet_after")

    def __init__(self, quiet_after: float) -> None:
        self.quiet_after = quiet_after
        self._seen = (-1, -1)
        self._at = time.monotonic()

    def silent(self, nc: Client) -> bool:
        now, heard = time.monotonic(), _heard(nc)
        if heard != self._seen:
            self._seen, self._at = heard, now
        return now - self._at > self.quiet_after


async def _answering(worker: NatsWorker, n: int, nc: Client, inbox: _Inbox) -> bool:
    """Whether partition `n` may pull now from a connection that heard nothing from
    its server lately (a frozen server, not yet known lost): once it hears something
    again or is replaced (False meanwhile, after a short wait that runs what arrived).
    A pull sent to a frozen server waits in its socket: when the server resumes, the
    worker has moved to a new connection, and the server reads the old one's pull
    before its end. A pull without a pin (a partition not owned here, pulled when the
    check that it is pinned elsewhere timed out) was then pinned (the priority group's
    pin, for `failover_timeout`) to a connection about to close, and a message it took
    came back as a redelivery: the partition's queries, published right after the
    thaw, waited one to three seconds (chaos15 `server_long_stop`)."""
    got = await inbox.get(_SILENT_POLL)  # (ended at once by a reconnect)
    if got is not None:
        await worker._take(n, inbox, *got)
        return False
    return not inbox.hearing.silent(nc)


async def _drain_and_hand_over(worker: NatsWorker) -> None:
    """A graceful stop: each partition handed over as soon as its own turns ended (at
    once for one with none running: its participants wait for no one else's long turn);
    after `drain_timeout` the turns still running are cut and the rest handed over."""
    router, loop = worker.router, asyncio.get_running_loop()
    deadline = loop.time() + worker.config.drain_timeout
    await asyncio.gather(*(_hand_over_when_idle(worker, n, deadline)
                           for n in sorted(worker._pins)))
    try:
        async with asyncio.timeout_at(deadline):
            await router.drain()
    except TimeoutError:
        # Cut the turns still running: each ends with the failure text (_inputs).
        logger.warning("turnrouter: drain took over %.1f s; interrupting the turns "
                       "still running", worker.config.drain_timeout)
        await router.interrupt(None)
    pending = [t for t in worker._tasks if not t.done()]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.gather(*(worker._hand_over(n) for n in sorted(worker._pins)))


async def _shed(worker: NatsWorker, n: int) -> bool:
    """Balance: hand partition `n` over if a peer is below its share (True: gone); a
    busy one waits at most `fleet.shed_wait` for its turns (its next inputs, a barge-in
    too, wait as long; the pin is kept meanwhile), else stays."""
    turns_of = worker.inputs.turns_of  # busy: a turn of one of its participants runs
    busy = any(turns_of.of(pid) for pid in worker.ledger.of_partition(n))
    fleet, pins = worker.fleet, worker._pins
    if not fleet.may_shed(busy):
        return False
    if busy:  # one busy handover at a time: others' inputs do not stall with it
        hold_off(fleet, fleet.shed_wait + 1.0)
    holder = None
    if busy and n in pins and fleet.shed_wait > worker.config.pull_expires:
        assert worker._nc is not None  # (longer than a pull lasts: the pin is held)
        holder = asyncio.create_task(_hold_pins(
            worker._nc, _OnePin(pins, n), worker.config, worker.inputs.handle),
            name="shed hold")  # (live: it stops before the unpin)
    try:
        gone = await worker._hand_over(n, fleet.shed_wait if busy else None)
    finally:
        if holder is not None:
            await cancel_and_wait((holder,))
    if not gone:
        fleet.handover_aborted()
        return False
    fleet.handed_over(n)
    return True


async def _hand_over_when_idle(worker: NatsWorker, n: int, deadline: float) -> None:
    """Partition `n` handed over once its participants' turns ended, if by `deadline`
    (a graceful stop; what is left after it goes once the router's drain is cut)."""
    loop, turns_of = asyncio.get_running_loop(), worker.inputs.turns_of
    turns = [t for p in worker.ledger.of_partition(n) for t in turns_of.of(p)
             if not t.done()]
    if turns:
        _, pending = await asyncio.wait(turns, timeout=max(0.0, deadline - loop.time()))
        if pending:
            return
    if n in worker._pins:  # (a turn started meanwhile gets the time left)
        await worker._hand_over(n, max(0.0, deadline - loop.time()))


class _OnePin(Mapping[int, str]):
    """The pin of one partition in `pins`, live (gone once it leaves `pins`)."""

    def __init__(self, pins: dict[int, str], n: int) -> None:
        self._pins, self._n = pins, n

    def __getitem__(self, n: int) -> str:
        if n != self._n:
            raise KeyError(n)
        return self._pins[n]

    def __iter__(self) -> Iterator[int]:
        return iter((self._n,) if self._n in self._pins else ())

    def __len__(self) -> int:
        return int(self._n in self._pins)


async def _hold_pins(nc: Client, pins: Mapping[int, str], config: NatsConfig,
                     handle: Callable[[int, Msg, bool, float], Awaitable[None]]) -> None:
    """During a graceful stop, keep each partition's pin until it is handed over: the
    turns still running finish here (a server that moved the partition after
    `failover_timeout` gave it to a new owner whose takeover ended them with the failure
    text). Every half `pull_expires` each partition still pinned gets a pull that can
    deliver nothing (`max_bytes` 1: the server answers 409 and keeps the message); a
    message it delivers all the same is run, not left to come back as a redelivery."""
    expires = int(config.pull_expires * 1e9)
    subscriptions: dict[int, tuple[str, Any]] = {}

    def receiver(n: int) -> Callable[[Msg], Awaitable[None]]:
        async def receive(msg: Msg) -> None:
            if server_status(msg) is None:
                await handle(n, msg, n in pins, time.monotonic())
        return receive

    try:
        while True:
            for n, pin in list(pins.items()):
                if n not in subscriptions:
                    inbox = nc.new_inbox()
                    subscriptions[n] = inbox, await nc.subscribe(inbox, cb=receiver(n))
                request = {"batch": 1, "max_bytes": 1, "expires": expires, "group": GROUP,
                           "id": pin}
                try:
                    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}."
                                     f"{config.consumer(n)}", json.dumps(request).encode(),
                                     reply=subscriptions[n][0])
                except Exception as exc:  # closed or reconnecting: tried again below
                    logger.debug("turnrouter: a pin-holding pull failed: %r", exc)
            await asyncio.sleep(config.pull_expires / 2)
    finally:
        for _, subscription in subscriptions.values():
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()


async def _keep_pins(nc: Client, inboxes: list[_Inbox], pins: dict[int, str],
                     config: NatsConfig, pulling: Callable[[], bool],
                     hearing: _Hearing) -> None:
    """Keep the pins of partitions whose loop is busy with one message (a claim or a
    write waiting on a loaded server, backpressure): the server moves a partition to
    another replica once its owner sent no pull request for `failover_timeout`, so
    every half `pull_expires` each held partition gets a one-message request with its
    pin, lasting `pull_expires` (so one is always waiting at the server; what it
    delivers goes to the loop, in order). Not past `drain_timeout` on one message: a
    loop stuck that long lets the server give the partition to another replica."""
    expires = int(config.pull_expires * 1e9)
    while pulling():
        await asyncio.sleep(config.pull_expires / 2)
        now = time.monotonic()
        if hearing.silent(nc):
            continue  # nothing into a frozen server's socket (`_answering`)
        for inbox in inboxes:
            pin = pins.get(inbox.partition)
            if pin is None or not inbox.holding or now - inbox.pulled < config.pull_expires / 4:
                continue
            if now - inbox.held_since > config.drain_timeout:
                if inbox.held_since != inbox.given_up:  # logged once per stuck message
                    inbox.given_up = inbox.held_since
                    logger.warning("turnrouter: partition %d: one message held for over "
                                   "%g s (drain_timeout); letting the partition go",
                                   inbox.partition, config.drain_timeout)
                continue
            inbox.pulled = now
            request = {"batch": 1, "expires": expires, "group": GROUP, "id": pin}
            _, reply = inbox.request(pin)  # (its replies go to the loop, in order)
            try:
                await nc.publish(inbox.next_subject, json.dumps(request).encode(),
                                 reply=reply)
            except Exception as exc:  # closed or reconnecting: the loop pulls again then
                logger.debug("turnrouter: a keep-alive pull failed: %r", exc)


# Readiness (`NatsWorker.run`) waits for a request, not `flush()`. nats-py writes its
# PING ahead of the commands it still buffers, so the PONG may beat the SUBs (the first
# fleet messages after "ready" were lost now and then); a request travels behind them,
# and the server answers one connection's commands in order.


async def _status(worker: NatsWorker, n: int, status: str, pin: str | None, *,
                  pause: bool = True) -> None:
    """A pull request (made with `pin`) ended with a status instead of a message; an
    unexpected one pauses the loop (`pull_failed`) when `pause` (the loop's own current
    request: another's, a keep-alive's or one sent before, is only counted)."""
    if status == "423":  # Nats-Pin-Id mismatch: the pin moved away
        # Only when the request carried the pin held now: a request made with a pin
        # since replaced (one of several waiting at the server after a reconnect)
        # is refused after the partition was pinned here afresh, and a running turn
        # of the new pin must not end for it.
        if pin is not None and pin == worker._pins.get(n):
            await worker._lose(n, "lost")
        else:
            logger.debug("turnrouter: partition %d: a 423 of a request made with a "
                         "pin no longer held", n)
    elif status not in ("404", "408", "409", "100") and worker._connection is not None:
        await worker._connection.pull_failed(n, status, pause=pause)  # logged rarely
    if status == "409":
        await asyncio.sleep(0.05)


async def _owner_alive(worker: NatsWorker, replica: str) -> bool:
    """`previous_owner_alive` of the worker's fleet (False before it has one)."""
    fleet = worker._fleet
    return fleet is not None and await previous_owner_alive(fleet, replica)


def _owner_heard(worker: NatsWorker, replica: str) -> bool | None:
    """`owner_heard` of the worker's fleet (None before it has one)."""
    fleet = worker._fleet
    return None if fleet is None else owner_heard(fleet, replica)
