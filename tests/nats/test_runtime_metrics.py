"""The runtime's histograms (`_metrics.Seconds`) are exposed exactly as
prometheus_client's `Histogram` exposes the same observations."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from turnrouter.runtime.nats._metrics import _WAIT_BUCKETS, Seconds, runtime_metrics

_VALUES = st.one_of(st.sampled_from([*_WAIT_BUCKETS, 0.0, -1.0, 1e9]),
                    st.floats(min_value=-10, max_value=100, allow_nan=False))


def _exposed(registry: CollectorRegistry) -> str:
    """The exposition without `_created` values (each family's creation time)."""
    text = generate_latest(registry).decode()
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", text)


@given(st.lists(st.tuples(st.sampled_from(["delivery", "queued"]), _VALUES), max_size=60),
       st.lists(_VALUES, max_size=30))
def test_seconds_exposes_what_histogram_exposes(
        labelled: list[tuple[str, float]], plain: list[float]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    families = [
        (Seconds("t_wait_seconds", "waits", ["stage"], buckets=_WAIT_BUCKETS, registry=ours),
         Histogram("t_wait_seconds", "waits", ["stage"], buckets=_WAIT_BUCKETS,
                   registry=theirs)),
        (Seconds("t_write_seconds", "writes", buckets=(0.001, 0.5), registry=ours),
         Histogram("t_write_seconds", "writes", buckets=(0.001, 0.5), registry=theirs))]
    (wait, wait_ref), (write, write_ref) = families
    for stage, value in labelled:
        wait.labels(stage).observe(value)
        wait_ref.labels(stage).observe(value)
    for value in plain:
        write.observe(value)
        write_ref.observe(value)
    assert _exposed(ours) == _exposed(theirs)
    assert ours.get_sample_value("t_write_seconds_count") == len(plain)


def test_the_runtime_families_are_exposed_before_any_observation() -> None:
    registry = CollectorRegistry()
    runtime_metrics(registry)
    assert registry.get_sample_value("turnrouter_nats_state_write_seconds_count") == 0
    assert registry.get_sample_value("turnrouter_nats_input_wait_seconds_count",
                                      {"stage": "queued"}) == 0


def _p95(registry: CollectorRegistry, stage: str) -> float:
    """The p95 `histogram_quantile` computes from the exposed buckets (linear within
    the bucket it falls in), as the dashboard and TurnrouterInputBacklog read it."""
    bounds = [*_WAIT_BUCKETS, float("inf")]
    counts = [registry.get_sample_value("turnrouter_nats_input_wait_seconds_bucket",
                                        {"stage": stage, "le": _le(bound)}) or 0.0
              for bound in bounds]
    rank, lower, below = 0.95 * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    raise AssertionError("no bucket holds the rank")


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def test_a_backlog_at_max_input_wait_reads_as_itself() -> None:
    """Waits piled up just past the default `max_input_wait` (10 s: a backlog's
    queries refused after it) read as about 10-12 s, not 26-30 s (spike12 D2: with no
    bound between 10 and 30 s, the dashboard and the backlog page said 29 s for waits
    of 10.3 s)."""
    registry = CollectorRegistry()
    metrics = runtime_metrics(registry)
    for k in range(200):
        metrics.wait_delivery.observe(10.0 + k * 0.01)  # 10.0 .. 11.99 s
    assert 10.0 < _p95(registry, "delivery") <= 12.5
