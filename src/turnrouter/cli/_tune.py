"""`turnrouter tune`: what-if analysis of the acknowledgment delay.

For each candidate delay (the telemetry latency bucket bounds) and each route, from
recorded first-response samples (the `JsonLinesSink` export) or a Prometheus server's
`turnrouter_first_response_seconds_bucket` histogram:

- acknowledgment rate: the share of turns whose first response comes after
  delay + generation time (those hear the fallback acknowledgment);
- p50 / p95 silence: silence is min(first response, delay + generation time).

It recommends a delay for a target (`--max-ack-rate`: the shortest delay within it;
`--max-silence-p95`: the longest delay within it, fewest acknowledgments) and can write
a PNG plot (`--plot`, needs matplotlib: the `turnrouter[plot]` extra).

Exit status: 0 done, 1 the target cannot be met by any candidate, 2 bad input.
Censored samples (interrupted turns) are handled by the Kaplan-Meier estimator.
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TextIO

__all__ = ["BucketDistribution", "SampleDistribution", "TuneRow", "analyse", "tune_main"]

ALL_ROUTES = "(all)"
PROMETHEUS_METRIC = "turnrouter_first_response_seconds_bucket"


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
    """A cumulative histogram (Prometheus buckets), linearly interpolated within buckets."""

    def __init__(self, buckets: Sequence[tuple[float, float]]) -> None:
        ordered = sorted(buckets)
        self._bounds = [b for b, _ in ordered]
        self._counts = [c for _, c in ordered]
        self.turns = self._counts[-1] if self._counts else 0.0

    def _cdf(self, t: float) -> float:
        if self.turns <= 0:
            return 0.0
        previous_bound, previous_count = 0.0, 0.0
        for bound, count in zip(self._bounds, self._counts, strict=True):
            if t < bound:
                if math.isinf(bound):
                    return previous_count / self.turns
                fraction = (t - previous_bound) / (bound - previous_bound)
                return (previous_count + fraction * (count - previous_count)) / self.turns
            previous_bound, previous_count = bound, count
        return 1.0

    def survival(self, t: float) -> float:
        return 1.0 - self._cdf(t)

    def quantile(self, q: float) -> float:
        if self.turns <= 0:
            return math.nan
        target = q * self.turns
        previous_bound, previous_count = 0.0, 0.0
        for bound, count in zip(self._bounds, self._counts, strict=True):
            if count >= target - 1e-12:
                if math.isinf(bound):
                    return previous_bound if previous_bound > 0 else math.inf
                if count == previous_count:
                    return bound
                return previous_bound + (bound - previous_bound) * (
                    (target - previous_count) / (count - previous_count))
            previous_bound, previous_count = bound, count
        return math.inf


@dataclass(frozen=True, slots=True)
class TuneRow:
    route: str
    delay: float
    turns: float
    ack_rate: float
    p50_silence: float
    p95_silence: float


def analyse(distributions: dict[str, Distribution], delays: Sequence[float],
            generation: float = 0.0) -> list[TuneRow]:
    """One row per route and candidate delay (routes in the given order)."""
    rows = []
    for route, dist in distributions.items():
        for delay in delays:
            threshold = delay + generation
            rows.append(TuneRow(
                route, delay, dist.turns, dist.survival(threshold),
                min(dist.quantile(0.5), threshold), min(dist.quantile(0.95), threshold)))
    return rows


# ---------------------------------------------------------------- sources

def from_samples(paths: Sequence[str], routes: set[str] | None) -> dict[str, Distribution]:
    from .._timing import iter_samples

    by_route: dict[str, list[tuple[float, bool]]] = {}
    for path in paths:
        for sample in iter_samples(path):
            if routes is None or sample.route in routes:
                by_route.setdefault(sample.route, []).append((sample.seconds, sample.censored))
    result: dict[str, Distribution] = {r: SampleDistribution(v) for r, v in
                                       sorted(by_route.items())}
    if len(by_route) > 1:
        result[ALL_ROUTES] = SampleDistribution(x for v in by_route.values() for x in v)
    return result


def prometheus_query(window: str) -> str:
    return f"sum by (route, le) (increase({PROMETHEUS_METRIC}[{window}]))"


def from_prometheus(url: str, window: str, routes: set[str] | None,
                    timeout: float) -> dict[str, Distribution]:
    query = urllib.parse.urlencode({"query": prometheus_query(window)})
    endpoint = url.rstrip("/") + "/api/v1/query?" + query
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout) as response:
            payload = json.load(response)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")[:300]
        raise ValueError(f"Prometheus {endpoint} returned HTTP {exc.code}: {body}") from exc
    except (OSError, ValueError) as exc:
        raise ValueError(f"Prometheus {endpoint} failed: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("status") != "success":
        raise ValueError(f"Prometheus query failed: {str(payload)[:300]}")
    buckets: dict[str, dict[float, float]] = {}
    for series in payload.get("data", {}).get("result", []):
        labels = series.get("metric", {})
        route, le = labels.get("route"), labels.get("le")
        if route is None or le is None or (routes is not None and route not in routes):
            continue
        value = float(series["value"][1])
        bound = math.inf if le in ("+Inf", "Inf") else float(le)
        per_route = buckets.setdefault(route, {})
        per_route[bound] = per_route.get(bound, 0.0) + (value if math.isfinite(value) else 0.0)
    result: dict[str, Distribution] = {
        route: BucketDistribution(sorted(b.items())) for route, b in sorted(buckets.items())
        if max(b.values(), default=0.0) > 0}
    if len(result) > 1:
        total: dict[float, float] = {}
        for b in buckets.values():
            for bound, count in b.items():
                total[bound] = total.get(bound, 0.0) + count
        result[ALL_ROUTES] = BucketDistribution(sorted(total.items()))
    return result


# ---------------------------------------------------------------- output

def _fmt(seconds: float) -> str:
    return "    n/a" if math.isnan(seconds) else f"{seconds:6.2f}s"


def print_table(rows: Sequence[TuneRow], out: TextIO) -> None:
    width = max([len("route"), *(len(r.route) for r in rows)])
    out.write(f"{'route':<{width}}  {'delay':>6}  {'turns':>7}  {'ack rate':>8}  "
              f"{'p50 silence':>11}  {'p95 silence':>11}\n")
    previous = None
    for row in rows:
        if previous is not None and row.route != previous:
            out.write("\n")
        previous = row.route
        out.write(f"{row.route:<{width}}  {row.delay:5.2f}s  {row.turns:7.0f}  "
                  f"{row.ack_rate:8.1%}  {_fmt(row.p50_silence):>11}  "
                  f"{_fmt(row.p95_silence):>11}\n")


def recommend(rows: Sequence[TuneRow], route: str, *, max_ack_rate: float | None,
              max_silence_p95: float | None) -> TuneRow | None:
    mine = [r for r in rows if r.route == route]
    if max_ack_rate is not None:
        fits = [r for r in mine if r.ack_rate <= max_ack_rate + 1e-12]
        return min(fits, key=lambda r: r.delay) if fits else None
    if max_silence_p95 is not None:
        fits = [r for r in mine if r.p95_silence <= max_silence_p95 + 1e-12]
        return max(fits, key=lambda r: r.delay) if fits else None
    return None


def plot(rows: Sequence[TuneRow], path: str, target: tuple[str, float] | None) -> str | None:
    """Write the PNG; returns an error message instead of raising when impossible."""
    try:  # optional extra, imported lazily (mypy: no stubs needed)
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return ("--plot needs matplotlib (pip install 'turnrouter[plot]' or matplotlib); "
                "the table above is complete, no plot was written")
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for route in dict.fromkeys(r.route for r in rows):
        mine = [r for r in rows if r.route == route]
        delays = [r.delay for r in mine]
        style = "k--" if route == ALL_ROUTES else "-o"
        top.plot(delays, [r.ack_rate for r in mine], style, label=route, markersize=3)
        bottom.plot(delays, [r.p95_silence for r in mine], style, label=route, markersize=3)
    if target is not None:
        (top if target[0] == "ack" else bottom).axhline(target[1], color="red", linewidth=1)
    top.set_ylabel("acknowledgment rate")
    bottom.set_ylabel("p95 silence (s)")
    bottom.set_xlabel("acknowledgment delay (s)")
    top.set_xscale("log")
    top.legend(fontsize="small")
    top.set_title("turnrouter tune: acknowledgment delay what-if")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnrouter tune",
        description="What-if analysis of the acknowledgment delay: acknowledgment rate and "
                    "silence per route for each candidate delay.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--samples", action="append", metavar="FILE",
                        help="JSON-lines samples written by JsonLinesSink (repeatable)")
    source.add_argument("--prometheus", metavar="URL",
                        help="Prometheus base URL (reads turnrouter_first_response_seconds)")
    parser.add_argument("--window", default="1d",
                        help="Prometheus range for increase() (default 1d)")
    parser.add_argument("--timeout", type=float, default=10.0, help="Prometheus timeout (s)")
    parser.add_argument("--route", action="append", help="only these routes (repeatable)")
    parser.add_argument("--generation-secs", type=float, default=0.0,
                        help="expected acknowledgment generation time added to the delay")
    parser.add_argument("--delays", help="comma-separated candidate delays "
                        "(default: the telemetry latency buckets)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--max-ack-rate", type=float, metavar="RATE",
                        help="recommend the shortest delay whose acknowledgment rate <= RATE")
    target.add_argument("--max-silence-p95", type=float, metavar="SECONDS",
                        help="recommend the longest delay whose p95 silence <= SECONDS")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG plot (needs matplotlib)")
    return parser


def tune_main(argv: list[str], *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point of `turnrouter tune ARGS...`; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = _parser().parse_args(argv)
    routes = set(args.route) if args.route else None
    try:
        if args.delays:
            delays = sorted({float(x) for x in args.delays.split(",") if x.strip()})
        else:
            from ..telemetry import LATENCY_BUCKETS

            delays = list(LATENCY_BUCKETS)
        if not delays or any(not math.isfinite(d) or d <= 0 for d in delays):
            raise ValueError("--delays must be positive numbers")
        if args.samples:
            distributions = from_samples(args.samples, routes)
            source = ", ".join(args.samples)
        else:
            distributions = from_prometheus(args.prometheus, args.window, routes, args.timeout)
            source = f"{args.prometheus} ({prometheus_query(args.window)})"
    except (OSError, ValueError) as exc:
        err.write(f"turnrouter tune: {exc}\n")
        return 2
    if not distributions:
        err.write("turnrouter tune: no first-response samples found\n")
        return 2
    rows = analyse(distributions, delays, args.generation_secs)
    out.write(f"source: {source}\n")
    if args.generation_secs:
        out.write(f"generation time: {args.generation_secs:g}s added to each delay\n")
    print_table(rows, out)
    status = 0
    overall = ALL_ROUTES if ALL_ROUTES in distributions else next(iter(distributions))
    target: tuple[str, float] | None = None
    if args.max_ack_rate is not None or args.max_silence_p95 is not None:
        if args.max_ack_rate is not None:
            target = ("ack", args.max_ack_rate)
            label = f"acknowledgment rate <= {args.max_ack_rate:.1%}"
        else:
            target, label = ("silence", args.max_silence_p95), (
                f"p95 silence <= {args.max_silence_p95:g}s")
        best = recommend(rows, overall, max_ack_rate=args.max_ack_rate,
                         max_silence_p95=args.max_silence_p95)
        out.write("\n")
        if best is None:
            out.write(f"no candidate delay meets {label} (over {overall})\n")
            status = 1
        else:
            out.write(f"recommended acknowledgment_delay_secs={best.delay:g} for {label} "
                      f"(over {overall}: ack rate {best.ack_rate:.1%}, p95 silence "
                      f"{best.p95_silence:.2f}s)\n")
        for route in distributions:
            if route == overall:
                continue
            mine = recommend(rows, route, max_ack_rate=args.max_ack_rate,
                             max_silence_p95=args.max_silence_p95)
            out.write(f"  {route}: " + ("none meets it\n" if mine is None else
                                        f"{mine.delay:g}s\n"))
    if args.plot:
        problem = plot(rows, args.plot, target)
        if problem is None:
            out.write(f"plot written to {args.plot}\n")
        else:
            err.write(f"turnrouter tune: {problem}\n")
    return status
