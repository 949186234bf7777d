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
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

import nats

from ..._contracts import AgentTurn
from ..._exceptions import (
    ContractValueError,
    LifecycleError,
    TurnInterrupted,
)
from ..._router import AgentRouter
from ..._timing import TimingPredictor, TimingSample
from .._messages import ResponseOutput, UserQuery
from ._fleet import Fleet
from ._ledger import Ledger, Participant
from ._metrics import RuntimeMetrics, runtime_metrics
from ._setup import GROUP, api_request, ensure_deployment
from ._wire import (
    Ending,
    NatsConfig,
    Rejected,
    output_message_id,
    parse_input,
)

__all__ = ["NatsWorker", "WorkerContext"]

logger = logging.getLogger("turnrouter.runtime.nats")

_RECENT = 4096  # bound of the handled-input id memory (duplicates beyond it are re-run)
_RECONNECTS = 120  # reconnect attempts (0.5 s apart) after the first connection


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
        await self._worker._answer(turn, route, text)

    def learn_from_fleet(self, predictor: TimingPredictor) -> None:
        self._worker._predictors.append(predictor)


class _FleetTimingSink:
    """A `TimingSink` publishing each local sample to the fleet."""

    def __init__(self, worker: NatsWorker) -> None:
        self._worker = worker

    def record(self, sample: TimingSample) -> None:
        self._worker._send_sample(sample)


class _Recent:
    """The last `bound` handled input ids (duplicates older than that run again; the
    input stream's own deduplication window covers republished ids)."""

    def __init__(self, bound: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._bound = bound

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._ids

    def add(self, message_id: str) -> None:
        self._ids[message_id] = None
        if len(self._ids) > self._bound:
            self._ids.popitem(last=False)


class _TurnIndex:
    """Running turn tasks by participant (entries go when their last task ends)."""

    def __init__(self) -> None:
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}

    def of(self, pid: str) -> tuple[asyncio.Task[None], ...]:
        return tuple(self._tasks.get(pid, ()))

    def add(self, pid: str, task: asyncio.Task[None]) -> None:
        self._tasks.setdefault(pid, set()).add(task)
        task.add_done_callback(functools.partial(self._done, pid))

    def _done(self, pid: str, task: asyncio.Task[None]) -> None:
        tasks = self._tasks.get(pid)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[pid]


RouterFactory = Callable[[WorkerContext], "AgentRouter | Awaitable[AgentRouter]"]


