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
import functools
import inspect
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import KeyWrongLastSequenceError

import nats

from ..._contracts import AgentTurn
from ..._exceptions import (
    ContractValueError,
    LifecycleError,
    TurnInterrupted,
)
from ..._frontend import ParticipantSnapshot
from ..._router import AgentRouter
from ..._timing import TimingPredictor, TimingSample
from .._messages import ResponseOutput, UserQuery
from ._metrics import RuntimeMetrics, runtime_metrics
from ._setup import GROUP, api_request, ensure_deployment
from ._wire import (
    Ending,
    NatsConfig,
    Rejected,
    encode_token,
    output_message_id,
    parse_input,
    parse_state,
    state_json,
)

__all__ = ["NatsWorker", "WorkerContext"]

logger = logging.getLogger("turnrouter.runtime.nats")

_RECENT = 4096  # bound of the handled-input id memory (duplicates beyond it are re-run)
_MAX_INFLIGHT = 64  # bound of one participant's in-flight ids in its record
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


@dataclass
class _Participant:
    partition: int
    revision: int = 0
    inflight: list[str] = field(default_factory=list)
    outbox: list[Ending] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    fenced: bool = False
    ended: frozenset[str] = frozenset()
    """Turns the claimed record had already ended (in flight: failure text; held answer)."""


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
        self._kv: Any = None
        self._router: AgentRouter | None = None
        self._pins: dict[int, str] = {}
        self._people: dict[str, _Participant] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._predictors: list[TimingPredictor] = []
        self._stop = asyncio.Event()
        self._peers: dict[str, tuple[float, int]] = {}
        self._shed_after = 0.0
        self._turns_of: dict[str, set[asyncio.Task[None]]] = {}
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

        try:
            self._nc = await nats.connect(
                config.url, name=f"turnrouter-{self.replica}", connect_timeout=2,
                max_reconnect_attempts=3, reconnect_time_wait=0.5, closed_cb=closed)
        except (NatsError, OSError, TimeoutError) as exc:
            raise LifecycleError(f"cannot connect to NATS at {config.url}: {exc!r}") from exc
        # Connected once: now ride out a server outage of about a minute (nats-py reads
        # this option on every reconnect); past it the worker exits with an error.
        self._nc.options["max_reconnect_attempts"] = _RECONNECTS
        nc = self._nc
        try:
            await ensure_deployment(nc, config)
            self._kv = await nc.jetstream().key_value(config.bucket)
            built = self._factory(WorkerContext(self, self._registry))
            router = await built if inspect.isawaitable(built) else built
            if not isinstance(router, AgentRouter):
                raise ContractValueError(
                    f"the router factory must return an AgentRouter, got "
                    f"{type(router).__name__}")
            self._router = router
            router.set_control_output(self._control_output)
            if self._metrics is not None:
                self._metrics.partitions.set(config.partitions)
            await nc.subscribe(config.interrupt_all_subject, cb=self._on_interrupt_all)
            await nc.subscribe(config.timing_subject, cb=self._on_sample)
            loops = [asyncio.create_task(self._partition_loop(n), name=f"partition {n}")
                     for n in range(config.partitions)]
            await nc.subscribe(f"{config.prefix}.presence", cb=self._on_presence)
            presence = asyncio.create_task(self._presence_loop(), name="presence")
            self._shed_after = time.monotonic() + 2 * config.failover_timeout
            probe = asyncio.create_task(self._probe_loop(), name="probes")
            self.ready.set()
            await self._stop.wait()
            if lost.is_set():
                raise LifecycleError(f"lost the connection to NATS at {config.url}")
            await self._shutdown(loops, probe)
        finally:
            background = [*self._tasks, *loops, presence, probe] if self.ready.is_set() \
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
                        probe: asyncio.Task[None]) -> None:
        self._pulling = False
        probe.cancel()
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
        share = self._fair_share()
        if n in self._pins and len(self._pins) > share and self._may_shed():
            await self._hand_over(n)
            return
        if n not in self._pins and len(self._pins) >= share and (
                await self._pinned_elsewhere(n)):
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

    def _fair_share(self) -> int:
        """Partitions per live replica (rounded up): balance, not ownership."""
        horizon = time.monotonic() - 3 * self.config.probe_interval
        live = 1 + sum(1 for seen, _ in self._peers.values() if seen >= horizon)
        return -(-self.config.partitions // live)

    def _may_shed(self) -> bool:
        """Hand one surplus partition over when a live peer holds less than its share."""
        now = time.monotonic()
        if now < self._shed_after:
            return False
        horizon = now - 3 * self.config.probe_interval
        share = self._fair_share()
        if any(seen >= horizon and owned < share for seen, owned in self._peers.values()):
            self._shed_after = now + self.config.probe_interval / 2
            return True
        return False

    async def _pinned_elsewhere(self, n: int) -> bool:
        """Whether partition `n` has a pinned client (this replica is at its share and
        leaves it alone); an unpinned one is pulled, so an orphan finds an owner."""
        assert self._nc is not None
        try:
            info = await api_request(
                self._nc, f"$JS.API.CONSUMER.INFO.{self.config.stream}."
                f"{self.config.consumer(n)}", wait=2.0)
        except Exception:
            return False
        groups = info.get("priority_groups") or []
        return any(isinstance(g, dict) and g.get("pinned_client_id") for g in groups)

    async def _hand_over(self, n: int) -> None:
        """Give partition `n` away without failure text: let its turns finish (their
        state is written), drop its participants, then unpin it for the next puller."""
        pids = [p for p, s in self._people.items() if s.partition == n]
        turns = [t for p in pids for t in self._turns_of.get(p, ()) if not t.done()]
        if turns:
            await asyncio.wait(turns, timeout=self.config.drain_timeout)
        self._pins.pop(n, None)
        self._set_owned()
        for pid in pids:
            state = self._people.pop(pid, None)
            if state is not None:
                async with state.lock:
                    state.fenced = True
            with contextlib.suppress(LifecycleError):
                await self.router.evict_participant(pid)
        assert self._nc is not None
        with contextlib.suppress(Exception):
            await api_request(self._nc, f"$JS.API.CONSUMER.UNPIN.{self.config.stream}."
                              f"{self.config.consumer(n)}", {"group": GROUP})
        if self._metrics is not None:
            self._metrics.partitions_lost.labels("handed_over").inc()

    async def _presence_loop(self) -> None:
        assert self._nc is not None
        while True:
            with contextlib.suppress(NatsError):
                await self._nc.publish(
                    f"{self.config.prefix}.presence",
                    json.dumps({"replica": self.replica, "owned": len(self._pins)}).encode())
            await asyncio.sleep(self.config.probe_interval)

    async def _on_presence(self, msg: Msg) -> None:
        try:
            data = json.loads(msg.data)
            replica, owned = str(data["replica"]), int(data["owned"])
        except (ValueError, KeyError, TypeError):
            return
        if replica != self.replica:
            if replica not in self._peers and len(self._peers) >= 1024:
                return  # bounded: more peers than that are ignored for balancing
            self._peers[replica] = (time.monotonic(), owned)

    async def _probe_loop(self) -> None:
        """Keep one probe queued on partitions not owned here, so a dead owner's
        partitions get a new pinned client (and their in-flight turns their ending) even
        when no participant of theirs is talking."""
        assert self._nc is not None
        js = self._nc.jetstream()
        while True:
            await asyncio.sleep(self.config.probe_interval)
            for n in range(self.config.partitions):
                if n in self._pins:
                    continue
                with contextlib.suppress(NatsError, TimeoutError):
                    # One probe per partition and window (deduplicated by id).
                    window = int(time.time() / self.config.probe_interval)
                    await js.publish(self.config.probe_subject(n), b"",
                                     headers={"Nats-Msg-Id": f"probe.{n}.{window}"})

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
        for pid in [p for p, s in self._people.items() if s.partition == n]:
            await self._fence(pid, refused=False)

    async def _fence(self, pid: str, *, refused: bool) -> None:
        state = self._people.pop(pid, None)
        if state is not None:
            state.fenced = True
        if refused and self._metrics is not None:
            self._metrics.state_refused.inc()
        with contextlib.suppress(LifecycleError):
            await self.router.evict_participant(pid)

    async def _take_over(self, n: int) -> None:
        """End the turns a previous owner left in flight on partition `n`."""
        if self._metrics is not None:
            self._metrics.takeovers.inc()
        watcher = await self._kv.watch(f"{n}.*", ignore_deletes=True)
        entries = []
        try:
            async with asyncio.timeout(10.0):  # bounded: the initial values, then None
                async for entry in watcher:
                    if entry is None:
                        break
                    entries.append(entry)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        for entry in entries:
            try:
                inflight, _, outbox = parse_state(entry.value or b"{}")
            except ValueError:
                continue
            if inflight or outbox:
                pid = _pid_of_key(entry.key)
                if pid is not None:
                    await self._participant(pid, n)

    async def _participant(self, pid: str, n: int) -> _Participant | None:
        """This replica's state of `pid`, claiming it on first contact (see module doc).

        Returns None when the claim was refused (another replica owns it)."""
        state = self._people.get(pid)
        if state is not None:
            return state
        key = f"{n}.{encode_token(pid)}"
        for _attempt in range(3):
            revision, snapshot = 0, None
            inflight: list[str] = []
            outbox: list[Ending] = []
            try:
                entry = await self._kv.get(key)
            except NatsError:
                entry = None
            if entry is not None and entry.value is not None:
                revision = entry.revision or 0
                try:
                    inflight, snapshot, outbox = parse_state(entry.value)
                except ValueError:
                    logger.warning("turnrouter: unreadable state of a participant; "
                                   "starting it afresh")
            # The claim keeps what the previous owner left, until it is published.
            claim = state_json(self.replica, inflight, snapshot, outbox)
            try:
                revision = await self._kv.update(key, claim, last=revision)
            except KeyWrongLastSequenceError:
                if self._metrics is not None:
                    self._metrics.state_refused.inc()
                continue  # the previous owner wrote meanwhile: read again
            except NatsError as exc:
                logger.warning("turnrouter: participant claim failed: %r", exc)
                return None
            break
        else:
            return None
        state = _Participant(partition=n, revision=revision,
                             ended=frozenset(inflight) | {e[0] for e in outbox})
        self._people[pid] = state
        if snapshot is not None:
            try:
                self.router.import_participant(ParticipantSnapshot.from_json(snapshot))
            except (ContractValueError, LifecycleError) as exc:
                logger.warning("turnrouter: participant state not imported: %s", exc)
        answered = {ending[0] for ending in outbox}
        horizon = time.time() - self.config.dedup_window / 2
        for turn_id, route, text, at in outbox:
            # Younger than half the deduplication window: maybe never published (the
            # owner died between the write and the publish); a duplicate is dropped.
            # Older ones were published long ago: republishing could be heard twice.
            if at >= horizon:
                await self.publish_output(pid, turn_id, route, text, final=True)
        for turn_id in inflight:
            if turn_id in answered:
                continue
            if self._metrics is not None:
                self._metrics.inflight_failed.inc()
            await self.publish_output(pid, turn_id, "none", self.config.failure_text,
                                      final=True)
        if (inflight or outbox) and not await self._write(pid, state):
            return None
        return state

    async def _write(self, pid: str, state: _Participant) -> bool:
        """Revision-checked write of `pid`'s record; False (and fenced) when refused."""
        async with state.lock:
            if state.fenced:
                return False
            snapshot = self.router.export_participant(pid)
            data = state_json(self.replica, state.inflight[-_MAX_INFLIGHT:],
                              None if snapshot is None else snapshot.to_json(),
                              state.outbox)
            key = f"{state.partition}.{encode_token(pid)}"
            t0 = time.perf_counter()
            try:
                state.revision = await self._kv.update(key, data, last=state.revision)
            except KeyWrongLastSequenceError:
                refused = True
            except NatsError as exc:
                logger.warning("turnrouter: state write failed: %r", exc)
                return True
            else:
                refused = False
            if self._metrics is not None:
                self._metrics.state_write.observe(time.perf_counter() - t0)
        if refused:
            await self._fence(pid, refused=True)
            return False
        return True

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
        state = await self._participant(pid, n)
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
                self._turns_of.setdefault(pid, set()).add(task)
                task.add_done_callback(functools.partial(self._turn_done, pid))
                if not await self._write(pid, state):
                    return
        elif kind == "joined":
            router.readmit(pid)
            self._spawn(self._write(pid, state), "state write")
        elif kind == "left":
            departure = router.begin_departure(pid)
            self._spawn(self._after(departure.join(), pid, state), "departure")
        elif kind == "interrupt":
            await router.interrupt(pid)
        self._remember(message.message_id)
        await self._ack(msg)

    def _turn_done(self, pid: str, task: asyncio.Task[None]) -> None:
        turns = self._turns_of.get(pid)
        if turns is not None:
            turns.discard(task)
            if not turns:
                del self._turns_of[pid]

    def _remember(self, message_id: str) -> None:
        self._recent[message_id] = None
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    async def _after(self, work: Awaitable[None], pid: str, state: _Participant) -> None:
        try:
            await work
        except Exception:
            logger.exception("turnrouter: departure failed")
        await self._write(pid, state)

    async def _turn(self, pid: str, state: _Participant, query: UserQuery,
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

    async def _finish(self, pid: str, state: _Participant, held: Ending | None,
                      trace: dict[str, str]) -> None:
        """Write the finished exchange, then publish the answer it holds (if any)."""
        if await self._write(pid, state) and held is not None:
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
        router = self._router
        if carrier is None:
            carrier = router.trace_carrier() if router is not None else {}
        message = ResponseOutput(participant_id=pid, request_id=turn_id, route=route,
                                 text=text, traceparent=carrier.get("traceparent"),
                                 tracestate=carrier.get("tracestate"))
        headers = {"Nats-Msg-Id": output_message_id(turn_id, route, text, final=final),
                   **carrier}
        try:
            ack = await self._nc.jetstream().publish(
                self.config.output_subject(pid), message.model_dump_json().encode(),
                headers=headers)
        except (NatsError, TimeoutError) as exc:
            logger.warning("turnrouter: output for turn %s not published: %r", turn_id, exc)
            return
        if ack.duplicate and self._metrics is not None:
            self._metrics.duplicates.labels("output").inc()

    async def _control_output(self, turn: AgentTurn, route: str, text: str) -> None:
        await self.publish_output(turn.participant_id, turn.turn_id, route, text,
                                  final=False)

    # ------------------------------------------------------------------ fleet-wide
    async def _on_interrupt_all(self, msg: Msg) -> None:
        self._spawn(self.router.interrupt(None), "interrupt all")

    def _send_sample(self, sample: TimingSample) -> None:
        if self._nc is None or self._nc.is_closed:
            return
        if self._metrics is not None:
            self._metrics.timing_samples.labels("sent").inc()
        self._spawn(self._nc.publish(self.config.timing_subject, sample.to_json().encode(),
                                     headers={"Turnrouter-Replica": self.replica}),
                    "timing sample")

    async def _on_sample(self, msg: Msg) -> None:
        if (msg.headers or {}).get("Turnrouter-Replica") == self.replica:
            return
        try:
            sample = TimingSample.from_json(msg.data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            logger.warning("turnrouter: rejected a timing sample: %s", exc)
            self.router.report_rejected("nats_timing", "invalid")
            return
        if self._metrics is not None:
            self._metrics.timing_samples.labels("received").inc()
        for predictor in self._predictors:
            predictor.record(sample)


def _delivery_count(reply: str | None) -> int:
    """The delivery count in a JetStream ack subject ($JS.ACK.<stream>.<consumer>.<n>...)."""
    if not reply:
        return 1
    parts = reply.split(".")
    try:
        return int(parts[4]) if len(parts) == 9 else int(parts[6])
    except (IndexError, ValueError):
        return 1


def _pid_of_key(key: str) -> str | None:
    from ._wire import decode_token

    try:
        return decode_token(key.split(".", 1)[1])
    except (IndexError, ValueError):
        return None
