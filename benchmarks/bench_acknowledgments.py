"""Acknowledgment timing: predictive policy against the fixed delay, through the real router.

Replays turns whose first-response latencies follow route-specific distributions (fast,
slow, bimodal, drifting up, drifting down) through `AgentRouter` on a `ManualClock`
(virtual time: deterministic, no sleeping). The acknowledgment LLM takes a random
generation time on the same clock. Both policies see the same latencies and generation
times, at the same fallback delay:

- fixed: no prediction; generation starts at the delay, spoken when ready;
- predictive: the default `RouteTimingPredictor` (decayed histogram restarted by its
  change detector); a confident prediction whose lower bound (p10) exceeds the delay
  makes the acknowledgment heard at `early_secs`.

Per route: p50/p95 silence (admission to the first thing heard), acknowledgment rate,
and needless-acknowledgment rate (the answer started within 300 ms after the
acknowledgment was spoken), per turn.

    .venv/bin/python benchmarks/bench_acknowledgments.py [--turns 1000] [--delay 1.0]
        [--seed 7] [--half-life 100] [--change-threshold 8|none]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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


def draw(route: str, index: int, total: int, rng: random.Random) -> float:
    """One first-response latency of `route` for its `index`-th turn out of `total`."""
    second_half = index >= total // 2
    if route == "fast":
        return _lognormal(rng, 0.35, 0.4)
    if route == "slow":
        return _lognormal(rng, 2.5, 0.3)
    if route == "bimodal":
        return _lognormal(rng, 0.3, 0.3) if rng.random() < 0.55 else _lognormal(rng, 3.0, 0.3)
    if route == "drift_up":
        return _lognormal(rng, 2.5, 0.3) if second_half else _lognormal(rng, 0.4, 0.3)
    if route == "drift_down":
        return _lognormal(rng, 0.4, 0.3) if second_half else _lognormal(rng, 2.5, 0.3)
    raise ValueError(route)


ROUTES = ("fast", "slow", "bimodal", "drift_up", "drift_down")


@dataclass
class Plan:
    route: str
    latency: float
    generation: float


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
            tg.start_soon(run, AgentTurn(f"p-{plan.route}", f"t{index}", "please help"))
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


def summarize(facts: list[TurnFacts], route: str) -> Row:
    mine = [f for f in facts if f.route == route]
    silences = [f.silence for f in mine if f.silence is not None]
    acks = [f for f in mine if f.ack_at is not None]
    needless = [f for f in acks if f.started_at is not None and f.ack_at is not None
                and 0.0 <= f.started_at - f.ack_at <= NEEDLESS_WINDOW]
    return Row(route, len(mine), _quantile(silences, 0.5), _quantile(silences, 0.95),
               len(acks) / len(mine), len(needless) / len(mine))


def make_plans(turns: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    per_route: dict[str, list[float]] = {
        route: [draw(route, i, turns, rng) for i in range(turns)] for route in ROUTES}
    order = [route for route in ROUTES for _ in range(turns)]
    rng.shuffle(order)
    counters = dict.fromkeys(ROUTES, 0)
    plans = []
    for route in order:
        latency = per_route[route][counters[route]]
        counters[route] += 1
        plans.append(Plan(route, latency, _lognormal(rng, 0.3, 0.3)))
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1000, help="turns per route")
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--early", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--half-life", type=float, default=100.0,
                        help="RouteTimingPredictor half_life_samples")
    parser.add_argument("--change-threshold", default="8",
                        help="RouteTimingPredictor change_threshold ('none': no detection)")
    args = parser.parse_args()
    threshold = None if args.change_threshold.lower() == "none" else float(args.change_threshold)
    plans = make_plans(args.turns, args.seed)
    policy = AcknowledgmentPolicy(early_secs=args.early)
    began = time.perf_counter()
    fixed = asyncio.run(replay(plans, NoPrediction(), args.delay, policy))
    predictor = RouteTimingPredictor(half_life_samples=args.half_life,
                                     change_threshold=threshold)
    predictive = asyncio.run(replay(plans, predictor, args.delay, policy))
    elapsed = time.perf_counter() - began
    print(f"{len(plans)} turns per policy ({args.turns} per route), delay {args.delay}s, "
          f"early {args.early}s, half-life {args.half_life:g}, "
          f"change threshold {args.change_threshold}, seed {args.seed}, "
          f"generation ~0.3s; "
          f"replayed in {elapsed:.1f}s wall")
    print("| route | policy | p50 silence | p95 silence | ack rate | needless rate | "
          "p95 cut |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for route in ROUTES:
        a, b = summarize(fixed, route), summarize(predictive, route)
        cut = 1.0 - b.p95 / a.p95
        for name, row, extra in (("fixed", a, ""), ("predictive", b, f"{cut:+.0%}")):
            print(f"| {route} | {name} | {row.p50:.2f}s | {row.p95:.2f}s | {row.ack_rate:.1%} | "
                  f"{row.needless_rate:.1%} | {extra} |")
    overall_a = statistics.fmean(summarize(fixed, r).needless_rate for r in ROUTES)
    overall_b = statistics.fmean(summarize(predictive, r).needless_rate for r in ROUTES)
    print(f"mean needless rate over routes: fixed {overall_a:.2%}, predictive {overall_b:.2%}")
    print("changes detected: " + ", ".join(f"{r} {predictor.changes(r)}" for r in ROUTES))


if __name__ == "__main__":
    main()
