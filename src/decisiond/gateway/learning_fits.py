"""The fits a learned profile is made of, on samples held as columns. Pure (numpy, scipy); the rule that judges them
is ``gateway.learning``.

- ``calibration``: ``softmax((log base + bias) / T)``, the fit ``decisiond calibrate`` makes, with an L2 penalty
  toward the identity (``strength · (log² T + |b|²)``) and its bounds (``engine.calibration``).
- ``head``: ``softmax(W · features + c)``, multinomial logistic regression on standardised features with an L2
  penalty on the weights **and** on the intercept's distance from the labels' own log-frequencies, add-one smoothed
  (``strength · (|W|² + |c − c₀|²)``, ``prior_logits``): labels of one option alone give a finite intercept (within
  ``sqrt(−log p₀ / strength)`` of ``c₀``, p₀ the smoothed frequency of that option), never one that runs off to
  infinity, while a head that learns little from the features still answers the labels' frequencies (a penalty
  toward zero would pull it toward equal odds, at a cost in log loss wherever the options are unevenly common). A
  feature is
  standardised by its spread, floored at ``SCALE_FLOOR`` times the largest spread of any feature: a feature that
  barely moves (float rounding in a hidden state) stays as small as it is instead of being blown up to the size of
  the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..engine.calibration import fit_scaling

FLOOR = 1e-12  # probabilities are clamped here in a log loss, as the metrics do
SCALE_FLOOR = 1e-4  # a feature's spread, relative to the largest spread among the features, below which it is floored

Array = NDArray[np.float64]


@dataclass
class Table:
    """Samples as columns: per sample the probabilities answered before any learned profile (``base``, n × k), the
    target (n × k, each row summing to 1: a label one-hot, or a teacher's probabilities), the features a head reads
    (n × d float32, None where not every sample has them) and the input it was about (``inputs``: the samples of one
    input are held out together)."""

    base: Array
    target: Array
    features: NDArray[np.float32] | None
    inputs: list[str]

    @property
    def size(self) -> int:
        return int(self.base.shape[0])

    def rows(self, index: Sequence[int] | NDArray[np.intp]) -> "Table":
        index = np.asarray(index, dtype=np.intp)
        return Table(self.base[index], self.target[index], None if self.features is None else self.features[index],
                     [self.inputs[i] for i in index])


def softmax(z: Array) -> Array:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def cross_entropy(p: Array, y: Array) -> Array:
    """Per sample: − Σ y log p (p clamped at ``FLOOR``)."""
    return -(y * np.log(np.maximum(p, FLOOR))).sum(axis=1)  # type: ignore[no-any-return]


def fit(kind: str, table: Table, strength: float) -> dict[str, Any]:
    """The parameters of a ``kind`` fitted to ``table`` at ``strength`` (a head only where the table has features)."""
    if kind == "calibration":
        return fit_calibration(table.base, table.target, strength)
    if table.features is None:
        raise ValueError(f"a {kind} is fitted to features; the table has none")
    return fit_head(table.features, table.target, strength)


def predict_rows(kind: str, params: dict[str, Any], table: Table) -> Array:
    """A profile's probabilities for every sample of ``table`` (a head only where the table has features)."""
    if kind == "calibration":
        z = (np.log(np.maximum(table.base, FLOOR)) + np.asarray(params["bias"])) / params["temperature"]
    else:
        if table.features is None:
            raise ValueError(f"a {kind} predicts from features; the table has none")
        z = table.features.astype(np.float64) @ np.asarray(params["weights"], dtype=np.float64).T + \
            np.asarray(params["intercept"], dtype=np.float64)
    return softmax(z)


def fit_calibration(base: Array, y: Array, strength: float) -> dict[str, Any]:
    """Temperature and bias minimising mean cross-entropy + strength · (log² T + |b|²), within the bounds."""
    z = np.log(np.maximum(base, FLOOR))
    n, k = z.shape

    def loss(log_t: float, bias: Array) -> tuple[float, float, Array]:
        scaled = (z + bias) / math.exp(log_t)
        p = softmax(scaled)
        g = (p - y) / n
        return float(cross_entropy(p, y).mean()), float(-(g * scaled).sum()), g.sum(axis=0) / math.exp(log_t)

    fitted = fit_scaling(loss, k, True, strength, 200)
    temperature, bias = fitted if fitted is not None else (1.0, [0.0] * k)
    return {"temperature": temperature, "bias": bias}


def standardiser(features: NDArray[Any]) -> tuple[Array, Array]:
    """The mean and the spread each feature is standardised by: its standard deviation, floored at ``SCALE_FLOOR``
    times the largest one (all ones where no feature moves at all)."""
    mean = features.mean(axis=0, dtype=np.float64)
    scale = features.std(axis=0, dtype=np.float64)
    top = float(scale.max()) if scale.size else 0.0
    if not top > 0.0:
        return mean, np.ones_like(scale)
    return mean, np.maximum(scale, SCALE_FLOOR * top)


def prior_logits(y: Array) -> Array:
    """The log-frequencies of the labels ``y`` (soft ones count by their mass), add-one smoothed and centred: the
    intercept a head is drawn toward."""
    logits = np.log((y.sum(axis=0) + 1.0) / (y.shape[0] + y.shape[1]))
    return logits - logits.mean()  # type: ignore[no-any-return]


def fit_head(features: NDArray[Any], y: Array, strength: float) -> dict[str, Any]:
    """Weights and intercepts minimising mean cross-entropy + strength · (|W|² + |c − c₀|²) over standardised
    features (``standardiser``; ``c₀``: ``prior_logits``), folded back so that the profile reads the features as they
    are."""
    from scipy import optimize

    mean, scale = standardiser(features)
    x = (np.asarray(features, dtype=np.float64) - mean) / scale
    n, d = x.shape
    k = y.shape[1]
    prior = prior_logits(y)

    def objective(theta: Array) -> tuple[float, Array]:
        w, c = theta[:k * d].reshape(k, d), theta[k * d:]
        p = softmax(x @ w.T + c)
        shift = c - prior
        loss = float(cross_entropy(p, y).mean()) + strength * (float((w * w).sum()) + float(shift @ shift))
        g = (p - y) / n
        return loss, np.concatenate(((g.T @ x + 2 * strength * w).ravel(), g.sum(axis=0) + 2 * strength * shift))

    start = np.concatenate((np.zeros(k * d), prior))
    result = optimize.minimize(objective, start, jac=True, method="L-BFGS-B", options={"maxiter": 300})
    theta = result.x if np.all(np.isfinite(result.x)) else start
    w, c = theta[:k * d].reshape(k, d) / scale, theta[k * d:]
    return {"weights": w.tolist(), "intercept": (c - w @ mean).tolist()}
