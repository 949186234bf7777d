"""First-response timing: samples, a streaming per-route predictor, and a JSON-lines sink.

A *first-response sample* is the time from the start of a destination's `answer()` (after
admission and any preamble) until it awaited `started()`. It excludes routing, admission,
preamble delivery, waiting for a committed acknowledgment, and audio playback. A turn
interrupted before `started()` gives a *censored* sample: the true latency is at least
`seconds`, so it is a lower bound, never a fast answer.

`RouteTimingPredictor` is the default `TimingPredictor`: per route, an exponentially
decayed histogram on a fixed log-spaced grid (bounded memory, recency-weighted, O(1) per
uncensored sample). Censored samples are redistributed to the right (Efron), as the
Kaplan-Meier estimator does. A CUSUM change detector on log latency restarts a route's
histogram from the samples of its new regime when its latency shifts (drift).
`LLMTimingPredictor` is the contract's optional LLM-assisted prediction on the same
protocol.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

from ._contracts import AgentTurn
from ._exceptions import ConfigurationError
from ._llm import LLMService

__all__ = [
    "JsonLinesSink",
    "LLMTimingPredictor",
    "Prediction",
    "RouteTimingPredictor",
    "TimingPredictor",
    "TimingSample",
    "TimingSink",
    "load_samples",
]

logger = logging.getLogger("turnrouter")


@dataclass(frozen=True, slots=True)
class TimingSample:
    """One first-response latency of one route.

    `censored=True`: the turn was interrupted after `seconds` without a response start,
    so the true latency is at least `seconds`. `at` is the Unix time it was recorded.
    """

    route: str
    seconds: float
    censored: bool = False
    at: float = 0.0

    def to_json(self) -> str:
        """One JSON object, the line format of `JsonLinesSink`."""
        return json.dumps({"route": self.route, "seconds": round(self.seconds, 6),
                           "censored": self.censored, "at": round(self.at, 3)},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> TimingSample:
        """Parse one line written by `to_json` (ValueError naming the problem)."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a timing sample must be a JSON object")
        route, seconds = data.get("route"), data.get("seconds")
        if not isinstance(route, str) or not route:
            raise ValueError(f"timing sample 'route' must be a non-empty string, got {route!r}")
        if (not isinstance(seconds, int | float) or isinstance(seconds, bool)
                or not math.isfinite(seconds) or seconds < 0):
            raise ValueError(f"timing sample 'seconds' must be a finite number >= 0, "
                             f"got {seconds!r}")
        censored = data.get("censored", False)
        if not isinstance(censored, bool):
            raise ValueError(f"timing sample 'censored' must be a boolean, got {censored!r}")
        at = data.get("at", 0.0)
        if not isinstance(at, int | float) or isinstance(at, bool):
            raise ValueError(f"timing sample 'at' must be a number, got {at!r}")
        return cls(route, float(seconds), censored, float(at))


@dataclass(frozen=True, slots=True)
class Prediction:
    """A first-response prediction for one route.

    `seconds` is the typical (median) first response, `lower` the conservative bound the
    acknowledgment policy compares with the delay (by default the 10th percentile: the
    answer is predicted to be later than `lower` nine times out of ten), `upper` the
    90th percentile. `samples` is the effective (decayed) sample count. Only a
    `confident` prediction can start an acknowledgment early.
    """

    seconds: float
    lower: float
    upper: float
    samples: float
    confident: bool


@runtime_checkable
class TimingPredictor(Protocol):
    """Predicts a route's first-response latency and learns from every sample.

    `predict` may return an awaitable (an LLM-assisted predictor); the router awaits it
    beside the answer, bounded in time. `estimate` is the cheap, synchronous typical
    value published as `turnrouter_predicted_first_response_seconds`.
    """

    def predict(
        self, route: str, turn: AgentTurn
    ) -> Prediction | Awaitable[Prediction | None] | None:
        """The prediction for `turn` routed to `route`, or None (no prediction)."""
        ...

    def record(self, sample: TimingSample, turn: AgentTurn | None = None) -> None:
        """Learn from one sample (`turn` is the turn it came from, when known)."""
        ...

    def estimate(self, route: str) -> float | None:
        """The current typical first-response seconds of `route`, if known."""
        ...


