"""Metric families: every family of `METRICS`, registered once per registry.

Labelled children are bound once and cached by label tuple (`labels()` costs
microseconds); latency histograms rate-limit their trace exemplars per bucket.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, Generic, TypeVar
from weakref import WeakKeyDictionary

from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ._metrics import LATENCY_BUCKETS, MetricSpec, metric

__all__ = [
    "BOOL_LABEL",
    "EXEMPLAR_INTERVAL_SECS",
    "NONE_LABEL",
    "Families",
    "Latency",
    "families_for",
]

#: The `route` label of a turn no destination answered.
NONE_LABEL = "none"
BOOL_LABEL = {True: "true", False: "false"}

_M = TypeVar("_M", Counter, Gauge, Histogram)
_C = TypeVar("_C")


class _Family(Generic[_C]):
    """A labelled metric with its children bound once and cached by label tuple; `wrap`
    turns a prometheus_client child into what callers use (itself, or a `Latency`)."""

    __slots__ = ("_wrap", "children", "metric")

    def __init__(self, collector: Counter | Gauge | Histogram,
                 wrap: Callable[[Any], _C]) -> None:
        self.metric = collector
        self._wrap = wrap
        self.children: dict[tuple[str, ...], _C] = {}

    def get(self, *values: str) -> _C:
        """The child for these label values (`labels()` costs microseconds; this does not)."""
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self._wrap(self.metric.labels(*values))
        return child


def _same(child: Any) -> Any:
    return child


def _plain(collector: _M) -> _Family[_M]:
    """A family whose children are prometheus_client's own."""
    return _Family(collector, _same)


#: At most one trace exemplar per histogram bucket and child in this many seconds.
EXEMPLAR_INTERVAL_SECS = 1.0


