"""`turnrouter tune`: which acknowledgment delay? The what-if of `turnrouter.ops._tuning`.

For each candidate delay and each route (and all routes together), from recorded
first-response samples (the `JsonLinesSink` export, e.g. `turnrouter demo --samples`) or
a Prometheus server's `turnrouter_first_response_seconds` histogram with
`turnrouter_first_response_interrupted_seconds` (the turns interrupted before a response:
censored, as in the samples; optionally narrowed by a label selector such as
`job="voice"`): the acknowledgment rate, the needless rate
(acknowledgment heard, answer started within `NEEDLESS_WITHIN_SECONDS`) and p95 silence
under two policies side by side: the fixed delay, and the predictive policy the router
really runs (its `RouteTimingPredictor` acknowledging some turns early), with the share
of turns it acknowledges early. Samples are replayed in order through the real trigger
for each candidate delay; a histogram has no order, so from Prometheus the predictive
policy is approximated per route (see `turnrouter.ops._tuning`). The tuning dashboard
computes the same numbers in PromQL; a test checks they agree.

The recommendation is over all routes (`acknowledgment_delay_secs`, router-wide) or, with
`--route X`, for that route alone (its `acknowledgment_route_delays` entry)
(`--max-ack-rate`: the shortest delay within it; `--max-silence-p95`: the longest delay
within it; `--policy` says which policy's figures it reads, predictive by default);
per-route rows show who pays for it. A PNG plot is optional (`--plot`, needs
matplotlib: the `turnrouter[plot]` extra).

Exit status: 0 done, 1 the target cannot be met by any candidate, 2 bad input (one line
on stderr, never a traceback). Censored samples (turns interrupted before a response) are
handled by the Kaplan-Meier estimator, from samples or from buckets (its life-table form,
`BucketDistribution`), so both sources recommend the same delay for the same turns.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import http.client
import importlib
import json
import math
import re
import socket
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, TextIO

from .._config import MAX_ROUTE_CHARS
from .._paths import open_regular
from .._redact import redact_url
from .._timing import RouteTimingPredictor, TimingSample
from ..ops._rules import DEAD_AIR_SECONDS
from ..ops._tuning import (
    ALL_ROUTES,
    CONFIDENCE,
    EARLY_SECS,
    GENERATION_SECS,
    HYSTERESIS,
    Candidate,
    candidate,
    candidates,
    early_at,
)
from ..telemetry import NEEDLESS_WITHIN_SECONDS, metric
from ._parser import OneLineParser

__all__ = [
    "MAX_ANSWER_TOKENS",
    "MAX_LINE_BYTES",
    "MAX_REPLAY_SAMPLES",
    "MAX_RESPONSE_BYTES",
    "MAX_ROUTES",
    "MAX_SAMPLES",
    "BucketDistribution",
    "SampleDistribution",
    "Split",
    "TuneRow",
    "analyse",
    "parse_prometheus_answer",
    "printable",
    "read_samples",
    "replay_splits",
    "tune_main",
]

PROMETHEUS_METRIC = metric("turnrouter_first_response_seconds").name + "_bucket"
#: Turns interrupted before `started()`: the censored samples of the histogram.
INTERRUPTED_METRIC = metric("turnrouter_first_response_interrupted_seconds").name + "_bucket"
#: Bounds on what tune reads (beyond them: a clear error, exit 2).
MAX_SAMPLES = 5_000_000
MAX_LINE_BYTES = 65_536
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_SERIES = 200_000
#: Separators (`,` `:` `[` `{`) an answer may hold: a bound on the values decoding makes
#: (each series of an answer takes about 12), so 64 MiB of `[{},{},...]` cannot cost
#: gigabytes of Python objects.
MAX_ANSWER_TOKENS = 3_000_000
#: Routes one run analyses, as many as `RouteTimingPredictor` tracks: each costs a replay
#: and a table section, so a file of a million route names would run for half an hour.
MAX_ROUTES = 256
#: The replay reads at most this many of the most recent samples by default (each
#: candidate delay replays them all through a predictor: ~22 us per sample and delay,
#: ~9 s for the default 20 candidates).
MAX_REPLAY_SAMPLES = 20_000

_MATCHER = r'[A-Za-z_][A-Za-z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\\n]|\\.)*"'
_SELECTOR = re.compile(rf"\s*\{{?\s*(?:{_MATCHER}(?:\s*,\s*{_MATCHER})*)?\s*,?\s*\}}?\s*")
_DURATION = re.compile(r"(?:[0-9]{1,9}(?:ms|s|m|h|d|w|y))+")


class Distribution(Protocol):
    turns: float

    def survival(self, t: float) -> float:
        """P(first response > t)."""
        ...

    def quantile(self, q: float) -> float:
        """The q quantile of the first response (inf when beyond what is known)."""
        ...


class SampleDistribution:
    """Kaplan-Meier estimate from samples; censored ones are lower bounds."""

    def __init__(self, samples: Iterable[tuple[float, bool]]) -> None:
        items = sorted(samples)
        self.turns = float(len(items))
        self._times: list[float] = []
        self._survival: list[float] = []  # S(t) just after each event time
        at_risk = len(items)
        survival = 1.0
        i = 0
        while i < len(items):
            t = items[i][0]
            events = censored = 0
            while i < len(items) and items[i][0] == t:
                if items[i][1]:
                    censored += 1
                else:
                    events += 1
                i += 1
            if events and at_risk:
                survival *= 1.0 - events / at_risk
                self._times.append(t)
                self._survival.append(survival)
            at_risk -= events + censored

    def survival(self, t: float) -> float:
        index = bisect.bisect_right(self._times, t)
        return 1.0 if index == 0 else self._survival[index - 1]

    def quantile(self, q: float) -> float:
        for t, s in zip(self._times, self._survival, strict=True):
            if 1.0 - s >= q - 1e-12:
                return t
        return math.inf


class BucketDistribution:
    """A cumulative histogram of first responses (Prometheus buckets), optionally with
    one of censored ones (turns interrupted before `started()`, bucketed by when), read
    as `SampleDistribution` reads samples: the Kaplan-Meier estimate at the bucket
    bounds (the life-table form: a bucket's censored turns count as at risk for half of
    it), linear within buckets. Without censored turns it is exactly the empirical
    distribution `histogram_quantile` interpolates (counts made monotonic, as
    Prometheus does)."""

    def __init__(self, buckets: Sequence[tuple[float, float]],
                 censored: Sequence[tuple[float, float]] = ()) -> None:
        self._buckets = tuple(buckets)
        self._censored = bool(censored)
        events = _monotonic(buckets)
        lost = _monotonic(censored)
        self._bounds = sorted(set(events) | set(lost))
        at_events = [_at(events, b) for b in self._bounds]
        at_lost = [_at(lost, b) for b in self._bounds]
        self.turns = (at_events[-1] if at_events else 0.0) + (at_lost[-1] if at_lost else 0.0)
        #: S just after each bound (1 - E/N when nothing is censored).
        self._survival: list[float] = []
        survival, at_risk = 1.0, self.turns
        previous_events = previous_lost = 0.0
        for e, c in zip(at_events, at_lost, strict=True):
            died, left = e - previous_events, c - previous_lost
            exposed = at_risk - left / 2
            if died > 0 and exposed > 0:
                survival *= max(0.0, 1.0 - died / exposed)
            at_risk -= died + left
            previous_events, previous_lost = e, c
            self._survival.append(survival)

    def answered(self) -> BucketDistribution:
        """The answered turns alone: what the tuning dashboard's approximated trigger
        reads (its PromQL cannot afford the censored estimate at five instants), so
        that tune approximates the same routes as early."""
        return BucketDistribution(self._buckets) if self._censored else self

    def survival(self, t: float) -> float:
        if self.turns <= 0:
            return 1.0
        previous_bound, previous = 0.0, 1.0
        for bound, s in zip(self._bounds, self._survival, strict=True):
            if t < bound:
                if math.isinf(bound):
                    return previous
                return previous + (t - previous_bound) / (bound - previous_bound) * (
                    s - previous)
            previous_bound, previous = bound, s
        return previous

    def quantile(self, q: float) -> float:
        if self.turns <= 0:
            return math.nan
        target = 1.0 - q
        previous_bound, previous = 0.0, 1.0
        for bound, s in zip(self._bounds, self._survival, strict=True):
            if s <= target + 1e-12:
                if math.isinf(bound):
                    return previous_bound if previous_bound > 0 else math.inf
                if s == previous:
                    return bound
                return previous_bound + (bound - previous_bound) * (
                    (previous - target) / (previous - s))
            previous_bound, previous = bound, s
        return math.inf


def _monotonic(buckets: Sequence[tuple[float, float]]) -> dict[float, float]:
    """Bound -> cumulative count, made monotonic (as Prometheus does)."""
    out: dict[float, float] = {}
    running = 0.0
    for bound, count in sorted(buckets):
        running = max(running, count)
        out[bound] = running
    return out


def _at(cumulative: dict[float, float], bound: float) -> float:
    """A cumulative histogram's count at `bound` (linear between its own bounds)."""
    if not cumulative:
        return 0.0
    if bound in cumulative:
        return cumulative[bound]
    previous_bound, previous = 0.0, 0.0
    for b, count in cumulative.items():
        if bound < b:
            if math.isinf(b) or math.isinf(bound):
                return previous
            return previous + (bound - previous_bound) / (b - previous_bound) * (
                count - previous)
        previous_bound, previous = b, count
    return previous


