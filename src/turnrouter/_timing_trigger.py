"""The early-acknowledgment trigger behind `RouteTimingPredictor` (private).

One turn, one decision: acknowledge early (heard at `early`, or when its text is ready,
`max(early, generation)`) or wait for the fallback delay `d` (heard at `d + generation`).
With `X` the turn's first response and `W` the needless window (the answer starting
within `W` after a spoken acknowledgment makes it needless):

- acknowledging early costs a needless acknowledgment when `early < X <= heard + W`;
- waiting costs a turn of avoidable silence when `X > d`, and a needless acknowledgment
  when `d + g < X <= d + g + W` (the delay's acknowledgment lands right before it).

With `confidence` c the share of a needless acknowledgment in the two costs
(`c = C_needless / (C_needless + C_silence)`), the expected advantage of acknowledging
early is

    A = (1 - c) P(X > d) + c P(d + g < X <= d + g + W) - c P(early < X <= heard + W),

shrunk towards "needless" as if `prior` needless answers had been seen. Answers just
under the delay but well after an early acknowledgment cost nothing, which is why a
route slower than the delay 85 % of the time, with the rest just under it, is
acknowledged early from a handful of turns on, and stays so (a rule on P(X > d) alone
hovered around its threshold there). The decision has hysteresis in the same units: it
switches on when `A >= hysteresis` and off when `A < 0`.

A turn's feature class (e.g. its request's length) refines the route's distribution by
partial pooling: the class's histogram is mixed in with the weight an empirical-Bayes
estimate gives the differences between the route's classes (about 0 on a route whose
latency does not depend on the class, about 1 on one where it clearly does).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ._timing_model import Histogram, Mixture, RouteModel

#: Variance of log latency assumed at least within a class (about one grid bin).
_MIN_VARIANCE = 0.01
#: Uncensored samples a class needs before it takes part in the pooling (fewer make
#: the estimate of the classes' spread too noisy: a class holding a route's few fast
#: answers by chance would overrule it).
_CLASS_MIN_SEEN = 5
#: The classes' spread must exceed this many times their sampling noise before it
#: counts: with 3-4 classes of a few samples each the plain moment estimate is noisy
#: (a class holding a route's few fast answers by chance looked different).
_SPREAD_NOISE = 2.0


class Trigger:
    """The trigger's settings and its decision (see the module docstring)."""

    __slots__ = ("confidence", "early_secs", "evidence", "generation_secs", "hysteresis",
                 "min_samples", "needless_secs", "prior")

    def __init__(self, *, confidence: float, hysteresis: float, prior: float,
                 min_samples: float, early_secs: float, generation_secs: float,
                 needless_secs: float, evidence: float = 0.0) -> None:
        self.confidence = confidence
        self.hysteresis = hysteresis
        self.evidence = evidence
        self.prior = prior
        self.min_samples = min_samples
        self.early_secs = early_secs
        self.generation_secs = generation_secs
        self.needless_secs = needless_secs

    def advantage(self, mixture: Mixture, samples: float, delay: float,
                  generation: float) -> tuple[float, float]:
        """(A, P(late)): the expected advantage of acknowledging early at `delay` and the
        probability that the first response comes after it, both shrunk by `prior`."""
        advantage, late = self.advantage_of(mixture.below, delay, generation)
        weight = samples / (samples + self.prior)
        return advantage * weight - self.confidence * (1.0 - weight), late * weight

    def margin(self, mixture: Mixture, samples: float, delay: float,
               generation: float) -> float:
        """What A must clear on top of the hysteresis to switch early on: `evidence`
        standard errors of A's estimate from `samples` effective samples."""
        if not self.evidence or samples <= 0.0:
            return 0.0
        below = mixture.below
        advantage, _ = self.advantage_of(below, delay, generation)
        variance = self.second_moment(below, delay, generation) - advantage * advantage
        return self.evidence * math.sqrt(max(variance, 0.0) / samples)

    def second_moment(self, below: Callable[[float], float], delay: float,
                      generation: float) -> float:
        """E[a^2] of one turn's advantage `a = (1 - c) L + c D - c E` (L: late, D: the
        delay's acknowledgment needless, E: the early one needless; D lies within L):
        with A = E[a], what the spread of A's estimate follows from."""
        c, window = self.confidence, self.needless_secs
        early = min(self.early_secs, delay)
        heard = max(early, generation)
        def between(low: float, high: float) -> float:
            return max(0.0, below(high) - below(low)) if high > low else 0.0
        late = min(max(1.0 - below(delay), 0.0), 1.0)
        d_start = delay + generation
        needless_delay = between(d_start, d_start + window)
        needless_early = between(early, heard + window)
        late_and_early = between(delay, heard + window)
        both = between(max(early, d_start), min(heard + window, d_start + window))
        return ((1.0 - c) ** 2 * late + c * c * (needless_delay + needless_early)
                + 2.0 * (1.0 - c) * c * (needless_delay - late_and_early)
                - 2.0 * c * c * both)

    def advantage_of(self, below: Callable[[float], float], delay: float,
                     generation: float) -> tuple[float, float]:
        """(A, P(late)) of a distribution given by `below(t) = P(X < t)`, unshrunk (the
        module docstring's formula; `turnrouter tune` applies it to recorded histograms)."""
        c, window = self.confidence, self.needless_secs
        early = min(self.early_secs, delay)
        heard = max(early, generation)
        late = min(max(1.0 - below(delay), 0.0), 1.0)  # rounding never leaves [0, 1]
        needless_early = max(0.0, below(heard + window) - below(early))
        needless_delay = max(0.0, below(delay + generation + window)
                             - below(delay + generation))
        return (1.0 - c) * late + c * (needless_delay - needless_early), late

    def decide(self, model: RouteModel, advantage: float, delay: float, confident: bool,
               margin: Callable[[], float]) -> bool:
        """Early or not, with hysteresis kept on `model` (per delay): on once A clears
        the hysteresis by `margin()` (asked only then: it costs a few more reads of the
        distribution), off once A is no longer positive."""
        if model.decided_for != delay:
            model.decided_for = delay
            model.early = False
        if model.early:
            early = confident and advantage >= 0.0
        else:
            early = (confident and advantage >= self.hysteresis
                     and advantage - margin() >= self.hysteresis)
        model.early = early
        return early


