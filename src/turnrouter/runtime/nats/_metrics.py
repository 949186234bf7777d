"""Prometheus metric families of the NATS runtime (the only module here importing
prometheus_client). Registered once per registry; labels are low-cardinality."""

from __future__ import annotations

import math
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterable

import prometheus_client.metrics
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

__all__ = ["RuntimeMetrics", "runtime_metrics"]

_WRITE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Up to 30 s: a backlog's waits (tens of seconds) read as themselves, not as 5 s; 2.5 s
#: is the backlog alert's threshold (TurnrouterInputBacklog), 10 s the default
#: `max_input_wait`, where a backlog's waits pile up (just past it: 11 and 12.5 s, or a
#: p95 of 10.3 s waits read as 29 s between 10 and 30).
_WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 5.0,
                 10.0, 11.0, 12.5, 15.0, 20.0, 30.0)


class RuntimeMetrics:
    """The families; see docs/distributed.md ("Telemetry")."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.partitions_owned = Gauge(
            "turnrouter_nats_partitions_owned",
            "Partitions this replica currently consumes (pinned client)",
            registry=registry)
        self.partitions = Gauge(
            "turnrouter_nats_partitions",
            "Partitions of the deployment (to compare with the fleet's owned sum)",
            registry=registry)
        self.fleet_replicas = Gauge(
            "turnrouter_nats_fleet_replicas",
            "Replicas of the fleet this replica hears on presence, itself included (more "
            "than the replicas scraped: one is not scraped)", registry=registry)
        self.fleet_owned = Gauge(
            "turnrouter_nats_fleet_partitions_owned",
            "Partitions the replicas this replica hears on presence say they consume, "
            "its own included, at most the partitions (the fleet's ownership as the "
            "replicas see it)",
            registry=registry)
        self.takeovers = Counter(
            "turnrouter_nats_takeovers_total",
            "Partitions this replica took over (pinned after another owner or none)",
            registry=registry)
        self.partitions_lost = Counter(
            "turnrouter_nats_partitions_lost_total",
            "Partitions this replica lost (pin moved away) or handed over",
            ["how"], registry=registry)
        self.redeliveries = Counter(
            "turnrouter_nats_redeliveries_total",
            "Input messages delivered more than once", registry=registry)
        self.duplicates = Counter(
            "turnrouter_nats_duplicates_dropped_total",
            "Duplicates dropped: input already handled here, output refused by the "
            "output stream's deduplication", ["where"], registry=registry)
        self.backpressure = Counter(
            "turnrouter_nats_backpressure_total",
            "Saturation (the router busy): pauses before taking the next message "
            "(what=paused), queries dropped unrun because a newer query of the same "
            "participant was queued behind them (what=superseded)",
            ["what"], registry=registry)
        self.inflight_failed = Counter(
            "turnrouter_nats_inflight_failed_total",
            "Turns found in flight on a dead or paused owner, ended with the failure text",
            registry=registry)
        self.inflight_marks = Counter(
            "turnrouter_nats_inflight_marks_total",
            "Turns still running after mark_after, marked in flight in their record "
            "(one more write) before their message was acknowledged", registry=registry)
        self.idle = Counter(
            "turnrouter_nats_idle_participants_total",
            "Participants let go after idle_after without an input (their record keeps "
            "their state for their next input)", registry=registry)
        self.state_write = Seconds(
            "turnrouter_nats_state_write_seconds",
            "Revision-checked participant state writes to the key-value bucket",
            buckets=_WRITE_BUCKETS, registry=registry)
        self.input_wait = Seconds(
            "turnrouter_nats_input_wait_seconds",
            "How long an input waited: stage=delivery from stored in the stream until this "
            "replica received it (server clock against ours), stage=queued from received "
            "until its handling began (behind its partition's previous message)",
            ["stage"], buckets=_WAIT_BUCKETS, registry=registry)
        self.state_refused = Counter(
            "turnrouter_nats_state_writes_refused_total",
            "State writes refused for a newer revision (participant fenced off here)",
            registry=registry)
        self.timing_samples = Counter(
            "turnrouter_nats_timing_samples_total",
            "First-response timing samples sent to / learned from the fleet, or dropped "
            "(not sent: the connection was closed or its buffer full)",
            ["direction"], registry=registry)
        self.serving = Gauge(
            "turnrouter_nats_serving",
            "1 while this replica serves: started, connected to NATS, and its streams, "
            "consumers and bucket all there (the --ready-file signal), else 0",
            registry=registry)
        self.deployment_missing = Counter(
            "turnrouter_nats_deployment_missing_total",
            "Times this replica found a part of the deployment gone while it ran "
            "(part=input_stream, output_stream, bucket, consumer) and recreated it, "
            "a participant's record gone from the bucket (part=record) written again, "
            "or a partition's consumer stalled (inputs pending, no pull waiting, no "
            "pinned client) and its leader asked to step down (part=consumer_leader)",
            ["part"], registry=registry)
        self.partitions.set(0)
        for part in ("input_stream", "output_stream", "bucket", "consumer", "record",
                     "consumer_leader"):
            self.deployment_missing.labels(part)
        for how in ("lost", "handed_over"):
            self.partitions_lost.labels(how)
        self.duplicates.labels("output")
        # The children used per message, looked up once.
        self.wait_delivery = self.input_wait.labels("delivery")
        self.wait_queued = self.input_wait.labels("queued")
        self.duplicate_inputs = self.duplicates.labels("input")
        for direction in ("sent", "received", "dropped"):
            self.timing_samples.labels(direction)
        for what in ("paused", "superseded"):
            self.backpressure.labels(what)


class SecondsChild:
    """One series of a `Seconds` histogram: bucket counts, found with `bisect`, and a
    sum; updated by the event loop's thread only, read by a scrape."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """One observation (a value on a bound falls in that bound's bucket, as in
        prometheus_client; the runtime observes clock differences, never NaN)."""
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class Seconds:
    """A histogram family exposed exactly as prometheus_client's `Histogram` exposes it
    (`_bucket`, `_count`, `_sum`, `_created`), without its locks and checks on every
    observation: a worker observes three per turn (two input waits, the record write),
    and `Histogram.observe` (a lock per value, a Python loop over the buckets) was the
    largest runtime entry of a turn's profile after the connection's own."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (), *,
                 buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(float(b) for b in buckets)
        self._les = tuple(floatToGoString(b) for b in (*self._bounds, math.inf))  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()  # children added (rarely) vs a scrape's copy
        self._children: dict[tuple[str, ...], SecondsChild] = {}
        if not self._labelnames:
            self._children[()] = SecondsChild(self._bounds)
        registry.register(self)

    def labels(self, *values: str) -> SecondsChild:
        if len(values) != len(self._labelnames):
            raise ValueError(f"expected {len(self._labelnames)} label values")
        child = self._children.get(values)
        if child is None:
            with self._lock:
                child = self._children.setdefault(values, SecondsChild(self._bounds))
        return child

    def observe(self, amount: float) -> None:
        """An observation of an unlabelled family."""
        self._children[()].observe(amount)

    def describe(self) -> list[Metric]:
        return [Metric(self._name, self._documentation, "histogram")]

    def collect(self) -> list[Metric]:
        out = Metric(self._name, self._documentation, "histogram")
        created = bool(getattr(prometheus_client.metrics, "_use_created", True))
        with self._lock:
            children = list(self._children.items())
        for values, child in children:
            labels = dict(zip(self._labelnames, values, strict=True))
            counts, total_sum = list(child.counts), child.sum
            total = 0.0
            for le, count in zip(self._les, counts, strict=True):
                total += count
                out.add_sample(f"{self._name}_bucket", {**labels, "le": le}, total)
            out.add_sample(f"{self._name}_count", labels, total)
            out.add_sample(f"{self._name}_sum", labels, total_sum)
            if created:
                out.add_sample(f"{self._name}_created", labels, child.created)
        return [out]


_LOCK = threading.Lock()
_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, RuntimeMetrics] = (
    weakref.WeakKeyDictionary())


def runtime_metrics(registry: CollectorRegistry) -> RuntimeMetrics:
    """The families registered on `registry` (created on first use)."""
    with _LOCK:
        metrics = _BY_REGISTRY.get(registry)
        if metrics is None:
            metrics = _BY_REGISTRY[registry] = RuntimeMetrics(registry)
        return metrics