@dataclass(frozen=True, slots=True)
class TuneRow:
    """The what-if of one route (or all routes) at one candidate delay: the predictive
    policy (what the router does) and the fixed delay."""

    route: str
    delay: float
    turns: float
    early: float
    """Share of turns the trigger acknowledges early (approximated: 0 or 1)."""
    ack_rate: float
    needless_rate: float
    p50_silence: float
    p95_silence: float
    fixed_ack_rate: float
    fixed_needless_rate: float
    fixed_p50_silence: float
    fixed_p95_silence: float
    replayed: bool
    """The predictive figures come from replaying samples (else: approximated)."""

    def figures(self, policy: str) -> tuple[float, float, float]:
        """(ack rate, needless rate, p95 silence) of `policy` ("predictive" or "fixed")."""
        if policy == "fixed":
            return self.fixed_ack_rate, self.fixed_needless_rate, self.fixed_p95_silence
        return self.ack_rate, self.needless_rate, self.p95_silence


@dataclass(frozen=True, slots=True)
class Split:
    """One route's turns at one candidate delay, split by the replayed trigger's decision."""

    early: Distribution | None
    waited: Distribution | None


def _outcome(dist: Distribution, heard: float) -> tuple[float, float]:
    """(ack rate, needless rate) of turns from `dist` acknowledged at `heard`."""
    ack = dist.survival(heard)
    return ack, max(0.0, ack - dist.survival(heard + NEEDLESS_WITHIN_SECONDS))


def _mixture_quantile(parts: list[tuple[float, Distribution, float]], q: float) -> float:
    """Quantile of silence over groups of turns: each `(weight, X, h)` contributes
    min(X, h)."""
    total = sum(weight for weight, _, _ in parts)
    if total <= 0:
        return math.nan

    def cdf(s: float) -> float:
        return sum(weight * (1.0 if s >= heard else 1.0 - dist.survival(s))
                   for weight, dist, heard in parts) / total

    low, high = 0.0, max(heard for _, _, heard in parts)
    if cdf(high) < q - 1e-12:
        return high
    for _ in range(60):
        middle = (low + high) / 2
        if cdf(middle) >= q - 1e-12:
            high = middle
        else:
            low = middle
    return high


def _groups(dist: Distribution, c: Candidate, split: Split | None, confidence: float,
            hysteresis: float) -> tuple[list[tuple[float, Distribution, float]], bool]:
    """The predictive policy's groups of turns `(turns, X, heard)`: the replay's split,
    else the approximation (the whole route early or not); and whether replayed."""
    if split is None:
        basis = dist.answered() if isinstance(dist, BucketDistribution) else dist
        early = early_at(basis.survival, c, confidence, hysteresis)
        return [(dist.turns, dist, c.heard_early if early else c.heard)], False
    groups = [(d.turns, d, heard) for d, heard in ((split.early, c.heard_early),
                                                   (split.waited, c.heard))
              if d is not None and d.turns > 0]
    return groups, True


def _row(route: str, dist: Distribution, c: Candidate,
         groups: list[tuple[float, Distribution, float]], replayed: bool) -> TuneRow:
    fixed_ack, fixed_needless = _outcome(dist, c.heard)
    turns = sum(weight for weight, _, _ in groups) or 1.0
    ack = needless = early = 0.0
    for weight, group, heard in groups:
        a, n = _outcome(group, heard)
        ack += weight * a / turns
        needless += weight * n / turns
        early += weight / turns if heard == c.heard_early and heard != c.heard else 0.0
    return TuneRow(route, c.delay, dist.turns, early, ack, needless,
                   _mixture_quantile(groups, 0.5), _mixture_quantile(groups, 0.95),
                   fixed_ack, fixed_needless, min(dist.quantile(0.5), c.heard),
                   min(dist.quantile(0.95), c.heard), replayed)