def class_weight(route: RouteModel, classes: dict[str, RouteModel], mine: RouteModel) -> float:
    """The weight of class `mine` against its route `route`: tau^2 / (tau^2 + v), with
    tau^2 the method-of-moments variance of the classes' mean log latencies around the
    route's beyond `_SPREAD_NOISE` times what their sampling noise explains, and v
    `mine`'s sampling noise."""
    own = mine.regimes[0]
    if own.seen < _CLASS_MIN_SEEN:
        return 0.0
    members = [(m.regimes[0], m.regimes[0].hist.effective()) for m in classes.values()
               if m.regimes[0].seen >= _CLASS_MIN_SEEN]
    total = sum(n for _, n in members)
    within = max(sum(r.var * n for r, n in members) / total, _MIN_VARIANCE)
    centre = route.regimes[route.cur].mean
    tau2 = sum((r.mean - centre) ** 2 - _SPREAD_NOISE * within / n
               for r, n in members) / len(members)
    if tau2 <= 0.0:
        return 0.0
    return tau2 / (tau2 + within / own.hist.effective())


def pooled(route: list[tuple[float, Histogram]], mine: list[tuple[float, Histogram]],
           weight: float) -> list[tuple[float, Histogram]]:
    """The route's distribution with a class's mixed in at `weight`."""
    if weight <= 0.0 or not mine:
        return route
    return ([(w * (1.0 - weight), h) for w, h in route]
            + [(w * weight, h) for w, h in mine])
