"""The timing model's shortcuts against its general path: the same state, sample by
sample (every field, every histogram weight, bit for bit)."""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from turnrouter import RouteTimingPredictor, TimingSample
from turnrouter._timing_model import RouteModel, Settings

SECONDS = st.one_of(st.floats(0.0, 200.0), st.sampled_from([0.0, 0.01, 0.0100001, 119.9,
                                                            120.0, 1e9]),
                    st.integers(0, 300))
#: Up to a few hundred samples (a drawn run repeated: past the 32-sample ring, and
#: with short half-lives past the histograms' renormalization).
SAMPLES = st.builds(lambda run, times: run * times,
                    st.lists(st.tuples(SECONDS, st.booleans()), max_size=40),
                    st.integers(1, 12))


def state(model: RouteModel) -> tuple[object, ...]:
    """Everything a model holds, its regimes' histograms included."""
    fields = tuple(
        (name, getattr(model, name)) for name in RouteModel.__slots__
        if name not in ("regimes", "recent", "recent_censored"))
    regimes = tuple(
        (r.mean, r.var, r.seen, r.used, r.hist.total, r.hist.increment, r.hist.count,
         r.hist.weights.tobytes()) for r in model.regimes)
    return fields, regimes, model.recent.tobytes(), bytes(model.recent_censored)


@settings(max_examples=150)
@given(SAMPLES, st.sampled_from([0.3, 1.0, 100.0]), st.sampled_from([0.005, 0.2]))
@example([(0.5, False)] * 400, 0.3, 0.005)  # renormalized (about every 150 samples)
@example([(0.5, False), (0.2, True), (3, False)] * 150, 0.3, 0.005)
def test_a_feature_class_learns_as_the_general_path_would(
        samples: list[tuple[float, bool]], half_life: float, hazard: float) -> None:
    """`add_plain` (a feature class's samples: one regime, no change detection) leaves
    what `add` leaves with those settings, after every sample (short half-lives reach
    the histograms' renormalization)."""
    plain = Settings(half_life=half_life, threshold=None, max_regimes=1, hazard=hazard)
    general, shortcut = RouteModel(), RouteModel()
    for seconds, censored in samples:
        general.add(seconds, censored, plain)
        shortcut.add_plain(seconds, censored, plain)
        assert state(shortcut) == state(general)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0.001, 30.0), st.booleans(),
                          st.sampled_from(["short", "long", "a", "b", "c"])), max_size=120))
def test_class_predictions_follow_the_samples(samples: list[tuple[float, bool, str]]) -> None:
    """Through the public predictor: every class's median is the one a model fed by the
    general path gives (the route's own model is untouched by the shortcut)."""
    predictor = RouteTimingPredictor(half_life_samples=5.0)
    reference: dict[str, RouteModel] = {}
    plain = Settings(half_life=5.0, threshold=None, max_regimes=1, hazard=0.005)
    changes = predictor.changes("r")
    for seconds, censored, feature in samples:
        predictor.record(TimingSample("r", seconds, censored, 0.0, feature))
        if predictor.changes("r") != changes:  # the route's latency changed: classes restart
            changes, reference = predictor.changes("r"), {}
        if feature in reference or len(reference) < 4:
            reference.setdefault(feature, RouteModel()).add(seconds, censored, plain)
    for feature, model in reference.items():
        parts = model.parts(0.005)
        held = predictor._classes["r"][1][feature]  # what the predictor pools with
        assert state(held) == state(model)
        if parts:
            assert math.isfinite(held.parts(0.005)[0][1].total)