def analyse(distributions: dict[str, Distribution], delays: Sequence[float],
            generation: float = GENERATION_SECS, early: float = EARLY_SECS, *,
            splits: dict[tuple[str, float], Split] | None = None,
            confidence: float = CONFIDENCE, hysteresis: float = HYSTERESIS,
            ) -> list[TuneRow]:
    """Rows per route and candidate delay (routes in the given order), then the
    all-routes rows (rates weighted by each route's turns). With `splits` (from
    `replay_splits`, keyed by route and candidate delay) the predictive policy is the
    replayed one, else it is approximated from each route's distribution."""
    rows: list[TuneRow] = []
    overall: list[TuneRow] = []
    routes = [r for r in distributions if r != ALL_ROUTES]
    grouped: dict[tuple[str, float], list[tuple[float, Distribution, float]]] = {}
    for route in routes:
        dist = distributions[route]
        for d in delays:
            c = candidate(d, generation, early)
            split = None if splits is None else splits.get((route, c.delay), Split(None, None))
            groups, replayed = _groups(dist, c, split, confidence, hysteresis)
            if replayed and not groups:  # nothing replayed for this route: its history
                groups = [(dist.turns, dist, c.heard)]
            grouped[route, c.delay] = groups
            rows.append(_row(route, dist, c, groups, replayed))
    total = sum(distributions[r].turns for r in routes)
    for d in delays:
        c = candidate(d, generation, early)
        mine = [r for r in rows if r.delay == c.delay]
        if total <= 0 or not mine:
            continue
        # Each route weighs its turns, however many of them were replayed.
        parts: list[tuple[float, Distribution, float]] = []
        for r in mine:
            groups = grouped[r.route, c.delay]
            scale = r.turns / (sum(w for w, _, _ in groups) or 1.0)
            parts.extend((w * scale, dist, heard) for w, dist, heard in groups)
        fixed = [(r.turns, distributions[r.route], c.heard) for r in mine]

        def weighted(field: str, rows: list[TuneRow] = mine) -> float:
            return float(sum(getattr(r, field) * r.turns for r in rows)) / total

        overall.append(TuneRow(
            ALL_ROUTES, c.delay, total, weighted("early"), weighted("ack_rate"),
            weighted("needless_rate"), _mixture_quantile(parts, 0.5),
            _mixture_quantile(parts, 0.95), weighted("fixed_ack_rate"),
            weighted("fixed_needless_rate"), _mixture_quantile(fixed, 0.5),
            _mixture_quantile(fixed, 0.95), all(r.replayed for r in mine)))
    return rows + overall


def replay_splits(samples: Sequence[TimingSample], delays: Sequence[float],
                  generation: float = GENERATION_SECS, early: float = EARLY_SECS, *,
                  confidence: float = CONFIDENCE, hysteresis: float = HYSTERESIS,
                  ) -> dict[tuple[str, float], Split]:
    """For each candidate delay, replay `samples` (in order) through a fresh default
    predictor and split each route's turns by its trigger's decision."""
    splits: dict[tuple[str, float], Split] = {}
    for d in delays:
        c = candidate(d, generation, early)
        predictor = RouteTimingPredictor(
            confidence=confidence, hysteresis=hysteresis, early_secs=early,
            generation_secs=generation, delay_secs=c.delay)
        groups: dict[str, tuple[list[tuple[float, bool]], list[tuple[float, bool]]]] = {}
        for sample, prediction in predictor.replay(samples, delay_secs=c.delay,
                                                   generation_secs=generation):
            early_turns, waited = groups.setdefault(sample.route, ([], []))
            chosen = early_turns if prediction is not None and prediction.early else waited
            chosen.append((sample.seconds, sample.censored))
        for route, (early_turns, waited) in groups.items():
            splits[route, c.delay] = Split(
                SampleDistribution(early_turns) if early_turns else None,
                SampleDistribution(waited) if waited else None)
    return splits


# ---------------------------------------------------------------- sources

def printable(text: str) -> str:
    """`text` with control and other unprintable characters escaped (safe for a
    terminal)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def read_samples(path: str, routes: set[str] | None) -> list[TimingSample]:
    """The samples of a JSON-lines samples file in file order (of `routes` only, when
    given); ValueError naming the file and line for anything malformed (junk,
    non-UTF-8, too deep, too long)."""
    try:
        # Without waiting: a FIFO with no writer would block tune for ever.
        handle = open_regular(path, "rb")
    except ValueError as exc:  # a NUL or a lone surrogate in the path
        raise ValueError(f"{printable(path)}: cannot open: {exc}") from exc
    except OSError as exc:
        raise ValueError(f"{printable(path)}: cannot open: "
                         f"{exc.strerror or exc}") from exc
    try:
        return _samples_of(handle, path, routes)
    except OSError as exc:  # e.g. /proc/self/mem: an I/O error, named with its file
        raise ValueError(f"{printable(path)}: cannot read: {exc.strerror or exc}") from exc
    finally:
        handle.close()


def _samples_of(handle: IO[bytes], path: str, routes: set[str] | None) -> list[TimingSample]:
    """`read_samples`'s reading of an open file, line by line."""
    samples: list[TimingSample] = []
    count = 0
    for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""),
                                 1):
        if len(raw) > MAX_LINE_BYTES:
            raise ValueError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            sample = TimingSample.from_json(line)
        except RecursionError:
            raise ValueError(f"{path}:{number}: invalid timing sample: nested too "
                             "deeply") from None
        except ValueError as exc:  # also UnicodeDecodeError, JSONDecodeError
            reason = " ".join(str(exc).split())[:200]
            raise ValueError(f"{path}:{number}: invalid timing sample: {reason}") from exc
        if len(sample.route) > MAX_ROUTE_CHARS:
            # As a router's route names: 65,000-character names padded every row of
            # the table, 16 MB of samples printing 218 MB (bounds17 M6).
            raise ValueError(f"{path}:{number}: route name longer than {MAX_ROUTE_CHARS} "
                             "characters (a router's route names are at most that)")
        count += 1
        if count > MAX_SAMPLES:
            raise ValueError(f"{path}: more than {MAX_SAMPLES} samples")
        if routes is None or sample.route in routes:
            samples.append(sample)
    return samples