@runtime_checkable
class TimingSink(Protocol):
    """Receives every recorded sample (for export; see `JsonLinesSink`)."""

    def record(self, sample: TimingSample) -> None:
        """Store one sample. Called on the event loop: must not block for long."""
        ...


# ---------------------------------------------------------------- decayed histogram

_LOW, _HIGH, _BINS = 0.01, 120.0, 96
_LOG_LOW = math.log(_LOW)
_STEP = (math.log(_HIGH) - _LOG_LOW) / _BINS
#: Bin edges: bin i covers [_EDGES[i], _EDGES[i + 1]); values outside are clamped.
_EDGES = tuple(math.exp(_LOG_LOW + i * _STEP) for i in range(_BINS + 1))
_RENORMALIZE_ABOVE = 1e150


def _bin(seconds: float) -> int:
    if seconds <= _LOW:
        return 0
    index = int((math.log(seconds) - _LOG_LOW) / _STEP)
    return index if index < _BINS else _BINS - 1


class _RouteHistogram:
    """Exponentially decayed histogram of one route (fixed size: _BINS doubles)."""

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

    def quantile(self, q: float) -> float:
        target = q * self.total
        cumulative = 0.0
        weights = self.weights
        for i in range(_BINS):
            w = weights[i]
            if w <= 0.0:
                continue
            if cumulative + w >= target:
                fraction = (target - cumulative) / w
                return math.exp(_LOG_LOW + (i + fraction) * _STEP)
            cumulative += w
        return _EDGES[-1]

    def effective(self) -> float:
        return self.total / self.increment if self.increment else 0.0


#: Change detection (see `_RouteModel`): CUSUM reference value and clip, in standard
#: deviations of log latency; uncensored samples before the detector runs; the smallest
#: standard deviation assumed (log units, about one bin); recent samples kept.
_CHANGE_SLACK = 1.0
_CHANGE_CLIP = 3.0
_CHANGE_WARMUP = 10
_MIN_SIGMA = 0.1
_RECENT = 32


