"""The acknowledgment-delay what-if: one model, two implementations that must agree.

For a candidate fallback delay `d`, a route whose first response `X` has survival
`S(t) = P(X > t)`, an acknowledgment generation time `g`, the policy's `early` time and
the needless window `W` (`NEEDLESS_WITHIN_SECONDS`):

- the route is *predicted slow* at `d` when its first-response p10 is above `d` (the
  router's predictor acknowledges early when a confident prediction's lower bound, by
  default the 10th percentile, exceeds the delay); its acknowledgment is heard at
  `h = max(min(early, d), g)`;
- otherwise the acknowledgment is heard at `h = d + g` (generation starts when the delay
  has passed);
- acknowledgment rate `S(h)`; needless rate (heard, and the answer started within `W`)
  `S(h) - S(h + W)`; silence is `min(X, h)`, so its p95 is `min(p95(X), h)`;
- over all routes, rates are weighted by each route's turns.

`turnrouter tune` evaluates it in Python (samples or Prometheus buckets); the tuning
dashboard evaluates it in PromQL (`whatif_queries`). Candidate delays are chosen so that
every `h`, `h + W` falls on a bucket bound of `RESPONSE_BUCKETS`: the PromQL reads
buckets without interpolation, and tune's bucket interpolation is exact there, so both
give the same numbers on the same data (a test checks it against a real Prometheus).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..telemetry import NEEDLESS_WITHIN_SECONDS, RESPONSE_BUCKETS, metric
from ._promql import le_value

__all__ = [
    "ALL_ROUTES",
    "EARLY_SECS",
    "GENERATION_SECS",
    "PREDICTION_QUANTILE",
    "Candidate",
    "candidates",
    "recommended_delay_query",
    "whatif_queries",
]

#: Modelled acknowledgment generation time (`AcknowledgmentPolicy.expected_generation_secs`).
GENERATION_SECS = 0.3
#: When a predicted-slow answer's acknowledgment is heard (`AcknowledgmentPolicy.early_secs`).
EARLY_SECS = 0.25
#: The predictor's lower bound: this quantile of the route's first response.
PREDICTION_QUANTILE = 0.1
#: Label of the all-routes rows.
ALL_ROUTES = "(all)"
#: Candidate delays searched.
MIN_DELAY, MAX_DELAY = 0.1, 2.0


def _r(value: float) -> float:
    return round(value, 6)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One candidate delay and the instants the model reads the distribution at."""

    delay: float
    heard: float
    """`d + g`: when a delay-triggered acknowledgment is heard."""
    heard_early: float
    """`max(min(early, d), g)`: when a prediction-triggered one is heard."""

    @property
    def needless_until(self) -> float:
        return _r(self.heard + NEEDLESS_WITHIN_SECONDS)

    @property
    def needless_early_until(self) -> float:
        return _r(self.heard_early + NEEDLESS_WITHIN_SECONDS)


def candidate(delay: float, generation: float = GENERATION_SECS,
              early: float = EARLY_SECS) -> Candidate:
    """The model's instants for `delay`."""
    return Candidate(_r(delay), _r(delay + generation),
                     _r(max(min(early, delay), generation)))


def candidates(generation: float = GENERATION_SECS, early: float = EARLY_SECS,
               bounds: Sequence[float] = RESPONSE_BUCKETS) -> tuple[Candidate, ...]:
    """Delays in [0.1, 2] s whose every instant falls on a bucket bound."""
    on = {_r(bound) for bound in bounds}
    found = []
    for bound in bounds:
        delay = _r(bound - generation)
        if not MIN_DELAY - 1e-9 <= delay <= MAX_DELAY + 1e-9:
            continue
        c = candidate(delay, generation, early)
        if {c.heard, c.heard_early, c.needless_until, c.needless_early_until} <= on:
            found.append(c)
    return tuple(found)


# --------------------------------------------------------------------------- PromQL

FIRST = metric("turnrouter_first_response_seconds").name


def _with(matchers: str, extra: str) -> str:
    return ", ".join(part for part in (matchers, extra) if part)