def from_samples(paths: Sequence[str], routes: set[str] | None,
                 ) -> tuple[dict[str, Distribution], list[TimingSample]]:
    """Each route's distribution, and all samples in time order (files merged by `at`,
    as `RouteTimingPredictor.from_samples` merges them)."""
    merged: list[TimingSample] = []
    for path in paths:
        merged.extend(read_samples(path, routes))
    if len(paths) > 1:
        merged.sort(key=lambda sample: sample.at)
    by_route: dict[str, list[tuple[float, bool]]] = {}
    for sample in merged:
        by_route.setdefault(sample.route, []).append((sample.seconds, sample.censored))
    return {r: SampleDistribution(v) for r, v in sorted(by_route.items())}, merged


def selector_matchers(selector: str | None) -> str:
    """The label matchers of `--selector` without braces (ValueError if malformed, or
    given without a matcher: `--selector "$SEL"` with the variable unset, or `'}'`,
    would widen the analysis to every job of the Prometheus without a word)."""
    if selector is None:
        return ""
    matchers = ""
    if len(selector) <= 2000 and _SELECTOR.fullmatch(selector):
        matchers = selector.strip().removeprefix("{").removesuffix("}").strip().rstrip(
            ",").strip()
    if not matchers:
        raise ValueError(f"--selector must be Prometheus label matchers such as "
                         f'job="voice",namespace=~"prod.*", got {printable(selector[:100])!r}'
                         " (leave it out to read every job)")
    return matchers


def prometheus_query(window: str, matchers: str = "",
                     metric: str = PROMETHEUS_METRIC) -> str:
    """The bucket query tune sends (of `metric`: first responses, or with
    `INTERRUPTED_METRIC` the censored ones)."""
    return f"sum by (route, le) (increase({metric}{{{matchers}}}[{window}]))" \
        if matchers else f"sum by (route, le) (increase({metric}[{window}]))"


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{what} is not a number: {printable(repr(value)[:60])}")
    try:
        return float(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{what} is not a number: {printable(repr(value)[:60])}") from None


def parse_prometheus_answer(payload: object,
                            routes: set[str] | None) -> dict[str, dict[float, float]]:
    """route -> {bucket bound: count} from an /api/v1/query answer; ValueError naming
    what is wrong for any answer that is not a vector of finite, non-negative counts
    with numeric `le` bounds."""
    if not isinstance(payload, dict):
        raise ValueError("Prometheus answer is not a JSON object")
    if payload.get("status") != "success":
        error = payload.get("error")
        detail = printable(str(error)[:200]) if isinstance(error, str) else "no error given"
        raise ValueError(f"Prometheus query failed: {detail}")
    data = payload.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise ValueError("Prometheus answer has no vector 'data'")
    result = data.get("result")
    if not isinstance(result, list):
        raise ValueError("Prometheus answer 'data.result' is not a list")
    if len(result) > MAX_SERIES:
        raise ValueError(f"Prometheus answer has more than {MAX_SERIES} series")
    buckets: dict[str, dict[float, float]] = {}
    for index, series in enumerate(result):
        where = f"series {index}"
        if not isinstance(series, dict):
            raise ValueError(f"Prometheus {where} is not an object")
        labels, value = series.get("metric"), series.get("value")
        if not isinstance(labels, dict):
            raise ValueError(f"Prometheus {where} has no 'metric' labels")
        route, le = labels.get("route"), labels.get("le")
        if not isinstance(route, str) or not isinstance(le, str):
            raise ValueError(f"Prometheus {where} lacks string 'route' and 'le' labels")
        if len(route) > MAX_ROUTE_CHARS:
            raise ValueError(f"Prometheus {where}: route label longer than "
                             f"{MAX_ROUTE_CHARS} characters (not a router's route name)")
        if not isinstance(value, list) or len(value) != 2:
            raise ValueError(f"Prometheus {where} 'value' is not [time, value]")
        bound = math.inf if le in ("+Inf", "Inf", "inf") else _number(le, f"{where} le")
        count = _number(value[1], f"{where} value")
        if math.isnan(bound) or bound <= 0:
            raise ValueError(f"Prometheus {where}: bucket bound le={printable(le[:30])!r} "
                             "is not a positive number")
        if not math.isfinite(count) or count < 0:
            raise ValueError(f"Prometheus {where}: bucket count {count!r} is not a finite "
                             "number >= 0")
        if routes is not None and route not in routes:
            continue
        per_route = buckets.setdefault(route, {})
        per_route[bound] = per_route.get(bound, 0.0) + count
    for route, per_route in buckets.items():
        if math.inf not in per_route:
            # Without it the histogram's total is unknown (Prometheus's own
            # histogram_quantile answers NaN): any figure would be made up.
            raise ValueError(f"Prometheus answer has no le=\"+Inf\" bucket for route "
                             f"{printable(route[:60])!r}")
    if not math.isfinite(sum(c for per_route in buckets.values() for c in per_route.values())):
        # Each finite, their sum not (1e308 per bucket): every rate would read inf or nan.
        raise ValueError("Prometheus answer's bucket counts are too large to add up "
                         "(their sum is not finite)")
    return buckets


def _check_url(url: str) -> None:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # "Invalid IPv6 URL"
        parts = urllib.parse.SplitResult("", "", "", "", "")
    if parts.scheme not in ("http", "https") or not parts.netloc or not url.isprintable():
        raise ValueError(f"--prometheus must be an http(s) URL, got "
                         f"{printable(redact_url(url)[:100])!r}")
    # tune sends no credentials, and urllib would take "user:password@host" for a host
    # name: refused before the URL is ever shown (errors name the endpoint).
    if "@" in parts.netloc:
        raise ValueError("--prometheus must not hold a user name or password (tune sends "
                         "no credentials; reach an authenticating Prometheus through a "
                         "local proxy)")
    if parts.query or parts.fragment or url.rstrip("/").endswith(("?", "#")):
        raise ValueError("--prometheus must be Prometheus's base URL, without a query or "
                         "fragment (tune appends /api/v1/query)")


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)


