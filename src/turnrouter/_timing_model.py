"""The per-route latency model behind `RouteTimingPredictor` (private).

A route is a small library of *regimes* (at most `max_regimes`, 4 by default), each an
exponentially decayed histogram of first responses on a fixed log-spaced grid plus an
exponentially weighted reference of its log latency. One regime is current:

- a two-sided CUSUM on the current regime's standardized log latency detects a shift to
  latencies no known regime explains: a new regime starts from the trailing run of
  samples that pushed the sum (the least recently used regime is forgotten when the
  library is full);
- a forward filter (a hidden Markov model whose states are the known regimes, switching
  with probability `hazard` per sample) recognises a return to a regime seen before from
  one or two samples, so a route alternating between two states does not relearn;
- a regime learns only while current, so a stored regime keeps what it knew.

The trigger (in `_timing`) reads the next turn's distribution, a `Mixture` of the
regimes weighted by the filter's prediction, at the few instants that decide what an
early acknowledgment would cost or save.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

_LOW, _HIGH, _BINS = 0.01, 120.0, 96
_LOG_LOW = math.log(_LOW)
_STEP = (math.log(_HIGH) - _LOG_LOW) / _BINS
#: Bin edges: bin i covers [_EDGES[i], _EDGES[i + 1]); values outside are clamped.
_EDGES = tuple(math.exp(_LOG_LOW + i * _STEP) for i in range(_BINS + 1))
_RENORMALIZE_ABOVE = 1e150

#: Change detection: CUSUM reference value and clip, in standard deviations of log
#: latency; uncensored samples before the detector runs; the smallest standard deviation
#: assumed (log units, about one bin); recent samples kept.
_CHANGE_SLACK = 1.0
_CHANGE_CLIP = 3.0
_CHANGE_WARMUP = 10
_MIN_SIGMA = 0.1
_RECENT = 32
#: Regime recognition: share of a regime's likelihood spread uniformly over the grid (so
#: no sample is impossible), and the posterior at which the filter switches regimes.
_FLOOR = 0.01
_SWITCH_POSTERIOR = 0.75
#: A sample is learned by the current regime only when the filter is this sure of it;
#: ambiguous ones wait (at most `_RECENT`) and go to the regime the filter switches to.
_LEARN_POSTERIOR = 0.9
#: Mixture parts lighter than this are left out of quantiles.
_NEGLIGIBLE = 1e-4


def _bin(seconds: float) -> int:
    if seconds <= _LOW:
        return 0
    index = int((math.log(seconds) - _LOG_LOW) / _STEP)
    return index if index < _BINS else _BINS - 1


class Histogram:
    """Exponentially decayed histogram of one regime (fixed size: _BINS doubles)."""

    __slots__ = ("count", "increment", "total", "weights")

    def __init__(self) -> None:
        self.weights = array("d", bytes(8 * _BINS))
        self.total = 0.0
        #: Weight of the next sample; grows by 1/alpha per sample instead of decaying
        #: every bin (O(1) per sample), renormalized before it overflows.
        self.increment = 1.0
        self.count = 0

    def add(self, seconds: float, censored: bool, growth: float) -> None:
        self.increment *= growth
        if self.increment > _RENORMALIZE_ABOVE:
            scale = 1.0 / self.increment
            for i in range(_BINS):
                self.weights[i] *= scale
            self.total *= scale
            self.increment = 1.0
        weight = self.increment
        self.count += 1
        index = _bin(seconds)
        if censored:
            # Redistribute to the right: the true latency is above `seconds`, so share
            # this weight among the longer latencies seen so far, in proportion.
            above = sum(self.weights[index + 1:])
            if above > 0.0:
                factor = weight / above
                for i in range(index + 1, _BINS):
                    self.weights[i] += self.weights[i] * factor
                self.total += weight
                return
            # Nothing longer known yet: keep the lower bound itself (conservative).
            index = min(index + 1, _BINS - 1)
        self.weights[index] += weight
        self.total += weight

    def effective(self) -> float:
        return self.total / self.increment if self.increment else 0.0

    def below(self, seconds: float) -> float:
        """Share of the mass below `seconds` (linear within a bin in log space)."""
        if self.total <= 0.0:
            return 0.0
        index = _bin(seconds)
        position = (math.log(max(seconds, _LOW)) - _LOG_LOW) / _STEP - index
        fraction = min(max(position, 0.0), 1.0)
        mass = sum(self.weights[:index]) + self.weights[index] * fraction
        return mass / self.total

    def likelihood(self, index: int, censored: bool) -> float:
        """Probability of a sample in bin `index` (of one above it, when censored),
        smoothed over neighbouring bins and floored so that nothing is impossible."""
        total = self.total
        if total <= 0.0:
            return 1.0 / _BINS
        weights = self.weights
        if censored:
            mass = (sum(weights[index + 1:]) + 0.5 * weights[index]) / total
            return (1.0 - _FLOOR) * mass + _FLOOR * (_BINS - index - 0.5) / _BINS
        low, high = max(index - 1, 0), min(index + 1, _BINS - 1)
        mass = (weights[low] + weights[index] + weights[high]) / (3.0 * total)
        return (1.0 - _FLOOR) * mass + _FLOOR / _BINS


class Mixture:
    """A distribution of first responses: histograms mixed with weights summing to 1
    (one cumulative sum over the grid, so each question is a bisection or a lookup; a
    single histogram is read in place, scaled at the answer)."""

    __slots__ = ("cumulative", "mass", "scale")

    def __init__(self, parts: list[tuple[float, Histogram]]) -> None:
        if len(parts) == 1:
            weight, hist = parts[0]
            self.scale = weight / hist.total
            self.mass: Sequence[float] = hist.weights
        else:
            self.scale = 1.0
            mass = [0.0] * _BINS
            for weight, hist in parts:
                scale = weight / hist.total
                mass = [m + scale * w for m, w in zip(mass, hist.weights, strict=True)]
            self.mass = mass
        self.cumulative = list(accumulate(self.mass))

    def below(self, seconds: float) -> float:
        """P(first response < seconds) (linear within a bin in log space)."""
        if seconds <= _LOW:
            return 0.0
        position = (math.log(seconds) - _LOG_LOW) / _STEP
        index = int(position)
        if index >= _BINS:
            return self.cumulative[-1] * self.scale
        before = self.cumulative[index - 1] if index else 0.0
        return (before + self.mass[index] * (position - index)) * self.scale

    def quantile(self, level: float) -> float:
        """The `level` quantile (0.0 for a level <= 0: no latency is that certain)."""
        if level <= 0.0:
            return 0.0
        target = level / self.scale
        cumulative = self.cumulative
        index = bisect_left(cumulative, target)
        if index >= _BINS:
            return _EDGES[-1]
        mass = self.mass[index]
        before = cumulative[index - 1] if index else 0.0
        fraction = (target - before) / mass if mass > 0.0 else 1.0
        return math.exp(_LOG_LOW + (index + min(max(fraction, 0.0), 1.0)) * _STEP)


class Regime:
    """One latency regime: its histogram and its log-latency reference (fixed size)."""

    __slots__ = ("hist", "mean", "seen", "used", "var")

    def __init__(self, used: int) -> None:
        self.hist = Histogram()
        self.mean = 0.0
        self.var = 0.0
        self.seen = 0  # uncensored samples in the reference
        self.used = used  # the model's sample counter when this regime was last current

    def learn(self, seconds: float, censored: bool, growth: float, alpha: float) -> None:
        hist = self.hist
        if censored:
            hist.add(seconds, censored, growth)
            return
        increment = hist.increment * growth
        if increment > _RENORMALIZE_ABOVE:
            hist.add(seconds, censored, growth)
            log = math.log(max(seconds, _LOW))
        else:
            # `Histogram.add` of an uncensored sample, inline (every sample comes here):
            # the same operations in the same order, its bin's log reused below.
            hist.increment = increment
            hist.count += 1
            if seconds <= _LOW:
                index, log = 0, _LOG_LOW
            else:
                log = math.log(seconds)
                index = int((log - _LOG_LOW) / _STEP)
                if index >= _BINS:
                    index = _BINS - 1
            hist.weights[index] += increment
            hist.total += increment
        self.seen = seen = self.seen + 1
        weight = 1.0 / seen
        if not weight > alpha:  # max(alpha, 1 / seen)
            weight = alpha
        delta = log - self.mean
        self.mean += weight * delta
        self.var = (1.0 - weight) * (self.var + weight * delta * delta)


class Settings:
    """A predictor's model settings, shared by its routes."""

    __slots__ = ("alpha", "growth", "hazard", "max_regimes", "threshold")

    def __init__(self, *, half_life: float, threshold: float | None, max_regimes: int,
                 hazard: float) -> None:
        self.growth = 2.0 ** (1.0 / half_life)
        self.alpha = 1.0 - 1.0 / self.growth
        self.threshold = threshold
        self.max_regimes = max_regimes
        self.hazard = hazard


