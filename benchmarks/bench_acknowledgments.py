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
acknowledgment rate, needless-acknowledgment rate (the answer started within
`--needless-window` after the acknowledgment was spoken: 0.5 s by default, as
`turnrouter_needless_acknowledgments_total` counts), the share of answers later than
the delay, and how often the trigger's decision changed; then a verdict table against
the issue's goals over `--turns` x `--seeds` (and against other source trees'
predictors with `--baseline SRC`, repeatable).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_acknowledgments.py [--turns 300,1000]
        [--seeds 1-20] [--delay 1.0] [--set confidence=0.8] [--feature none]
        [--routes slow85,bimodal] [--needless-window 0.3] [--baseline OTHER/src] [--detail]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import math
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from _trees import import_tree

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
    query_length_class,
)
from turnrouter.events import AcknowledgmentFinished, SilenceMeasured, TurnStarted
from turnrouter.llm import TemplateAcknowledger
from turnrouter.testing import ManualClock

try:  # the metric's window; older trees (--baseline) may not have it
    from turnrouter.telemetry import NEEDLESS_WITHIN_SECONDS as NEEDLESS_WINDOW
except ImportError:  # pragma: no cover - only under an old --baseline tree
    NEEDLESS_WINDOW = 0.5


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
        return self.probe(route, index, query)

    def probe(self, route: str, index: int, query: str) -> tuple[float, str]:
        """The probe shapes (`PROBES`): not the issue's, shapes its goals were not tuned
        on, to see how the trigger holds up beyond them."""
        rng, total, delay = self.rng, self.total, self.delay
        ln = _lognormal
        if route == "wide":
            # One broad distribution centred on the delay: early is about as costly as not.
            return delay * ln(rng, 1.0, 0.8), query
        if route == "ramp":
            # A back end slowing down steadily over the run, 0.4 s to 2.5 s.
            return ln(rng, 0.4 + 2.1 * index / total, 0.3), query
        if route == "just_over":
            # Nearly every answer a little after the delay.
            return delay * ln(rng, 1.15, 0.08), query
        if route == "periodic":
            # Slow for a third of every 90 turns (a daily peak, compressed).
            return ln(rng, 2.0 if index % 90 < 30 else 0.4, 0.3), query
        if route == "near_fast":
            # Mostly a little under the delay, 15 % at 1.5x it.
            return delay * (ln(rng, 1.5, 0.2) if rng.random() < 0.15 else ln(rng, 0.8, 0.1)), query
        if route == "slow_tail90":
            # 90 % far slower than the delay, the rest instant.
            return (ln(rng, 4.0, 0.3) if rng.random() < 0.9 else ln(rng, 0.2, 0.3)), query
        raise ValueError(route)


ROUTES = ("fast", "slow", "bimodal", "drift_up", "drift_down", "mostly_slow", "slow85",
          "flipflop", "cold", "heavy_fast", "heavy_slow", "request")
EXISTING = ("fast", "slow", "bimodal", "drift_up", "drift_down")
PROBES = ("wide", "ramp", "just_over", "periodic", "near_fast", "slow_tail90")
"""Shapes beyond the issue's (`--probes`): drawn after every default route's, so adding
them leaves the default routes' plans as they were."""


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
    trigger: str | None = None


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
        self.facts.trigger = event.trigger
        if event.outcome == "emitted":
            self.facts.ack_at = event.ended_at

    def silence(self, event: SilenceMeasured) -> None:
        self.facts.silence = event.seconds


@dataclass
class Observer(RouterObserver):
    enabled = True  # the router builds events only for an enabled observer
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
    agents = {name: Agent(name, clock, observer) for name in ROUTES + PROBES}
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
    switches: int = 0