class _Deadline:
    """Shuts down every socket of one query once `seconds` have passed.

    urllib's timeout bounds each socket operation only: a server answering one byte at
    a time satisfies every read, and would hold tune for as long as it likes. Shutting
    the sockets down ends any blocked read; `expired` tells that apart from a server
    that really closed.
    """

    def __init__(self, seconds: float) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def watch(self, sock: socket.socket) -> None:
        """Shut `sock` down with the others when the time is up (at once if it is)."""
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shutdown(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener, with every connection it makes (redirects too) watched by
    `deadline`."""

    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            deadline.watch(self.sock)

    class TLSConnection(http.client.HTTPSConnection):
        def connect(self) -> None:
            super().connect()
            deadline.watch(self.sock)

    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(Connection, req)

    class TLSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(TLSConnection, req)

    class Redirects(urllib.request.HTTPRedirectHandler):
        # urllib follows http -> ftp too, on a connection the deadline does not watch.
        def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int,
                             msg: str, headers: http.client.HTTPMessage, newurl: str,
                             ) -> urllib.request.Request | None:
            scheme = urllib.parse.urlsplit(newurl).scheme
            if scheme not in ("http", "https"):
                raise urllib.error.URLError(
                    f"redirect to a {printable(scheme[:20])} URL refused (http(s) only)")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    return urllib.request.build_opener(Handler, TLSHandler, Redirects)


def _query(url: str, expr: str, timeout: float, at: float | None) -> object:
    """POST one instant query; the decoded JSON answer (ValueError for any failure).
    `timeout` bounds the whole exchange (connect, headers, body), not each read."""
    _check_url(url)
    form = {"query": expr}
    if at is not None:
        form["time"] = f"{at:.3f}"
    body = urllib.parse.urlencode(form).encode()
    endpoint = url.rstrip("/") + "/api/v1/query"
    request = urllib.request.Request(
        endpoint, data=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
    late = f"Prometheus {endpoint} failed: no complete answer within --timeout {timeout:g}s"
    with _Deadline(timeout) as deadline:
        try:
            with _opener(deadline).open(request, timeout=timeout) as response:
                raw = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            try:
                detail = printable(exc.read(300).decode("utf-8", "replace"))
            except (OSError, http.client.HTTPException):  # the error body itself is broken
                detail = "(unreadable body)"
            if deadline.expired:
                raise ValueError(late) from exc
            raise ValueError(f"Prometheus {endpoint} returned HTTP {exc.code}: {detail}"
                             ) from exc
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if deadline.expired:
                raise ValueError(late) from exc
            # HTTPException: a broken reply (bad status line, truncated chunk, header flood).
            detail = printable(f"{type(exc).__name__}: {exc}"[:200])
            raise ValueError(f"Prometheus {endpoint} failed: {detail}") from exc
        if deadline.expired:  # a reply without a length ends where its socket was shut
            raise ValueError(late)
    if len(raw) > MAX_RESPONSE_BYTES:
        raise ValueError(f"Prometheus answer larger than {MAX_RESPONSE_BYTES} bytes")
    tokens = sum(raw.count(separator) for separator in (b",", b":", b"[", b"{"))
    if tokens > MAX_ANSWER_TOKENS:  # counted in C before any object is made
        raise ValueError(f"Prometheus answer holds more than {MAX_ANSWER_TOKENS:,} values "
                         f"(tune reads at most {MAX_SERIES:,} series)")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("Prometheus answer is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"Prometheus answer is not JSON: {str(exc)[:100]}") from exc


def from_prometheus(url: str, window: str, routes: set[str] | None, timeout: float,
                    matchers: str = "", at: float | None = None) -> dict[str, Distribution]:
    """Each route's distribution from the first-response histogram and the censored one
    (turns interrupted before `started()`, counted as the samples path counts them)."""
    payload = _query(url, prometheus_query(window, matchers), timeout, at)
    buckets = parse_prometheus_answer(payload, routes)
    payload = _query(url, prometheus_query(window, matchers, INTERRUPTED_METRIC), timeout, at)
    censored = parse_prometheus_answer(payload, routes)
    out: dict[str, Distribution] = {}
    for route in sorted(buckets.keys() | censored.keys()):
        events, lost = buckets.get(route, {}), censored.get(route, {})
        if max(events.values(), default=0.0) > 0 or max(lost.values(), default=0.0) > 0:
            out[route] = BucketDistribution(sorted(events.items()), sorted(lost.items()))
    return out


DELAY_GAUGE = metric("turnrouter_acknowledgment_delay_seconds").name
GENERATION_METRIC = metric("turnrouter_acknowledgment_generation_seconds").name
#: Past this difference from the modelled generation time, tune names the measured one.
GENERATION_NOTE_SECS = 0.05
#: The delay each route runs with (its `acknowledgment_route_delays` entry, else the
#: router-wide one).
ROUTE_DELAY_GAUGE = metric("turnrouter_acknowledgment_route_delay_seconds").name


def route_matcher(route: str) -> str:
    """A PromQL matcher selecting exactly `route` (quotes and backslashes escaped)."""
    return 'route="' + route.replace("\\", "\\\\").replace('"', '\\"').replace(
        "\n", "\\n") + '"'


def configured_delay(url: str, timeout: float, matchers: str = "",
                     at: float | None = None, route: str | None = None) -> float | None:
    """The fallback delay the routers report (`max` of the gauge over the selector): of
    `route` when given (its per-route gauge, else the router-wide one, for routers
    without it), else router-wide; None when none reports one (acknowledgments off, no
    data, or an unusable answer)."""
    queries = [f"max({DELAY_GAUGE}{{{matchers}}})" if matchers else f"max({DELAY_GAUGE})"]
    if route is not None:
        queries.insert(0, f"max({ROUTE_DELAY_GAUGE}{{"
                          f"{', '.join(m for m in (matchers, route_matcher(route)) if m)}}})")
    for expr in queries:
        delay = _gauge_value(url, expr, timeout, at)
        if delay is not None:
            return delay
    return None


def measured_generation(url: str, timeout: float, window: str, matchers: str = "",
                        at: float | None = None) -> float | None:
    """The mean acknowledgment generation time the selected routers measured over
    `window` (`turnrouter_acknowledgment_generation_seconds`), None without one."""
    selector = f"{{{matchers}}}" if matchers else ""
    mean = _gauge_value(url, f"sum(increase({GENERATION_METRIC}_sum{selector}[{window}])) / "
                             f"(sum(increase({GENERATION_METRIC}_count{selector}[{window}]))"
                             " > 0)", timeout, at)
    return mean if mean is not None and mean <= 10 else None


def delay_disagreement(url: str, timeout: float, matchers: str = "",
                       at: float | None = None) -> float | None:
    """The lowest router-wide fallback delay the selected routers report (`min`; the
    marked one is the `max`), None when none reports one: two deployments read
    together (no `--selector`) report different delays, and the mark is only one's."""
    return _gauge_value(url, f"min({DELAY_GAUGE}{{{matchers}}})" if matchers
                        else f"min({DELAY_GAUGE})", timeout, at)


def _gauge_value(url: str, expr: str, timeout: float, at: float | None) -> float | None:
    """The single value of `expr` when it is a delay in (0, 60] s, else None."""
    try:
        payload = _query(url, expr, timeout, at)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("status") != "success":
        return None
    data = payload.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or len(result) != 1 or not isinstance(result[0], dict):
        return None
    value = result[0].get("value")
    if not isinstance(value, list) or len(value) != 2:
        return None
    try:
        delay = _number(value[1], "delay")
    except ValueError:
        return None
    return delay if math.isfinite(delay) and 0 < delay <= 60 else None


# ---------------------------------------------------------------- output

def _fmt(seconds: float) -> str:
    return "    n/a" if math.isnan(seconds) else f"{seconds:6.2f}s"


def print_table(rows: Sequence[TuneRow], out: TextIO, current: float | None = None,
                aggregate: str | None = ALL_ROUTES) -> None:
    """Per route and candidate: the fixed delay's figures, then the predictive policy's
    (the share of turns it acknowledges early first). The rows over all routes are
    labelled `aggregate` (None: left out, e.g. for a single route: they are its own)."""
    rows = [r for r in rows if r.route != ALL_ROUTES or aggregate is not None]
    names = {row.route: printable(aggregate if row.route == ALL_ROUTES and aggregate
                                  else row.route) for row in rows}
    width = max([len("route"), *(len(n) for n in names.values())])
    lead = " " * (width + 19)
    out.write(f"{lead}  {'fixed delay':-^30}  {'predictive (what the router does)':-^40}\n")
    out.write(f"{'route':<{width}}  {'delay':>6}  {'turns':>7}  {'ack rate':>8}  "
              f"{'needless':>8}  {'p95 sil.':>8}  {'early':>7}  {'ack rate':>8}  "
              f"{'needless':>8}  {'p95 sil.':>9}\n")
    previous = None
    for row in rows:
        if previous is not None and row.route != previous:
            out.write("\n")
        previous = row.route
        mark = "  <- current" if current is not None and abs(row.delay - current) < 0.025 else ""
        out.write(f"{names[row.route]:<{width}}  {row.delay:5.2f}s  {row.turns:7.0f}  "
                  f"{row.fixed_ack_rate:8.1%}  {row.fixed_needless_rate:8.1%}  "
                  f"{_fmt(row.fixed_p95_silence):>8}  {row.early:7.1%}  "
                  f"{row.ack_rate:8.1%}  {row.needless_rate:8.1%}  "
                  f"{_fmt(row.p95_silence):>9}{mark}\n")


def recommend(rows: Sequence[TuneRow], *, max_ack_rate: float | None,
              max_silence_p95: float | None, policy: str = "predictive") -> TuneRow | None:
    """The all-routes row meeting the target under `policy` (None if none does)."""
    mine = [r for r in rows if r.route == ALL_ROUTES]
    if max_ack_rate is not None:
        fits = [r for r in mine if r.figures(policy)[0] <= max_ack_rate + 1e-12]
        return min(fits, key=lambda r: r.delay) if fits else None
    if max_silence_p95 is not None:
        fits = [r for r in mine if r.figures(policy)[2] <= max_silence_p95 + 1e-12]
        return max(fits, key=lambda r: r.delay) if fits else None
    return None


def plot(rows: Sequence[TuneRow], path: str, target: tuple[str, float] | None,
         aggregate: str | None = ALL_ROUTES) -> str | None:
    """Write the PNG (the all-routes lines labelled `aggregate`, or left out when None,
    as in `print_table`); returns an error message instead of raising when impossible."""
    rows = [r for r in rows if r.route != ALL_ROUTES or aggregate is not None]
    try:  # optional extra, imported lazily (mypy: no stubs needed)
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return ("--plot needs matplotlib (pip install matplotlib, or from a checkout "
                "pip install -e '.[plot]'); the table above is complete, no plot was written")
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for route in dict.fromkeys(r.route for r in rows):
        mine = [r for r in rows if r.route == route]
        delays = [r.delay for r in mine]
        style = "k--" if route == ALL_ROUTES else "-o"
        name = printable(aggregate if route == ALL_ROUTES and aggregate else route)
        top.plot(delays, [r.ack_rate for r in mine], style, label=name, markersize=3)
        bottom.plot(delays, [r.p95_silence for r in mine], style, label=name, markersize=3)
        if route == ALL_ROUTES:  # what the fixed delay alone would give
            top.plot(delays, [r.fixed_ack_rate for r in mine], "k:",
                     label=f"{name} fixed delay")
            bottom.plot(delays, [r.fixed_p95_silence for r in mine], "k:",
                        label=f"{name} fixed delay")
    if target is not None:
        (top if target[0] == "ack" else bottom).axhline(target[1], color="red", linewidth=1)
    top.set_ylabel("acknowledgment rate")
    bottom.set_ylabel("p95 silence (s)")
    bottom.set_xlabel("acknowledgment delay (s)")
    top.legend(fontsize="small")
    top.set_title("turnrouter tune: acknowledgment delay what-if")
    try:
        figure.tight_layout()
        figure.savefig(path, format="png")
    except (OSError, ValueError) as exc:
        return f"cannot write the plot {printable(path)!r}: {exc}"
    finally:
        plt.close(figure)
    return None


def _bounded(low: float, high: float, *, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (either end open)."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
        if not math.isfinite(number) or (number >= high if high_open else number > high) or (
                number <= low if low_open else number < low):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if low_open else '>='} {low:g} and "
                f"{'<' if high_open else '<='} {high:g}, got {value!r}")
        return number
    return parse


