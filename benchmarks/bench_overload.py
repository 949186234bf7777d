"""The overload curve: goodput and first response from 0.5x to 4x of one process' capacity.

Each step runs the shipped demo (`turnrouter demo`: participants speak on their own
schedule, as real callers do, and speak again when an answer is late) in a fresh
interpreter, at `--participants` participants and a time compression of `--speed`
times the step's multiple; `--speed` is the load one process serves (calibrate it with
`--probe`, which prints the steps of the starting tree only). With `--base DIR` every
step also runs the tree in `DIR` (e.g. `git worktree add ../base <the starting commit>`), and the
two trees alternate step by step, round by round, so a noisy machine hits both alike.

With `--cpu-clock` each demo's event loop runs on a clock that counts only the process'
own CPU time and the waits it would have slept: a dedicated core on a shared machine,
whatever else runs there (durations and rates are in that clock).

`--cost` instead measures what admission control costs an unloaded router: the same
turns through `AgentRouter.handle()` with `overload=None` and with the default policy,
alternating, in one process (µs per turn, median of the rounds).

Per step and tree: answers/s (turns answered: answer, focus or release), shed turns/s
(outcome `busy`), interrupted turns/s, and the p95 first response of answered turns in
seconds of the simulated conversations (times the step's speed, so steps compare).

    .venv/bin/python benchmarks/bench_overload.py --speed 1 --base ../base-overload \\
        [--participants 1000] [--duration 20] [--rounds 1] [--steps 0.5,1,2,3,4] \\
        [--json out.json] [--plot docs/overload.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

from bench_router import FirstCandidate, InstantAgent, _noop_output, _turns

from turnrouter import AgentRouter, OverloadPolicy
from turnrouter.telemetry import Telemetry

#: Run inside the fresh interpreter (either tree): one demo run, its figures as JSON.
CHILD = r"""
import asyncio, json, selectors, sys, time, anyio, io
from turnrouter.demo import DemoConfig, run_demo
from turnrouter.demo._report import histogram_quantile
participants, speed, duration = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
fields = dict(duration=duration, participants=participants, speed=speed, progress=False)
if sys.argv[5] != "default":  # the demo's policy with OverloadPolicy(max_busy_fraction=)
    import functools
    import turnrouter.demo._run as demo_run
    from turnrouter import OverloadPolicy
    demo_run.OverloadPolicy = functools.partial(OverloadPolicy,
                                                max_busy_fraction=float(sys.argv[5]))
if sys.argv[4] == "cpu":
    # (the loop's busy time on this clock: its CPU time, the run queue aside)
    import turnrouter._clock as clock
    clock.loop_busy_time = time.thread_time
    # A dedicated core, whatever else runs: the loop's clock is this process' CPU time
    # plus the waits it would have slept (the demo does no I/O), and time.monotonic (the
    # router's SystemClock, the demo's elapsed time) reads the same clock.
    cpu = time.process_time

    class Selector(selectors.DefaultSelector):
        loop = None

        def select(self, timeout=None):
            ready = super().select(None if timeout is None else 0)
            if not ready and timeout:
                self.loop.offset += timeout
            return ready

    class Loop(asyncio.SelectorEventLoop):
        def __init__(self):
            selector, self.offset = Selector(), 0.0
            super().__init__(selector)
            selector.loop = self
            time.monotonic = self.time

        def time(self):
            return cpu() + self.offset

    with asyncio.Runner(loop_factory=Loop) as runner:
        report = runner.run(run_demo(DemoConfig(**fields), out=io.StringIO()))
else:
    report = anyio.run(lambda: run_demo(DemoConfig(**fields), out=io.StringIO()))