def summarize(facts: list[TurnFacts], plans: list[Plan], route: str, delay: float,
              window: float = NEEDLESS_WINDOW) -> Row:
    mine = [f for f in facts if f.route == route]
    late = [p for p in plans if p.route == route and p.latency > delay]
    silences = [f.silence for f in mine if f.silence is not None]
    acks = [f for f in mine if f.ack_at is not None]
    needless = [f for f in acks if f.started_at is not None and f.ack_at is not None
                and 0.0 <= f.started_at - f.ack_at <= window]
    triggers = [f.trigger for f in mine if f.trigger is not None]
    switches = sum(a != b for a, b in itertools.pairwise(triggers))
    return Row(route, len(mine), _quantile(silences, 0.5), _quantile(silences, 0.95),
               len(acks) / len(mine), len(needless) / len(mine), len(late) / len(mine),
               switches)


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
             make_predictor: Callable[[], TimingPredictor], routes: tuple[str, ...] = ROUTES,
             window: float = NEEDLESS_WINDOW) -> dict[str, tuple[Row, Row]]:
    """Fixed delay and predictive replays of one seed: (fixed, predictive) per route.
    The plans are those of all routes (the same for any `routes`), replayed for
    `routes` only."""
    probes = tuple(route for route in PROBES if route in routes)
    plans = [p for p in make_plans(turns, seed, delay, ROUTES + probes) if p.route in routes]
    policy = AcknowledgmentPolicy(early_secs=early)
    fixed = asyncio.run(replay(plans, NoPrediction(), delay, policy))
    predictive = asyncio.run(replay(plans, make_predictor(), delay, policy))
    return {route: (summarize(fixed, plans, route, delay, window),
                    summarize(predictive, plans, route, delay, window)) for route in routes}


def goal(route: str, late_share: float) -> float | None:
    """The p95 silence cut the issue asks for on this route (None: no cut required)."""
    if route == "flipflop":
        return 0.20
    if late_share >= 0.85:
        return 0.40
    return None


# ---------------------------------------------------------------- other trees' predictors


class Foreign:
    """Another source tree's `RouteTimingPredictor` behind this tree's protocol (its
    predictions converted), so both run through this tree's router."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._with_turn = len(inspect.signature(inner.record).parameters) > 1

    def predict(self, route: str, turn: AgentTurn) -> Prediction | None:
        p = self.inner.predict(route, turn)
        if p is None:
            return None
        return Prediction(p.seconds, p.lower, p.upper, p.samples, p.confident,
                          getattr(p, "probability_late", None), getattr(p, "early", None))

    def record(self, sample: TimingSample, turn: AgentTurn | None = None) -> None:
        if self._with_turn:
            self.inner.record(sample, turn)
        else:
            self.inner.record(sample)

    def estimate(self, route: str) -> float | None:
        value = self.inner.estimate(route)
        return None if value is None else float(value)


def foreign_factory(src: str, alias: str, delay: float) -> Callable[[], TimingPredictor]:
    """A factory of `src`'s default predictor (its package imported as `alias`)."""
    cls = import_tree(src, alias).RouteTimingPredictor
    kwargs = {"delay_secs": delay} if "delay_secs" in inspect.signature(cls).parameters else {}
    return lambda: Foreign(cls(**kwargs))


# ---------------------------------------------------------------- the report