def _window(value: str) -> str:
    if len(value) > 32 or not _DURATION.fullmatch(value) or not any(
            c in "123456789" for c in value):
        raise argparse.ArgumentTypeError(f"must be a positive Prometheus duration such as "
                                         f"1d or 6h30m, got {printable(value[:40])!r}")
    return value


def _route(value: str) -> str:
    if not value or len(value) > MAX_ROUTE_CHARS or not value.isprintable():
        raise argparse.ArgumentTypeError(f"not a route name: {printable(value[:40])!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="turnrouter tune",
        description="Which acknowledgment delay? Acknowledgment rate, needless "
                    "acknowledgments and silence per candidate delay, per route and over "
                    "all routes (acknowledgment_delay_secs), or for --route "
                    "(acknowledgment_route_delays).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--samples", action="append", metavar="FILE",
                        help="JSON-lines samples file: what `turnrouter demo --samples "
                             "FILE` writes, or your router's "
                             "timing_sink=JsonLinesSink(FILE) (repeatable)")
    source.add_argument("--prometheus", metavar="URL",
                        help="Prometheus base URL (reads turnrouter_first_response_seconds and "
                             "turnrouter_first_response_interrupted_seconds)")
    parser.add_argument("--selector", metavar="MATCHERS",
                        help='Prometheus label matchers narrowing the series, e.g. '
                             'job="voice",namespace="prod"')
    parser.add_argument("--window", type=_window,
                        help="Prometheus range for increase() (default 1d)")
    parser.add_argument("--at", type=_bounded(0.0, 1e11, low_open=True), metavar="UNIX_TIME",
                        help="evaluate at this instant (default: now)")
    parser.add_argument("--timeout", type=_bounded(0.0, 300.0, low_open=True),
                        help="bound on each Prometheus query, connect to last byte, in "
                             "seconds (default 10)")
    parser.add_argument("--route", action="append", type=_route,
                        help="only these routes (repeatable)")
    parser.add_argument("--generation-secs", type=_bounded(0.0, 10.0),
                        help=f"acknowledgment generation time modelled (default "
                             f"{GENERATION_SECS:g}, AcknowledgmentPolicy's initial guess, "
                             "as the tuning dashboard; pass what yours measures: the "
                             "dashboard's "
                             "'Acknowledgment generation time' panel, or "
                             f"{GENERATION_METRIC}_sum / _count; with --prometheus tune "
                             "reads that mean and says when it differs)")
    parser.add_argument("--current", type=_bounded(0.0, 60.0, low_open=True),
                        metavar="SECONDS", help="mark the delay configured today (default "
                        "with --prometheus: the routers' "
                        "turnrouter_acknowledgment_route_delay_seconds for a single --route, "
                        "else turnrouter_acknowledgment_delay_seconds)")
    parser.add_argument("--delays", help="comma-separated candidate delays (default: those "
                        "on the histogram's bucket bounds, as the dashboard)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--max-ack-rate", type=_bounded(0.0, 1.0), metavar="RATE",
                        help="recommend the shortest delay whose acknowledgment rate <= RATE")
    target.add_argument("--max-silence-p95", type=_bounded(0.0, 60.0, low_open=True),
                        metavar="SECONDS",
                        help="recommend the longest delay whose p95 silence <= SECONDS")
    parser.add_argument("--policy", choices=("predictive", "fixed"), default="predictive",
                        help="which policy's figures the recommendation reads (default "
                             "predictive: what the router does with its default predictor)")
    parser.add_argument("--confidence", type=_bounded(0.5, 1.0, low_open=True,
                                                      high_open=True),
                        default=CONFIDENCE,
                        help=f"the trigger's RouteTimingPredictor confidence (default "
                             f"{CONFIDENCE:g})")
    parser.add_argument("--replay-samples", type=int, default=MAX_REPLAY_SAMPLES,
                        metavar="N", help="replay at most the N most recent samples through "
                        f"the trigger (default {MAX_REPLAY_SAMPLES:,})")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG plot (needs matplotlib)")
    return parser