class Latency:
    """A latency histogram child whose trace exemplars are rate-limited per bucket.

    prometheus_client keeps one exemplar per bucket, the newest, and Prometheus reads it
    once per scrape (seconds apart); under load almost every exemplar is overwritten
    unseen, yet each one costs microseconds of validation. So a bucket takes a new
    exemplar only when its last one is `EXEMPLAR_INTERVAL_SECS` old: a scrape still sees
    an exemplar in every bucket that had traced observations, at most that much older
    than the newest, and a quiet deployment keeps every one.
    """

    __slots__ = ("_bounds", "_last", "child")

    def __init__(self, child: Histogram, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        #: The prometheus_client child: untraced observations go to it directly.
        self.child = child
        #: The family's bucket upper bounds (`+Inf` implicit), to find a value's bucket.
        self._bounds = bounds
        self._last = [-math.inf] * (len(bounds) + 1)

    def observe_traced(self, seconds: float, now: float, span: Span) -> None:
        """Record one observation, with an exemplar pointing at `span` unless its bucket
        has a recent one (`now` is a `perf_counter()` reading)."""
        index = bisect_left(self._bounds, seconds)  # prometheus_client: value <= bound
        last = self._last
        if now - last[index] < EXEMPLAR_INTERVAL_SECS:
            self.child.observe(seconds)
            return
        last[index] = now  # a race between threads at worst sets one exemplar more
        context = span.get_span_context()
        self.child.observe(seconds, {"trace_id": format(context.trace_id, "032x"),
                                     "span_id": format(context.span_id, "016x")})


class Families:
    """Every family of `METRICS`, registered once on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._created: list[Counter | Gauge | Histogram] = []
        try:
            self.turns = _plain(self._counter("turnrouter_turns_total"))
            self.clarifications = _plain(self._counter("turnrouter_clarifications_total"))
            self.admissions = _plain(self._counter("turnrouter_admissions_total"))
            self.reroutes = _plain(self._counter("turnrouter_reroutes_total"))
            self.fallbacks = _plain(self._counter("turnrouter_default_fallbacks_total"))
            self.failures = _plain(self._counter("turnrouter_failures_total"))
            self.interruptions = self._counter("turnrouter_interruptions_total")
            self.focus = _plain(self._counter("turnrouter_focus_transitions_total"))
            self.turn_duration = self._latency("turnrouter_turn_duration_seconds")
            self.decision_duration = Latency(
                self._histogram("turnrouter_decision_duration_seconds"),
                self._bounds("turnrouter_decision_duration_seconds"))
            self.admission_duration = self._latency("turnrouter_admission_duration_seconds")
            self.first_response = self._latency("turnrouter_first_response_seconds")
            self.silence = self._latency("turnrouter_silence_seconds")
            self.acknowledgments = _plain(self._counter("turnrouter_acknowledgments_total"))
            self.ack_delay = self._gauge("turnrouter_acknowledgment_delay_seconds")
            self.predicted = _plain(self._gauge("turnrouter_predicted_first_response_seconds"))
            self.context_patches = _plain(self._counter("turnrouter_context_patches_total"))
            self.rejected = _plain(self._counter("turnrouter_runtime_rejected_messages_total"))
            self.overflows = _plain(self._counter("turnrouter_limit_overflows_total"))
            self.ineligible = _plain(self._counter("turnrouter_ineligible_routes_total"))
            self.needless = _plain(self._counter("turnrouter_needless_acknowledgments_total"))
            self.ack_generation = self._latency("turnrouter_acknowledgment_generation_seconds")
            self.participants = self._gauge("turnrouter_active_participants")
            # Turns in flight change twice per turn: plain counts read at scrape time
            # instead of two locked gauge updates per turn (the event loop's thread
            # updates them; several routers may share them through one registry).
            self.turns_begun = 0
            self.turns_ended = 0
            self._gauge("turnrouter_turns_in_flight").set_function(
                lambda: self.turns_begun - self.turns_ended)
        except BaseException:
            for collector in self._created:  # leave the registry as it was
                registry.unregister(collector)
            raise
        del self._created
        # Children updated together on every turn, bound once per label combination.
        self._turn_pairs: dict[tuple[str, str], tuple[Counter, Latency]] = {}
        self._admission_pairs: dict[tuple[str, str, bool], tuple[Counter, Latency]] = {}

    def turn_children(self, route: str, outcome: str) -> tuple[Counter, Latency]:
        """`turnrouter_turns_total` and `turnrouter_turn_duration_seconds` children."""
        key = (route, outcome)
        pair = self._turn_pairs.get(key)
        if pair is None:
            pair = self._turn_pairs[key] = (
                self.turns.get(route, outcome), self.turn_duration.get(route, outcome))
        return pair

    def admission_children(
        self, route: str, disposition: str, focused: bool
    ) -> tuple[Counter, Latency]:
        """`turnrouter_admissions_total` and `turnrouter_admission_duration_seconds` children."""
        key = (route, disposition, focused)
        pair = self._admission_pairs.get(key)
        if pair is None:
            pair = self._admission_pairs[key] = (
                self.admissions.get(route, disposition, BOOL_LABEL[bool(focused)]),
                self.admission_duration.get(route))
        return pair

    def _spec(self, name: str, kind: str) -> MetricSpec:
        spec = metric(name)
        if spec.type != kind:  # pragma: no cover - guards edits of METRICS
            raise TypeError(f"{name} is defined as a {spec.type}, not a {kind}")
        return spec

    def _counter(self, name: str) -> Counter:
        spec = self._spec(name, "counter")
        created = Counter(spec.name, spec.documentation, spec.labels, registry=self._registry)
        self._created.append(created)
        return created

    def _gauge(self, name: str) -> Gauge:
        spec = self._spec(name, "gauge")
        created = Gauge(spec.name, spec.documentation, spec.labels, registry=self._registry)
        self._created.append(created)
        return created

    def _bounds(self, name: str) -> tuple[float, ...]:
        buckets = self._spec(name, "histogram").buckets
        assert buckets is not None
        return buckets

    def _latency(self, name: str) -> _Family[Latency]:
        """A labelled latency family whose children know the family's buckets."""
        bounds = self._bounds(name)
        return _Family(self._histogram(name), lambda child: Latency(child, bounds))

    def _histogram(self, name: str) -> Histogram:
        spec = self._spec(name, "histogram")
        assert spec.buckets is not None
        created = Histogram(spec.name, spec.documentation, spec.labels,
                            registry=self._registry, buckets=spec.buckets)
        self._created.append(created)
        return created


_FAMILIES: WeakKeyDictionary[CollectorRegistry, Families] = WeakKeyDictionary()
_FAMILIES_LOCK = threading.Lock()


def families_for(registry: CollectorRegistry) -> Families:
    """The families registered on `registry`, registering them on first use."""
    with _FAMILIES_LOCK:
        families = _FAMILIES.get(registry)
        if families is None:
            families = _FAMILIES[registry] = Families(registry)
        return families


