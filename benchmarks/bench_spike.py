"""Traffic spikes past one process' capacity, in process: what the participants who were
already talking hear while a crowd arrives.

Each answered turn costs `--burn-ms` of CPU on the event loop (a destination's own
work: parsing, serialising, a small model) and awaits `--think` seconds (an LLM call),
so the process answers about 1000 / burn-ms turns a second. `--steady` participants
speak once a second throughout. Then new participants arrive:

- `burst`: `--crowd` new participants send their first turn in one loop pass (a front
  end flushing its buffer after a hiccup), then speak once a second;
- `ramp`: `--crowd` new participants arrive spread over `--ramp-secs` and speak once a
  second for `--spike-secs` (a sustained spike of crowd / capacity times);
- `voice`: a voice deployment under capacity whose destinations are LLM calls:
  `--crowd` callers arrive spread over `--spike-secs`, each speaks every 3-5 s for
  `--call-secs`, then hangs up (`participant_left`); the steady participants speak
  every 4 s; every answer awaits 0.5-2 s (so dozens of turns are always in flight).
  Run it with `--hiccup-every 4 --hiccup-secs 0.3`: admission control must not mistake
  a hiccup for saturation.

`--hiccup-every S --hiccup-secs H` (any mode) blocks the event loop with H seconds of
CPU every S seconds (a collector pause, a blocking call in a destination).

Printed (and written with `--json`): per group (steady, crowd) and phase, the turns
answered and refused busy, p95 and max latency of the answered ones, and the longest
stretch of the run in which the steady participants got no answer (`stall_secs`): a
router that admits past its capacity stalls everyone. Per group also the participants
never admitted (every turn refused) and the longest time a participant was refused
from its first refused turn until a turn of it was admitted (`longest_refused_secs`).
Wall-clock figures on a shared machine: compare runs made side by side (`--overload
none` runs the router without admission control, `--max-busy-fraction 0.75` with the
projected busy fraction).

    .venv/bin/python benchmarks/bench_spike.py burst --crowd 1000
    .venv/bin/python benchmarks/bench_spike.py ramp --crowd 1500 --spike-secs 20
    .venv/bin/python benchmarks/bench_spike.py voice --crowd 400 --hiccup-every 4 \
        --hiccup-secs 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from turnrouter import (
    AgentRouter,
    AgentTurn,
    Destination,
    DestinationResult,
    OverloadPolicy,
    RouterBusyError,
)
from turnrouter.telemetry import Telemetry
from turnrouter.testing import ScriptedDecisions


def burn(ms: float) -> None:
    """Hold the event loop for `ms` milliseconds of CPU (a destination's own work)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


class Working(Destination):
    """Burns `burn_ms` on the loop, then awaits `think` seconds (a number, or a range
    drawn from uniformly per answer)."""

    def __init__(self, burn_ms: float, think: float | tuple[float, float]) -> None:
        super().__init__("everything")
        self._burn_ms, self._think = burn_ms, think
        self._random = random.Random(7)

    async def answer(self, turn: AgentTurn, *, started: Callable[[], Awaitable[None]]
                     ) -> DestinationResult:
        await started()
        burn(self._burn_ms)
        think = self._think
        await asyncio.sleep(think if isinstance(think, float) else self._random.uniform(*think))
        return DestinationResult(text="answer")


async def hiccups(every: float, secs: float) -> None:
    """Block the loop with `secs` of CPU every `every` seconds, until cancelled."""
    while True:
        await asyncio.sleep(every)
        burn(secs * 1000)


async def _silent(turn: AgentTurn, route: str, text: str) -> None:
    return None


@dataclass
class Record:
    pid: str
    group: str  # "steady" or "crowd"
    phase: str  # "before", "spike", "after"
    start: float
    end: float
    outcome: str  # "answered", "busy", or the error's type
    projected: bool = False  # refused by the projected busy fraction, not by lag


@dataclass
class Run:
    router: AgentRouter
    t0: float
    records: list[Record] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def turn(self, group: str, phase: str, pid: str, turn_id: str, last: bool = False
             ) -> None:
        task = asyncio.get_running_loop().create_task(
            self._one(group, phase, pid, turn_id, last))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _one(self, group: str, phase: str, pid: str, turn_id: str, last: bool
                   ) -> None:
        start = time.perf_counter()
        projected = False
        try:
            await self.router.handle(AgentTurn(pid, turn_id, "hello"))
            outcome = "answered"
        except RouterBusyError as exc:
            outcome, projected = "busy", "leaves no room" in str(exc)
        except Exception as exc:  # counted by type: a benchmark reports, never stops
            outcome = type(exc).__name__
        self.records.append(Record(pid, group, phase, start - self.t0,
                                   time.perf_counter() - self.t0, outcome, projected))
        if last and pid in self.router.participants:  # the caller hangs up
            await self.router.participant_left(pid)


async def scenario(args: argparse.Namespace) -> dict[str, object]:
    overload = OverloadPolicy() if args.overload == "default" else None
    if args.max_busy_fraction is not None:
        overload = OverloadPolicy(max_busy_fraction=args.max_busy_fraction)
    think = (0.5, 2.0) if args.mode == "voice" else args.think
    router = AgentRouter({"conversation": Working(args.burn_ms, think)},
                         ScriptedDecisions("conversation"), output=_silent,
                         telemetry=Telemetry.disabled(), overload=overload)
    run = Run(router, time.perf_counter())
    spike_at = args.warm_secs
    spike_end = spike_at + args.spike_secs
    end = spike_end + args.recover_secs
    # (due time, group, participant) in time order; each turn schedules the next.
    agenda: list[tuple[float, str, str]] = [
        (i / args.steady, "steady", f"s{i}") for i in range(args.steady)]
    # Voice callers: each speaks every 3-5 s (its own period) for --call-secs.
    periods = random.Random(11)
    every = {f"c{i}": periods.uniform(3.0, 5.0) if args.mode == "voice" else 1.0
             for i in range(args.crowd)}
    hangs_up: dict[str, float] = {}
    steady_every = 4.0 if args.mode == "voice" else 1.0
    if args.mode == "burst":
        agenda += [(spike_at, "crowd", f"c{i}") for i in range(args.crowd)]
    elif args.mode == "ramp":
        agenda += [(spike_at + args.ramp_secs * i / args.crowd, "crowd", f"c{i}")
                   for i in range(args.crowd)]
    else:
        agenda += [(spike_at + args.spike_secs * i / args.crowd, "crowd", f"c{i}")
                   for i in range(args.crowd)]
        hangs_up = {pid: due + args.call_secs for due, group, pid in agenda
                    if group == "crowd"}
        end = max(end, max(hangs_up.values(), default=end))
    heapq.heapify(agenda)
    turns: Counter[str] = Counter()
    hiccup = (asyncio.get_running_loop().create_task(
        hiccups(args.hiccup_every, args.hiccup_secs)) if args.hiccup_every > 0 else None)
    while agenda:
        due, group, pid = heapq.heappop(agenda)
        now = time.perf_counter() - run.t0
        if due > now:
            await asyncio.sleep(due - now)
        phase = "before" if due < spike_at else "spike" if due < spike_end else "after"
        turns[pid] += 1
        following = due + (every[pid] if group == "crowd" else steady_every)
        if pid in hangs_up:
            more = following < hangs_up[pid]
        else:
            more = following < end and (group == "steady" or following < spike_end)
        run.turn(group, phase, pid, f"t{turns[pid]}", last=pid in hangs_up and not more)
        if more:
            heapq.heappush(agenda, (following, group, pid))
    async with asyncio.timeout(max(args.think, 2.0) + 60):
        while run.tasks:
            await asyncio.wait(set(run.tasks))
    if hiccup is not None:
        hiccup.cancel()
    await router.stop()
    return summary(run.records, end)


def summary(records: list[Record], end: float) -> dict[str, object]:
    """Outcomes and latencies per group and phase; the steady participants' longest
    stretch without an answer (from the first answer on)."""
    groups: dict[str, dict[str, object]] = {}
    by: defaultdict[tuple[str, str], list[Record]] = defaultdict(list)
    for record in records:
        by[(record.group, record.phase)].append(record)
    for (group, phase), rows in sorted(by.items()):
        latencies = sorted(r.end - r.start for r in rows if r.outcome == "answered")
        groups[f"{group}/{phase}"] = {
            "outcomes": dict(Counter(r.outcome for r in rows)),
            "p95_secs": round(latencies[int(0.95 * (len(latencies) - 1))], 3)
            if latencies else None,
            "max_secs": round(latencies[-1], 3) if latencies else None}
    for group in sorted({r.group for r in records}):
        groups[group] = refusals([r for r in records if r.group == group])
    answers = sorted(r.end for r in records if r.group == "steady" and r.outcome == "answered")
    gaps = [b - a for a, b in itertools.pairwise(answers)]
    return {"groups": groups, "stall_secs": round(max(gaps, default=end), 3),
            "turns": len(records)}


def refusals(records: list[Record]) -> dict[str, object]:
    """Participants never admitted (every turn refused busy), and the longest time one
    was held back: from a refused turn's start until a later turn of it was admitted
    (or its last turn, when none was)."""
    by: defaultdict[str, list[Record]] = defaultdict(list)
    for record in sorted(records, key=lambda r: r.start):
        by[record.pid].append(record)
    never, longest = 0, 0.0
    for rows in by.values():
        never += all(r.outcome == "busy" for r in rows)
        since: float | None = None
        for row in rows:
            if row.outcome == "busy":
                since = row.start if since is None else since
                longest = max(longest, row.start - since)
            elif since is not None:
                longest, since = max(longest, row.start - since), None
    return {"participants": len(by), "never_admitted": never,
            "turns_refused": sum(r.outcome == "busy" for r in records),
            "turns_refused_projected": sum(r.projected for r in records),
            "turns_answered": sum(r.outcome == "answered" for r in records),
            "longest_refused_secs": round(longest, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["burst", "ramp", "voice"])
    parser.add_argument("--crowd", type=int, default=1000)
    parser.add_argument("--steady", type=int, default=40)
    parser.add_argument("--burn-ms", type=float, default=4.0)
    parser.add_argument("--think", type=float, default=0.3)
    parser.add_argument("--warm-secs", type=float, default=3.0)
    parser.add_argument("--spike-secs", type=float, default=10.0)
    parser.add_argument("--ramp-secs", type=float, default=2.0)
    parser.add_argument("--recover-secs", type=float, default=5.0)
    parser.add_argument("--call-secs", type=float, default=20.0,
                        help="voice: how long each caller stays")
    parser.add_argument("--hiccup-every", type=float, default=0.0,
                        help="block the loop every this many seconds (0: never)")
    parser.add_argument("--hiccup-secs", type=float, default=0.3)
    parser.add_argument("--overload", choices=["default", "none"], default="default")
    parser.add_argument("--max-busy-fraction", type=float, default=None,
                        help="OverloadPolicy(max_busy_fraction=...) (default: the policy's)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.crowd < 1 or args.steady < 1 or args.burn_ms < 0 or args.think < 0:
        parser.error("--crowd and --steady must be at least 1; times not negative")
    figures = asyncio.run(scenario(args))
    figures["args"] = vars(args)
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
