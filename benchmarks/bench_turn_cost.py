"""Per-turn cost of the router, deterministic and A/B against another source tree.

Two measures of one plain answered turn (instant agents, first-candidate decisions):

- bytecodes executed per turn (`sys.settrace` opcode events): deterministic, so it
  compares two versions on a machine too noisy for wall-clock ratios;
- microseconds per turn, both versions imported into one process and measured in
  interleaved rounds (minimum and median over the rounds).

    .venv/bin/python benchmarks/bench_turn_cost.py [--metrics] [--baseline OLD/src]
    .venv/bin/python benchmarks/bench_turn_cost.py --worker [--by-file] [--baseline OLD/src]
    .venv/bin/python benchmarks/bench_turn_cost.py --paced 300 [--seconds 5]

`--worker` runs the turn a NATS worker runs (`bench_distributed:make_router`): one
destination, telemetry on, a `RouteTimingPredictor` and a sink writing each sample's JSON
line, `route_turn()` with output callbacks, then the participant's snapshot JSON (the
record write); `--by-file` splits its bytecodes by source file.

`--paced RATE` runs that worker turn one every 1/RATE s, as a paced worker does, and
prints its CPU per turn above the same pacing loop running no turn: the router's share
of a paced worker's CPU (`bench_distributed.py --floor` runs it in every round).

`--baseline` names another checkout's `src` directory (e.g. `git worktree add /tmp/old
<commit>`, then `/tmp/old/src`); its `turnrouter` is copied under another package name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

_ROUTES = ("weather", "calendar", "conversation")


def build(pkg: types.ModuleType, metrics: bool, turns: int) -> tuple[Any, list[Any]]:
    """A router over instant agents, and `turns` turns for 100 participants."""
    accept, result = pkg.Admission("accept"), pkg.DestinationResult("answer", "done")

    class Agent:
        def __init__(self, name: str) -> None:
            self.aid = pkg.RoutingAid(name, f"{name} requests")

        def routing_aid(self, participant_id: str) -> Any:
            return self.aid

        async def admit(self, turn: Any, *, focused: bool) -> Any:
            return accept

        async def answer(self, turn: Any, *, started: Any) -> Any:
            await started()
            return result

        async def release(self, participant_id: str) -> None:
            return None

    class First:
        async def decide(self, request: Any) -> Any:
            return pkg.RouteDecision(request.candidates[0].name)

    async def output(turn: Any, route: str, text: str) -> None:
        return None

    import importlib

    from prometheus_client import CollectorRegistry

    telemetry_module = importlib.import_module(f"{pkg.__name__}.telemetry")
    telemetry = (telemetry_module.Telemetry(registry=CollectorRegistry()) if metrics
                 else telemetry_module.Telemetry.disabled())
    router = pkg.AgentRouter({name: Agent(name) for name in _ROUTES}, First(),
                             output=output, telemetry=telemetry)
    return router, [pkg.AgentTurn(f"p{i % 100}", f"t{i}", "what's the weather")
                    for i in range(turns)]


def build_worker(pkg: types.ModuleType, turns: int) -> tuple[Any, list[Any]]:
    """What a NATS worker's turn runs on the router (see `--worker`): a callable running
    one turn, and `turns` turns for 100 participants."""
    import importlib

    from prometheus_client import CollectorRegistry

    result = pkg.DestinationResult("answer", "done")

    class Instant:
        def routing_aid(self, participant_id: str) -> Any:
            return pkg.RoutingAid("instant", "answers at once")

        async def admit(self, turn: Any, *, focused: bool) -> Any:
            return pkg.Admission("accept")

        async def answer(self, turn: Any, *, started: Any) -> Any:
            await started()
            return result

        async def release(self, participant_id: str) -> None:
            return None

    class First:
        async def decide(self, request: Any) -> Any:
            return pkg.RouteDecision("instant")

    class Sink:  # the fleet's sink: one JSON line per sample
        def __init__(self) -> None:
            self.lines: list[str] = []

        def record(self, sample: Any) -> None:
            self.lines.append(sample.to_json())
            if len(self.lines) > 64:
                self.lines.clear()

    async def output(turn: Any, route: str, text: str) -> None:
        return None

    telemetry_module = importlib.import_module(f"{pkg.__name__}.telemetry")
    router = pkg.AgentRouter({"instant": Instant()}, First(), default_destination="instant",
                             telemetry=telemetry_module.Telemetry(registry=CollectorRegistry()),
                             timing_predictor=pkg.RouteTimingPredictor(), timing_sink=Sink())

    async def one(turn: Any) -> None:
        with router.continue_trace({}):
            await router.route_turn(turn, output=output, ending=output)
        router.export_participant_json(turn.participant_id)

    return one, [pkg.AgentTurn(f"p{i % 100}", f"t{i}", "what's the weather")
                 for i in range(turns)]


def bytecodes_per_turn(pkg: types.ModuleType, metrics: bool, worker: bool = False,
                       by_file: dict[str, int] | None = None) -> float:
    """Bytecodes per turn over 1,800 turns after 200 of warm-up; `by_file` (when given)
    receives the count of each source file (the package's own by module name)."""
    if worker:
        one, turns = build_worker(pkg, 2000)
    else:
        router, turns = build(pkg, metrics, 2000)
        one = router.handle
    count = 0
    prefix = str(Path(pkg.__file__ or "").parent)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
            if by_file is not None:
                name = frame.f_code.co_filename
                name = ("turnrouter" + name[len(prefix):] if name.startswith(prefix)
                        else name.rsplit("site-packages/", 1)[-1])
                by_file[name] = by_file.get(name, 0) + 1
        return tracer

    async def run() -> None:
        for turn in turns[:200]:  # warm the caches (children, label tuples)
            await one(turn)
        sys.settrace(tracer)
        try:
            for turn in turns[200:]:
                await one(turn)
        finally:
            sys.settrace(None)

    asyncio.run(run())
    return count / 1800


def microseconds(packages: dict[str, types.ModuleType], metrics: bool, rounds: int,
                 turns: int, worker: bool = False) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in packages}

    async def run(one: Any, batch: list[Any]) -> float:
        start = time.perf_counter()
        for turn in batch:
            await one(turn)
        return (time.perf_counter() - start) / len(batch) * 1e6

    for _ in range(rounds):
        for name, pkg in packages.items():
            if worker:
                one, batch = build_worker(pkg, turns)
            else:
                router, batch = build(pkg, metrics, turns)
                one = router.handle
            results[name].append(asyncio.run(run(one, batch)))
    return results