def _delays(text: str | None, generation: float) -> list[float]:
    if text is None:
        return [c.delay for c in candidates(generation)] or [0.5, 1.0]
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or len(items) > 100:
        raise ValueError("--delays must list 1 to 100 numbers")
    delays: set[float] = set()
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--delays: not a number: {printable(item[:30])!r}") from None
        if not math.isfinite(value) or not 0.001 <= value <= 60:
            raise ValueError(f"--delays must be numbers in [0.001, 60] (seconds), got "
                             f"{printable(item[:30])!r}")
        delays.add(value)
    return sorted(delays)


def _check_routes(distributions: dict[str, Distribution]) -> None:
    named = sum(1 for route in distributions if route != ALL_ROUTES)
    if named > MAX_ROUTES:
        raise ValueError(f"{named:,} routes found, more than tune analyses in one run "
                         f"({MAX_ROUTES}, as many as RouteTimingPredictor tracks); name the "
                         "routes to analyse with --route")


def _check_plot_target(path: str) -> None:
    """`--plot FILE` checked before any work: a missing folder, a folder, a FIFO or a
    device would otherwise fail only after the analysis (`ValueError` naming it)."""
    if not path:
        raise ValueError("--plot needs a file name")
    target = Path(path)
    if target.exists() and not target.is_file():
        raise ValueError(f"--plot {printable(path)!r} exists and is not a regular file")
    if not target.parent.is_dir():
        raise ValueError(f"--plot {printable(path)!r}: no folder {printable(str(target.parent))!r}")


