"""Scale check: the demo's workload with instant agents at many concurrent participants.

Every participant joins, sends turns through the runtime topics and leaves, with
telemetry on (a real Telemetry with its own registry, no-op tracer). Reports turns per
second, router CPU per turn, peak and per-participant memory, and checks that no turn is
lost and no task is left after stop().

    .venv/bin/python benchmarks/bench_scale.py [--participants 10000] [--turns 3]
        [--freeze] [--profile N]
    .venv/bin/python benchmarks/bench_scale.py --baseline TREE [--rounds 3]
    .venv/bin/python benchmarks/bench_scale.py --publish-batches 1,16,64 [--rounds 3]

`--baseline TREE` compares another checkout (e.g. `git worktree add /tmp/old REV`) with
this one: the timing pass of this very script runs in a fresh process per tree and round
(`PYTHONPATH=<tree>/src`), interleaved, so both trees see the same machine; the ratio of
what one core holds is what to quote on a shared machine whose speed drifts.
`--publish-batches` interleaves this tree under several `AgentRuntime(publish_batch=)`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import pstats
import random
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from prometheus_client import CollectorRegistry

from turnrouter import AgentRouter, AgentTurn, DestinationResult
from turnrouter.decisions import LexicalDecisions
from turnrouter.demo import DESCRIPTIONS, SimulatedAgent, load_sample
from turnrouter.runtime import (
    AgentRuntime,
    ParticipantJoined,
    ParticipantLeft,
    ResponseOutput,
    Topic,
    UserQuery,
)
from turnrouter.telemetry import Telemetry

QUERY = Topic("scale.query", UserQuery)
OUTPUT = Topic("scale.output", ResponseOutput)
JOINED = Topic("scale.joined", ParticipantJoined)
LEFT = Topic("scale.left", ParticipantLeft)
#: This checkout's sources (what `--baseline` and `--publish-batches` time as "this").
THIS_TREE = Path(__file__).resolve().parents[1] / "src"


class InstantAgent(SimulatedAgent):
    """The demo's agent without the wait: answers at once."""

    async def answer(
        self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
    ) -> DestinationResult:
        await started()
        return DestinationResult("answer", text=f"[{self.name}] done")


