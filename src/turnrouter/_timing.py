"""First-response timing: samples, a streaming per-route predictor, and a JSON-lines sink.

A *first-response sample* is the time from the start of a destination's `answer()` (after
admission and any preamble) until it awaited `started()`. It excludes routing, admission,
preamble delivery, waiting for a committed acknowledgment, and audio playback. A turn
interrupted before `started()` gives a *censored* sample: the true latency is at least
`seconds`, so it is a lower bound, never a fast answer.

`RouteTimingPredictor` is the default `TimingPredictor`: per route, a small library of
latency regimes (exponentially decayed histograms on a fixed log-spaced grid: bounded
memory, recency-weighted), a CUSUM change detector that starts a new regime when the
latency shifts, a filter that recognises a return to a known regime within a sample or
two, and a trigger with hysteresis on the probability that the answer comes after the
delay (see `_timing_model`). Censored samples are redistributed to the right (Efron), as
the Kaplan-Meier estimator does. `RouteTimingPredictor.from_samples` warm-starts it from
recorded samples.
`LLMTimingPredictor` is the contract's optional LLM-assisted prediction on the same
protocol.
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
import stat
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from ._contracts import AgentTurn
from ._exceptions import ConfigurationError
from ._llm import LLMService
from ._numbers import finite
from ._paths import open_regular
from ._redact import has_surrogates, preview, strip_reasoning
from ._timing_model import Histogram, Mixture, RouteModel, Settings
from ._timing_trigger import Trigger, class_weight, pooled

__all__ = [
    "JsonLinesSink",
    "LLMTimingPredictor",
    "Prediction",
    "RouteTimingPredictor",
    "TimingPredictor",
    "TimingSample",
    "TimingSink",
    "load_samples",
    "query_length_class",
]

logger = logging.getLogger("turnrouter")


#: Longest feature class a sample carries (a class name, never request text).
MAX_FEATURE_CHARS = 64
#: Longest line of a samples file (a `JsonLinesSink` line is about 100 bytes).
MAX_SAMPLE_LINE_BYTES = 65_536


@dataclass(frozen=True, slots=True)
class TimingSample:
    """One first-response latency of one route.

    `censored=True`: the turn was interrupted after `seconds` without a response start,
    so the true latency is at least `seconds`. `at` is the Unix time it was recorded.
    `feature` is the turn's feature class when the predictor has a per-turn feature
    (e.g. "long" from `query_length_class`; never the request itself), so that a warm
    start restores the classes too.
    """

    route: str
    """The route that answered."""
    seconds: float
    """From admission to the destination's `started()` (or to the interruption)."""
    censored: bool = False
    """The turn was interrupted first: the true latency is at least `seconds`."""
    at: float = 0.0
    """Unix time the sample was recorded."""
    feature: str | None = None
    """The turn's feature class (e.g. "long"), when the predictor uses one."""

    def to_json(self) -> str:
        """One JSON object, the line format of `JsonLinesSink` (`feature` only when set);
        ValueError for a sample whose `seconds` or `at` is not finite."""
        seconds, at = round(self.seconds, 6), round(self.at, 3)
        route, feature = self.route, self.feature
        if (type(seconds) is float and type(at) is float and type(route) is str
                and type(self.censored) is bool and (feature is None or type(feature) is str)
                and math.isfinite(seconds) and math.isfinite(at)):
            # What json.dumps writes for these types (floats by their repr), without
            # building an encoder per call: a worker sends one sample per turn.
            return (f'{{"route":{_json_str(route)},"seconds":{seconds!r},"censored":'
                    f'{"true" if self.censored else "false"},"at":{at!r}'
                    + ("}" if feature is None else f',"feature":{_json_str(feature)}}}'))
        if not (finite(seconds) and finite(at)):
            # NaN or Infinity in a samples file made the whole file unloadable.
            raise ValueError(f"timing sample of route {preview(route)}: seconds and at "
                             f"must be finite numbers, got {preview(seconds)} and "
                             f"{preview(at)}")
        data: dict[str, object] = {"route": route, "seconds": seconds,
                                   "censored": self.censored, "at": at}
        if self.feature is not None:
            data["feature"] = self.feature
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> TimingSample:
        """Parse one line written by `to_json` (ValueError naming the problem); lines
        without `feature` (older files) load with none."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a timing sample must be a JSON object")
        route, seconds = data.get("route"), data.get("seconds")
        # Values are shown bounded (`preview`): a line may hold a megabyte-long value.
        if not isinstance(route, str) or not route:
            raise ValueError(f"timing sample 'route' must be a non-empty string, "
                             f"got {preview(route)}")
        if has_surrogates(route):
            raise ValueError("timing sample 'route' holds a lone surrogate: not a route name")
        if not finite(seconds) or seconds < 0:
            raise ValueError(f"timing sample 'seconds' must be a finite number >= 0, "
                             f"got {preview(seconds)}")
        censored = data.get("censored", False)
        if not isinstance(censored, bool):
            raise ValueError(f"timing sample 'censored' must be a boolean, "
                             f"got {preview(censored)}")
        at = data.get("at", 0.0)
        if not finite(at):
            raise ValueError(f"timing sample 'at' must be a finite number, got {preview(at)}")
        feature = data.get("feature")
        if feature is not None and not valid_feature(feature):
            raise ValueError(f"timing sample 'feature' must be a non-empty string of at most "
                             f"{MAX_FEATURE_CHARS} characters, got {preview(feature)}")
        return cls(route, float(seconds), censored, float(at), feature)


def valid_feature(value: object) -> bool:
    """A usable feature class: a non-empty str of at most `MAX_FEATURE_CHARS`."""
    return isinstance(value, str) and 0 < len(value) <= MAX_FEATURE_CHARS


@dataclass(frozen=True, slots=True)
class Prediction:
    """A first-response prediction for one route.

    `seconds` is the typical (median) first response, `lower` and `upper` the 10th and
    90th percentiles, `samples` the effective (decayed) sample count. Without a decision
    from the predictor, the acknowledgment code starts early when the prediction is
    `confident` and `lower > delay`.

    When the predictor knows the delay (`RouteTimingPredictor` always does when the
    router asks), `probability_late` is the predicted probability that the first
    response comes after it and `early` the trigger's decision, which the acknowledgment
    code follows; both are None otherwise.
    """

    seconds: float
    """Typical (median) first response, in seconds."""
    lower: float
    """10th percentile, in seconds."""
    upper: float
    """90th percentile, in seconds."""
    samples: float
    """Effective (decayed) sample count behind the prediction."""
    confident: bool
    """Whether there are enough samples to act on it."""
    probability_late: float | None = None
    """Predicted probability that the first response comes after the delay."""
    early: bool | None = None
    """The trigger's decision: acknowledge early (None: no decision)."""


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