class _RouteModel:
    """One route: its decayed histogram plus a change detector (fixed size).

    The detector is a two-sided CUSUM on standardized log latency. Its reference is an
    exponentially weighted mean and standard deviation of log latency with the
    histogram's half-life (floored at `_MIN_SIGMA`); each sample's z-score is clipped to
    +-`_CHANGE_CLIP` and the slack `_CHANGE_SLACK` is subtracted, so noise drifts the
    sums back to zero and a few outliers cannot raise an alarm (with the default
    threshold 8 it takes at least four consecutive samples). A sum reaching
    the threshold is a change: the histogram and the reference restart from the trailing
    run of samples that each pushed that sum up (beyond the slack, so they lie on the
    new side; at most `_RECENT` of them, kept in a ring buffer). Confidence must then be
    earned again from samples of the new regime only. Censored samples count as their
    lower bound for "slower" evidence and never as "faster" evidence, and do not move
    the reference.
    """

    __slots__ = ("changes", "down", "down_run", "filled", "head", "hist", "mean",
                 "recent", "recent_censored", "seen", "up", "up_run", "var")

    def __init__(self) -> None:
        self.hist = _RouteHistogram()
        self.recent = array("d", bytes(8 * _RECENT))
        self.recent_censored = bytearray(_RECENT)
        self.head = 0
        self.filled = 0
        self.changes = 0
        self._restart()

    def _restart(self) -> None:
        self.mean = 0.0
        self.var = 0.0
        self.seen = 0  # uncensored samples in the reference since the last restart
        self.up = self.down = 0.0
        self.up_run = self.down_run = 0

    def _learn(self, seconds: float, censored: bool, growth: float, alpha: float) -> None:
        self.hist.add(seconds, censored, growth)
        if censored:
            return
        self.seen += 1
        weight = max(alpha, 1.0 / self.seen)
        delta = math.log(max(seconds, _LOW)) - self.mean
        self.mean += weight * delta
        self.var = (1.0 - weight) * (self.var + weight * delta * delta)

    def add(self, seconds: float, censored: bool, growth: float, alpha: float,
            threshold: float | None) -> None:
        self.recent[self.head] = seconds
        self.recent_censored[self.head] = censored
        self.head = (self.head + 1) % _RECENT
        if self.filled < _RECENT:
            self.filled += 1
        if threshold is not None and self.seen >= _CHANGE_WARMUP:
            sigma = max(math.sqrt(self.var), _MIN_SIGMA)
            z = (math.log(max(seconds, _LOW)) - self.mean) / sigma
            z = min(max(z, -_CHANGE_CLIP), _CHANGE_CLIP)
            slower = z - _CHANGE_SLACK
            self.up = max(0.0, self.up + slower)
            self.up_run = self.up_run + 1 if slower > 0.0 else 0
            # A censored sample is a lower bound: never evidence of a faster route.
            faster = (-max(z, 0.0) if censored else -z) - _CHANGE_SLACK
            self.down = max(0.0, self.down + faster)
            self.down_run = self.down_run + 1 if faster > 0.0 else 0
            if self.up >= threshold or self.down >= threshold:
                run = self.up_run if self.up >= threshold else self.down_run
                self._change(min(run, self.filled), growth, alpha)
                return
        self._learn(seconds, censored, growth, alpha)

    def _change(self, run: int, growth: float, alpha: float) -> None:
        """Restart from the last `run` samples (those of the new regime)."""
        self.changes += 1
        self.hist = _RouteHistogram()
        self._restart()
        start = self.head - run
        for i in range(start, self.head):
            self._learn(self.recent[i % _RECENT], bool(self.recent_censored[i % _RECENT]),
                        growth, alpha)