async def run(participants: int, turns: int, seed: int, *, trace_memory: bool,
              freeze: bool = False, publish_batch: int | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    sample = load_sample()
    truth = {text: (domain, intent) for text, domain, intent in sample.queries}

    async def publish(turn: AgentTurn, route: str, text: str) -> None:
        return None

    agents = {name: InstantAgent(name, rng=rng, truth=truth, publish=publish)
              for name in DESCRIPTIONS}
    registry = CollectorRegistry()
    router = AgentRouter(agents, LexicalDecisions(examples=sample.examples),
                         telemetry=Telemetry(registry=registry),
                         query_topic=QUERY, output_topic=OUTPUT,
                         participant_joined_topic=JOINED, participant_left_topic=LEFT)
    queries = [text for text, _, _ in sample.queries]
    gc.collect()
    if freeze:
        # What `turnrouter worker` does once the app is built: start-up objects (imported
        # modules, the decision model) leave the collector's generations for good.
        gc.freeze()
    if trace_memory:
        tracemalloc.start()
    base_memory = tracemalloc.get_traced_memory()[0]
    published = 0
    collector = _CollectorTime()
    gc.callbacks.append(collector)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    phases = _Phases(collector)
    peak_state = 0
    batch = {} if publish_batch is None else {"publish_batch": publish_batch}
    async with AgentRuntime(**batch) as runtime:
        runtime.register(router.runtime_subscriber())
        for i in range(participants):
            await runtime.publish(JOINED, ParticipantJoined(participant_id=f"p{i}"))
        phases.mark("joins", participants)
        for _ in range(turns):
            for i in range(participants):
                await runtime.publish(QUERY, UserQuery(participant_id=f"p{i}",
                                                       text=rng.choice(queries)))
                published += 1
            await anyio.wait_all_tasks_blocked()
            phases.mark("turns", participants)
        peak_state = tracemalloc.get_traced_memory()[0] - base_memory
        held = len(router.participants)
        for i in range(participants):
            await runtime.publish(LEFT, ParticipantLeft(participant_id=f"p{i}"))
    await router.stop()
    phases.mark("departures", participants)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    gc.callbacks.remove(collector)
    gc.unfreeze()
    _, peak = tracemalloc.get_traced_memory()
    if trace_memory:
        tracemalloc.stop()
    finished = sum(
        sample.value for family in registry.collect() for sample in family.samples
        if sample.name == "turnrouter_turns_total")
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    return {
        "participants": participants, "published": published, "finished": finished,
        "wall": wall, "cpu": cpu, "peak": peak - base_memory, "state": peak_state,
        "held": held, "after_stop": len(router.participants), "tasks_left": len(leftover),
        "gc": sum(collector.seconds), "gc_full": collector.seconds[2],
        "gc_full_runs": collector.runs[2], "gc_longest": collector.longest[2],
        "phases": phases.totals,
    }


class _Phases:
    """CPU and collector seconds per phase of a pass (joins, turn rounds, departures
    with stop()) and the items (joins, turns, departures) they cover, summed by name."""

    def __init__(self, collector: _CollectorTime) -> None:
        self._collector = collector
        self._cpu, self._gc = time.process_time(), sum(collector.seconds)
        self.totals: dict[str, dict[str, float]] = {}

    def mark(self, name: str, items: int) -> None:
        cpu, gc_seconds = time.process_time(), sum(self._collector.seconds)
        total = self.totals.setdefault(name, {"cpu": 0.0, "gc": 0.0, "items": 0})
        total["items"] += items
        total["cpu"] += cpu - self._cpu
        total["gc"] += gc_seconds - self._gc
        self._cpu, self._gc = cpu, gc_seconds


class _CollectorTime:
    """Time spent in the cyclic garbage collector, per generation (a `gc.callbacks` hook)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.runs = [0, 0, 0]
        self.longest = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            generation = info["generation"]
            pause = time.perf_counter() - self._t0
            self.seconds[generation] += pause
            self.runs[generation] += 1
            self.longest[generation] = max(self.longest[generation], pause)


def profile(participants: int, turns: int, seed: int, top: int) -> None:
    """Print the `top` functions by own time of one pass, as shares of the whole."""
    profiler = cProfile.Profile()
    profiler.enable()
    r = asyncio.run(run(participants, turns, seed, trace_memory=False))
    profiler.disable()
    stats = pstats.Stats(profiler)
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in entries.values())
    print(f"profile of {r['finished']:.0f} turns: top {top} functions by own time")
    ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:top]
    for (path, line, name), (_, calls, own, _cumulative, _) in ranked:
        where = f"{Path(path).name}:{line}" if line else path
        print(f"  {own / total * 100:5.1f}%  {calls / r['finished']:6.2f} calls/turn  "
              f"{name} ({where})")


def compare(baseline: Path, rounds: int, extra: list[str]) -> None:
    """Interleaved rounds of the timing pass, `baseline`'s tree then this one, each in
    a fresh process; prints what one core holds per round and the ratio of medians."""
    trees = {"baseline": baseline.resolve() / "src", "this": THIS_TREE}
    if not (trees["baseline"] / "turnrouter" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {baseline}: no src/turnrouter there")
    held, _ = _interleaved({name: (src, extra) for name, src in trees.items()}, rounds)
    medians = {name: statistics.median(values) for name, values in held.items()}
    print(json.dumps({
        "one_core_holds_turns_per_s": {name: [round(v) for v in values]
                                       for name, values in held.items()},
        "median": {name: round(v) for name, v in medians.items()},
        "ratio_this_over_baseline": round(medians["this"] / medians["baseline"], 3),
        "ratio_by_round": [round(t / b, 3) for b, t in zip(held["baseline"], held["this"],
                                                             strict=True)],
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }, indent=2))


def sweep_batches(batches: list[int], rounds: int, extra: list[str]) -> None:
    """Interleaved rounds of this tree's timing pass under each `publish_batch`; prints
    what one core holds and each phase's CPU per item, as medians, and each batch's
    ratio to the first."""
    runs = {f"publish_batch={n}": (THIS_TREE, [*extra, f"--publish-batch={n}"])
            for n in batches}
    held, phases = _interleaved(runs, rounds)
    first = statistics.median(next(iter(held.values())))
    print(json.dumps({name: {
        "one_core_holds_turns_per_s": round(statistics.median(values)),
        "ratio_to_first": round(statistics.median(values) / first, 3),
        "us_each_by_phase": {phase: round(statistics.median(p[phase] for p in phases[name]))
                             for phase in phases[name][0]},
    } for name, values in held.items()} | {
        "load_average": [round(x, 2) for x in os.getloadavg()]}, indent=2))


def _interleaved(runs: dict[str, tuple[Path, list[str]]], rounds: int
                 ) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """`rounds` rounds of the timing pass for each (tree, arguments) in turn, each in a
    fresh process: what one core holds, and µs per item by phase, per round."""
    held: dict[str, list[float]] = {name: [] for name in runs}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (src, extra) in runs.items():
            out = subprocess.run(
                [sys.executable, __file__, "--json", *extra], check=True, text=True,
                capture_output=True, env={**os.environ, "PYTHONPATH": str(src)},
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            if r["finished"] != r["published"]:
                raise SystemExit(f"{name}: {r['published'] - r['finished']:.0f} turns lost")
            held[name].append(r["finished"] / r["cpu"])
            phases[name].append({phase: spent["cpu"] / spent["items"] * 1e6
                                 for phase, spent in r.get("phases", {}).items()})
    return held, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--participants", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--freeze", action="store_true",
                        help="call gc.freeze() once the router is built, as the worker CLI "
                             "does (start-up objects no longer walked by full collections)")
    parser.add_argument("--publish-batch", type=int, metavar="N",
                        help="AgentRuntime(publish_batch=N): publications between the "
                             "publisher's yields to the loop (default: the runtime's; with "
                             "--baseline, both trees must accept it)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="instead, profile one timing pass and print its top N "
                             "functions by own time (cProfile: slower, shares are what count)")
    parser.add_argument("--json", action="store_true",
                        help="run the timing pass only and print its figures as JSON")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="compare another checkout with this one, interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--publish-batches", metavar="N,N,...",
                        help="compare publish batches on this tree, interleaved")
    args = parser.parse_args()
    if args.baseline is not None:
        extra = [f"--participants={args.participants}", f"--turns={args.turns}",
                 f"--seed={args.seed}", *(["--freeze"] if args.freeze else []),
                 *([f"--publish-batch={args.publish_batch}"]
                   if args.publish_batch is not None else [])]
        compare(args.baseline, args.rounds, extra)
        return
    if args.publish_batches is not None:
        try:
            batches = [int(n) for n in args.publish_batches.split(",")]
        except ValueError:
            parser.error(f"--publish-batches takes integers separated by commas, got "
                         f"{args.publish_batches[:40]!r}")
        sweep_batches(batches, args.rounds, [f"--participants={args.participants}",
                                             f"--turns={args.turns}", f"--seed={args.seed}"])
        return
    if args.json:
        print(json.dumps(asyncio.run(run(args.participants, args.turns, args.seed,
                                         trace_memory=False, freeze=args.freeze,
                                         publish_batch=args.publish_batch))))
        return
    if args.profile:
        profile(args.participants, args.turns, args.seed, args.profile)
        return
    # Timing and memory in separate passes: tracemalloc slows Python down severalfold.
    r = asyncio.run(run(args.participants, args.turns, args.seed, trace_memory=False,
                        freeze=args.freeze, publish_batch=args.publish_batch))
    m = asyncio.run(run(args.participants, args.turns, args.seed, trace_memory=True,
                        freeze=args.freeze, publish_batch=args.publish_batch))
    r["peak"], r["state"] = m["peak"], m["state"]
    print(f"participants            {r['participants']:.0f} concurrent, {args.turns} turns each")
    print(f"turns                   {r['finished']:.0f} finished of {r['published']:.0f} "
          f"published (lost: {r['published'] - r['finished']:.0f})")
    print(f"throughput              {r['finished'] / r['wall']:.0f} turns/s "
          f"(wall {r['wall']:.2f} s)")
    print(f"router CPU per turn     {r['cpu'] / r['finished'] * 1e6:.0f} µs "
          "(whole process: lexical decisions, telemetry, runtime included)")
    print(f"one core holds          {r['finished'] / r['cpu']:.0f} turns/s "
          "(1 / CPU per turn: what the wall figure is on an otherwise idle core)")
    print(f"garbage collector       {r['gc'] / r['finished'] * 1e6:.0f} µs per turn, of it "
          f"{r['gc_full'] / r['finished'] * 1e6:.0f} µs in {r['gc_full_runs']} full "
          "collections (their count and cost grow with the participants held); the "
          f"longest stalled the event loop {r['gc_longest'] * 1e3:.0f} ms")
    print("by phase                " + "; ".join(
        f"{name} {phase['cpu'] / phase['items'] * 1e6:.0f} µs each "
        f"({phase['gc'] / phase['items'] * 1e6:.0f} µs collector)"
        for name, phase in r["phases"].items()))
    print(f"peak traced memory      {r['peak'] / 1e6:.1f} MB; state held with every "
          f"participant present: {r['state'] / 1e6:.1f} MB "
          f"({r['state'] / r['participants']:.0f} B/participant)")
    print(f"max RSS                 {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f}"
          " MB")
    print(f"after stop()            {r['after_stop']:.0f} participants held, "
          f"{r['tasks_left']:.0f} tasks left (held before departures: {r['held']:.0f})")


if __name__ == "__main__":
    main()