def _bucket(matchers: str, window: str, bound: float) -> str:
    return (f'sum by (route) (increase({FIRST}_bucket{{'
            f'{_with(matchers, f"le={chr(34)}{le_value(bound)}{chr(34)}")}}}[{window}]))')


def _count(matchers: str, window: str) -> str:
    return f"sum by (route) (increase({FIRST}_count{{{matchers}}}[{window}]))"


def _survival(matchers: str, window: str, bound: float) -> str:
    return f"(1 - {_bucket(matchers, window, bound)} / ({_count(matchers, window)} > 0))"


def _between(matchers: str, window: str, low: float, high: float) -> str:
    """S(low) - S(high): the share of turns with low < X <= high."""
    return (f"(({_bucket(matchers, window, high)} - {_bucket(matchers, window, low)})"
            f" / ({_count(matchers, window)} > 0))")


def _quantile(matchers: str, window: str, q: float) -> str:
    return (f"histogram_quantile({q:g}, sum by (route, le) "
            f"(increase({FIRST}_bucket{{{matchers}}}[{window}])))")


def _predicted(matchers: str, window: str, c: Candidate) -> str:
    return f"({_quantile(matchers, window, PREDICTION_QUANTILE)} > bool {c.delay:g})"


def _per_route(kind: str, matchers: str, window: str, c: Candidate) -> str:
    pred = _predicted(matchers, window, c)
    if kind == "ack":
        early = _survival(matchers, window, c.heard_early)
        late = _survival(matchers, window, c.heard)
    elif kind == "needless":
        early = _between(matchers, window, c.heard_early, c.needless_early_until)
        late = _between(matchers, window, c.heard, c.needless_until)
    else:  # silence p95
        q95 = _quantile(matchers, window, 0.95)
        early = f"clamp_max({q95}, {c.heard_early:g})"
        late = (f"(clamp_max({q95}, {c.heard:g}) and on (route) "
                f"({_count(matchers, window)} > 0))")
    return f"({pred} * {early} + (1 - {pred}) * {late})"


def _label(expr: str, name: str, value: str) -> str:
    return f'label_replace({expr}, "{name}", "{value}", "__name__", ".*")'


def whatif_queries(matchers: str, window: str,
                   chosen: Sequence[Candidate] | None = None) -> dict[str, str]:
    """PromQL of the what-if, by measure: `ack`, `needless`, `silence_p95` (per route
    and candidate, labels `route`, `delay`), `ack_all` and `needless_all` (label
    `route="(all)"`, weighted by turns). `matchers` select the series (e.g.
    `job=~"$job"`), `window` is the range (`$__range`, `1d`)."""
    chosen = candidates() if chosen is None else chosen
    out: dict[str, str] = {}
    for kind, key in (("ack", "ack"), ("needless", "needless"), ("silence", "silence_p95")):
        out[key] = "\nor\n".join(
            _label(_per_route(kind, matchers, window, c), "delay", f"{c.delay:g}")
            for c in chosen)
    count = _count(matchers, window)
    for kind in ("ack", "needless"):
        out[f"{kind}_all"] = "\nor\n".join(
            _label(_label(f"(sum({_per_route(kind, matchers, window, c)} * on (route) "
                          f"{count}) / (sum({count}) > 0))", "delay", f"{c.delay:g}"),
                   "route", ALL_ROUTES)
            for c in chosen)
    return out


def recommended_delay_query(matchers: str, window: str, max_ack_rate: str,
                            chosen: Sequence[Candidate] | None = None) -> str:
    """PromQL: the shortest candidate delay whose all-routes acknowledgment rate is at
    most `max_ack_rate` (a number or a dashboard variable); empty when none is."""
    chosen = candidates() if chosen is None else chosen
    count = _count(matchers, window)
    parts = [
        _label(f"((sum({_per_route('ack', matchers, window, c)} * on (route) {count}) "
               f"/ (sum({count}) > 0)) <= {max_ack_rate}) * 0 + {c.delay:g}",
               "delay", f"{c.delay:g}")
        for c in chosen]
    return "min(\n" + "\nor\n".join(parts) + "\n)"
