"""Metric families: every family of `METRICS`, registered once per registry.

Counters and histograms are turnrouter's own prometheus_client *collectors*: a turn
updates plain numbers (a counter child is one float, a histogram child a list of bucket
counts found with `bisect`), and the registry reads them at scrape time. prometheus_client's
own `Counter` and `Histogram` take a lock and validate on every update: about twenty
updates per turn made them the largest entry of a turn's profile. The exposition is the
same series prometheus_client's classes would expose (`_total`, `_bucket`/`_count`/
`_sum`, `_created`, exemplars).

Each `Telemetry` keeps one *shard* of children per thread that records through it
(usually just its router's event loop), written only by that thread, so updates need no
lock; a scrape adds up every live shard of the registry plus what shards that were
garbage-collected (a finished thread's, a dropped `Telemetry`'s) left behind. Gauges (set
rarely) stay prometheus_client's.

In prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, as a LiveKit worker
sets it), each child also writes through to prometheus_client's process-wide families,
whose files are the export (see `_multiprocess`).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable
from functools import lru_cache, partial
from typing import Generic, TypeVar, get_args
from weakref import WeakKeyDictionary

import prometheus_client.metrics
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from .._exceptions import ConfigurationError
from .._observer import ClarificationReason
from ._metrics import METRICS, MetricSpec, metric
from ._multiprocess import GAUGE_MODES, VARIABLE, is_multiprocess, mirrors, prepare
from ._window import ParticipantWindow

__all__ = [
    "BOOL_LABEL",
    "EXEMPLAR_INTERVAL_SECS",
    "NONE_LABEL",
    "Count",
    "Families",
    "Latency",
    "families_for",
]

#: The `route` label of a turn no destination answered.
NONE_LABEL = "none"
BOOL_LABEL = {True: "true", False: "false"}

#: At most one trace exemplar per histogram bucket and child in this many seconds.
EXEMPLAR_INTERVAL_SECS = 1.0


class Count:
    """One counter child: a float only its shard's thread increments."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self) -> None:
        """Add one."""
        self.value += 1.0

    def _merge(self, other: Count) -> None:
        self.value += other.value
        self.created = min(self.created, other.created)


class Latency:
    """One histogram child: bucket counts, a sum, and rate-limited trace exemplars.

    prometheus_client keeps one exemplar per bucket, the newest, and Prometheus reads it
    once per scrape (seconds apart); under load almost every exemplar is overwritten
    unseen. So a bucket takes a new exemplar only when its last one is
    `EXEMPLAR_INTERVAL_SECS` old: a scrape still sees an exemplar in every bucket that had
    traced observations, at most that much older than the newest, and a quiet deployment
    keeps every one.
    """

    __slots__ = ("_last", "bounds", "counts", "created", "exemplars", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        #: The family's bucket upper bounds (`+Inf` implicit).
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)
        self._last = [-math.inf] * (len(bounds) + 1)

    def observe(self, seconds: float) -> None:
        """Record one observation (a value on a bound falls in that bound's bucket)."""
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def observe_traced(self, seconds: float, now: float, span: Span) -> None:
        """Record one observation, with an exemplar pointing at `span` unless its bucket
        has a recent one or the span is not sampled (recorded only: its trace is never
        exported, so the exemplar would lead nowhere); `now` is a `perf_counter()`
        reading."""
        index = bisect_left(self.bounds, seconds)
        self.counts[index] += 1
        self.sum += seconds
        last = self._last
        if now - last[index] < EXEMPLAR_INTERVAL_SECS:
            return
        context = span.get_span_context()
        if not context.trace_flags.sampled:
            return
        last[index] = now
        self.exemplars[index] = Exemplar(
            {"trace_id": format(context.trace_id, "032x"),
             "span_id": format(context.span_id, "016x")}, seconds, time.time())

    def _merge(self, other: Latency) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum += other.sum
        self.created = min(self.created, other.created)
        self.exemplars = [_newer(a, b) for a, b in zip(self.exemplars, other.exemplars,
                                                        strict=True)]


def _newer(a: Exemplar | None, b: Exemplar | None) -> Exemplar | None:
    if a is None or b is None:
        return a or b
    return a if _stamp(a) >= _stamp(b) else b


