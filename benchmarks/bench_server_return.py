"""Turns published right after the NATS server's return (issue #30: outputs resume
within 2 s of the server's return; docs/distributed.md "The server crashes").

A nats-server, `--workers` real `turnrouter worker` processes (the tests' echo app,
answering in 20 ms) and one `NatsFrontEnd` whose `--participants` each publish a query
0.3-1.2 s after their last one ended (a publish refused while the server is away is
tried again every 0.1 s). Each cycle: 8 s steady, then the fault, then 10 s:
- `kill`: kill -9 of the server, 3 s down, restarted on the same store and port;
- `stop`: SIGSTOP of the server for 8 s, then SIGCONT.
The figure is publish (acknowledged) -> final output read (and the failure texts read
over the whole run, which should stay 0), for the turns whose
successful publish started after the return, by when it was acknowledged: 0-1 s and
1-3 s after the return (`restart` returning healthy, or SIGCONT). With `--baseline
OTHER_CHECKOUT` the workers run that checkout's code first, then this one's (the front
end is this one's in both), in one run:

    PYTHONPATH=src .venv/bin/python benchmarks/bench_server_return.py \\
        --baseline ../main --cycles 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nats.conftest import NatsServer, Worker

from turnrouter import LifecycleError
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = ((0.0, 1.0), (1.0, 3.0))


class Talk:
    """The participants' turns: when each publish was tried and acknowledged, and
    when its final output was read."""

    def __init__(self, front: NatsFrontEnd) -> None:
        self.front = front
        self.sent: list[tuple[str, str, float, float]] = []  # pid, mid, tried, acked
        self.finals: dict[tuple[str, str], float] = {}
        self.waiting: dict[tuple[str, str], asyncio.Future[None]] = {}
        self.failures = 0  # finals with the failure text, over the whole run
        self.stop = False

    async def read(self, subscribed: asyncio.Event) -> None:
        async for output in self.front.outputs(subscribed=subscribed):
            if output.final:
                self.failures += output.text == NatsConfig().failure_text
                key = (output.participant_id, output.request_id)
                self.finals.setdefault(key, time.time())
                future = self.waiting.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(None)

    async def participant(self, pid: str) -> None:
        turn = 0
        while not self.stop:
            await asyncio.sleep(random.uniform(0.3, 1.2))
            turn += 1
            mid = f"m{turn}"
            future = self.waiting[(pid, mid)] = asyncio.get_running_loop().create_future()
            first = time.time()
            while True:
                tried = time.time()
                try:
                    await self.front.publish(UserQuery(participant_id=pid, text=f"q {mid}",
                                                       message_id=mid))
                    break
                except LifecycleError:
                    if time.time() - first > 30:
                        break
                    await asyncio.sleep(0.1)
            self.sent.append((pid, mid, tried, time.time()))
            try:
                await asyncio.wait_for(future, 20)
            except TimeoutError:
                self.waiting.pop((pid, mid), None)


async def scenario(tree: Path, fault: str, cycles: int, participants: int,
                   workers: int) -> tuple[dict[tuple[float, float], list[float | None]], int]:
    """Latencies (None: no final) of the turns in each window after each return, and
    the failure texts read over the run."""
    server = NatsServer()
    fleet: list[Worker] = []
    returns: list[float] = []
    try:
        env = {"PYTHONPATH": f"{tree / 'src'}:{tree}", "TR_TEST_ANSWER_SECS": "0.02"}
        fleet = [await asyncio.to_thread(Worker, server.url, f"w{i}", env=env)
                 for i in range(workers)]
        front = await NatsFrontEnd.connect(NatsConfig(url=server.url))
        talk = Talk(front)
        subscribed = asyncio.Event()
        reader = asyncio.create_task(talk.read(subscribed))
        await subscribed.wait()
        talkers = [asyncio.create_task(talk.participant(f"p{i}"))
                   for i in range(participants)]
        await asyncio.sleep(10)
        for _ in range(cycles):
            await asyncio.sleep(8)
            if fault == "kill":
                await asyncio.to_thread(server.crash)
                await asyncio.sleep(3)
                await asyncio.to_thread(server.restart)
            else:
                await asyncio.to_thread(server.freeze)
                await asyncio.sleep(8)
                server.thaw()
            returns.append(time.time())
            await asyncio.sleep(10)
        talk.stop = True
        await asyncio.sleep(3)
        for task in (*talkers, reader):
            task.cancel()
        await asyncio.gather(*talkers, reader, return_exceptions=True)
        await front.close()
    finally:
        for worker in fleet:
            await asyncio.to_thread(worker.close)
        server.thaw()
        server.close()
    found: dict[tuple[float, float], list[float | None]] = {w: [] for w in WINDOWS}
    for back in returns:
        for pid, mid, tried, acked in talk.sent:
            for low, high in WINDOWS:
                if tried >= back and back + low <= acked < back + high:
                    final = talk.finals.get((pid, mid))
                    found[(low, high)].append(None if final is None else final - acked)
    return found, talk.failures


def _row(name: str, fault: str, window: tuple[float, float],
         latencies: list[float | None], failures: int) -> str:
    answered = sorted(x for x in latencies if x is not None)
    if not answered:
        return f"| {name} | {fault} | {window[0]:g}-{window[1]:g} s | 0 | | | | | {failures} |"

    def pick(q: float) -> float:
        return answered[min(len(answered) - 1, int(q * len(answered)))]

    return (f"| {name} | {fault} | {window[0]:g}-{window[1]:g} s | {len(answered)} | "
            f"{pick(0.5):.2f} | {pick(0.95):.2f} | {answered[-1]:.2f} | "
            f"{len(latencies) - len(answered)} | {failures} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another checkout whose workers run first")
    parser.add_argument("--faults", default="kill,stop")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--participants", type=int, default=60)
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    trees = [("this", ROOT)]
    if args.baseline:
        trees.insert(0, ("baseline", Path(args.baseline).resolve()))
    rows = []
    for fault in args.faults.split(","):
        for name, tree in trees:
            found, failures = asyncio.run(scenario(tree, fault, args.cycles,
                                                   args.participants, args.workers))
            rows += [_row(name, fault, window, found[window], failures) for window in WINDOWS]
    print("| tree | fault | published after the return | turns | p50 s | p95 s | max s "
          "| unanswered | failure texts (run) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
