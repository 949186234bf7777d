"""A publish in flight when nats-server dies (issue #30, chaos20 O3): how long
`NatsFrontEnd.publish` takes to return, or to raise, counted from the server's restart.

Each round: a nats-server with JetStream on a fresh store, a front end, one query stored;
then the server is frozen (SIGSTOP), a query is published (written to the server's
socket, unread), the server is killed (kill -9: the query is lost with it) and restarted
on the same store and port. The front end of the tree on `PYTHONPATH` is measured; run it
once per tree for a comparison:

    PYTHONPATH=<earlier checkout>/src .venv/bin/python benchmarks/bench_publish_at_crash.py
    PYTHONPATH=src .venv/bin/python benchmarks/bench_publish_at_crash.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nats.conftest import NatsServer, until_true

import turnrouter
from turnrouter.runtime import UserQuery
from turnrouter.runtime.nats import NatsConfig, NatsFrontEnd


async def one_round() -> tuple[str, float]:
    """(outcome, seconds from the server's restart until `publish` returned or raised)."""
    server = NatsServer()
    front = await NatsFrontEnd.connect(NatsConfig(url=server.url))
    try:
        await front.publish(UserQuery(participant_id="p", text="warm"))
        nc = front.connection
        server.freeze()
        sent = nc.stats["out_msgs"]
        publishing = asyncio.create_task(front.publish(UserQuery(participant_id="p", text="x")))
        await until_true(lambda: nc.stats["out_msgs"] > sent and nc.pending_data_size == 0,
                         "the publish written to the frozen server")
        server.crash()
        server.restart()
        back = time.monotonic()
        try:
            async with asyncio.timeout(30):
                await publishing
            outcome = "returned"
        except Exception as exc:  # (the outcome is the figure)
            outcome = type(exc).__name__
        return outcome, time.monotonic() - back
    finally:
        await front.close()
        server.close()


async def main(rounds: int, tree: Path) -> None:
    results = [await one_round() for _ in range(rounds)]
    outcomes = sorted({outcome for outcome, _ in results})
    seconds = [s for _, s in results]
    print(f"tree {tree}: {rounds} rounds, "
          f"outcomes {outcomes}, seconds after the restart: median "
          f"{statistics.median(seconds):.2f}, max {max(seconds):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args().rounds, Path(turnrouter.__file__).resolve().parents[1]))