def _stamp(exemplar: Exemplar) -> float:
    stamp = exemplar.timestamp
    return stamp if isinstance(stamp, float) else 0.0


class _MirroredCount(Count):
    """A counter child that also increments prometheus_client's (multiprocess mode)."""

    __slots__ = ("_mirror",)

    def __init__(self, mirror: Counter) -> None:
        super().__init__()
        self._mirror = mirror

    def inc(self) -> None:
        """Add one, here and in this process's multiprocess file."""
        self.value += 1.0
        self._mirror.inc()


class _MirroredLatency(Latency):
    """A histogram child that also observes into prometheus_client's (multiprocess mode:
    without exemplars, which its files cannot hold)."""

    __slots__ = ("_mirror",)

    def __init__(self, bounds: tuple[float, ...], mirror: Histogram) -> None:
        super().__init__(bounds)
        self._mirror = mirror

    def observe(self, seconds: float) -> None:
        """Record one observation, here and in this process's multiprocess file."""
        super().observe(seconds)
        self._mirror.observe(seconds)

    def observe_traced(self, seconds: float, now: float, span: Span) -> None:
        """As `Latency.observe_traced`; the file gets the observation only."""
        super().observe_traced(seconds, now, span)
        self._mirror.observe(seconds)


_C = TypeVar("_C", Count, Latency)


class _Family(Generic[_C]):
    """One shard's children of a labelled family, bound once per label tuple."""

    __slots__ = ("__weakref__", "_make", "_width", "children")

    def __init__(self, make: Callable[[tuple[str, ...]], _C], width: int) -> None:
        self._make: Callable[[tuple[str, ...]], _C] = make
        self._width = width
        self.children: dict[tuple[str, ...], _C] = {}

    def get(self, *values: str) -> _C:
        """The child for these label values."""
        child = self.children.get(values)
        if child is None:
            if len(values) != self._width:
                raise ValueError(f"expected {self._width} label values, got {values!r}")
            child = self.children[values] = self._make(values)
        return child


def _use_created() -> bool:
    """Whether `_created` series are exposed, as prometheus_client decides it."""
    return bool(getattr(prometheus_client.metrics, "_use_created", True))


class _Collector(Generic[_C]):
    """A family registered on a registry: adds up its shards' children at scrape time."""

    def __init__(self, spec: MetricSpec, make: Callable[[], _C],
                 mirrored: Callable[[tuple[str, ...]], _C] | None = None) -> None:
        self.spec = spec
        self._make: Callable[[], _C] = make
        #: Makes a shard's child for label values (write-through in multiprocess mode).
        self._child: Callable[[tuple[str, ...]], _C] = (
            mirrored if mirrored is not None else self._plain)
        self._kind = spec.type
        self._name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        self._lock = threading.Lock()
        self._shards: weakref.WeakSet[_Family[_C]] = weakref.WeakSet()
        #: What shards that were garbage-collected had counted.
        self._retired: dict[tuple[str, ...], _C] = {}

    def _plain(self, values: tuple[str, ...]) -> _C:
        return self._make()

    def shard(self) -> _Family[_C]:
        """A new shard of children for one `Telemetry`."""
        family: _Family[_C] = _Family(self._child, len(self.spec.labels))
        with self._lock:
            self._shards.add(family)
        weakref.finalize(family, self._retire, family.children)
        return family

    def _retire(self, children: dict[tuple[str, ...], _C]) -> None:
        with self._lock:
            _fold(self._retired, children, self._make)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self._name, self.spec.documentation, self._kind)]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            shards = list(self._shards)
            totals: dict[tuple[str, ...], _C] = {}
            _fold(totals, self._retired, self._make)
        for shard in shards:
            _fold(totals, shard.children.copy(), self._make)
        out = Metric(self._name, self.spec.documentation, self._kind)
        names, created = self.spec.labels, _use_created()
        for values, child in totals.items():
            labels = dict(zip(names, values, strict=True))
            if isinstance(child, Count):
                out.add_sample(self._name + "_total", labels, child.value)
            else:
                total = 0.0
                for le, count, exemplar in zip(_les(child.bounds), child.counts,
                                               child.exemplars, strict=True):
                    total += count
                    out.add_sample(self._name + "_bucket", {**labels, "le": le}, total,
                                   exemplar=exemplar)
                out.add_sample(self._name + "_count", labels, total)
                out.add_sample(self._name + "_sum", labels, child.sum)
            if created:
                out.add_sample(self._name + "_created", labels, child.created)
        return [out]


