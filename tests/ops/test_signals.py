"""The families the router does not record yet (`PENDING_METRICS`) and their reference
recorder `RouterSignals`: what the rules and dashboards read, with synthetic data."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from turnrouter.ops import exposed_series_names
from turnrouter.ops._promql import pending_series_names
from turnrouter.telemetry import (
    INELIGIBLE_REASONS,
    METRICS,
    NEEDLESS_WITHIN_SECONDS,
    PENDING_METRICS,
    RESPONSE_BUCKETS,
    RouterSignals,
    metric,
)


def test_pending_families_are_defined_apart_from_metrics() -> None:
    """Pending families are looked up by `metric()`, read by the generator, not in METRICS."""
    names = {spec.name for spec in PENDING_METRICS}
    assert names == {"turnrouter_ineligible_routes_total",
                     "turnrouter_needless_acknowledgments_total",
                     "turnrouter_acknowledgment_generation_seconds"}
    assert not names & {spec.name for spec in METRICS}
    for spec in PENDING_METRICS:
        assert metric(spec.name) is spec and "participant" not in spec.labels
    assert pending_series_names() <= exposed_series_names()
    assert metric("turnrouter_acknowledgment_generation_seconds").buckets == RESPONSE_BUCKETS


def test_ineligible_counts_by_route_and_reason() -> None:
    """One count per ineligible candidate; unknown reasons are `other` (bounded labels)."""
    registry = CollectorRegistry()
    signals = RouterSignals(registry)
    signals.ineligible("travel", "unavailable")
    signals.ineligible("travel", "unavailable")
    signals.ineligible("meta", "policy")
    signals.ineligible("meta", "user text that must not become a label")
    value = registry.get_sample_value
    assert value("turnrouter_ineligible_routes_total",
                 {"route": "travel", "reason": "unavailable"}) == 2
    assert value("turnrouter_ineligible_routes_total",
                 {"route": "meta", "reason": "policy"}) == 1
    assert value("turnrouter_ineligible_routes_total",
                 {"route": "meta", "reason": "other"}) == 1
    assert "policy" in INELIGIBLE_REASONS


@pytest.mark.parametrize(("gap", "needless"), [
    (0.0, True), (NEEDLESS_WITHIN_SECONDS / 2, True), (NEEDLESS_WITHIN_SECONDS, True),
    (NEEDLESS_WITHIN_SECONDS + 0.01, False), (-0.1, False)])
def test_needless_acknowledgment_is_an_answer_right_behind_it(gap: float,
                                                              needless: bool) -> None:
    """Needless: the answer started within NEEDLESS_WITHIN_SECONDS after it was heard."""
    registry = CollectorRegistry()
    signals = RouterSignals(registry)
    assert signals.acknowledgment_finished("banking", 10.0, 10.0 + gap) is needless
    count = registry.get_sample_value("turnrouter_needless_acknowledgments_total",
                                      {"route": "banking"})
    assert count == (1.0 if needless else None)


def test_generation_time_is_a_histogram() -> None:
    """Generation times land in RESPONSE_BUCKETS; negative or NaN ones are ignored."""
    registry = CollectorRegistry()
    signals = RouterSignals(registry)
    for seconds in (0.12, 0.31, -1.0, float("nan")):
        signals.acknowledgment_generated("travel", seconds)
    value = registry.get_sample_value
    assert value("turnrouter_acknowledgment_generation_seconds_count",
                 {"route": "travel"}) == 2
    assert value("turnrouter_acknowledgment_generation_seconds_bucket",
                 {"route": "travel", "le": "0.15"}) == 1
    assert b"turnrouter_acknowledgment_generation_seconds_bucket" in generate_latest(registry)


def test_second_registration_fails_and_leaves_the_registry_as_it_was() -> None:
    """Registering twice on one registry raises; a failed registration leaves nothing."""
    registry = CollectorRegistry()
    RouterSignals(registry)
    before = generate_latest(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        RouterSignals(registry)
    assert generate_latest(registry) == before
    with pytest.raises(TypeError, match="CollectorRegistry"):
        RouterSignals(object())