class RouteTimingPredictor:
    """The default `TimingPredictor`: a decayed histogram of first responses per route,
    restarted when a change detector sees the route's latency shift.

    - `half_life_samples`: a sample's weight halves after this many newer samples of
      the same route (recency; the effective memory is about 1.44x this).
    - `min_samples`: effective samples needed before a prediction is confident.
    - `lower_quantile`: the quantile reported as `Prediction.lower` (default 0.1).
    - `max_spread`: a prediction whose p90/p10 ratio exceeds this is not confident.
    - `max_routes`: routes tracked at most (memory bound: ~1.6 KB per route).
    - `change_threshold`: the CUSUM threshold (in standard deviations of log latency) of
      the change detector; a detected change restarts the route from the samples since
      the change, so a route that turned slow (or fast) is predicted from its new
      latencies only. Lower is faster but flaps more; None disables detection (the
      histogram then only decays).
    """

    def __init__(
        self, *, half_life_samples: float = 100.0, min_samples: float = 20.0,
        lower_quantile: float = 0.1, max_spread: float = 20.0, max_routes: int = 256,
        change_threshold: float | None = 8.0,
    ) -> None:
        for name, value in (("half_life_samples", half_life_samples),
                            ("min_samples", min_samples), ("max_spread", max_spread)):
            if not math.isfinite(value) or value <= 0:
                raise ConfigurationError(
                    f"RouteTimingPredictor {name} must be finite and positive, got {value!r}")
        if not 0.0 < lower_quantile < 0.5:
            raise ConfigurationError(
                f"RouteTimingPredictor lower_quantile must be in (0, 0.5), got {lower_quantile!r}")
        if max_routes < 1:
            raise ConfigurationError("RouteTimingPredictor max_routes must be >= 1")
        if change_threshold is not None and (
                not math.isfinite(change_threshold) or change_threshold <= 0):
            raise ConfigurationError(
                f"RouteTimingPredictor change_threshold must be finite and positive or None, "
                f"got {change_threshold!r}")
        self._growth = 2.0 ** (1.0 / half_life_samples)
        self._alpha = 1.0 - 1.0 / self._growth
        self._min_samples = min_samples
        self._lower_q = lower_quantile
        self._max_spread = max_spread
        self._max_routes = max_routes
        self._threshold = change_threshold
        self._routes: dict[str, _RouteModel] = {}
        self._dropped = False

    @property
    def routes(self) -> tuple[str, ...]:
        """Routes with at least one sample."""
        return tuple(self._routes)

    def record(self, sample: TimingSample, turn: AgentTurn | None = None) -> None:
        """Add one sample (censored samples count as lower bounds)."""
        model = self._routes.get(sample.route)
        if model is None:
            if len(self._routes) >= self._max_routes:
                if not self._dropped:
                    self._dropped = True
                    logger.warning("turnrouter: timing predictor tracks at most %d routes; "
                                   "ignoring samples of new routes", self._max_routes)
                return
            model = self._routes[sample.route] = _RouteModel()
        model.add(sample.seconds, sample.censored, self._growth, self._alpha, self._threshold)

    def load(self, samples: Iterable[TimingSample]) -> int:
        """Record samples in order (e.g. `load_samples(path)` after a restart)."""
        count = 0
        for sample in samples:
            self.record(sample)
            count += 1
        return count

    def quantile(self, route: str, q: float) -> float | None:
        """The decayed `q` quantile of `route`'s first responses (None without samples)."""
        model = self._routes.get(route)
        if model is None or model.hist.total <= 0.0:
            return None
        return model.hist.quantile(q)

    def samples(self, route: str) -> float:
        """The effective (decayed) sample count of `route` since its last detected change."""
        model = self._routes.get(route)
        return 0.0 if model is None else model.hist.effective()

    def changes(self, route: str) -> int:
        """How many latency changes were detected on `route` (each restarted it)."""
        model = self._routes.get(route)
        return 0 if model is None else model.changes

    def estimate(self, route: str) -> float | None:
        """The typical (median) first response of `route`."""
        return self.quantile(route, 0.5)

    def predict(self, route: str, turn: AgentTurn | None = None) -> Prediction | None:
        """Median, bounds and confidence for `route`; None before its first sample."""
        model = self._routes.get(route)
        if model is None or model.hist.total <= 0.0:
            return None
        hist = model.hist
        lower = hist.quantile(self._lower_q)
        upper = hist.quantile(1.0 - self._lower_q)
        effective = hist.effective()
        confident = effective >= self._min_samples and upper <= lower * self._max_spread
        return Prediction(hist.quantile(0.5), lower, upper, effective, confident)


# ---------------------------------------------------------------- JSON lines

