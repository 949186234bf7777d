"""The acknowledgment-delay what-if: one model, two implementations that must agree.

For a candidate fallback delay `d`, a route whose first response `X` has survival
`S(t) = P(X > t)`, an acknowledgment generation time `g`, the policy's `early` time and
the needless window `W` (`NEEDLESS_WITHIN_SECONDS`), two policies:

- **fixed delay**: the acknowledgment is heard at `h = d + g` (generation starts when the
  delay has passed);
- **predictive** (what the router does with its default `RouteTimingPredictor`): a turn
  the trigger decides early is acknowledged at `h = max(min(early, d), g)`, the others
  at `d + g`.

For either: acknowledgment rate `S(h)`; needless rate (heard, and the answer started
within `W`) `S(h) - S(h + W)`; silence is `min(X, h)`, so its p95 is `min(p95(X), h)`;
over all routes, rates are weighted by each route's turns.

Turns interrupted before a response are censored first responses (the true one is
longer): `turnrouter tune` reads them by Kaplan-Meier, from samples or from the
`turnrouter_first_response_interrupted_seconds` buckets. PromQL has no running product,
so the dashboard takes the first-order form for the acknowledgment rate, `S(h) = 1 -
B(h) / R(h)`, `R(h)` the turns not interrupted by `h` (exact when every interruption
comes before the first answer; it reads low by at most the share of turns interrupted
before `h` times the share answered by then: on the demo within 0.01 of tune over all
routes, 0.04 for its most interrupted route), and reads the
needless rate, p95 silence and the early decision from the answered turns alone (the
dashboard's size limit leaves no room for more; tune has them all).

Which turns the trigger decides early needs their order: `turnrouter tune --samples`
replays the recorded samples through the real trigger (`RouteTimingPredictor.replay`).
Without order (a histogram: Prometheus, this dashboard), the predictive policy is
*approximated* per route: the route is early at `d` when the trigger's expected
advantage of acknowledging early on its stationary distribution reaches the trigger's
hysteresis,

    A = (1 - c) S(d) + c (S(d + g) - S(d + g + W)) - c (S(e) - S(max(e, g) + W)),

`c` the trigger's confidence, `e = min(early, d)` (`turnrouter._timing_trigger`): no
warm-up, no regime changes, no feature classes.

`turnrouter tune` evaluates it in Python (samples or Prometheus buckets); the tuning
dashboard evaluates it in PromQL (`whatif_queries`). Candidate delays are chosen so that
every instant above falls on a bucket bound of `RESPONSE_BUCKETS`: the PromQL reads
buckets without interpolation, and tune's bucket interpolation is exact there, so both
give the same numbers on the same data (a test checks it against a real Prometheus).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._timing import DEFAULT_CONFIDENCE, DEFAULT_HYSTERESIS
from .._timing_trigger import Trigger
from ..telemetry import NEEDLESS_WITHIN_SECONDS, RESPONSE_BUCKETS, metric
from ._promql import le_regex, le_value

__all__ = [
    "ALL_ROUTES",
    "CONFIDENCE",
    "EARLY_SECS",
    "GENERATION_SECS",
    "HYSTERESIS",
    "Candidate",
    "candidates",
    "early_at",
    "recommended_delay_query",
    "whatif_queries",
]

#: Modelled acknowledgment generation time (`AcknowledgmentPolicy.expected_generation_secs`).
GENERATION_SECS = 0.3
#: When a predicted-slow answer's acknowledgment is heard (`AcknowledgmentPolicy.early_secs`).
EARLY_SECS = 0.25
#: The trigger's knob and hysteresis (`RouteTimingPredictor` defaults).
CONFIDENCE = DEFAULT_CONFIDENCE
HYSTERESIS = DEFAULT_HYSTERESIS
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
    early_from: float
    """`min(early, d)`: when a prediction-triggered one is due."""

    @property
    def needless_until(self) -> float:
        return _r(self.heard + NEEDLESS_WITHIN_SECONDS)

    @property
    def needless_early_until(self) -> float:
        return _r(self.heard_early + NEEDLESS_WITHIN_SECONDS)

    @property
    def instants(self) -> frozenset[float]:
        """Every instant the model reads (the dashboard needs each on a bucket bound)."""
        return frozenset({self.delay, self.heard, self.heard_early, self.early_from,
                          self.needless_until, self.needless_early_until})


def candidate(delay: float, generation: float = GENERATION_SECS,
              early: float = EARLY_SECS) -> Candidate:
    """The model's instants for `delay`."""
    return Candidate(_r(delay), _r(delay + generation),
                     _r(max(min(early, delay), generation)), _r(min(early, delay)))


