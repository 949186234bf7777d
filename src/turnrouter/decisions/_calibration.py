"""Calibration of `LexicalDecisions` scores: a logistic map from raw signals to confidence.

A candidate's raw signals (see `SIGNALS`) are mapped to the probability that choosing it
is right: `sigmoid(bias + sum(weight * signal))`. The weights are fitted offline by
`fit_calibration` (weighted logistic regression, Newton's method, pure Python) on
held-out training decisions; the shipped defaults come from
`benchmarks/sweep_decisions.py` on CLINC150 train + oos_train only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._exceptions import ConfigurationError
from .._numbers import finite
from .._redact import preview

__all__ = ["SIGNALS", "LexicalCalibration", "fit_calibration"]

SIGNALS: tuple[str, ...] = ("linear", "neighbors", "description", "lead", "coverage")
"""Raw per-candidate signals, in weight order:

- `linear`: the route's score from the linear model trained on the examples;
- `neighbors`: mean cosine of the route's `neighbors` nearest examples;
- `description`: the name + description + best-phrase similarity;
- `lead`: `description` minus the best other candidate's `description`;
- `coverage`: the share of the query's content words (stopwords left out, unless the
  query has nothing else) found in the examples or in the names and descriptions of the
  candidates scored from them: queries about something no route mentions score low.
  The same for every candidate of a request.
"""


@dataclass(frozen=True, slots=True)
class LexicalCalibration:
    """`confidence = sigmoid(bias + sum(weights[i] * signal[i]))`, signals in `SIGNALS` order.

    A zero weight means the signal is not computed at all (saves time).
    """

    weights: tuple[float, float, float, float, float]
    """One finite weight per signal, in `SIGNALS` order (0 skips the signal)."""
    bias: float
    """The finite intercept."""

    def __post_init__(self) -> None:
        weights = self.weights
        if (
            not isinstance(weights, tuple)
            or len(weights) != len(SIGNALS)
            or not all(finite(w) for w in weights)
        ):
            raise ConfigurationError(
                f"LexicalCalibration.weights must be {len(SIGNALS)} finite floats "
                f"({', '.join(SIGNALS)}), got {preview(weights)}"
            )
        bias = self.bias
        if not finite(bias):
            raise ConfigurationError(
                f"LexicalCalibration.bias must be a finite float, got {preview(bias)}")

    def confidence(self, signals: Sequence[float]) -> float:
        """The calibrated probability for one candidate's signals."""
        z = self.bias
        for weight, value in zip(self.weights, signals, strict=True):
            z += weight * value
        if z >= 0.0:
            return 1.0 / (1.0 + math.exp(-z))
        e = math.exp(z)
        return e / (1.0 + e)


def fit_calibration(
    rows: Sequence[Sequence[float]],
    right: Sequence[bool],
    weights: Sequence[float],
    *,
    use: Sequence[bool],
    l2: float = 1e-3,
    iterations: int = 30,
) -> LexicalCalibration:
    """Weighted logistic regression of `right` on the `use`d columns of `rows` (Newton).

    `weights` are per-row sample weights (e.g. equal total weight for in-scope and
    out-of-scope rows); `l2` is a small ridge keeping the fit finite on separable data.
    """
    columns = [i for i, flag in enumerate(use) if flag]
    size = len(columns) + 1
    theta = [0.0] * size
    data = [[row[i] for i in columns] + [1.0] for row in rows]
    total = sum(weights)
    for _ in range(iterations):
        gradient = [0.0] * size
        hessian = [[0.0] * size for _ in range(size)]
        for x, y, w in zip(data, right, weights, strict=True):
            z = sum(t * v for t, v in zip(theta, x, strict=True))
            p = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
            scale = w / total
            error = (p - (1.0 if y else 0.0)) * scale
            curvature = p * (1.0 - p) * scale
            for i in range(size):
                gradient[i] += error * x[i]
                xi = curvature * x[i]
                row = hessian[i]
                for j in range(i + 1):
                    row[j] += xi * x[j]
        for i in range(size):
            for j in range(i):
                hessian[j][i] = hessian[i][j]
            if i < size - 1:
                gradient[i] += l2 * theta[i]
                hessian[i][i] += l2
            hessian[i][i] += 1e-12
        step = _solve(hessian, gradient)
        updated = [t - s for t, s in zip(theta, step, strict=True)]
        if not all(math.isfinite(t) and abs(t) < 1e6 for t in updated):
            break  # diverging on (near-)separable data: keep the last finite fit
        theta = updated
        if max(abs(s) for s in step) < 1e-9:
            break
    full = [0.0] * len(SIGNALS)
    for column, value in zip(columns, theta, strict=False):
        full[column] = round(value, 4)
    return LexicalCalibration(weights=(full[0], full[1], full[2], full[3], full[4]),
                              bias=round(theta[-1], 4))


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (tiny systems only)."""
    n = len(vector)
    a = [[*row, vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        head = a[col][col]
        if head == 0.0:
            continue
        for r in range(col + 1, n):
            factor = a[r][col] / head
            if factor:
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        head = a[r][r]
        rest = sum(a[r][c] * out[c] for c in range(r + 1, n))
        out[r] = (a[r][n] - rest) / head if head else 0.0
    return out