turns = report.turns
answered = sum(v for (r, o), v in turns.items() if o in ("answer", "focus", "release"))
print(json.dumps({
    "elapsed": report.elapsed,
    "answered": answered,
    "busy": sum(v for (r, o), v in turns.items() if o == "busy"),
    "interrupted": sum(v for (r, o), v in turns.items() if o == "interrupted"),
    "turns": report.total_turns,
    "p95": histogram_quantile(0.95, report.overall_first_response()),
    "lost": report.lost_turns,
}))
"""


@dataclass
class Step:
    tree: str
    multiple: float
    speed: float
    answers_per_s: float
    shed_per_s: float
    interrupted_per_s: float
    turns_per_s: float
    p95_simulated_s: float
    lost: int


def run_step(tree: Path, participants: int, speed: float, duration: float,
             clock: str = "wall", busy_fraction: float | None = None) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    share = "default" if busy_fraction is None else str(busy_fraction)
    done = subprocess.run([sys.executable, "-c", CHILD, str(participants), str(speed),
                           str(duration), clock, share], env=env, capture_output=True, text=True,
                          timeout=duration * 10 + 120, check=False)
    if done.returncode:
        raise RuntimeError(f"demo in {tree} at speed {speed} failed: {done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def measure(trees: dict[str, Path], args: argparse.Namespace) -> list[Step]:
    runs: dict[tuple[str, float], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for multiple in args.steps:
            order = list(trees.items())
            if round_ % 2:
                order.reverse()
            for name, tree in order:
                speed = args.speed * multiple
                one = run_step(tree, args.participants, speed, args.duration,
                               "cpu" if args.cpu_clock else "wall",
                               args.max_busy_fraction if name == "after" else None)
                runs.setdefault((name, multiple), []).append(one)
                print(f"round {round_ + 1} {name:>5} x{multiple:g} (speed {speed:g}): "
                      f"{one['answered'] / one['elapsed']:.0f} answers/s, "
                      f"{one['busy'] / one['elapsed']:.0f} shed/s, p95 "
                      f"{one['p95'] * speed:.2f} s", file=sys.stderr, flush=True)
    steps = []
    for (name, multiple), figures in runs.items():
        speed = args.speed * multiple

        def rate(key: str, figures: list[dict[str, float]] = figures) -> float:
            return median(f[key] / f["elapsed"] for f in figures)

        steps.append(Step(name, multiple, speed, rate("answered"), rate("busy"),
                          rate("interrupted"), rate("turns"),
                          median(f["p95"] for f in figures) * speed,
                          int(sum(f["lost"] for f in figures))))
    return steps


def table(steps: list[Step]) -> str:
    rows = ["| tree | load | answers/s | shed turns/s | interrupted/s | p95 first response "
            "(simulated s) | lost |", "|---|---:|---:|---:|---:|---:|---:|"]
    for step in sorted(steps, key=lambda s: (s.tree, s.multiple)):
        rows.append(f"| {step.tree} | {step.multiple:g}x | {step.answers_per_s:.0f} | "
                    f"{step.shed_per_s:.0f} | {step.interrupted_per_s:.0f} | "
                    f"{step.p95_simulated_s:.2f} | {step.lost} |")
    return "\n".join(rows)


def plot(steps: list[Step], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for tree in sorted({s.tree for s in steps}):
        mine = sorted((s for s in steps if s.tree == tree), key=lambda s: s.multiple)
        xs = [s.multiple for s in mine]
        left.plot(xs, [s.answers_per_s for s in mine], marker="o", label=tree)
        right.plot(xs, [s.p95_simulated_s for s in mine], marker="o", label=tree)
    left.set(xlabel="offered load (x capacity)", ylabel="answers/s", title="goodput")
    right.set(xlabel="offered load (x capacity)", ylabel="s (simulated)",
              title="p95 first response")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")


async def _timed(overload: OverloadPolicy | None, turns: int) -> float:
    """CPU seconds per turn of `turns` sequential turns (100 participants), telemetry
    on; the sampler runs beside them (every turn yields to the loop once)."""
    from prometheus_client import CollectorRegistry

    agents = {name: InstantAgent(name) for name in ("weather", "calendar", "conversation")}
    router = AgentRouter(agents, FirstCandidate(), output=_noop_output, overload=overload,
                         telemetry=Telemetry(registry=CollectorRegistry()))
    batch = _turns(turns, 100)
    start = time.process_time()  # CPU time: less exposed to a shared machine's noise
    for turn in batch:
        await router.handle(turn)
        await asyncio.sleep(0)
    elapsed = time.process_time() - start
    await router.stop()
    return elapsed / turns


def cost(turns: int, rounds: int) -> str:
    """Admission control's cost per turn: off and on alternating, medians (CPU time)."""
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(rounds):
        order = [("off", None), ("on", OverloadPolicy())]
        for name, policy in order if round_ % 2 == 0 else order[::-1]:
            seconds[name].append(asyncio.run(_timed(policy, turns)))
    off, on = median(seconds["off"]), median(seconds["on"])
    return (f"admission control off: {off * 1e6:.1f} us/turn, on: {on * 1e6:.1f} us/turn "
            f"({(on / off - 1) * 100:+.1f}%, median of {rounds} alternating rounds of "
            f"{turns} turns)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=1.0,
                        help="demo speed one process serves (the 1x step)")
    parser.add_argument("--cost", action="store_true",
                        help="measure admission control's per-turn cost instead")
    parser.add_argument("--participants", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=lambda v: [float(x) for x in v.split(",")],
                        default=[0.5, 1.0, 2.0, 3.0, 4.0])
    parser.add_argument("--base", type=Path, help="the starting tree, run side by side")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="run each demo on a clock of its own CPU time and idle waits "
                             "(a dedicated core on a shared machine; durations in it)")
    parser.add_argument("--max-busy-fraction", type=float, default=None,
                        help="run this tree's demo with OverloadPolicy(max_busy_fraction=) "
                             "(the base tree keeps its default)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.cost:
        print(cost(20_000, max(args.rounds, 5)))
        return
    here = Path(__file__).resolve().parents[1]
    trees = {"after": here}
    if args.base is not None:
        trees = {"before": args.base.resolve(), "after": here}
    steps = measure(trees, args)
    print(table(steps))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(s) for s in steps], indent=1) + "\n")
    if args.plot is not None:
        plot(steps, args.plot)


if __name__ == "__main__":
    main()