def candidates(generation: float = GENERATION_SECS, early: float = EARLY_SECS,
               bounds: Sequence[float] = RESPONSE_BUCKETS) -> tuple[Candidate, ...]:
    """Delays in [0.1, 2] s, in steps of 0.1 s, whose every instant falls on a bucket
    bound (finer steps would not fit the dashboards' ConfigMap)."""
    on = {_r(bound) for bound in bounds}
    found = []
    for bound in bounds:
        delay = _r(bound - generation)
        if not MIN_DELAY - 1e-9 <= delay <= MAX_DELAY + 1e-9 or abs(
                delay * 10 - round(delay * 10)) > 1e-6:
            continue
        c = candidate(delay, generation, early)
        if c.instants <= on:
            found.append(c)
    return tuple(found)


def early_at(survival: Callable[[float], float], c: Candidate,
             confidence: float = CONFIDENCE, hysteresis: float = HYSTERESIS) -> bool:
    """The approximated trigger: early at `c` for a route with this stationary
    `survival` when the advantage of acknowledging early reaches the hysteresis."""
    generation = _r(c.heard - c.delay)
    trigger = Trigger(confidence=confidence, hysteresis=hysteresis, prior=0.0,
                      min_samples=0.0, early_secs=c.early_from, generation_secs=generation,
                      needless_secs=NEEDLESS_WITHIN_SECONDS)
    advantage, _ = trigger.advantage_of(lambda t: 1.0 - survival(t), c.delay, generation)
    return advantage >= hysteresis - 1e-12


# --------------------------------------------------------------------------- PromQL

FIRST = metric("turnrouter_first_response_seconds").name
INTERRUPTED = metric("turnrouter_first_response_interrupted_seconds").name


def _with(matchers: str, extra: str) -> str:
    return ", ".join(part for part in (matchers, extra) if part)


def _bucket(matchers: str, window: str, bound: float, name: str = FIRST) -> str:
    return (f'sum by (route) (increase({name}_bucket{{'
            f'{_with(matchers, f"le={chr(34)}{le_value(bound)}{chr(34)}")}}}[{window}]))')


def _count(matchers: str, window: str) -> str:
    return f"sum by (route) (increase({FIRST}_count{{{matchers}}}[{window}]))"


def _at_risk(matchers: str, window: str, at: float) -> str:
    """Per route, the turns not interrupted by `at`: the answered ones plus those
    interrupted before a response after `at` (still silent then)."""
    return (f"({_count(matchers, window)} + sum by (route) (increase({INTERRUPTED}_count"
            f"{{{matchers}}}[{window}])) - {_bucket(matchers, window, at, INTERRUPTED)})")


def _quantile(matchers: str, window: str, q: float) -> str:
    return (f"histogram_quantile({q:g}, sum by (route, le) "
            f"(increase({FIRST}_bucket{{{matchers}}}[{window}])))")


def _predicted(matchers: str, window: str, c: Candidate) -> str:
    """1 where the approximated trigger is early at `c`, else 0 (per route): A >= h with
    A = (1 - c) + (c (B(d+g+W) - B(d+g) - B(h_e+W) + B(e)) - (1 - c) B(d)) / N, B the
    bucket counts and N the count (the module docstring's A): the five buckets are read
    by one selector and weighed by a constant vector on `le`."""
    conf = CONFIDENCE
    weights: dict[float, float] = {}
    for bound, weight in ((c.needless_until, conf), (c.heard, -conf),
                          (c.needless_early_until, -conf), (c.early_from, conf),
                          (c.delay, conf - 1)):
        weights[bound] = weights.get(bound, 0.0) + weight
    used = {bound: weight for bound, weight in weights.items() if abs(weight) > 1e-12}
    vector = " or ".join(f'label_replace(vector({weight:.12g}), "le", "{le_value(bound)}", '
                         '"", "")' for bound, weight in sorted(used.items()))
    selector = _with(matchers, f'le=~"{le_regex(sorted(used))}"')
    buckets = f"increase({FIRST}_bucket{{{selector}}}[{window}])"
    return (f"((sum by (route) ({buckets} * on (le) group_left () ({vector})) / "
            f"({_count(matchers, window)} > 0)) >= bool {HYSTERESIS - (1 - conf) - 1e-12:.12g})")


def _turns_of(kind: str, matchers: str, window: str, c: Candidate, policy: str) -> str:
    """Per route, the number of turns with a needless acknowledgment (`kind`
    "needless") at `c` under `policy` (the predictive one: `late + early? * (early -
    late)`, the decision read once)."""
    def b(bound: float) -> str:
        return _bucket(matchers, window, bound)

    assert kind == "needless", kind  # acknowledgment rates: `_unacknowledged`
    # N (S(h) - S(h + W)) = B(h + W) - B(h)
    late = f"({b(c.needless_until)} - {b(c.heard)})"
    shift = (f"({b(c.needless_early_until)} - {b(c.heard_early)} - "
             f"{b(c.needless_until)} + {b(c.heard)})")
    if policy == "fixed":
        return late
    return f"({late} + {_predicted(matchers, window, c)} * {shift})"