class JsonLinesSink:
    """A `TimingSink` appending one JSON object per sample to a file.

    Lines look like `{"route":"calendar","seconds":1.234,"censored":false,"at":1.7e9}`.
    The file is opened lazily in append mode and flushed every `flush_every` samples
    (default: every sample); call `close()` (or use it as a context manager) at exit.
    Read it back with `load_samples()`, or analyse it with `turnrouter tune --samples`.
    """

    def __init__(self, path: str | Path, *, flush_every: int = 1) -> None:
        if flush_every < 1:
            raise ConfigurationError("JsonLinesSink flush_every must be >= 1")
        self.path = Path(path)
        self._flush_every = flush_every
        self._pending = 0
        self._file: IO[str] | None = None

    def record(self, sample: TimingSample) -> None:
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(sample.to_json() + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self._file.flush()
            self._pending = 0

    def flush(self) -> None:
        """Write buffered samples to the file."""
        if self._file is not None:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        """Flush and close the file (a later `record()` reopens it)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonLinesSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_samples(path: str | Path) -> Iterator[TimingSample]:
    """Samples of a JSON-lines file in order; ConfigurationError names a bad line."""
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield TimingSample.from_json(line)
            except ValueError as exc:
                raise ConfigurationError(f"{path}:{number}: invalid timing sample: {exc}") from exc


def load_samples(path: str | Path) -> list[TimingSample]:
    """All samples of a JSON-lines file written by `JsonLinesSink`, in order."""
    return list(iter_samples(path))


def now_unix() -> float:
    return time.time()


# ---------------------------------------------------------------- LLM-assisted

_SECONDS = re.compile(r"seconds\s*[:=]\s*([0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


def timing_prompt(
    route: str, description: str, query: str, examples: Iterable[tuple[str, float]]
) -> str:
    """The prompt of `LLMTimingPredictor` (documented in docs/acknowledgments.md)."""
    lines = [
        "Estimate how many seconds an assistant's helper will need before it starts "
        "answering a request. Reply with exactly one line: seconds: <number>",
        f"Helper: {route}",
    ]
    if description:
        lines.append(f"Helper description: {description}")
    lines.append("Recent requests and their seconds to first response:")
    lines.extend(f"- {q!r}: {s:.2f}" for q, s in examples)
    lines.append(f"Request: {query!r}")
    return "\n".join(lines)


def parse_seconds(reply: str) -> float | None:
    """The `seconds: <number>` of a reply; None when absent or implausible."""
    match = _SECONDS.search(reply)
    if match is None:
        return None
    value = float(match.group(1))
    return value if 0.0 < value < 600.0 else None


class LLMTimingPredictor:
    """Optional LLM-assisted prediction: recent timing examples of the route, the new
    query, and a request for `seconds: <number>`.

    A reply it cannot parse, an LLM error, or fewer than `min_examples` examples means
    no prediction (never a failed turn). Samples are learned by `base` (a
    `RouteTimingPredictor` by default), which also supplies `estimate()`. Example
    queries live only in memory (`examples` per route) and are never exported.
    """

    def __init__(
        self, llm: LLMService, *, base: RouteTimingPredictor | None = None,
        descriptions: Mapping[str, str] | None = None, examples: int = 8,
        min_examples: int = 4, max_tokens: int = 12,
    ) -> None:
        if not callable(getattr(llm, "complete", None)):
            raise ConfigurationError("LLMTimingPredictor llm must have an async complete()")
        if examples < 1 or min_examples < 1 or max_tokens < 1:
            raise ConfigurationError("LLMTimingPredictor examples, min_examples and "
                                     "max_tokens must be >= 1")
        self.base = base if base is not None else RouteTimingPredictor()
        self._llm = llm
        self._descriptions = dict(descriptions or {})
        self._size = examples
        self._min = min_examples
        self._max_tokens = max_tokens
        self._examples: dict[str, deque[tuple[str, float]]] = {}

    def record(self, sample: TimingSample, turn: AgentTurn | None = None) -> None:
        self.base.record(sample, turn)
        if turn is not None and not sample.censored:
            examples = self._examples.get(sample.route)
            if examples is None:
                if len(self._examples) >= 256:
                    return
                examples = self._examples[sample.route] = deque(maxlen=self._size)
            examples.append((turn.query[:200], sample.seconds))

    def estimate(self, route: str) -> float | None:
        return self.base.estimate(route)

    async def predict(self, route: str, turn: AgentTurn) -> Prediction | None:
        examples = self._examples.get(route)
        if examples is None or len(examples) < self._min:
            return None
        prompt = timing_prompt(route, self._descriptions.get(route, ""), turn.query, examples)
        try:
            reply = await self._llm.complete(prompt, max_tokens=self._max_tokens,
                                             reasoning=False)
        except Exception as exc:
            logger.info("turnrouter: timing prediction failed (no prediction): %r", exc)
            return None
        seconds = parse_seconds(reply) if isinstance(reply, str) else None
        if seconds is None:
            return None
        return Prediction(seconds, seconds, seconds, float(len(examples)), True)