# ---------------------------------------------------------------- the default predictor

#: Feature classes per route at most.
_MAX_CLASSES = 4
#: The needless window the trigger prices (the telemetry's `NEEDLESS_WITHIN_SECONDS`).
NEEDLESS_SECS = 0.5
#: The trigger's defaults (`turnrouter tune` and the tuning dashboard model them).
DEFAULT_CONFIDENCE = 0.75
DEFAULT_HYSTERESIS = 0.05
DEFAULT_EVIDENCE = 1.0


def query_length_class(turn: AgentTurn) -> str:
    """A cheap per-turn feature: the request's length class by words ("short" up to 6,
    "medium" up to 15, "long" beyond)."""
    words = len(turn.query[:4000].split())  # bounded work on a huge request
    return "short" if words <= 6 else "medium" if words <= 15 else "long"


class RouteTimingPredictor:
    """The default `TimingPredictor`: per route, a few latency regimes (decayed
    histograms), a change detector, a filter that recognises a regime seen before, and a
    trigger that acknowledges early when that is expected to cost less than waiting for
    the delay (see `docs/acknowledgments.md`).

    - `half_life_samples`: a sample's weight halves after this many newer samples of
      the same regime (recency; the effective memory is about 1.44x this).
    - `confidence`: the trigger's knob, the share of a needless acknowledgment in the
      two costs it weighs: `C_needless / (C_needless + C_silence)`. 0.75 says a needless
      early acknowledgment costs 3x a turn of avoidable silence (0.8: 4x, 0.9: 9x).
      Early wins when (1 - c) P(late) + c P(the delay's acknowledgment is needless)
      exceeds c P(the early one is needless).
    - `hysteresis`: early switches on once it is better by this much expected cost per
      turn (in units of C_needless + C_silence) and off once it is no longer better.
    - `evidence`: switching on also needs that advantage to clear this many standard
      errors of its own estimate (0: off), so a route whose answers are spread around
      the delay is not switched on by the estimate's noise.
    - `prior_samples`: the estimate is shrunk as if this many needless answers had been
      seen; with `min_samples` a new slow route is acknowledged early from its 6th turn.
    - `min_samples`: effective samples needed before a prediction is `confident`.
    - `max_spread`: when set, a prediction whose p90/p10 ratio exceeds it is not
      confident (default None: the trigger already prices a wide spread).
    - `lower_quantile`: an older spelling of the knob: `confidence = 1 - lower_quantile`.
    - `early_secs`: when an early acknowledgment is due
      (`AcknowledgmentPolicy.early_secs`).
    - `generation_secs`: the generation time expected when the router does not say
      (`expected_generation_secs`).
    - `needless_secs`: the needless window (0.5 s, as
      `turnrouter_needless_acknowledgments_total` counts).
    - `max_routes`: routes tracked at most (the least recently used is forgotten).
    - `max_regimes`: regimes kept per route (the least recently used is forgotten).
      Memory: ~1.2 KB per regime plus ~0.5 KB per route (`memory_bytes()`).
    - `change_threshold`: the CUSUM threshold (standard deviations of log latency) that
      starts a new regime; lower is faster but flaps more; None disables detection.
    - `switch_rate`: the prior probability per sample that a route returns to another
      known regime (the regime filter's hazard).
    - `delay_secs`: the acknowledgment delay, when known: predictions then also carry
      `probability_late` and the trigger's decision `early`.
    - `feature`: a cheap per-turn class (default `query_length_class`; None: off). A
      route's samples are also learned per class (at most 4 classes) and a turn's class
      is pooled with its route by how much the route's classes really differ. Samples
      carry the class (`TimingSample.feature`), so `from_samples` restores it.
    """

    def __init__(
        self, *, half_life_samples: float = 100.0, min_samples: float = 5.0,
        confidence: float = DEFAULT_CONFIDENCE, hysteresis: float = DEFAULT_HYSTERESIS,
        evidence: float = DEFAULT_EVIDENCE, prior_samples: float = 1.0,
        lower_quantile: float | None = None, max_spread: float | None = None,
        max_routes: int = 256, max_regimes: int = 4, change_threshold: float | None = 8.0,
        switch_rate: float = 0.005, delay_secs: float | None = None,
        early_secs: float = 0.25, generation_secs: float = 0.3,
        needless_secs: float = NEEDLESS_SECS,
        feature: Callable[[AgentTurn], str | None] | None = query_length_class,
    ) -> None:
        for name, value in (("half_life_samples", half_life_samples),
                            ("min_samples", min_samples),
                            ("max_spread", 1.0 if max_spread is None else max_spread),
                            ("needless_secs", needless_secs)):
            if not finite(value) or value <= 0:
                raise ConfigurationError(
                    f"RouteTimingPredictor {name} must be finite and positive, got {value!r}")
        for name, value in (("early_secs", early_secs), ("generation_secs", generation_secs)):
            if not finite(value) or value < 0:
                raise ConfigurationError(
                    f"RouteTimingPredictor {name} must be finite and >= 0, got {value!r}")
        if lower_quantile is not None:
            if not finite(lower_quantile) or not 0.0 < lower_quantile < 0.5:
                raise ConfigurationError(f"RouteTimingPredictor lower_quantile must be in "
                                         f"(0, 0.5), got {lower_quantile!r}")
            confidence = 1.0 - lower_quantile
        if not finite(confidence) or not 0.5 < confidence < 1.0:
            raise ConfigurationError(
                f"RouteTimingPredictor confidence must be in (0.5, 1), got {confidence!r}")
        if not finite(hysteresis) or not 0.0 <= hysteresis <= 0.5:
            raise ConfigurationError(
                f"RouteTimingPredictor hysteresis must be in [0, 0.5], got {hysteresis!r}")
        if not finite(evidence) or evidence < 0:
            raise ConfigurationError(f"RouteTimingPredictor evidence must be finite and "
                                     f">= 0, got {evidence!r}")
        if not finite(prior_samples) or prior_samples < 0:
            raise ConfigurationError(f"RouteTimingPredictor prior_samples must be finite and "
                                     f">= 0, got {prior_samples!r}")
        for name, count in (("max_routes", max_routes), ("max_regimes", max_regimes)):
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ConfigurationError(
                    f"RouteTimingPredictor {name} must be an int >= 1, got {count!r}")
        if change_threshold is not None and (
                not finite(change_threshold) or change_threshold <= 0):
            raise ConfigurationError(
                f"RouteTimingPredictor change_threshold must be finite and positive or None, "
                f"got {change_threshold!r}")
        if not finite(switch_rate) or not 0.0 < switch_rate < 0.5:
            raise ConfigurationError(
                f"RouteTimingPredictor switch_rate must be in (0, 0.5), got {switch_rate!r}")
        if delay_secs is not None and (not finite(delay_secs) or delay_secs <= 0):
            raise ConfigurationError(f"RouteTimingPredictor delay_secs must be finite and "
                                     f"positive or None, got {delay_secs!r}")
        self._settings = Settings(half_life=half_life_samples, threshold=change_threshold,
                                  max_regimes=max_regimes, hazard=switch_rate)
        self._class_settings = Settings(half_life=half_life_samples, threshold=None,
                                        max_regimes=1, hazard=switch_rate)
        self._trigger = Trigger(
            confidence=confidence, hysteresis=hysteresis, prior=prior_samples,
            min_samples=min_samples, early_secs=early_secs, generation_secs=generation_secs,
            needless_secs=needless_secs, evidence=evidence)
        self._max_spread = max_spread
        self._max_routes = max_routes
        self._delay = delay_secs
        self._routes: dict[str, RouteModel] = {}
        self._dropped = False
        self._overflow = {"routes": 0, "classes": 0, "invalid": 0}
        self.feature = feature
        self._classes: dict[str, tuple[int, dict[str, RouteModel]]] = {}

    @classmethod
    def from_samples(cls, *sources: str | Path | Iterable[TimingSample],
                     missing_ok: bool = False, **settings: Any) -> RouteTimingPredictor:
        """A predictor warmed up with recorded samples (warm start after a restart).

        Each source is a `JsonLinesSink` file or an iterable of samples (e.g. the
        fleet's). Several sources are merged in time order (`TimingSample.at`); a
        missing or unreadable file raises `ConfigurationError` naming it, except a
        missing one with `missing_ok=True` (the first start, before any sample).
        """
        predictor = cls(**settings)
        streams: list[Iterable[TimingSample]] = []
        for source in sources:
            if isinstance(source, str | Path):
                if missing_ok and not Path(source).exists():
                    continue
                streams.append(load_samples(source))  # ConfigurationError naming it
            else:
                streams.append(source)
        if len(streams) == 1:
            predictor.load(streams[0])
        elif streams:
            predictor.load(sorted((s for stream in streams for s in stream),
                                  key=lambda s: s.at))
        return predictor

    @property
    def routes(self) -> tuple[str, ...]:
        """Routes with at least one sample."""
        return tuple(self._routes)

    @property
    def confidence(self) -> float:
        """The trigger's knob (see the class docstring)."""
        return self._trigger.confidence

    @property
    def overflow(self) -> dict[str, int]:
        """Samples not learned: "routes" (beyond `max_routes`), "classes" (a feature
        class beyond the 4 a route keeps; the route learned it) and "invalid" (seconds
        not a finite number >= 0, which `TimingSample` does not check: one NaN would
        have spoiled the route's model)."""
        return dict(self._overflow)

    def feature_of(self, turn: AgentTurn) -> str | None:
        """The turn's feature class (None: no feature, it failed, or it returned anything
        but a non-empty str of at most 64 characters)."""
        if self.feature is None:
            return None
        try:
            value = self.feature(turn)
        except Exception:
            logger.exception("turnrouter: timing feature failed (ignored for this turn)")
            return None
        # `valid_feature`, inline (every turn's sample asks).
        return value if isinstance(value, str) and 0 < len(value) <= MAX_FEATURE_CHARS else None

    def record(self, sample: TimingSample, turn: AgentTurn | None = None) -> None:
        """Add one sample (censored samples count as lower bounds), and to its feature
        class: `sample.feature`, else the class of `turn`."""
        seconds = sample.seconds
        if not (finite(seconds) and seconds >= 0):
            self._overflow["invalid"] += 1
            return
        model = self._routes.get(sample.route)
        if model is None:
            if len(self._routes) >= self._max_routes:
                self._overflow["routes"] += 1
                if not self._dropped:
                    self._dropped = True
                    logger.warning("turnrouter: timing predictor tracks at most %d routes; "
                                   "ignoring samples of new routes", self._max_routes)
                return
            model = self._routes[sample.route] = RouteModel()
        model.add(sample.seconds, sample.censored, self._settings)
        if self.feature is not None:
            key = sample.feature if sample.feature is not None else (
                self.feature_of(turn) if turn is not None else None)
            if key is not None:
                self._record_class(model, sample, key)

    def _record_class(self, model: RouteModel, sample: TimingSample, key: str) -> None:
        """Learn the sample in its feature class too; a route's classes restart when the
        route's own latency changes (they then relearn while the route decides)."""
        entry = self._classes.get(sample.route)
        if entry is None or entry[0] != model.changes:
            classes: dict[str, RouteModel] = {}
            self._classes[sample.route] = (model.changes, classes)
        else:
            classes = entry[1]
        sub = classes.get(key)
        if sub is None:
            if len(classes) >= _MAX_CLASSES:
                self._overflow["classes"] += 1
                return
            sub = classes[key] = RouteModel()
        # (Classes have one regime and no change detection: `add_plain` is their `add`.)
        sub.add_plain(sample.seconds, sample.censored, self._class_settings)

    def load(self, samples: Iterable[TimingSample]) -> int:
        """Record samples in order (e.g. `load_samples(path)` after a restart)."""
        count = 0
        for sample in samples:
            self.record(sample)
            count += 1
        return count

    def replay(self, samples: Iterable[TimingSample], *, delay_secs: float,
               generation_secs: float | None = None,
               ) -> Iterator[tuple[TimingSample, Prediction | None]]:
        """Each sample, in order, with the prediction this predictor makes for its turn
        (its route and feature class, at `delay_secs`) just before learning it: what the
        router would have decided on those turns (`turnrouter tune` replays files so)."""
        for sample in samples:
            yield sample, self._predict(sample.route, sample.feature, delay_secs,
                                        generation_secs)
            self.record(sample)

    def _distribution(self, route: str, key: str | None,
                      ) -> tuple[RouteModel, RouteModel, list[tuple[float, Histogram]]] | None:
        """The route's model, the model holding this turn's decision (its class's, when
        it has one), and the turn's distribution (the class pooled with the route)."""
        model = self._routes.get(route)
        if model is None:
            return None
        parts = model.parts(self._settings.hazard)
        if not parts:
            return None
        holder = model
        if key is not None:
            synced, classes = self._classes.get(route, (-1, {}))
            sub = classes.get(key) if synced == model.changes else None
            if sub is not None:
                holder = sub
                parts = pooled(parts, sub.parts(self._settings.hazard),
                               class_weight(model, classes, sub))
        return model, holder, parts

    def quantile(self, route: str, q: float) -> float | None:
        """The `q` quantile of `route`'s next first response (None without samples)."""
        found = self._distribution(route, None)
        return None if found is None else Mixture(found[2]).quantile(q)

    def samples(self, route: str) -> float:
        """The effective (decayed) sample count behind `route`'s next prediction."""
        model = self._routes.get(route)
        return 0.0 if model is None else RouteModel.effective(
            model.parts(self._settings.hazard))

    def changes(self, route: str) -> int:
        """How many latency changes were detected on `route`: new regimes started by the
        change detector plus returns to a regime seen before."""
        model = self._routes.get(route)
        return 0 if model is None else model.changes

    def regimes(self, route: str) -> int:
        """How many latency regimes `route` remembers (at most `max_regimes`)."""
        model = self._routes.get(route)
        return 0 if model is None else len(model.regimes)

    def memory_bytes(self, route: str) -> int:
        """The size of `route`'s state (`sys.getsizeof` of its parts; 0 if unknown)."""
        model = self._routes.get(route)
        if model is None:
            return 0
        size = sum(sys.getsizeof(part) for part in (
            model, model.recent, model.recent_censored, model.regimes, model.post))
        for regime in model.regimes:
            size += sum(sys.getsizeof(part) for part in (
                regime, regime.hist, regime.hist.weights))
        return size

    def estimate(self, route: str) -> float | None:
        """The typical (median) first response of `route`."""
        return self.quantile(route, 0.5)

    def predict(self, route: str, turn: AgentTurn | None = None, *,
                delay_secs: float | None = None,
                generation_secs: float | None = None) -> Prediction | None:
        """The prediction for `route`'s next turn (`turn` gives its feature class); None
        before the route's first sample.

        With a delay (`delay_secs` here or in the constructor) it carries
        `probability_late` and the trigger's decision `early`; `generation_secs` is the
        acknowledgment generation time expected now (default: the constructor's).
        """
        key = self.feature_of(turn) if turn is not None else None
        return self._predict(route, key, delay_secs, generation_secs)

    def _predict(self, route: str, key: str | None, delay_secs: float | None,
                 generation_secs: float | None) -> Prediction | None:
        found = self._distribution(route, key)
        if found is None:
            return None
        model, holder, parts = found
        mixture = Mixture(parts)
        p10, median, p90 = (mixture.quantile(q) for q in (0.1, 0.5, 0.9))
        effective = RouteModel.effective(parts)
        trigger = self._trigger
        # Confidence rests on the route's evidence; a class only refines the estimate.
        confident = (effective if holder is model else RouteModel.effective(
            model.parts(self._settings.hazard))) >= trigger.min_samples and (
            self._max_spread is None or p90 <= p10 * self._max_spread)
        delay = delay_secs if delay_secs is not None else self._delay
        if delay is None:
            return Prediction(median, p10, p90, effective, confident)
        generation = trigger.generation_secs if generation_secs is None else generation_secs
        advantage, late = trigger.advantage(mixture, effective, delay, generation)

        def margin() -> float:
            # The noise of the route's own estimate: a class's distribution is already
            # shrunk to the route's by the pooling, so its fewer samples do not count twice.
            if holder is model:
                return trigger.margin(mixture, effective, delay, generation)
            own = model.parts(self._settings.hazard)
            return trigger.margin(Mixture(own), RouteModel.effective(own), delay, generation)

        early = trigger.decide(holder, advantage, delay, confident, margin)
        return Prediction(median, p10, p90, effective, confident, late, early)


