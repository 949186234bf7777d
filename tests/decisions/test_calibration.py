"""fit_calibration: the offline logistic fit behind LexicalDecisions' confidence."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from turnrouter.decisions import SIGNALS, fit_calibration


def test_fit_recovers_a_monotone_relation_and_skips_unused_signals() -> None:
    """Rows right more often at higher signal get a positive weight; unused ones stay 0."""
    rng = random.Random(3)
    rows = [(x, rng.random(), 0.0, 0.0, 0.0) for x in (rng.random() for _ in range(2000))]
    right = [rng.random() < row[0] for row in rows]
    fitted = fit_calibration(rows, right, [1.0] * len(rows),
                             use=(True, False, False, False, False))
    assert fitted.weights[0] > 3.0
    assert fitted.weights[1:] == (0.0, 0.0, 0.0, 0.0)
    assert fitted.confidence((0.9, 0, 0, 0, 0)) > 0.75 > 0.25 > fitted.confidence(
        (0.1, 0, 0, 0, 0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.booleans(), st.floats(0.01, 10)),
                min_size=1, max_size=40))
def test_fit_is_finite_on_any_data(data: list[tuple[float, bool, float]]) -> None:
    """Separable, constant or tiny data still yields a valid (finite) calibration."""
    rows = [(x, 0.0, 0.0, 0.0, 0.0) for x, _, _ in data]
    fitted = fit_calibration(rows, [y for _, y, _ in data], [w for _, _, w in data],
                             use=(True,) + (False,) * (len(SIGNALS) - 1))
    assert 0.0 <= fitted.confidence((0.5, 0, 0, 0, 0)) <= 1.0