def tune_main(argv: list[str], *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point of `turnrouter tune ARGS...`; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    routes = set(args.route) if args.route else None
    splits: dict[tuple[str, float], Split] | None = None
    disagree = ""
    modelled_by_default = args.generation_secs is None
    if modelled_by_default:
        args.generation_secs = GENERATION_SECS
    try:
        delays = _delays(args.delays, args.generation_secs)
        if not 1 <= args.replay_samples <= MAX_SAMPLES:
            raise ValueError(f"--replay-samples must be in 1..{MAX_SAMPLES:,}")
        if args.plot is not None:
            _check_plot_target(args.plot)
        if args.samples:
            for flag, value in (("--selector", args.selector), ("--window", args.window),
                                ("--timeout", args.timeout), ("--at", args.at)):
                if value is not None:  # (said, not silently ignored)
                    raise ValueError(f"{flag} applies to --prometheus only")
            distributions, ordered = from_samples(args.samples, routes)
            _check_routes(distributions)
            splits = replay_splits(ordered[-args.replay_samples:], delays,
                                   args.generation_secs, confidence=args.confidence)
            source = ", ".join(printable(path) for path in args.samples)
            if modelled_by_default:  # (samples hold first responses, not generation)
                disagree += (
                    f"note: acknowledgment generation modelled as {args.generation_secs:g}s "
                    "(samples do not record it): pass --generation-secs with your "
                    "acknowledger's (about 0 for TemplateAcknowledger; a deployment's "
                    "dashboard shows it: 'Acknowledgment generation time')\n")
            replayed = min(len(ordered), args.replay_samples)
            model = (f"predictive = {replayed:,} samples replayed in order through "
                     f"RouteTimingPredictor(confidence={args.confidence:g}) per delay")
        else:
            args.window = args.window or "1d"
            args.timeout = args.timeout or 10.0
            matchers = selector_matchers(args.selector)
            only = sorted(routes)[0] if routes and len(routes) == 1 else None
            if only is not None:  # the queries themselves speak for that route
                matchers = ", ".join(m for m in (matchers, route_matcher(only)) if m)
            distributions = from_prometheus(args.prometheus, args.window, routes,
                                            args.timeout, matchers, args.at)
            _check_routes(distributions)
            if args.current is None:
                selected = selector_matchers(args.selector)
                args.current = configured_delay(args.prometheus, args.timeout, selected,
                                                args.at, only)
                lowest = delay_disagreement(args.prometheus, args.timeout, selected, args.at)
                if lowest is not None and args.current is not None and lowest < args.current:
                    disagree = (f"note: the routers read report different fallback delays "
                                f"({lowest:g}s to {args.current:g}s; the highest is marked): "
                                "narrow --selector to one deployment\n")
            if modelled_by_default:
                measured = measured_generation(args.prometheus, args.timeout, args.window,
                                               matchers, args.at)
                if measured is not None and abs(
                        measured - args.generation_secs) > GENERATION_NOTE_SECS:
                    disagree += (
                        f"note: the routers measured acknowledgment generation at "
                        f"{measured:.3g}s on average over {args.window} ({GENERATION_METRIC}),"
                        f" this table models {args.generation_secs:g}s: rerun with "
                        f"--generation-secs {measured:.2g} for figures that match your "
                        "acknowledger (and --delays, e.g. 0.4,0.5,...,1.2: the default "
                        "candidates are those on the model's bucket bounds)\n")
            source = (f"{printable(args.prometheus)} ({prometheus_query(args.window, matchers)}"
                      f", interrupted before a response: "
                      f"{prometheus_query(args.window, matchers, INTERRUPTED_METRIC)})")
            model = ("predictive = APPROXIMATION (a histogram has no turn order): a route is "
                     f"early when the trigger (confidence {args.confidence:g}) would be on "
                     "its whole-window distribution of answered turns (as the dashboard); "
                     "no warm-up, regime changes or feature classes")
    except (OSError, ValueError) as exc:
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        filename = getattr(exc, "filename", None)
        prefix = f"{printable(str(filename))}: " if isinstance(exc, OSError) and filename else ""
        err.write(f"turnrouter tune: error: {prefix}{' '.join(printable(message).split())}\n")
        return 2
    if not distributions:
        # Say where it looked: an empty answer is usually a --selector, --window or
        # --route that matches nothing, and the operator needs to see which.
        named = (f" of --route {', '.join(printable(route) for route in sorted(routes))}"
                 if routes else "")
        # A window of one scrape holds no increase: at a 1-minute scrape, `--window 1m`
        # finds nothing although the samples are there.
        short = ("; the window must span at least two scrapes (at a 1-minute scrape, "
                 "--window 2m or more)" if args.prometheus is not None else "")
        err.write(f"turnrouter tune: error: no first-response samples{named} found in "
                  f"{source}{short}\n")
        return 2
    rows = analyse(distributions, delays, args.generation_secs, splits=splits,
                   confidence=args.confidence)
    status = 0
    target: tuple[str, float] | None = None
    # The recommendation comes first: the table below it runs to hundreds of lines.
    summary: list[str] = []
    if args.max_ack_rate is not None or args.max_silence_p95 is not None:
        if args.max_ack_rate is not None:
            target = ("ack", args.max_ack_rate)
            label = f"acknowledgment rate <= {args.max_ack_rate:.1%}"
        else:
            target, label = ("silence", args.max_silence_p95), (
                f"p95 silence <= {args.max_silence_p95:g}s")
        label += f" ({args.policy})"
        best = recommend(rows, max_ack_rate=args.max_ack_rate,
                         max_silence_p95=args.max_silence_p95, policy=args.policy)
        chosen = sorted(routes) if routes else []
        scope = ("over all routes" if not chosen else
                 f"for route {printable(chosen[0])}" if len(chosen) == 1 else
                 "over routes " + ", ".join(printable(r) for r in chosen))
        if best is None:
            longest = (f"; the default candidates stop at {max(delays):g}s: try longer "
                       "ones with --delays (e.g. --delays 2,3,4)" if args.delays is None
                       else "")
            summary.append(f"no candidate delay meets {label} {scope}{longest}")
            status = 1
        else:
            ack, needless, p95 = best.figures(args.policy)
            setting = (f"acknowledgment_delay_secs={best.delay:g}" if not chosen else
                       "acknowledgment_route_delays={" + ", ".join(
                           f"{printable(r)!r}: {best.delay:g}" for r in chosen) + "}")
            summary.append(
                f"recommended {setting} for {label} "
                f"{scope} (ack rate {ack:.1%}, needless {needless:.1%}, p95 "
                f"silence {p95:.2f}s; fixed delay: {best.fixed_ack_rate:.1%}, "
                f"{best.fixed_needless_rate:.1%}, {best.fixed_p95_silence:.2f}s; "
                f"predictive: {best.ack_rate:.1%}, {best.needless_rate:.1%}, "
                f"{best.p95_silence:.2f}s)")
            if p95 > DEAD_AIR_SECONDS:
                summary.append(
                    f"  warning: p95 silence {p95:.2f}s at that delay is over the "
                    f"TurnrouterDeadAir alert's {DEAD_AIR_SECONDS:g}s (see the predictive "
                    "policy's column, or a shorter delay)")
            paying = [r for r in rows if r.route != ALL_ROUTES and r.delay == best.delay]
            worst = max(paying, key=lambda r: r.figures(args.policy)[2], default=None)
            if worst is not None and len(chosen) != 1:
                summary.append(f"  longest p95 silence at that delay: "
                               f"{printable(worst.route)} {worst.figures(args.policy)[2]:.2f}s")
        summary.append("")
    for line in summary:
        out.write(f"{line}\n")
    out.write(f"source: {source}\n")
    out.write(f"model: acknowledgment generation {args.generation_secs:g}s; fixed delay = "
              f"heard at delay + generation; early = heard at {EARLY_SECS:g}s (or when "
              f"ready); needless = answer within {NEEDLESS_WITHIN_SECONDS:g}s of it\n")
    out.write(f"       {model}\n")
    chosen = sorted(routes) if routes else []
    if args.current is not None:
        whose = f" of route {printable(chosen[0])}" if len(chosen) == 1 else ""
        out.write(f"current delay{whose}: {args.current:g}s (marked)\n")
    out.write(disagree)
    aggregate = None if len(chosen) == 1 else "(chosen)" if chosen else ALL_ROUTES
    print_table(rows, out, args.current, aggregate)
    if args.plot is not None:
        problem = plot(rows, args.plot, target, aggregate)
        if problem is None:
            out.write(f"plot written to {printable(args.plot)}\n")
        else:  # the table is out, but what was asked for is not all there: say so
            err.write(f"turnrouter tune: {problem}\n")
            status = 1
    return status
