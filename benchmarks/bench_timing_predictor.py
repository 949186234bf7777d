"""Cost of the timing predictor: microseconds per `record()` and per `predict()`.

Steady slow route (lognormal 2.5 s), a flip-flopping one (two regimes), with the default
feature classes and without; `predict` is asked as the router asks it (with the delay,
so the trigger decides). `--baseline SRC` (repeatable) also times the default
`RouteTimingPredictor` of another source tree (its package imported under another
name), in the same process and interleaved round by round with this tree's, so the
ratios hold on a shared machine; medians of `--repeat` rounds.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_timing_predictor.py [--samples 20000]
        [--repeat 5] [--baseline OTHER/src]
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from _trees import import_tree

from turnrouter import AgentTurn, RouteTimingPredictor, TimingSample

SHAPES = ("steady", "flipflop")


def _samples(shape: str, count: int) -> list[TimingSample]:
    rng = random.Random(1)
    out = []
    for i in range(count):
        median = 2.5 if shape == "steady" or (i // 40) % 2 else 0.4
        out.append(TimingSample("r", median * math.exp(rng.gauss(0.0, 0.3))))
    return out


def _other_tree(src: str, alias: str) -> Any:
    """Another tree's `RouteTimingPredictor` class (its package imported as `alias`)."""
    return import_tree(src, alias).RouteTimingPredictor


def _asker(predictor: Any) -> Callable[[str, AgentTurn], object]:
    """`predict` as the router calls it: with the delay when the predictor takes it."""
    parameters = inspect.signature(predictor.predict).parameters
    if "generation_secs" in parameters:
        return lambda route, turn: predictor.predict(route, turn, delay_secs=1.0,
                                                     generation_secs=0.3)
    if "delay_secs" in parameters:
        return lambda route, turn: predictor.predict(route, turn, delay_secs=1.0)
    return lambda route, turn: predictor.predict(route, turn)


def measure_once(make: Callable[[], Any], samples: list[TimingSample],
                 turn: AgentTurn) -> tuple[float, float]:
    """Microseconds per record() over `samples`, then per predict() (a quarter as many)."""
    predictor = make()
    record = predictor.record
    began = time.perf_counter()
    for sample in samples:
        record(sample, turn)
    recorded = (time.perf_counter() - began) / len(samples) * 1e6
    ask = _asker(predictor)
    calls = max(1, len(samples) // 4)
    began = time.perf_counter()
    for _ in range(calls):
        ask("r", turn)
    return recorded, (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", action="append", default=[], metavar="SRC")
    args = parser.parse_args()
    variants: dict[str, Callable[[], Any]] = {
        "default": RouteTimingPredictor,
        "feature=None": lambda: RouteTimingPredictor(feature=None),
    }
    for i, src in enumerate(args.baseline):
        other = _other_tree(src, f"_baseline{i}")
        variants[f"b{i + 1} ({src})"] = other
    turn = AgentTurn("p", "t", "what is on my calendar tomorrow afternoon")
    data = {shape: _samples(shape, args.samples) for shape in SHAPES}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.repeat):  # interleaved: every variant once per round
        for shape in SHAPES:
            for name, make in variants.items():
                times.setdefault((name, shape), []).append(
                    measure_once(make, data[shape], turn))
    print(f"{args.samples} samples, median of {args.repeat} interleaved rounds; "
          f"microseconds per call (load average {os.getloadavg()[0]:.1f})")
    print("| predictor | steady record | steady predict | flip-flop record | "
          "flip-flop predict |")
    print("|---|---:|---:|---:|---:|")
    for name in variants:
        cells = []
        for shape in SHAPES:
            rounds = times[name, shape]
            cells += [statistics.median(r for r, _ in rounds),
                      statistics.median(p for _, p in rounds)]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