@lru_cache(maxsize=16)
def _les(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The `le` label values prometheus_client exposes for these bounds (and `+Inf`)."""
    return tuple(floatToGoString(bound) for bound in (*bounds, math.inf))  # type: ignore[no-untyped-call]


def _fold(into: dict[tuple[str, ...], _C], children: dict[tuple[str, ...], _C],
          make: Callable[[], _C]) -> None:
    """Add `children` (a snapshot: the dict is not iterated while it may grow) to `into`."""
    for values, child in list(children.items()):
        total: _C | None = into.get(values)
        if total is None:
            total = into[values] = make()
            total.created = child.created
        total._merge(child)


class _Registered:
    """The collectors and gauges of `METRICS` on one registry, registered once."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.collectors: dict[str, _Collector[Count] | _Collector[Latency]] = {}
        self.shards: weakref.WeakSet[Families] = weakref.WeakSet()
        self.lock = threading.Lock()
        #: prometheus_client writes this process's values to multiprocess files: the
        #: counters and histograms write through, and the gauges read at scrape time
        #: (which the files cannot call) are set as they change instead.
        self.multiprocess = is_multiprocess()
        if self.multiprocess:
            prepare()  # (ConfigurationError: prometheus_client could not write there)
        registered: list[object] = []
        try:
            for name in _COUNTERS:
                self._add(registry, registered, _counter(_spec(name, "counter"),
                                                         self.multiprocess))
            for name in _HISTOGRAMS:
                self._add(registry, registered, _histogram(_spec(name, "histogram"),
                                                           self.multiprocess))
            self.gauges = {name: self._gauge(registry, registered, name) for name in _GAUGES}
            if not self.multiprocess:
                # Turns in flight change twice per turn: plain counts read at scrape time.
                self.gauges["turnrouter_turns_in_flight"].set_function(self._in_flight)
                # Distinct participants in the sliding windows: the union over shards.
                self.gauges["turnrouter_window_participants"].set_function(
                    partial(self._distinct, "speakers"))
                self.gauges["turnrouter_window_clarified_participants"].set_function(
                    partial(self._distinct, "clarified"))
        except BaseException as exc:
            for collector in registered:  # leave the registry as it was
                registry.unregister(collector)  # type: ignore[arg-type]
            if self.multiprocess and isinstance(exc, OSError):  # a file there, or the disk
                raise ConfigurationError(
                    f"{VARIABLE}: prometheus_client cannot write this process's metrics "
                    f"there: {type(exc).__name__}: {exc}") from exc
            raise

    def _add(self, registry: CollectorRegistry, registered: list[object],
             collector: _Collector[Count] | _Collector[Latency]) -> None:
        registry.register(collector)
        registered.append(collector)
        self.collectors[collector.spec.name] = collector

    @staticmethod
    def _gauge(registry: CollectorRegistry, registered: list[object], name: str) -> Gauge:
        spec = _spec(name, "gauge")
        gauge = Gauge(spec.name, spec.documentation, spec.labels, registry=registry,
                      multiprocess_mode=GAUGE_MODES[name])
        registered.append(gauge)
        return gauge

    def publish_windows(self) -> None:
        """Set the window gauges (multiprocess mode: the files hold values, not calls)."""
        self.gauges["turnrouter_window_participants"].set(self._distinct("speakers"))
        self.gauges["turnrouter_window_clarified_participants"].set(
            self._distinct("clarified"))

    def _in_flight(self) -> float:
        with self.lock:
            shards = list(self.shards)
        return float(sum(shard.turns_begun - shard.turns_ended for shard in shards))

    def _distinct(self, window: str) -> float:
        with self.lock:
            shards = list(self.shards)
        ids: set[str] = set()
        for shard in shards:
            ids.update(getattr(shard, window).live())
        return float(len(ids))


def _counter(spec: MetricSpec, multiprocess: bool) -> _Collector[Count]:
    if not multiprocess:
        return _Collector(spec, Count)
    mirror = mirrors().counter(spec)
    return _Collector(spec, Count, lambda values: _MirroredCount(
        mirror.labels(*values) if values else mirror))


def _histogram(spec: MetricSpec, multiprocess: bool) -> _Collector[Latency]:
    bounds = spec.buckets
    assert bounds is not None
    make = partial(Latency, bounds)
    if not multiprocess:
        return _Collector(spec, make)
    mirror = mirrors().histogram(spec)
    return _Collector(spec, make,
                      lambda values: _MirroredLatency(
        bounds, mirror.labels(*values) if values else mirror))


_COUNTERS = tuple(spec.name for spec in METRICS if spec.type == "counter")
_HISTOGRAMS = tuple(spec.name for spec in METRICS if spec.type == "histogram")
_GAUGES = tuple(spec.name for spec in METRICS if spec.type == "gauge")


def _spec(name: str, kind: str) -> MetricSpec:
    spec = metric(name)
    if spec.type != kind:  # pragma: no cover - guards edits of METRICS
        raise TypeError(f"{name} is defined as a {spec.type}, not a {kind}")
    return spec


class Families:
    """One thread's shard of every family of `METRICS` for one `Telemetry` (see the
    module docstring)."""

    __slots__ = (
        "__weakref__",
        "_admission_pairs",
        "_turn_pairs",
        "_unlabelled",
        "ack_delay",
        "ack_generation",
        "ack_route_delay",
        "acknowledgments",
        "admission_duration",
        "admissions",
        "clarifications",
        "clarified",
        "context_patches",
        "decision_duration",
        "failures",
        "fallbacks",
        "first_response",
        "first_response_interrupted",
        "focus",
        "in_flight",
        "ineligible",
        "interruptions",
        "loop_lag",
        "multiprocess",
        "needless",
        "overflows",
        "overload_state",
        "participants",
        "predicted",
        "rejected",
        "reroutes",
        "shed",
        "silence",
        "speakers",
        "turn_duration",
        "turn_wait",
        "turns",
        "turns_begun",
        "turns_ended",
    )

    def __init__(self, registered: _Registered) -> None:
        def counter(name: str) -> _Family[Count]:
            return registered.collectors[name].shard()  # type: ignore[return-value]

        def histogram(name: str) -> _Family[Latency]:
            return registered.collectors[name].shard()  # type: ignore[return-value]

        self.turns = counter("turnrouter_turns_total")
        self.clarifications = counter("turnrouter_clarifications_total")
        for reason in get_args(ClarificationReason):
            # Every reason's series exists from the start (a rate of 0): a reason seen
            # for the first time then counts in rate() at the next scrape, not the second.
            self.clarifications.get(reason)
        self.admissions = counter("turnrouter_admissions_total")
        self.reroutes = counter("turnrouter_reroutes_total")
        self.fallbacks = counter("turnrouter_default_fallbacks_total")
        self.failures = counter("turnrouter_failures_total")
        interruptions = counter("turnrouter_interruptions_total")
        self.interruptions = interruptions.get()
        self.focus = counter("turnrouter_focus_transitions_total")
        self.acknowledgments = counter("turnrouter_acknowledgments_total")
        self.context_patches = counter("turnrouter_context_patches_total")
        self.rejected = counter("turnrouter_runtime_rejected_messages_total")
        self.overflows = counter("turnrouter_limit_overflows_total")
        self.ineligible = counter("turnrouter_ineligible_routes_total")
        self.needless = counter("turnrouter_needless_acknowledgments_total")
        self.shed = counter("turnrouter_shed_turns_total")
        for reason in ("new_participant", "shedding", "turns_in_flight"):
            self.shed.get(reason)  # both series exist from the start (a rate of 0)
        self.turn_duration = histogram("turnrouter_turn_duration_seconds")
        decisions = histogram("turnrouter_decision_duration_seconds")
        self.decision_duration = decisions.get()
        # The unlabelled families' shards: alive as long as this object (a shard that
        # is garbage-collected is folded into its collector's retired totals).
        lag = histogram("turnrouter_event_loop_lag_seconds")
        self.loop_lag = lag.get()
        self._unlabelled = (interruptions, decisions, lag)
        self.admission_duration = histogram("turnrouter_admission_duration_seconds")
        self.first_response = histogram("turnrouter_first_response_seconds")
        self.first_response_interrupted = histogram(
            "turnrouter_first_response_interrupted_seconds")
        self.silence = histogram("turnrouter_silence_seconds")
        self.ack_generation = histogram("turnrouter_acknowledgment_generation_seconds")
        gauges = registered.gauges
        self.ack_delay = gauges["turnrouter_acknowledgment_delay_seconds"]
        self.ack_route_delay = gauges["turnrouter_acknowledgment_route_delay_seconds"]
        self.predicted = gauges["turnrouter_predicted_first_response_seconds"]
        self.participants = gauges["turnrouter_active_participants"]
        self.turn_wait = gauges["turnrouter_turn_wait_seconds"]
        self.overload_state = gauges["turnrouter_overload_state"]
        #: Turns begun and ended on this shard (`turnrouter_turns_in_flight` at scrape).
        self.turns_begun = 0
        self.turns_ended = 0
        #: Multiprocess mode: the gauge turns in flight are added to and taken from as
        #: they begin and end (None otherwise: read at scrape time).
        self.in_flight: Gauge | None = (
            gauges["turnrouter_turns_in_flight"] if registered.multiprocess else None)
        #: Multiprocess mode: the registration whose window gauges are set on each change.
        self.multiprocess: _Registered | None = (
            registered if registered.multiprocess else None)
        #: Distinct participants with a turn / a clarification in the sliding window.
        self.speakers = ParticipantWindow()
        self.clarified = ParticipantWindow()
        # Children updated together on every turn, bound once per label combination.
        self._turn_pairs: dict[tuple[str, str], tuple[Count, Latency]] = {}
        self._admission_pairs: dict[tuple[str, str, bool], tuple[Count, Latency]] = {}
        with registered.lock:
            registered.shards.add(self)

    def note_speaker(self, participant_id: str) -> None:
        """A turn of `participant_id` began: a speaker of the window, no longer counted as
        clarified until this turn is (the window's overflow is counted)."""
        self.clarified.discard(participant_id)
        if not self.speakers.note(participant_id):
            self.overflows.get("participant_window").inc()
        if self.multiprocess is not None:
            self.multiprocess.publish_windows()

    def note_clarified(self, participant_id: str) -> None:
        """`participant_id` was asked to clarify."""
        if not self.clarified.note(participant_id):
            self.overflows.get("participant_window").inc()
        if self.multiprocess is not None:
            self.multiprocess.publish_windows()

    def turn_children(self, route: str, outcome: str) -> tuple[Count, Latency]:
        """`turnrouter_turns_total` and `turnrouter_turn_duration_seconds` children."""
        key = (route, outcome)
        pair = self._turn_pairs.get(key)
        if pair is None:
            pair = self._turn_pairs[key] = (
                self.turns.get(route, outcome), self.turn_duration.get(route, outcome))
        return pair

    def admission_children(
        self, route: str, disposition: str, focused: bool
    ) -> tuple[Count, Latency]:
        """`turnrouter_admissions_total` and `turnrouter_admission_duration_seconds` children."""
        key = (route, disposition, focused)
        pair = self._admission_pairs.get(key)
        if pair is None:
            pair = self._admission_pairs[key] = (
                self.admissions.get(route, disposition, BOOL_LABEL[bool(focused)]),
                self.admission_duration.get(route))
        return pair


_REGISTERED: WeakKeyDictionary[CollectorRegistry, _Registered] = WeakKeyDictionary()
_REGISTERED_LOCK = threading.Lock()


def families_for(registry: CollectorRegistry) -> Families:
    """A new shard of the families registered on `registry` (registered on first use)."""
    with _REGISTERED_LOCK:
        registered = _REGISTERED.get(registry)
        if registered is None:
            registered = _REGISTERED[registry] = _Registered(registry)
    return Families(registered)