def _unacknowledged(matchers: str, window: str, c: Candidate, policy: str) -> str:
    """Per route, the answered turns that would hear no acknowledgment at `c` under
    `policy`: answered by `h` (`B(h)`), less, under the predictive policy, those
    acknowledged early instead."""
    answered = _bucket(matchers, window, c.heard)
    if policy == "fixed":
        return answered
    return (f"({answered} - {_predicted(matchers, window, c)} * "
            f"({answered} - {_bucket(matchers, window, c.heard_early)}))")


def _per_route(kind: str, matchers: str, window: str, c: Candidate,
               policy: str = "predictive") -> str:
    """One measure per route at `c` under `policy`: a share of turns, or p95 silence.
    The acknowledgment rate counts the turns interrupted before a response as the
    samples do, to first order: `1 - B(h) / R(h)`, `R(h)` the turns not interrupted by
    `h` (the other measures read the answered turns only)."""
    count = f"({_count(matchers, window)} > 0)"
    if kind == "ack":  # floored at 0: increase() extrapolates each series on its own
        return (f"clamp_min(1 - {_unacknowledged(matchers, window, c, policy)} / "
                f"({_at_risk(matchers, window, c.heard)} > 0), 0)")
    if kind != "silence":
        return f"({_turns_of(kind, matchers, window, c, policy)} / {count})"
    q95 = _quantile(matchers, window, 0.95)
    late = f"(clamp_max({q95}, {c.heard:g}) and on (route) {count})"
    if policy == "fixed":
        return late
    return (f"({late} + {_predicted(matchers, window, c)} * "
            f"(clamp_max({q95}, {c.heard_early:g}) - clamp_max({q95}, {c.heard:g})))")


def _all_routes(kind: str, matchers: str, window: str, c: Candidate, policy: str) -> str:
    """The share over all routes (weighted by turns: the sum of turns over the sum of
    counts; for the acknowledgment rate, as `_per_route`, of the turns not interrupted
    by `h`)."""
    if kind == "ack":
        return (f"clamp_min(1 - sum({_unacknowledged(matchers, window, c, policy)}) / "
                f"(sum({_at_risk(matchers, window, c.heard)}) > 0), 0)")
    return (f"(sum({_turns_of(kind, matchers, window, c, policy)}) / "
            f"(sum({_count(matchers, window)}) > 0))")


def _label(expr: str, name: str, value: str) -> str:
    return f'label_replace({expr}, "{name}", "{value}", "__name__", ".*")'


def whatif_queries(matchers: str, window: str,
                   chosen: Sequence[Candidate] | None = None) -> dict[str, str]:
    """PromQL of the what-if, by measure: `early` (1 where the approximated trigger is
    early), `ack`, `needless`, `silence_p95` (per route and candidate, labels `route`,
    `delay`; the predictive policy), `ack_all` and `needless_all` (label
    `route="(all)"`, weighted by turns), and the same five for the fixed delay with a
    `_fixed` suffix (`ack_fixed`, ..., `needless_fixed_all`). `matchers` select the
    series (e.g. `job=~"$job"`), `window` is the range (`$__range`, `1d`)."""
    chosen = candidates() if chosen is None else chosen
    out: dict[str, str] = {
        "early": "\nor\n".join(
            _label(f"({_predicted(matchers, window, c)} and on (route) "
                   f"({_count(matchers, window)} > 0))", "delay", f"{c.delay:g}")
            for c in chosen)}
    for policy, suffix in (("predictive", ""), ("fixed", "_fixed")):
        for kind, key in (("ack", "ack"), ("needless", "needless"),
                          ("silence", "silence_p95")):
            out[key + suffix] = "\nor\n".join(
                _label(_per_route(kind, matchers, window, c, policy), "delay", f"{c.delay:g}")
                for c in chosen)
        for kind in ("ack", "needless"):
            out[f"{kind}{suffix}_all"] = "\nor\n".join(
                _label(_label(_all_routes(kind, matchers, window, c, policy), "delay",
                              f"{c.delay:g}"), "route", ALL_ROUTES)
                for c in chosen)
    return out


def recommended_delay_query(matchers: str, window: str, max_ack_rate: str,
                            chosen: Sequence[Candidate] | None = None) -> str:
    """PromQL: the shortest candidate delay whose all-routes acknowledgment rate under
    the predictive policy is at most `max_ack_rate` (a number or a dashboard variable);
    empty when none is."""
    chosen = candidates() if chosen is None else chosen
    parts = [
        _label(f"({_all_routes('ack', matchers, window, c, 'predictive')} <= {max_ack_rate})"
               f" * 0 + {c.delay:g}", "delay", f"{c.delay:g}")
        for c in chosen]
    return "min(\n" + "\nor\n".join(parts) + "\n)"
