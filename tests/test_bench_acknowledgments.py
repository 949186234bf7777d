"""The acknowledgment benchmark measures what it reports: silence and acknowledgments
through the real router, and verdicts that fail when nothing was measured."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_acknowledgments as bench

from turnrouter import RouteTimingPredictor


def test_a_replay_measures_silence_and_acknowledgments() -> None:
    """Both policies' rows carry finite silences and rates (the observer must be enabled
    for the router to report them), and the predictive one acknowledges a slow route
    early."""
    case = bench.run_case(200, 1, 1.0, 0.25, RouteTimingPredictor, routes=("slow", "fast"))
    fixed, predictive = case["slow"]
    assert fixed.turns == predictive.turns == 200
    assert all(math.isfinite(row.p95) for row in (fixed, predictive, *case["fast"]))
    assert predictive.p95 < 0.6 < 1.2 < fixed.p95
    assert predictive.switches == 1  # on once warmed up, never off
    assert case["fast"][1].ack_rate == 0.0


def test_a_run_without_measured_silence_is_a_missed_goal() -> None:
    """NaN silences (nothing measured) never pass as "cut ok"."""
    empty = bench.Row("slow", 10, math.nan, math.nan, 0.0, 0.0, 1.0)
    verdicts = bench._verdicts("slow", [1], [(empty, empty)], {})
    assert verdicts[0] == "NO SILENCE MEASURED"
    assert sum(v.split()[0].isupper() for v in verdicts) >= 1


def test_probe_shapes_leave_the_default_routes_plans_unchanged() -> None:
    """Adding the probe shapes to a run draws them after every default route, so each
    default route's latencies and order are what they are without them; the probes get
    their turns too."""
    plain = bench.make_plans(50, 3, 1.0)
    probed = bench.make_plans(50, 3, 1.0, bench.ROUTES + bench.PROBES)
    for route in bench.ROUTES:
        assert ([p.latency for p in plain if p.route == route]
                == [p.latency for p in probed if p.route == route])
    assert all(sum(p.route == route for p in probed) == 50 for route in bench.PROBES)
    case = bench.run_case(60, 1, 1.0, 0.25, RouteTimingPredictor, routes=("slow", "wide"))
    assert case["wide"][0].turns == case["wide"][1].turns == 60
    assert math.isfinite(case["wide"][1].p95)