def paced(pkg: types.ModuleType, rate: float, seconds: float) -> dict[str, float]:
    """The worker's turn alone (no NATS), one turn every 1/`rate` s for `seconds`, as a
    paced worker runs it: process CPU per turn, the CPU per tick of the same pacing loop
    running no turn, and their difference (the router's share of a paced worker turn).
    200 participants with 30 exchanges of history each, as `bench_distributed.py`'s."""
    one, _ = build_worker(pkg, 0)
    participants = 200

    async def loop(run_turns: bool) -> float:
        clock = asyncio.get_running_loop()
        if run_turns:
            for i in range(participants * 30):
                await one(pkg.AgentTurn(f"p{i % participants}", f"w{i}", "what's the weather"))
        ticks, due = 0, clock.time()
        cpu, end = time.process_time(), clock.time() + seconds
        while clock.time() < end:
            due += 1 / rate
            if (wait := due - clock.time()) > 0:
                await asyncio.sleep(wait)
            if run_turns:
                await one(pkg.AgentTurn(f"p{ticks % participants}", f"t{ticks}",
                                        "what's the weather"))
            ticks += 1
        return (time.process_time() - cpu) / ticks * 1e6

    empty = asyncio.run(loop(False))
    turn = asyncio.run(loop(True))
    return {"turn_us": round(turn, 1), "empty_loop_us": round(empty, 1),
            "router_us": round(turn - empty, 1)}


def load_baseline(src: Path) -> types.ModuleType:
    """The other tree's `turnrouter`, imported as `turnrouter_baseline`."""
    target = Path(tempfile.mkdtemp()) / "turnrouter_baseline"
    shutil.copytree(src / "turnrouter", target)
    sys.path.insert(0, str(target.parent))
    import importlib

    return importlib.import_module("turnrouter_baseline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics", action="store_true", help="telemetry with metrics on")
    parser.add_argument("--baseline", type=Path, help="another checkout's src directory")
    parser.add_argument("--worker", action="store_true",
                        help="the NATS worker's turn (telemetry, predictor, sink, snapshot)")
    parser.add_argument("--by-file", action="store_true",
                        help="split the bytecodes per turn by source file")
    parser.add_argument("--paced", type=float, metavar="RATE",
                        help="the worker's turn paced at RATE turns/s: CPU per turn above "
                             "an empty pacing loop, as JSON (with --seconds)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--turns", type=int, default=5000)
    args = parser.parse_args()
    import turnrouter

    if args.paced is not None:
        print(json.dumps(paced(turnrouter, args.paced, args.seconds)))
        return
    packages = {"this tree": turnrouter}
    if args.baseline is not None:
        packages["baseline"] = load_baseline(args.baseline)
    mode = ("worker" if args.worker else "metrics on" if args.metrics
            else "telemetry off")
    files: dict[str, dict[str, int]] = {}
    for name, pkg in packages.items():
        files[name] = {}
        count = bytecodes_per_turn(pkg, args.metrics, args.worker,
                                   files[name] if args.by_file else None)
        print(f"{name:10} bytecodes per turn ({mode}): {count:8.0f}")
    if args.by_file:
        names = sorted(set().union(*files.values()),
                       key=lambda f: -max(counts.get(f, 0) for counts in files.values()))
        print(f"{'per turn, by file':50}" + "".join(f"{name:>12}" for name in files))
        for file in names:
            if max(counts.get(file, 0) for counts in files.values()) >= 1800:
                print(f"{file[-50:]:50}" + "".join(
                    f"{counts.get(file, 0) / 1800:12.0f}" for counts in files.values()))
    times = microseconds(packages, args.metrics, args.rounds, args.turns, args.worker)
    for name, values in times.items():
        print(f"{name:10} µs per turn ({mode}): min {min(values):6.2f}  "
              f"median {statistics.median(values):6.2f}  ({args.rounds} interleaved rounds)")
    if "baseline" in times:
        ratio = min(times["this tree"]) / min(times["baseline"])
        print(f"this tree / baseline (minimum): {ratio:.3f}")


if __name__ == "__main__":
    main()