class NatsWorker:
    """One replica: pulls its partitions, runs turns on the factory's router."""

    def __init__(self, factory: RouterFactory, config: NatsConfig, *,
                 registry: Any = None, replica: str | None = None) -> None:
        self.config = config
        self.replica = replica or uuid.uuid4().hex[:12]
        self._factory = factory
        self._registry = registry
        self._metrics: RuntimeMetrics | None = (
            runtime_metrics(registry) if registry is not None else None)
        self._nc: Client | None = None
        self._router: AgentRouter | None = None
        self._pins: dict[int, str] = {}
        self._ledger: Ledger | None = None
        self._fleet: Fleet | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._recent = _Recent(_RECENT)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._predictors: list[TimingPredictor] = []
        self._stop = asyncio.Event()
        self._turns_of = _TurnIndex()
        self._held: dict[str, Ending] = {}
        self._held_trace: dict[str, dict[str, str]] = {}
        self._pulling = True
        self.ready = asyncio.Event()

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
    def owned_partitions(self) -> frozenset[int]:
        return frozenset(self._pins)

    def request_stop(self) -> None:
        """Begin the graceful end (SIGTERM): drain, hand partitions over, exit."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until `request_stop()`; then drain and hand the partitions over."""
        config = self.config
        lost = asyncio.Event()

        async def closed() -> None:
            if not self._stop.is_set():
                lost.set()
                self._stop.set()

        self._nc = await _connect(config, self.replica, closed)
        nc = self._nc
        try:
            await ensure_deployment(nc, config)
            built = self._factory(WorkerContext(self, self._registry))
            router = await built if inspect.isawaitable(built) else built
            if not isinstance(router, AgentRouter):
                raise ContractValueError(
                    f"the router factory must return an AgentRouter, got "
                    f"{type(router).__name__}")
            self._router = router
            # The router's own failure text is what a takeover says for a lost turn.
            config = self.config = dataclasses.replace(config,
                                                       failure_text=router.failure_text)
            router.set_control_output(self._control_output)
            if self._metrics is not None:
                self._metrics.partitions.set(config.partitions)
            self._ledger = Ledger(await nc.jetstream().key_value(config.bucket), config,
                                  self.replica, lambda: self.router, self.publish_output,
                                  self._metrics)
            self._fleet = Fleet(nc, config, self.replica, lambda: self._pins,
                                lambda: len(self._pins), self._metrics, self._spawn,
                                router.report_rejected)
            self._fleet.predictors = self._predictors
            await nc.subscribe(config.interrupt_all_subject, cb=self._on_interrupt_all)
            helpers = await self._fleet.start()
            loops = [asyncio.create_task(self._partition_loop(n), name=f"partition {n}")
                     for n in range(config.partitions)]
            self.ready.set()
            await self._stop.wait()
            if lost.is_set():
                raise LifecycleError(f"lost the connection to NATS at {config.url}")
            await self._shutdown(loops, helpers)
        finally:
            background = [*self._tasks, *loops, *helpers] if self.ready.is_set() \
                else list(self._tasks)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if self._router is not None and lost.is_set():
                with contextlib.suppress(Exception):
                    await self._router.stop()
            with contextlib.suppress(Exception):
                await nc.drain()

    async def _shutdown(self, loops: list[asyncio.Task[None]],
                        helpers: list[asyncio.Task[None]]) -> None:
        self._pulling = False
        for task in helpers:  # no more presence nor probes
            task.cancel()
        # Outstanding pulls expire within pull_expires; what they deliver is still run.
        await asyncio.gather(*loops, return_exceptions=True)
        router = self.router
        try:
            async with asyncio.timeout(self.config.drain_timeout):
                await router.drain()
        except TimeoutError:
            # Cut the turns still running: each ends with the failure text (_turn).
            logger.warning("turnrouter: drain took over %.1f s; interrupting the turns "
                           "still running", self.config.drain_timeout)
            await router.interrupt(None)
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(self._hand_over(n) for n in sorted(self._pins)))
        await router.stop()
        self._pins.clear()
        self._set_owned()

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
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def put(msg: Msg) -> None:
            queue.put_nowait(msg)

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=put)
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{config.stream}.{config.consumer(n)}"
        expires = int(config.pull_expires * 1e9)
        try:
            while self._pulling:
                try:
                    await self._pull_once(n, nc, queue, inbox, next_subject, expires)
                except Exception:
                    # The loop outlives any one failure: a message not acknowledged
                    # comes back (and ends with the failure text if it was a query).
                    logger.exception("turnrouter: partition %d: pull failed", n)
                    await asyncio.sleep(0.1)
        finally:
            await sub.unsubscribe()

    async def _pull_once(self, n: int, nc: Client, queue: asyncio.Queue[Msg], inbox: str,
                         next_subject: str, expires: int) -> None:
        """One pull on partition `n` (or a pause while balance says not to pull)."""
        config = self.config
        share = self.fleet.fair_share()
        if n in self._pins and len(self._pins) > share and self.fleet.may_shed():
            await self._hand_over(n)
            return
        if n not in self._pins and len(self._pins) >= share and (
                await self.fleet.pinned_elsewhere(n)):
            await asyncio.sleep(self.config.probe_interval)
            return
        request: dict[str, Any] = {"batch": 1, "expires": expires, "group": GROUP}
        pin = self._pins.get(n)
        if pin is not None:
            request["id"] = pin
        await nc.publish(next_subject, json.dumps(request).encode(), reply=inbox)
        try:
            msg = await asyncio.wait_for(queue.get(), config.pull_expires + 2.0)
        except TimeoutError:
            return  # a lost reply (reconnect): ask again
        status = (msg.headers or {}).get("Status")
        if status is not None:
            if status == "423":  # Nats-Pin-Id mismatch: the pin moved away
                await self._lose(n, "lost")
            elif status not in ("404", "408", "409", "100"):
                logger.warning("turnrouter: pull on partition %d: status %s", n,
                               status)
            if status == "409":
                await asyncio.sleep(0.05)
            return
        new_pin = (msg.headers or {}).get("Nats-Pin-Id")
        if new_pin is not None and new_pin != self._pins.get(n):
            if n in self._pins:
                await self._lose(n, "lost")
            self._pins[n] = new_pin
            self._set_owned()
            await self._take_over(n)
        await self._handle(n, msg)

    async def _hand_over(self, n: int) -> None:
        """Give partition `n` away without failure text: let its turns finish (their
        state is written), drop its participants, then unpin it for the next puller."""
        pids = self.ledger.of_partition(n)
        turns = [t for p in pids for t in self._turns_of.of(p) if not t.done()]
        if turns:
            await asyncio.wait(turns, timeout=self.config.drain_timeout)
        self._pins.pop(n, None)
        self._set_owned()
        for pid in pids:
            await self.ledger.drop(pid)
        assert self._nc is not None
        with contextlib.suppress(Exception):
            await api_request(self._nc, f"$JS.API.CONSUMER.UNPIN.{self.config.stream}."
                              f"{self.config.consumer(n)}", {"group": GROUP})
        if self._metrics is not None:
            self._metrics.partitions_lost.labels("handed_over").inc()

    async def _ack(self, msg: Msg, how: bytes = b"+ACK") -> None:
        if msg.reply:
            assert self._nc is not None
            with contextlib.suppress(NatsError):
                await self._nc.publish(msg.reply, how)

    # ------------------------------------------------------------------ ownership
    async def _lose(self, n: int, how: str) -> None:
        """The pin of partition `n` moved away: stop serving its participants."""
        self._pins.pop(n, None)
        self._set_owned()
        if self._metrics is not None:
            self._metrics.partitions_lost.labels(how).inc()
        for pid in self.ledger.of_partition(n):
            await self.ledger.fence(pid, refused=False)

    async def _take_over(self, n: int) -> None:
        """End the turns a previous owner left unfinished on partition `n`."""
        if self._metrics is not None:
            self._metrics.takeovers.inc()
        await self.ledger.scan(n)

    # ------------------------------------------------------------------ inputs
    def _reject(self, msg: Msg, reason: str, detail: str) -> None:
        logger.warning("turnrouter: rejected input on %s: %s", msg.subject[:200], detail)
        self.router.report_rejected("nats_input", reason)

    async def _handle(self, n: int, msg: Msg) -> None:
        try:
            partition, pid, kind, message = parse_input(self.config, msg.subject, msg.data)
            if partition != n:
                raise Rejected("not_owned", f"partition {partition} delivered on {n}")
        except Rejected as exc:
            self._reject(msg, exc.reason, str(exc))
            await self._ack(msg, b"+TERM")
            return
        if kind == "probe" or pid is None or message is None:
            await self._ack(msg)
            return
        if n not in self._pins:
            self._reject(msg, "not_owned", f"partition {n} is not owned here")
            return  # not acknowledged: the owner gets it
        delivered = _delivery_count(msg.reply)
        if delivered > 1 and self._metrics is not None:
            self._metrics.redeliveries.inc()
        if message.message_id in self._recent or message.message_id in self._running:
            if self._metrics is not None:
                self._metrics.duplicates.labels("input").inc()
            await self._ack(msg)
            return
        state = await self.ledger.claim(pid, n)
        if state is None:
            return  # fenced: another replica owns the participant
        router = self.router
        if kind == "query":
            assert isinstance(message, UserQuery)
            if delivered > 1:
                # A previous owner received it and may have started answering: end it
                # the way a turn in flight on a dead owner ends (unless the claimed
                # record already ended it: its held answer, or the failure text).
                if message.message_id not in state.ended:
                    if self._metrics is not None:
                        self._metrics.inflight_failed.inc()
                    await self.publish_output(pid, message.message_id, "none",
                                              self.config.failure_text, final=True)
            else:
                carrier = {k: v for k, v in (msg.headers or {}).items()
                           if k in ("traceparent", "tracestate")} or message.trace_carrier()
                state.inflight.append(message.message_id)
                task = self._running[message.message_id] = self._spawn(
                    self._turn(pid, state, message, carrier), f"turn {message.message_id}")
                self._turns_of.add(pid, task)
                if not await self.ledger.write(pid, state):
                    return
        elif kind == "joined":
            router.readmit(pid)
            self._spawn(self.ledger.write(pid, state), "state write")
        elif kind == "left":
            departure = router.begin_departure(pid)
            self._spawn(self._after(departure.join(), pid, state), "departure")
        elif kind == "interrupt":
            await router.interrupt(pid)
        self._recent.add(message.message_id)
        await self._ack(msg)

    async def _after(self, work: Awaitable[None], pid: str, state: Participant) -> None:
        try:
            await work
        except Exception:
            logger.exception("turnrouter: departure failed")
        await self.ledger.write(pid, state)

    async def _turn(self, pid: str, state: Participant, query: UserQuery,
                    carrier: dict[str, str]) -> None:
        router = self.router
        turn = AgentTurn(pid, query.message_id, query.text, timestamp_us=query.timestamp_us)

        async def emit(turn: AgentTurn, route: str, text: str) -> None:
            await self.publish_output(turn.participant_id, turn.turn_id, route, text,
                                      final=route == "none")

        try:
            with router.continue_trace(carrier):
                await router.report_status("processing", pid)
                try:
                    await router.route_turn(turn, output=emit)
                finally:
                    await router.report_status("idle", pid)
        except (TurnInterrupted, LifecycleError) as exc:
            if self._stop.is_set() and query.message_id not in self._held:
                # Cut short by a graceful end that outlasted drain_timeout: say so.
                await self.publish_output(pid, turn.turn_id, "none",
                                          self.config.failure_text, final=True,
                                          carrier=carrier)
            elif isinstance(exc, LifecycleError):
                logger.info("turnrouter: turn %s refused: %s", turn.turn_id, exc)
        except Exception:
            logger.exception("turnrouter: turn %s failed", turn.turn_id)
            # Every turn ends audibly: the failure text under the terminal id is dropped
            # by the output stream when the router or the destination already ended it.
            await self.publish_output(pid, turn.turn_id, "none", self.config.failure_text,
                                      final=True, carrier=carrier)
        finally:
            self._running.pop(query.message_id, None)
            with contextlib.suppress(ValueError):
                state.inflight.remove(query.message_id)
            held = self._held.pop(query.message_id, None)
            trace = self._held_trace.pop(query.message_id, {})
            if held is not None:
                state.outbox.append(held)
            if not state.fenced:
                await asyncio.shield(self._finish(pid, state, held, trace))

    async def _finish(self, pid: str, state: Participant, held: Ending | None,
                      trace: dict[str, str]) -> None:
        """Write the finished exchange, then publish the answer it holds (if any)."""
        if await self.ledger.write(pid, state) and held is not None:
            await self.publish_output(pid, held[0], held[1], held[2], final=True,
                                      carrier=trace)
            with contextlib.suppress(ValueError):
                state.outbox.remove(held)  # the next write drops it from the record

    async def _answer(self, turn: AgentTurn, route: str, text: str) -> None:
        if turn.turn_id in self._running and turn.turn_id not in self._held:
            self._held[turn.turn_id] = (turn.turn_id, route, text, time.time())
            self._held_trace[turn.turn_id] = self.router.trace_carrier()  # the turn's span
            return
        await self.publish_output(turn.participant_id, turn.turn_id, route, text, final=True)

    # ------------------------------------------------------------------ outputs
    async def publish_output(self, pid: str, turn_id: str, route: str, text: str, *,
                             final: bool, carrier: dict[str, str] | None = None) -> None:
        """Publish one output to the output stream under its deduplication id, with the
        W3C context of `carrier` (default: the current span's)."""
        assert self._nc is not None
        if carrier is None:
            carrier = self._router.trace_carrier() if self._router is not None else {}
        if await _publish(self._nc, self.config, pid, turn_id, route, text, final,
                          carrier) and self._metrics is not None:
            self._metrics.duplicates.labels("output").inc()

    async def _control_output(self, turn: AgentTurn, route: str, text: str) -> None:
        await self.publish_output(turn.participant_id, turn.turn_id, route, text,
                                  final=False)

    # ------------------------------------------------------------------ fleet-wide
    async def _on_interrupt_all(self, msg: Msg) -> None:
        self._spawn(self.router.interrupt(None), "interrupt all")

    def _send_sample(self, sample: TimingSample) -> None:
        if self._fleet is not None:
            self._fleet.send_sample(sample)


