"""Cost of the timing predictor: microseconds per `record()` and per `predict()`.

Steady slow route (lognormal 2.5 s), a flip-flopping one (two regimes), with the default
feature classes and without; median of `--repeat` runs. `--baseline SRC` also times the
`RouteTimingPredictor` of another source tree (e.g. the previous commit's `src`) in a
subprocess, for a ratio measured in the same run.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_timing_predictor.py [--samples 20000]
        [--repeat 5] [--baseline OTHER/src]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from turnrouter import AgentTurn, RouteTimingPredictor, TimingSample


def _samples(shape: str, count: int) -> list[TimingSample]:
    rng = random.Random(1)
    out = []
    for i in range(count):
        median = 2.5 if shape == "steady" or (i // 40) % 2 else 0.4
        out.append(TimingSample("r", median * math.exp(rng.gauss(0.0, 0.3))))
    return out


def measure(count: int, repeat: int, settings: dict[str, Any]) -> dict[str, float]:
    """Median microseconds per record() and predict() for each shape."""
    turn = AgentTurn("p", "t", "what is on my calendar tomorrow afternoon")
    results: dict[str, float] = {}
    for shape in ("steady", "flipflop"):
        samples = _samples(shape, count)
        records, predicts = [], []
        for _ in range(repeat):
            predictor = RouteTimingPredictor(**settings)
            began = time.perf_counter()
            for sample in samples:
                predictor.record(sample, turn)
            records.append((time.perf_counter() - began) / count * 1e6)
            began = time.perf_counter()
            for _ in range(count // 4):
                predictor.predict("r", turn)
            predicts.append((time.perf_counter() - began) / (count // 4) * 1e6)
        results[f"{shape} record"] = statistics.median(records)
        results[f"{shape} predict"] = statistics.median(predicts)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", default=None, metavar="SRC")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-feature", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        settings: dict[str, Any] = {"feature": None} if args.no_feature else {}
        print(json.dumps(measure(args.samples, args.repeat, settings)))
        return
    rows = {"default": measure(args.samples, args.repeat, {}),
            "feature=None": measure(args.samples, args.repeat, {"feature": None})}
    if args.baseline:
        command = [sys.executable, __file__, "--json", "--samples", str(args.samples),
                   "--repeat", str(args.repeat)]
        out = subprocess.run(command, env=dict(os.environ, PYTHONPATH=args.baseline),
                             check=True, capture_output=True, text=True)
        rows["baseline"] = json.loads(out.stdout)
    keys = list(rows["default"])
    print(f"{args.samples} samples, median of {args.repeat}; microseconds per call")
    print("| predictor | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{values[k]:.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
