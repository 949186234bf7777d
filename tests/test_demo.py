"""The demo: shipped sample, simulated destinations, report arithmetic, a short real run."""

from __future__ import annotations

import io
import math
import random

import pytest

from turnrouter import AgentTurn
from turnrouter.demo import (
    DESCRIPTIONS,
    DemoConfig,
    build_agents,
    histogram_quantile,
    load_sample,
    run_demo,
)

pytestmark = pytest.mark.anyio


def test_sample_covers_ten_domains_and_out_of_scope() -> None:
    """The shipped CLINC150 sample has examples for ten domains and oos queries."""
    sample = load_sample()
    assert len(sample.domains) == 10
    assert set(sample.domains) | {"conversation"} == set(DESCRIPTIONS)
    assert sum(1 for _, domain, _ in sample.queries if domain == "oos") == 60
    assert all(len(texts) == 75 for texts in sample.examples.values())


def test_histogram_quantile_matches_prometheus() -> None:
    """Quantiles interpolate within buckets like Prometheus; empty is NaN."""
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, [(1.0, 1.0), (math.inf, 2.0)]) == 1.0
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


async def _published(_: AgentTurn, route: str, text: str) -> None:
    return None


async def test_simulated_destinations_decline_outside_their_domain() -> None:
    """A simulated destination declines queries of other domains; the default accepts."""
    sample = load_sample()
    agents = build_agents(sample, rng=random.Random(1), publish=_published, speed=100.0,
                          clarify_heavy=False)
    weather = next(text for text, domain, _ in sample.queries if domain == "utility")
    turn = AgentTurn("p1", "t1", weather)
    assert (await agents["utility"].admit(turn, focused=False)).disposition in {
        "accept", "decline"}
    assert (await agents["banking"].admit(turn, focused=False)).disposition == "decline"
    assert (await agents["conversation"].admit(turn, focused=False)).disposition == "accept"


async def test_clarify_heavy_makes_the_default_ineligible() -> None:
    """The alert scenario takes the general agent out of routing."""
    agents = build_agents(load_sample(), rng=random.Random(1), publish=_published,
                          speed=100.0, clarify_heavy=True)
    assert agents["conversation"].routing_aid("p1").eligible is False


async def test_short_demo_run_loses_no_turn() -> None:
    """A short, fast demo run routes turns to many destinations and loses none."""
    out = io.StringIO()
    report = await run_demo(DemoConfig(duration=2.0, participants=30, speed=10.0,
                                       progress=False, seed=3), out=out)
    assert report.lost_turns == 0
    assert report.total_turns > 50
    answered = {route for (route, outcome), n in report.turns.items()
                if outcome == "answer" and n}
    assert len(answered) >= 6
    assert "lost 0" in out.getvalue()
