"""Read the demo's figures back from its Prometheus registry, as a dashboard would."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

__all__ = ["DemoReport", "histogram_quantile"]


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """Prometheus' `histogram_quantile` over cumulative (upper bound, count) buckets.

    NaN when there are no observations; linear interpolation inside the bucket, and the
    largest finite bound when the quantile falls in the +Inf bucket.
    """
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    total = ordered[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass
class DemoReport:
    """Figures of one demo run, read from the registry the router reported to."""

    elapsed: float
    turns: dict[tuple[str, str], float] = field(default_factory=dict)
    clarifications: float = 0.0
    acknowledgments: dict[str, float] = field(default_factory=dict)
    decisions: float = 0.0
    published: int = 0
    rejected: float = 0.0
    first_response: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    silence: list[tuple[float, float]] = field(default_factory=list)
    patches: dict[str, float] = field(default_factory=dict)
    overflows: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, registry: CollectorRegistry, elapsed: float, published: int) -> DemoReport:
        report = cls(elapsed=elapsed, published=published)
        first: dict[str, dict[float, float]] = defaultdict(dict)
        silence: dict[float, float] = defaultdict(float)
        for family in registry.collect():
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "turnrouter_turns_total":
                    report.turns[(labels["route"], labels["outcome"])] = sample.value
                elif sample.name == "turnrouter_clarifications_total":
                    report.clarifications += sample.value
                elif sample.name == "turnrouter_acknowledgments_total":
                    outcome = labels["outcome"]
                    report.acknowledgments[outcome] = (
                        report.acknowledgments.get(outcome, 0.0) + sample.value)
                elif sample.name == "turnrouter_decision_duration_seconds_count":
                    report.decisions += sample.value
                elif sample.name == "turnrouter_context_patches_total":
                    outcome = labels["outcome"]
                    report.patches[outcome] = report.patches.get(outcome, 0.0) + sample.value
                elif sample.name == "turnrouter_limit_overflows_total" and sample.value:
                    report.overflows[labels["limit"]] = sample.value
                elif sample.name == "turnrouter_runtime_rejected_messages_total":
                    report.rejected += sample.value
                elif sample.name == "turnrouter_first_response_seconds_bucket":
                    first[labels["route"]][float(labels["le"])] = sample.value
                elif sample.name == "turnrouter_silence_seconds_bucket":
                    silence[float(labels["le"])] += sample.value
        report.first_response = {route: sorted(b.items()) for route, b in first.items()}
        report.silence = sorted(silence.items())
        return report

    @property
    def total_turns(self) -> float:
        return sum(self.turns.values())

    @property
    def answered(self) -> float:
        """Turns a destination answered (outcome answer, focus or release)."""
        return sum(v for (_, o), v in self.turns.items() if o in ("answer", "focus", "release"))

    def outcome_total(self, outcome: str) -> float:
        return sum(v for (_, o), v in self.turns.items() if o == outcome)

    @property
    def clarification_rate(self) -> float:
        return self.clarifications / self.total_turns if self.total_turns else 0.0

    @property
    def acknowledgment_rate(self) -> float:
        answered = sum(v for (route, _), v in self.turns.items() if route != "none")
        emitted = self.acknowledgments.get("emitted", 0.0)
        return emitted / answered if answered else 0.0

    @property
    def lost_turns(self) -> int:
        """Published queries that neither finished as a turn nor were refused, counted."""
        return int(self.published - self.total_turns - self.rejected)

    def overall_first_response(self) -> list[tuple[float, float]]:
        merged: dict[float, float] = defaultdict(float)
        for buckets in self.first_response.values():
            for bound, count in buckets:
                merged[bound] += count
        return sorted(merged.items())

    def render(self) -> str:
        lines = [
            f"turns: {self.total_turns:.0f} in {self.elapsed:.1f} s "
            f"({self.total_turns / max(self.elapsed, 1e-9):.1f}/s); decisions/s: "
            f"{self.decisions / max(self.elapsed, 1e-9):.1f}",
            f"clarification rate: {self.clarification_rate:.1%}   acknowledgment rate: "
            f"{self.acknowledgment_rate:.1%} (emitted {self.acknowledgments.get('emitted', 0):.0f}"
            f", suppressed {self.acknowledgments.get('suppressed', 0):.0f})",
            "",
            f"{'route':<20}{'answer':>8}{'focus':>7}{'release':>8}{'clarify':>8}"
            f"{'failed':>7}{'interr.':>8}{'busy':>6}{'refused':>8}"
            "   first response p50 / p95 (s)",
        ]
        routes = sorted({route for route, _ in self.turns})
        for route in routes:
            counts = [self.turns.get((route, o), 0.0) for o in _OUTCOMES]
            buckets = self.first_response.get(route, [])
            quantiles = (f"{histogram_quantile(0.5, buckets):.2f} / "
                         f"{histogram_quantile(0.95, buckets):.2f}" if buckets else "-")
            lines.append(f"{route:<20}" + "".join(
                f"{c:>{w}.0f}" for c, w in zip(counts, (8, 7, 8, 8, 7, 8, 6, 8), strict=True))
                + f"   {quantiles}")
        overall = self.overall_first_response()
        lines += [
            "",
            f"first response (all routes) {_quantiles(overall)}",
            f"silence {_quantiles(self.silence)} (admission to the first thing heard)",
            "quantiles are estimated from the histogram buckets, as Prometheus would",
            "background context patches: " + (", ".join(
                f"{outcome} {count:.0f}" for outcome, count in sorted(self.patches.items()))
                or "none"),
            "bounds overflowed: " + (", ".join(
                f"{limit} {count:.0f}" for limit, count in sorted(self.overflows.items()))
                or "none") + " (docs/limits.md)",
            f"answered {self.answered:.0f} ({self.answered / max(self.elapsed, 1e-9):.1f}/s), "
            f"shed for load {self.outcome_total('busy'):.0f} (outcome busy, "
            "docs/limits.md: Overload)",
            f"queries published {self.published}, refused {self.rejected:.0f}, "
            f"lost {self.lost_turns}",
        ]
        return "\n".join(lines)


def _quantiles(buckets: Iterable[tuple[float, float]]) -> str:
    """`p50 x s, p95 y s` from histogram buckets, or `no samples` (not `nan s`: a run
    whose turns were all still running at the end has none)."""
    p50, p95 = histogram_quantile(0.5, buckets), histogram_quantile(0.95, buckets)
    if not (math.isfinite(p50) and math.isfinite(p95)):
        return "no samples"
    return f"p50 {p50:.2f} s, p95 {p95:.2f} s"


#: The report's columns: every turn outcome, so a route's row adds up to its turns
#: (newcomer18 F11: shed turns had no column, the `none` row read all zeros).
_OUTCOMES = ("answer", "focus", "release", "clarify", "failed", "interrupted", "busy",
             "refused")
