"""Acknowledgment timing: predictive policy against the fixed delay, through the real router.

Replays turns whose first-response latencies follow route-specific shapes through
`AgentRouter` on a `ManualClock` (virtual time: deterministic, no sleeping): the existing
fast, slow, bimodal, drift_up and drift_down, and mostly_slow / slow85 (about 90 % / 87 %
of answers a little slower than the delay, the rest just under it), flipflop (fast and
overloaded regimes alternating every 20-60 turns), cold (a slow route with traffic only
in the second half), heavy_fast / heavy_slow (4 % of answers 10-30x the median) and
request (latency grows with the request's length). The acknowledgment LLM takes a
random generation time on the same clock. Both policies see the same latencies,
requests and generation times, at the same fallback delay:

- fixed: no prediction; generation starts at the delay, spoken when ready;
- predictive: `RouteTimingPredictor` (defaults, or `--set name=value`); its trigger
  makes the acknowledgment heard at `early_secs`.

Per route and seed: p50/p95 silence (admission to the first thing heard),
acknowledgment rate, needless-acknowledgment rate (the answer started within 300 ms
after the acknowledgment was spoken), and the share of answers later than the delay;
then a verdict table against the issue's goals over `--turns` x `--seeds` (and against
another source tree's predictor with `--baseline SRC`).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_acknowledgments.py [--turns 300,1000]
        [--seeds 1,2,3,4,5] [--delay 1.0] [--set confidence=0.8] [--feature none]
        [--baseline OTHER/src] [--detail]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from turnrouter import (
    AcknowledgmentPolicy,
    Admission,
    AgentRouter,
    AgentTurn,
    DestinationResult,
    Prediction,
    RouteDecision,
    RouteRequest,
    RouterObserver,
    RouteTimingPredictor,
    RoutingAid,
    TimingPredictor,
    TimingSample,
    TurnObserver,
)
from turnrouter.events import AcknowledgmentFinished, SilenceMeasured, TurnStarted
from turnrouter.llm import TemplateAcknowledger
from turnrouter.testing import ManualClock

NEEDLESS_WINDOW = 0.3


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(count))


_VOCABULARY = ("book", "flight", "meeting", "tomorrow", "compare", "prices", "weather",
               "summary", "report", "please", "calendar", "Paris", "hotel", "week")


class Shape:
    """One route's latency shape: `draw(index, total)` gives (seconds, query)."""

    def __init__(self, rng: random.Random, total: int, delay: float) -> None:
        self.rng, self.total, self.delay = rng, total, delay
        self.regime_slow = False
        self.regime_left = 0

    def draw(self, route: str, index: int) -> tuple[float, str]:
        rng, total, delay = self.rng, self.total, self.delay
        ln = _lognormal
        # Requests of any length; only the `request` route's latency depends on it.
        query = _words(rng, rng.choice((2, 3, 4, 5, 6)) if rng.random() < 0.5
                       else rng.randint(7, 40))
        if route == "fast":
            return ln(rng, 0.35, 0.4), query
        if route == "slow":
            return ln(rng, 2.5, 0.3), query
        if route == "bimodal":
            return (ln(rng, 0.3, 0.3) if rng.random() < 0.55 else ln(rng, 3.0, 0.3)), query
        if route == "drift_up":
            return ln(rng, 2.5 if index >= total // 2 else 0.4, 0.3), query
        if route == "drift_down":
            return ln(rng, 0.4 if index >= total // 2 else 2.5, 0.3), query
        if route in ("mostly_slow", "slow85"):
            # ~90 % (~87 %) of answers a little slower than the delay, the rest just under.
            if rng.random() < (0.9 if route == "mostly_slow" else 0.87):
                return delay * (1.02 + ln(rng, 0.45, 0.5)), query
            return delay * rng.uniform(0.7, 0.98), query
        if route == "flipflop":
            # A back end alternating between fast and overloaded every 20-60 turns.
            if self.regime_left <= 0:
                self.regime_slow = not self.regime_slow if index else rng.random() < 0.5
                self.regime_left = rng.randint(20, 60)
            self.regime_left -= 1
            return ln(rng, 2.2 if self.regime_slow else 0.4, 0.3), query
        if route == "cold":
            # A slow route that only gets traffic in the second half (a new destination).
            return ln(rng, 1.8, 0.3), query
        if route == "heavy_fast":
            tail = rng.uniform(10.0, 30.0) if rng.random() < 0.04 else 1.0
            return ln(rng, 0.3, 0.35) * tail, query
        if route == "heavy_slow":
            tail = rng.uniform(10.0, 30.0) if rng.random() < 0.04 else 1.0
            return ln(rng, 1.6, 0.3) * tail, query
        if route == "request":
            # Latency grows with the request: short lookups are fast, long asks slow.
            words = rng.choice((2, 3, 4, 5, 6)) if rng.random() < 0.5 else rng.randint(14, 40)
            return ln(rng, 0.08 * words + 0.1, 0.25), _words(rng, words)
        raise ValueError(route)


ROUTES = ("fast", "slow", "bimodal", "drift_up", "drift_down", "mostly_slow", "slow85",
          "flipflop", "cold", "heavy_fast", "heavy_slow", "request")
EXISTING = ("fast", "slow", "bimodal", "drift_up", "drift_down")


@dataclass
class Plan:
    route: str
    latency: float
    generation: float
    query: str = "please help"


@dataclass
class TurnFacts:
    route: str
    silence: float | None = None
    ack_at: float | None = None
    started_at: float | None = None


class NoPrediction:
    """The fixed-delay policy: a predictor that never predicts."""

    def predict(self, route: str, turn: AgentTurn) -> Prediction | None:
        return None

    def record(self, sample: TimingSample, turn: AgentTurn | None = None) -> None:
        return None

    def estimate(self, route: str) -> float | None:
        return None


class _Turn(TurnObserver):
    __slots__ = ("facts",)

    def __init__(self, facts: TurnFacts) -> None:
        self.facts = facts

    def acknowledgment(self, event: AcknowledgmentFinished) -> None:
        if event.outcome == "emitted":
            self.facts.ack_at = event.ended_at

    def silence(self, event: SilenceMeasured) -> None:
        self.facts.silence = event.seconds


@dataclass
class Observer(RouterObserver):
    current: TurnFacts | None = None
    turns: list[TurnFacts] = field(default_factory=list)

    def turn_started(self, event: TurnStarted) -> TurnObserver:
        assert self.current is not None
        return _Turn(self.current)


class Agent:
    def __init__(self, name: str, clock: ManualClock, observer: Observer) -> None:
        self.aid = RoutingAid(name, f"handles {name} requests")
        self.clock, self.observer = clock, observer
        self.latency = 0.0

    def routing_aid(self, participant_id: str) -> RoutingAid:
        return self.aid

    async def admit(self, turn: AgentTurn, *, focused: bool) -> Admission:
        return Admission("accept")

    async def answer(self, turn: AgentTurn, *,
                     started: Callable[[], Awaitable[None]]) -> DestinationResult:
        t0 = self.clock.now()
        await self.clock.sleep_until(t0 + self.latency)
        assert self.observer.current is not None
        self.observer.current.started_at = self.clock.now()
        await started()
        return DestinationResult("answer", "")

    async def release(self, participant_id: str) -> None:
        return None


class ClockLLM(TemplateAcknowledger):
    """Template text after a generation time on the manual clock."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        self.clock = clock
        self.generation = 0.3

    async def acknowledge(self, request: Any) -> str:
        await self.clock.sleep_until(self.clock.now() + self.generation)
        return await super().acknowledge(request)


class Chooser:
    def __init__(self) -> None:
        self.route = ""

    async def decide(self, request: RouteRequest) -> RouteDecision:
        return RouteDecision(self.route)


async def _noop(turn: AgentTurn, route: str, text: str) -> None:
    return None


async def replay(plans: list[Plan], predictor: TimingPredictor, delay: float,
                 policy: AcknowledgmentPolicy) -> list[TurnFacts]:
    clock = ManualClock()
    observer = Observer()
    agents = {name: Agent(name, clock, observer) for name in ROUTES}
    llm = ClockLLM(clock)
    chooser = Chooser()
    router = AgentRouter(agents, chooser, output=_noop, default_destination="fast",
                         acknowledgment_llm=llm, acknowledgment_delay_secs=delay,
                         acknowledgment_policy=policy, timing_predictor=predictor,
                         clock=clock, telemetry=observer)
    facts: list[TurnFacts] = []
    for index, plan in enumerate(plans):
        chooser.route = plan.route
        agents[plan.route].latency = plan.latency
        llm.generation = plan.generation
        observer.current = TurnFacts(plan.route)
        done = anyio.Event()

        async def run(turn: AgentTurn, done: anyio.Event = done) -> None:
            try:
                await router.handle(turn)
            finally:
                done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, AgentTurn(f"p-{plan.route}", f"t{index}", plan.query))
            await clock.run_until(done, limit=clock.now() + 3600)
        facts.append(observer.current)
    return facts


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Row:
    route: str
    turns: int
    p50: float
    p95: float
    ack_rate: float
    needless_rate: float
    late_share: float


def summarize(facts: list[TurnFacts], plans: list[Plan], route: str, delay: float) -> Row:
    mine = [f for f in facts if f.route == route]
    late = [p for p in plans if p.route == route and p.latency > delay]
    silences = [f.silence for f in mine if f.silence is not None]
    acks = [f for f in mine if f.ack_at is not None]
    needless = [f for f in acks if f.started_at is not None and f.ack_at is not None
                and 0.0 <= f.started_at - f.ack_at <= NEEDLESS_WINDOW]
    return Row(route, len(mine), _quantile(silences, 0.5), _quantile(silences, 0.95),
               len(acks) / len(mine), len(needless) / len(mine), len(late) / len(mine))


def make_plans(turns: int, seed: int, delay: float,
               routes: tuple[str, ...] = ROUTES) -> list[Plan]:
    """`turns` turns per route, interleaved at random (the `cold` route only in the
    second half of the run); latencies and generation times drawn from `seed`."""
    rng = random.Random(seed)
    shape = Shape(rng, turns, delay)
    by_route: dict[str, list[Plan]] = {}
    slots: list[tuple[float, str]] = []
    for route in routes:
        shape.regime_left = 0
        for i in range(turns):
            latency, query = shape.draw(route, i)
            by_route.setdefault(route, []).append(
                Plan(route, latency, _lognormal(rng, 0.3, 0.3), query))
            slots.append((rng.uniform(0.5, 1.0) if route == "cold" else rng.random(), route))
    slots.sort()
    # Each route's turns keep their generated order (drifts and regimes stay in place).
    counters = dict.fromkeys(routes, 0)
    plans = []
    for _, route in slots:
        plans.append(by_route[route][counters[route]])
        counters[route] += 1
    return plans


def run_case(turns: int, seed: int, delay: float, early: float,
             make_predictor: Callable[[], TimingPredictor]) -> dict[str, tuple[Row, Row]]:
    """Fixed delay and predictive replays of one seed: (fixed, predictive) per route."""
    plans = make_plans(turns, seed, delay)
    policy = AcknowledgmentPolicy(early_secs=early)
    fixed = asyncio.run(replay(plans, NoPrediction(), delay, policy))
    predictive = asyncio.run(replay(plans, make_predictor(), delay, policy))
    return {route: (summarize(fixed, plans, route, delay),
                    summarize(predictive, plans, route, delay)) for route in ROUTES}


def goal(route: str, late_share: float) -> float | None:
    """The p95 silence cut the issue asks for on this route (None: no cut required)."""
    if route == "flipflop":
        return 0.20
    if late_share >= 0.85:
        return 0.40
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="300,1000", help="turns per route (list)")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--early", type=float, default=0.25)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a RouteTimingPredictor setting, e.g. --set confidence=0.8")
    parser.add_argument("--baseline", default=None, metavar="SRC",
                        help="also replay the RouteTimingPredictor of another source tree "
                             "(e.g. a checkout of the previous commit's src) and compare")
    parser.add_argument("--feature", choices=("default", "none", "query_length"),
                        default="default",
                        help="RouteTimingPredictor feature (per-turn query length classes)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--detail", action="store_true", help="print every seed's table")
    args = parser.parse_args()
    turns_list = [int(x) for x in args.turns.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    settings: dict[str, Any] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        settings[name] = None if value == "none" else float(value)
    if args.feature == "none":
        settings["feature"] = None
    elif args.feature == "query_length":
        from turnrouter import query_length_class  # not in older trees (--baseline)

        settings["feature"] = query_length_class

    began = time.perf_counter()
    results = {(t, seed): run_case(t, seed, args.delay, args.early,
                                   lambda: RouteTimingPredictor(**settings))
               for t in turns_list for seed in seeds}
    elapsed = time.perf_counter() - began
    if args.json:
        print(json.dumps({f"{t}/{seed}": {r: [asdict(a), asdict(b)] for r, (a, b) in case.items()}
                          for (t, seed), case in results.items()}))
        return
    baseline: dict[tuple[int, int], dict[str, Row]] = {}
    if args.baseline:
        command = [sys.executable, __file__, "--json", "--turns", args.turns,
                   "--seeds", args.seeds, "--delay", str(args.delay), "--early", str(args.early)]
        env = dict(os.environ, PYTHONPATH=args.baseline)
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        for key, case in json.loads(out.stdout).items():
            t, seed = (int(x) for x in key.split("/"))
            baseline[t, seed] = {r: Row(**pair[1]) for r, pair in case.items()}

    described = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in settings.items())
    described = described or "defaults"
    print(f"delay {args.delay}s, early {args.early}s, generation ~0.3s, turns per route "
          f"{args.turns}, seeds {args.seeds}, RouteTimingPredictor({described}); "
          f"{sum(len(ROUTES) * 2 * t for t, _ in results)} turns replayed in {elapsed:.0f}s wall")
    if args.detail:
        for (t, seed), case in results.items():
            print(f"\n{t} turns per route, seed {seed}")
            print("| route | late | policy | p50 silence | p95 silence | ack rate | needless "
                  "| p95 cut |")
            print("|---|---:|---|---:|---:|---:|---:|---:|")
            for route, (a, b) in case.items():
                print(f"| {route} | {a.late_share:.0%} | fixed | {a.p50:.2f}s | {a.p95:.2f}s | "
                      f"{a.ack_rate:.1%} | {a.needless_rate:.1%} | |")
                print(f"| {route} | | predictive | {b.p50:.2f}s | {b.p95:.2f}s | "
                      f"{b.ack_rate:.1%} | {b.needless_rate:.1%} | {1 - b.p95 / a.p95:+.0%} |")
    header = "| turns | route | late | fixed p95 | predictive p95 | p95 cut (min..max) | goal "
    header += "| needless fixed -> predictive (worst delta) |"
    header += " previous p95 / needless |" if baseline else ""
    print("\nPer route over the seeds (median p95; cut range over seeds; needless: mean "
          "rates, worst per-seed difference in points):")
    print(header + " verdict |")
    print("|---|---|---:|---:|---:|---|---|---|" + ("---|" if baseline else "") + "---|")
    failures = 0
    for t in turns_list:
        for route in ROUTES:
            pairs = [results[t, seed][route] for seed in seeds]
            cuts = [1 - b.p95 / a.p95 for a, b in pairs]
            deltas = [b.needless_rate - a.needless_rate for a, b in pairs]
            late = statistics.fmean(a.late_share for a, _ in pairs)
            # The goal applies per seed: to each sample whose own late share qualifies.
            targets = [goal(route, a.late_share) for a, _ in pairs]
            judged = [(cut, t) for cut, t in zip(cuts, targets, strict=True) if t is not None]
            target = max((t for _, t in judged), default=None)
            verdicts = []
            if judged:
                missed = sum(cut < t for cut, t in judged)
                verdicts.append("cut ok" if not missed else
                                f"CUT MISSED in {missed} of {len(judged)} seeds")
            verdicts.append("needless ok" if max(deltas) <= 0.01 + 1e-9 else "NEEDLESS OVER")
            extra = ""
            if baseline:
                old = [baseline[t, seed][route] for seed in seeds]
                worse = any(b.p95 > o.p95 * 1.02 + 1e-9
                            or b.needless_rate > o.needless_rate + 0.005
                            for (_, b), o in zip(pairs, old, strict=True))
                extra = (f" {statistics.median(o.p95 for o in old):.2f}s / "
                         f"{statistics.fmean(o.needless_rate for o in old):.1%} |")
                if route in EXISTING:
                    verdicts.append("WORSE THAN BEFORE" if worse else "not worse")
            failures += sum(v.split()[0].isupper() for v in verdicts)
            print(f"| {t} | {route} | {late:.0%} | "
                  f"{statistics.median(a.p95 for a, _ in pairs):.2f}s | "
                  f"{statistics.median(b.p95 for _, b in pairs):.2f}s | "
                  f"{statistics.median(cuts):+.0%} ({min(cuts):+.0%}..{max(cuts):+.0%}) | "
                  f"{'' if target is None else f'>= {target:.0%} ({len(judged)} seeds)'} | "
                  f"{statistics.fmean(a.needless_rate for a, _ in pairs):.1%} -> "
                  f"{statistics.fmean(b.needless_rate for _, b in pairs):.1%} "
                  f"({max(deltas) * 100:+.1f}) |{extra} {', '.join(verdicts)} |")
    print(f"\n{failures} goal(s) missed")


if __name__ == "__main__":
    main()