# ---------------------------------------------------------------- JSON lines

class JsonLinesSink:
    """A `TimingSink` appending one JSON object per sample to a file.

    Lines look like `{"route":"calendar","seconds":1.234,"censored":false,"at":1.7e9}`.
    The file is opened lazily in append mode and flushed every `flush_every` samples
    (default: every sample); call `close()` (or use it as a context manager) at exit.
    Read it back with `load_samples()`, or analyse it with `turnrouter tune --samples`.

    Args:
        path: The JSON-lines file (created if missing, appended to otherwise).
        flush_every: Flush after this many samples (default 1: every sample).
    """

    def __init__(self, path: str | Path, *, flush_every: int = 1) -> None:
        if (not isinstance(flush_every, int) or isinstance(flush_every, bool)
                or flush_every < 1):
            # NaN compared false with everything: such a sink never flushed.
            raise ConfigurationError(
                f"JsonLinesSink flush_every must be an int >= 1, got {preview(flush_every)}")
        self.path = Path(path)
        try:
            kind = self.path.stat().st_mode
        except FileNotFoundError:
            kind = None
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            raise ConfigurationError(
                f"JsonLinesSink cannot use {preview(str(path))}: {exc}") from exc
        if kind is not None and not (stat.S_ISREG(kind) or stat.S_ISCHR(kind)):
            # A FIFO nobody reads blocked the event loop at the first sample for ever.
            raise ConfigurationError(
                f"JsonLinesSink path {preview(str(path))} is not a regular file")
        self._flush_every = flush_every
        self._pending = 0
        self._file: IO[str] | None = None

    def record(self, sample: TimingSample) -> None:
        if self._file is None:
            # Without waiting: the path may have become a FIFO since (OSError, logged
            # by the router as a timing-sink failure).
            self._file = io.TextIOWrapper(open_regular(self.path, "ab", devices=True),
                                          encoding="utf-8")
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
    """Samples of a JSON-lines file in order; ConfigurationError names a bad line (one
    longer than `MAX_SAMPLE_LINE_BYTES` too: it is never read whole), or the file when
    it cannot be opened (missing, a directory, a FIFO, no permission)."""
    try:
        handle = open_regular(path, "rb")  # a FIFO with no writer: refused, not waited on
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigurationError(
            f"cannot read timing samples from {preview(str(path))}: {exc}") from exc
    with handle:
        lines = iter(lambda: handle.readline(MAX_SAMPLE_LINE_BYTES + 1), b"")
        for number, raw in enumerate(lines, 1):
            if len(raw) > MAX_SAMPLE_LINE_BYTES:
                raise ConfigurationError(f"{path}:{number}: invalid timing sample: line "
                                         f"longer than {MAX_SAMPLE_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8")
                sample = TimingSample.from_json(line) if line.strip() else None
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
                raise ConfigurationError(f"{path}:{number}: invalid timing sample: {exc}") from exc
            if sample is not None:
                yield sample