def _delivery_count(reply: str | None) -> int:
    """The delivery count in a JetStream ack subject ($JS.ACK.<stream>.<consumer>.<n>...)."""
    if not reply:
        return 1
    parts = reply.split(".")
    try:
        return int(parts[4]) if len(parts) == 9 else int(parts[6])
    except (IndexError, ValueError):
        return 1


async def _connect(config: NatsConfig, replica: str,
                   closed: Callable[[], Awaitable[None]]) -> Client:
    """Connect with bounded first attempts, then ride out a server outage of about a
    minute (nats-py reads this option on every reconnect); past it the worker exits."""
    try:
        nc = await nats.connect(config.url, name=f"turnrouter-{replica}", connect_timeout=2,
                                max_reconnect_attempts=3, reconnect_time_wait=0.5,
                                closed_cb=closed)
    except (NatsError, OSError, TimeoutError) as exc:
        raise LifecycleError(f"cannot connect to NATS at {config.url}: {exc!r}") from exc
    nc.options["max_reconnect_attempts"] = _RECONNECTS
    return nc


async def _publish(nc: Client, config: NatsConfig, pid: str, turn_id: str, route: str,
                   text: str, final: bool, carrier: dict[str, str]) -> bool:
    """One output on the output stream; True when the stream dropped it as a duplicate."""
    message = ResponseOutput(participant_id=pid, request_id=turn_id, route=route, text=text,
                             traceparent=carrier.get("traceparent"),
                             tracestate=carrier.get("tracestate"))
    headers = {"Nats-Msg-Id": output_message_id(turn_id, route, text, final=final),
               **carrier}
    try:
        ack = await nc.jetstream().publish(config.output_subject(pid),
                                           message.model_dump_json().encode(),
                                           headers=headers)
    except (NatsError, TimeoutError) as exc:
        logger.warning("turnrouter: output for turn %s not published: %r", turn_id, exc)
        return False
    return bool(ack.duplicate)