class RouteModel:
    """One route (or one feature class of a route): a library of regimes, the current
    one, a change detector, a regime filter, and the trigger's last decision (fixed
    size; see the module docstring).

    The CUSUM runs on the current regime's reference (mean and standard deviation of log
    latency, floored at `_MIN_SIGMA`); each sample's z-score is clipped to
    +-`_CHANGE_CLIP` and the slack `_CHANGE_SLACK` subtracted, so noise drifts the sums
    back to zero and a few outliers cannot raise an alarm (threshold 8: at least four
    consecutive samples). Censored samples count as their lower bound for "slower"
    evidence and never as "faster" evidence. The run of samples pushing a sum is held
    back from the regime until it breaks (then learned) or raises the alarm (then it
    starts the new regime, from the suffix that fits one new level): a shift neither
    widens the reference it is measured against nor smears the old regime.
    """

    __slots__ = ("changes", "cur", "decided_for", "down", "down_run", "early", "filled",
                 "head", "held", "pending", "post", "recent", "recent_censored", "regimes",
                 "tick", "up", "up_run")

    def __init__(self) -> None:
        self.regimes = [Regime(0)]
        self.post = [1.0]
        self.cur = 0
        self.recent = array("d", bytes(8 * _RECENT))
        self.recent_censored = bytearray(_RECENT)
        self.head = 0
        self.filled = 0
        self.changes = 0
        self.tick = 0
        #: The trigger's last decision (its hysteresis state), and the delay it was for.
        self.early = False
        self.decided_for = -1.0
        #: Trailing samples no regime learned yet: held while the filter is unsure of
        #: them or a change detector sum is accumulating (at most _RECENT - 1).
        self.pending = 0
        self.held = 0  # the direction of the detector run holding them (0: the filter)
        self.up = self.down = 0.0
        self.up_run = self.down_run = 0

    def _reset_detector(self) -> None:
        self.up = self.down = 0.0
        self.up_run = self.down_run = 0

    def add(self, seconds: float, censored: bool, s: Settings) -> None:
        head, recent = self.head, self.recent
        recent[head] = seconds
        self.recent_censored[head] = censored
        self.head = (head + 1) % _RECENT
        if self.filled < _RECENT:
            self.filled += 1
        self.tick = tick = self.tick + 1
        regimes, threshold = self.regimes, s.threshold
        multi = len(regimes) > 1  # (not changed below but by the alarm, which returns)
        if multi:
            before = self.cur
            if self._filter(_bin(seconds), censored, s.hazard):
                # Held samples go to whichever of the two regimes explains them better.
                self._sort_pending(regimes[before], s)
        regime = regimes[self.cur]
        direction = 0
        if threshold is not None and regime.seen >= _CHANGE_WARMUP:
            sigma = max(math.sqrt(regime.var), _MIN_SIGMA)
            z = (math.log(max(seconds, _LOW)) - regime.mean) / sigma
            z = min(max(z, -_CHANGE_CLIP), _CHANGE_CLIP)
            slower = z - _CHANGE_SLACK
            self.up = max(0.0, self.up + slower)
            self.up_run = self.up_run + 1 if slower > 0.0 else 0
            # A censored sample is a lower bound: never evidence of a faster route.
            faster = (-max(z, 0.0) if censored else -z) - _CHANGE_SLACK
            self.down = max(0.0, self.down + faster)
            self.down_run = self.down_run + 1 if faster > 0.0 else 0
            if self.up >= threshold or self.down >= threshold:
                unlearned = self.pending + 1
                run = min(self.up_run if self.up >= threshold else self.down_run, unlearned)
                run = self._shifted(run, regime.mean)
                # Held samples before the run were the old latency's.
                self._learn_trailing(unlearned - run, run, regime, s)
                self._new_regime(run, s)
                return
            # A run of samples pushing one sum is held: a shift must not widen the
            # reference it is measured against, nor smear this regime's histogram.
            # A sample that does not push it releases the run to this regime.
            direction = 1 if slower > 0.0 else -1 if faster > 0.0 else 0
            if self.pending and self.held and direction != self.held:
                self._learn_trailing(self.pending, 1, regime, s)
                self.pending = 0
        if direction or (multi and self.post[self.cur] < _LEARN_POSTERIOR):
            self.held = direction
            self.pending += 1
            if self.pending >= _RECENT:  # the ring is full: the oldest is learned now
                self.pending -= 1
                self._learn_trailing(1, self.pending, regime, s)
        elif self.pending:
            self._learn_trailing(self.pending + 1, 0, regime, s)
            self.pending = self.held = 0
        else:  # the common case: only this sample to learn, read back as stored
            regime.learn(recent[head], bool(self.recent_censored[head]), s.growth, s.alpha)
            self.held = 0
        regime.used = tick

    def add_plain(self, seconds: float, censored: bool, s: Settings) -> None:
        """`add` for a model of one regime without change detection (a feature class's:
        `threshold` None, `max_regimes` 1), the same state after it: no detector holds a
        sample back and no filter runs, so each sample is learned at once (every turn's
        sample comes here too, beside its route's `add`)."""
        head, recent, censoring = self.head, self.recent, self.recent_censored
        recent[head] = seconds
        censoring[head] = censored
        self.head = (head + 1) % _RECENT
        if self.filled < _RECENT:
            self.filled += 1
        self.tick = tick = self.tick + 1
        regime = self.regimes[self.cur]
        regime.learn(recent[head], bool(censoring[head]), s.growth, s.alpha)
        regime.used = tick

    def _shifted(self, run: int, mean: float) -> int:
        """How many of the last `run` samples are the new latency's: the suffix that
        best fits one new level, the samples before it fitting the old `mean` (least
        squares on log latency), so the new regime does not start from the noise that
        began the run."""
        logs = [math.log(max(self.recent[i % _RECENT], _LOW))
                for i in range(self.head - run, self.head)]
        best, best_cost = run, math.inf
        before = 0.0  # squared error of logs[:k] against the old mean
        for k in range(run):
            tail = logs[k:]
            level = sum(tail) / len(tail)
            cost = before + sum((y - level) ** 2 for y in tail)
            if cost < best_cost:
                best, best_cost = run - k, cost
            before += (logs[k] - mean) ** 2
        return best

    def _learn_trailing(self, count: int, skip: int, regime: Regime, s: Settings) -> None:
        """`regime` learns `count` recent samples, oldest first, leaving the newest
        `skip` aside."""
        end = self.head - skip
        for i in range(end - count, end):
            regime.learn(self.recent[i % _RECENT], bool(self.recent_censored[i % _RECENT]),
                         s.growth, s.alpha)

    def _sort_pending(self, old: Regime, s: Settings) -> None:
        """After a switch away from `old`: each held sample (not the newest) is learned
        by `old` or the new current regime, whichever gives it the higher likelihood."""
        new = self.regimes[self.cur]
        for i in range(self.head - 1 - self.pending, self.head - 1):
            seconds = self.recent[i % _RECENT]
            censored = bool(self.recent_censored[i % _RECENT])
            index = _bin(seconds)
            target = (old if old.hist.likelihood(index, censored)
                      > new.hist.likelihood(index, censored) else new)
            target.learn(seconds, censored, s.growth, s.alpha)
        self.pending = self.held = 0

    def _filter(self, index: int, censored: bool, hazard: float) -> bool:
        """Bayes update of which known regime is current; switch when another one is
        clearly more likely (its detector then starts afresh). True on a switch."""
        regimes, post = self.regimes, self.post
        spread = hazard / (len(regimes) - 1)
        new = [((1.0 - hazard) * p + spread * (1.0 - p)) * r.hist.likelihood(index, censored)
               for p, r in zip(post, regimes, strict=True)]
        total = sum(new)
        if not total > 0.0 or not math.isfinite(total):
            return False
        self.post = post = [v / total for v in new]
        best = max(range(len(post)), key=post.__getitem__)
        if best != self.cur and post[best] >= _SWITCH_POSTERIOR:
            self.cur = best
            self.changes += 1
            self._reset_detector()
            return True
        return False

    def _new_regime(self, run: int, s: Settings) -> None:
        """Start a regime from the last `run` samples (those of the new latency)."""
        self.changes += 1
        regimes = self.regimes
        if len(regimes) >= s.max_regimes:
            if s.max_regimes == 1:
                regimes.clear()
            else:
                victim = min((i for i in range(len(regimes)) if i != self.cur),
                             key=lambda i: regimes[i].used)
                del regimes[victim]
        regime = Regime(self.tick)
        regimes.append(regime)
        self.cur = len(regimes) - 1
        self.post = [0.0] * len(regimes)
        self.post[self.cur] = 1.0
        self._reset_detector()
        self._learn_trailing(run, 0, regime, s)
        self.pending = self.held = 0

    # -------------------------------------------------------------- predictions

    def parts(self, hazard: float) -> list[tuple[float, Histogram]]:
        """The next sample's distribution: regimes weighted by the filter's prediction."""
        regimes = self.regimes
        if len(regimes) == 1:
            return [(1.0, regimes[0].hist)] if regimes[0].hist.total > 0.0 else []
        spread = hazard / (len(regimes) - 1)
        weighted = [((1.0 - hazard) * p + spread * (1.0 - p), r.hist)
                    for p, r in zip(self.post, regimes, strict=True)]
        kept = [(w, h) for w, h in weighted if w > _NEGLIGIBLE and h.total > 0.0]
        total = sum(w for w, _ in kept)
        return [(w / total, h) for w, h in kept] if total > 0.0 else []

    @staticmethod
    def effective(parts: list[tuple[float, Histogram]]) -> float:
        return sum(w * h.effective() for w, h in parts)