def load_samples(path: str | Path) -> list[TimingSample]:
    """All samples of a JSON-lines file written by `JsonLinesSink`, in order."""
    return list(iter_samples(path))


def now_unix() -> float:
    return time.time()


# ---------------------------------------------------------------- LLM-assisted

#: `seconds: <number>`, the number whole (not the start of `1e9` or `10**9`), and the
#: word after it, which may only be a unit of seconds.
_SECONDS = re.compile(r"seconds\s*[:=]\s*([0-9]+(?:\.[0-9]+)?)(?![0-9eE*^]|\.[0-9])\s*([A-Za-z]*)",
                      re.IGNORECASE | re.ASCII)
_SECOND_UNITS = frozenset(("", "s", "sec", "secs", "second", "seconds"))


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
    """The `seconds: <number>` of a reply, its reasoning removed; None when absent,
    implausible, written with an exponent, or in another unit ("3 minutes")."""
    match = _SECONDS.search(strip_reasoning(reply))
    if match is None or match.group(2).lower() not in _SECOND_UNITS:
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

    Args:
        llm: The `LLMService` asked for `seconds: <number>`.
        base: The predictor that learns the samples (default `RouteTimingPredictor()`).
        descriptions: Route -> description, shown to the model.
        examples: Recent (query, seconds) examples kept per route (default 8).
        min_examples: Examples a route needs before the model is asked (default 4).
        max_tokens: Output-token budget of each prediction (default 12).
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

    def feature_of(self, turn: AgentTurn) -> str | None:
        """The base predictor's feature class of `turn` (recorded with its sample)."""
        return self.base.feature_of(turn)

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
