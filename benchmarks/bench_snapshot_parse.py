"""How long reading the costliest participant snapshot stalls an event loop.

A NATS worker parses a big record in a thread, but parsing holds the interpreter's lock
throughout, so the event loop waits all the same. The costliest shape per byte is one
patch whose facts are tiny numbers (`0,`). This builds it at `MAX_SNAPSHOT_ITEMS` values
(the largest snapshot `ParticipantSnapshot.from_json` takes) and, for comparison, at
`MAX_SNAPSHOT_BYTES` (refused now, before parsing), then reads each in a thread while
the loop runs a 1 ms heartbeat: the parse's own time and the loop's longest gap, over
`--rounds` rounds (median and max).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_snapshot_parse.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time

from turnrouter import (
    MAX_SNAPSHOT_BYTES,
    MAX_SNAPSHOT_ITEMS,
    ContractValueError,
    ParticipantSnapshot,
)

_HEAD = ('{"participant_id":"bob","history":[{"user":"q","assistant":"a","patch":'
         '{"patch_id":"x","task_id":"t","strategy":"append","diverged":false,"patch":'
         '{"task_id":"t","facts":{"a":[')


def numbers(count: int) -> str:
    """A snapshot holding one merged patch whose facts are `count` zeros."""
    return _HEAD + ",".join(["0"] * count) + "]}}}}]}"


def _read(data: str) -> None:
    with contextlib.suppress(ContractValueError):
        ParticipantSnapshot.from_json(data)


async def stall(data: str) -> tuple[float, float]:
    """(seconds the parse took, the loop's longest gap past its 1 ms heartbeat)."""
    worst, stop = 0.0, False

    async def beat() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last - 0.001), now

    beating = asyncio.create_task(beat())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    await asyncio.to_thread(_read, data)
    took = time.perf_counter() - started
    stop = True
    await beating
    return took, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    shapes = {"at MAX_SNAPSHOT_ITEMS": numbers(MAX_SNAPSHOT_ITEMS - 64),
              "at MAX_SNAPSHOT_BYTES (refused)": numbers((MAX_SNAPSHOT_BYTES - 400) // 2)}
    report: dict[str, dict[str, float]] = {}
    for name, data in shapes.items():
        runs = [asyncio.run(stall(data)) for _ in range(args.rounds)]
        report[name] = {
            "bytes": len(data),
            "parse_ms_median": round(1e3 * statistics.median(r[0] for r in runs), 1),
            "loop_gap_ms_median": round(1e3 * statistics.median(r[1] for r in runs), 1),
            "loop_gap_ms_max": round(1e3 * max(r[1] for r in runs), 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