def _seeds(text: str) -> list[int]:
    """"1,2,5" or "1-20" (or a mix: "1-5,9")."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high) + 1) if high else [int(low)])
    return seeds


def _verdicts(route: str, seeds: list[int], pairs: list[tuple[Row, Row]],
              befores: dict[str, list[Row]]) -> list[str]:
    """The goals judged on one route over the seeds (upper case: missed)."""
    cuts = [1 - b.p95 / a.p95 for a, b in pairs]
    deltas = [b.needless_rate - a.needless_rate for a, b in pairs]
    verdicts = []
    if any(math.isnan(c) for c in cuts):
        verdicts.append("NO SILENCE MEASURED")
    # The goal applies per seed: to each sample whose own late share qualifies.
    missed = [(seed, cut) for seed, cut, (a, _) in zip(seeds, cuts, pairs, strict=True)
              if (target := goal(route, a.late_share)) is not None and cut < target]
    judged = sum(goal(route, a.late_share) is not None for a, _ in pairs)
    if judged:
        verdicts.append("cut ok" if not missed else f"CUT MISSED in {len(missed)} of {judged} "
                        "seeds (" + ", ".join(f"seed {s}: {c:+.0%}" for s, c in missed) + ")")
    over = [(seed, d) for seed, d in zip(seeds, deltas, strict=True) if d > 0.01 + 1e-9]
    verdicts.append("needless ok" if not over else "NEEDLESS OVER in " + ", ".join(
        f"seed {s} ({d * 100:+.1f})" for s, d in over))
    for name, before in befores.items():
        if route not in EXISTING:
            break
        worse = [seed for seed, (_, b), o in zip(seeds, pairs, before, strict=True)
                 if b.p95 > o.p95 * 1.02 + 1e-9 or b.needless_rate > o.needless_rate + 0.005]
        label = name.split(" ")[0]
        verdicts.append(f"not worse than {label}" if not worse else
                        f"WORSE THAN {label} in seeds " + ", ".join(map(str, worse)))
    return verdicts


def report(results: dict[tuple[int, int], dict[str, tuple[Row, Row]]], turns_list: list[int],
           seeds: list[int], routes: tuple[str, ...],
           baselines: dict[str, dict[tuple[int, int], dict[str, tuple[Row, Row]]]]
           ) -> tuple[int, int]:
    """Print the goal table; the number of goals missed on the issue's shapes and on
    the probe shapes."""
    names = list(baselines)
    header = ("| turns | route | late | fixed p95 | predictive p95 | p95 cut median (min..max) "
              "| goal | needless fixed -> predictive (worst delta) | decision changes med/max |")
    header += "".join(f" {name}: p95 / needless |" for name in names)
    print("\nPer route over the seeds (median p95; cut range over seeds; needless: mean "
          "rates, worst per-seed difference in points; decision changes: trigger switches "
          "per run):")
    print(header + " verdict |")
    print("|---|---|---:|---:|---:|---|---|---|---|" + "---|" * len(names) + "---|")
    failures = [0, 0]
    for t in turns_list:
        for route in routes:
            pairs = [results[t, seed][route] for seed in seeds]
            cuts = [1 - b.p95 / a.p95 for a, b in pairs]
            deltas = [b.needless_rate - a.needless_rate for a, b in pairs]
            targets = [g for a, _ in pairs if (g := goal(route, a.late_share)) is not None]
            switches = [b.switches for _, b in pairs]
            befores = {name: [baselines[name][t, seed][route][1] for seed in seeds]
                       for name in names}
            verdicts = _verdicts(route, seeds, pairs, befores)
            failures[route in PROBES] += sum(v.split()[0].isupper() for v in verdicts)
            extra = "".join(
                f" {statistics.median(o[t, s][route][1].p95 for s in seeds):.2f}s / "
                f"{statistics.fmean(o[t, s][route][1].needless_rate for s in seeds):.1%} |"
                for o in baselines.values())
            print(f"| {t} | {route} | {statistics.fmean(a.late_share for a, _ in pairs):.0%} | "
                  f"{statistics.median(a.p95 for a, _ in pairs):.2f}s | "
                  f"{statistics.median(b.p95 for _, b in pairs):.2f}s | "
                  f"{statistics.median(cuts):+.0%} ({min(cuts):+.0%}..{max(cuts):+.0%}) | "
                  f"{f'>= {max(targets):.0%} ({len(targets)} seeds)' if targets else ''} | "
                  f"{statistics.fmean(a.needless_rate for a, _ in pairs):.1%} -> "
                  f"{statistics.fmean(b.needless_rate for _, b in pairs):.1%} "
                  f"({max(deltas) * 100:+.1f}) | "
                  f"{statistics.median(switches):g} / {max(switches)} |{extra} "
                  f"{', '.join(verdicts)} |")
    return failures[0], failures[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="300,1000", help="turns per route (list)")
    parser.add_argument("--seeds", default="1-20", help='seeds: "1,2,3" or "1-20"')
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--early", type=float, default=0.25)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a RouteTimingPredictor setting, e.g. --set confidence=0.8")
    parser.add_argument("--baseline", action="append", default=[], metavar="SRC",
                        help="also replay the default RouteTimingPredictor of another source "
                             "tree (its src directory), through this tree's router; the "
                             "existing shapes must be no worse than with any of them "
                             "(repeatable)")
    parser.add_argument("--feature", choices=("default", "none", "query_length"),
                        default="default",
                        help="RouteTimingPredictor feature (per-turn query length classes)")
    parser.add_argument("--routes", default=",".join(ROUTES),
                        help="only these routes (their latencies are drawn as in a full run)")
    parser.add_argument("--probes", action="store_true",
                        help="also replay the probe shapes (" + ", ".join(PROBES) + "): "
                             "beyond the issue's, their goals reported apart")
    parser.add_argument("--needless-window", type=float, default=NEEDLESS_WINDOW,
                        help=f"seconds after an acknowledgment within which the answer "
                             f"makes it needless (default {NEEDLESS_WINDOW:g}, the metric's)")
    parser.add_argument("--detail", action="store_true", help="print every seed's table")
    args = parser.parse_args()
    turns_list = [int(x) for x in args.turns.split(",")]
    seeds = _seeds(args.seeds)
    routes = tuple(r for r in args.routes.split(",") if r)
    if args.probes:
        routes += tuple(r for r in PROBES if r not in routes)
    unknown = set(routes) - set(ROUTES) - set(PROBES)
    if unknown:
        parser.error(f"unknown routes {sorted(unknown)}; known: "
                     f"{', '.join(ROUTES + PROBES)}")
    settings: dict[str, Any] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        settings[name] = None if value == "none" else float(value)
    if args.feature == "none":
        settings["feature"] = None
    elif args.feature == "query_length":
        settings["feature"] = query_length_class

    Results = dict[tuple[int, int], dict[str, tuple[Row, Row]]]

    def run(make: Callable[[], TimingPredictor]) -> Results:
        return {(t, seed): run_case(t, seed, args.delay, args.early, make, routes,
                                    args.needless_window)
                for t in turns_list for seed in seeds}

    began = time.perf_counter()
    results = run(lambda: RouteTimingPredictor(**settings))
    elapsed = time.perf_counter() - began
    baselines = {f"b{i + 1} ({src})": run(foreign_factory(src, f"_baseline{i}", args.delay))
                 for i, src in enumerate(args.baseline)}
    described = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in settings.items())
    print(f"delay {args.delay}s, early {args.early}s, generation ~0.3s, needless window "
          f"{args.needless_window:g}s, turns per route {args.turns}, seeds {args.seeds}, "
          f"RouteTimingPredictor({described or 'defaults'}); "
          f"{sum(len(routes) * 2 * t for t, _ in results)} turns replayed in {elapsed:.0f}s "
          f"wall (load average {os.getloadavg()[0]:.1f})")
    if args.detail:
        for (t, seed), case in results.items():
            print(f"\n{t} turns per route, seed {seed}")
            print("| route | late | policy | p50 silence | p95 silence | ack rate | needless "
                  "| p95 cut | decision changes |")
            print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
            for route, (a, b) in case.items():
                print(f"| {route} | {a.late_share:.0%} | fixed | {a.p50:.2f}s | {a.p95:.2f}s | "
                      f"{a.ack_rate:.1%} | {a.needless_rate:.1%} | | |")
                print(f"| {route} | | predictive | {b.p50:.2f}s | {b.p95:.2f}s | "
                      f"{b.ack_rate:.1%} | {b.needless_rate:.1%} | {1 - b.p95 / a.p95:+.0%} | "
                      f"{b.switches} |")
    failures, probes = report(results, turns_list, seeds, routes, baselines)
    print(f"\n{failures} goal(s) missed")
    if any(route in PROBES for route in routes):
        print(f"{probes} goal(s) missed on the probe shapes (not the issue's)")


if __name__ == "__main__":
    main()
