"""A decision's time when the CPU caches are disturbed between decisions, as at scale.

In `bench_scale.py` a decision costs about twice what it costs in a tight loop over the
same queries: between two decisions the router touches thousands of other objects, which
evict the model's entries from the caches. This benchmark reproduces that in isolation:
the demo sample's examples and routes (as in `bench_scale.py`), and `--disturb N`
unrelated objects touched between decisions (0: a tight loop). With `--baseline TREE`
another checkout's `turnrouter` is imported beside this one and both score the same
queries in alternating passes, so a drifting machine affects both alike; the medians and
the median of the per-pass ratios are printed.

    .venv/bin/python benchmarks/bench_decisions_disturbed.py [--disturb 2000]
        [--baseline /tmp/old/src] [--passes 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import types
from collections.abc import Sequence
from typing import Any

from _trees import import_tree

import turnrouter
import turnrouter.decisions
import turnrouter.demo

_JUNK = 400_000


def _workload(package: types.ModuleType, alias: str) -> tuple[Any, list[Any]]:
    """(service, requests) of the demo sample, built with `package` (`alias` names it in
    `sys.modules` for its submodules)."""
    decisions = __import__(f"{alias}.decisions", fromlist=["LexicalDecisions"])
    demo = __import__(f"{alias}.demo", fromlist=["load_sample"])
    sample = demo.load_sample()
    service = decisions.LexicalDecisions(examples=sample.examples)
    aids = tuple(package.RoutingAid(name, text) for name, text in demo.DESCRIPTIONS.items())
    queries = [text for text, _, _ in sample.queries]
    random.Random(1).shuffle(queries)
    requests = [package.RouteRequest(package.AgentTurn("p", "t", q), aids) for q in queries]
    for request in requests:  # warm: every word seen once
        service.score(request)
    return service, requests


def _pass(service: Any, requests: Sequence[Any], junk: list[list[float]],
          disturb: int) -> float:
    """Mean µs per decision over `requests`, `disturb` junk objects touched between two."""
    spent = 0.0
    position = 0
    for request in requests:
        if disturb:
            for item in junk[position:position + disturb]:
                item[0] += 1.0
            position = (position + disturb) % (_JUNK - disturb)
        start = time.perf_counter()
        service.score(request)
        spent += time.perf_counter() - start
    return spent / len(requests) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--disturb", type=int, default=2000,
                        help="unrelated objects touched between decisions (0: none)")
    parser.add_argument("--baseline", metavar="SRC",
                        help="another checkout's src directory, compared in one process")
    parser.add_argument("--passes", type=int, default=10)
    args = parser.parse_args()
    if args.disturb < 0 or args.disturb >= _JUNK:
        parser.error(f"--disturb must be in [0, {_JUNK})")
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    junk = [[float(i)] for i in range(_JUNK)]
    trees = {"this": _workload(turnrouter, "turnrouter")}
    if args.baseline:
        trees["baseline"] = _workload(import_tree(args.baseline, "tr_baseline"),
                                      "tr_baseline")
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.passes):
        for name, (service, requests) in trees.items():
            times[name].append(_pass(service, requests, junk, args.disturb))
    for name, values in times.items():
        print(f"{name:8s} µs per decision (disturb {args.disturb}): median "
              f"{statistics.median(values):.1f}, min {min(values):.1f}")
    if "baseline" in times:
        ratios = [t / b for t, b in zip(times["this"], times["baseline"], strict=True)]
        print(f"this ÷ baseline, median of {args.passes} passes: "
              f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
