"""Learning from outcomes: a profile per target and question fitted from labelled answers, and the rule that accepts
it. Pure (numpy, scipy): ``gateway.profile_store`` reads the samples and stores what this decides.

- **A sample** is one answer a target gave to the question: the probabilities it gave before any learned profile
  (``base``), the model's final hidden state at the answer position where a local model gave it (``features``), and
  what it should have said (``target``): a label, one-hot, or a cascade's teacher, the later step's probabilities.
- **Candidates**, each regularised with its strength chosen by cross-validated log loss (``FOLDS`` interleaved folds,
  the answers about one input in one fold):
  - ``calibration``: ``softmax((log base + bias) / T)``, the fit ``decisiond calibrate`` makes, with an L2 penalty
    toward the identity and its bounds (``engine.calibration``);
  - ``head``: ``softmax(W · features + c)``, multinomial logistic regression on standardised features with an L2
    penalty on ``W``; only where every sample has features.
- **Acceptance** (``learn``): a candidate is accepted only where its cross-validated log loss beats that of what is
  served now (the active profile, else the base answers), fold by fold, by more than one standard error of the gain,
  and its cross-validated accuracy is not lower; of those accepted, the lowest log loss wins. Else nothing changes.
  A bias that buys log loss by answering the most common option always can lower accuracy: it is refused. The
  strength is chosen on the same folds that judge the candidate (not nested): the one-standard-error margin is what
  stands between that optimism and an accepted profile.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .. import scores
from ..engine.calibration import BIAS_BOUND, FOLDS, LOG_T_BOUNDS, MIN_FIT_QUESTIONS, STRENGTHS, folds, standard_error
from ..limits import ECE_BINS

KINDS = ("calibration", "head")
HEAD_STRENGTHS = (1.0, 0.1, 0.01, 0.001, 0.0001)  # L2 on a head's weights over standardised features, strongest first
FLOOR = 1e-12  # probabilities are clamped here in a log loss, as the metrics do

Array = NDArray[np.float64]


@dataclass
class Sample:
    base: list[float]
    features: Sequence[float] | NDArray[Any] | None
    target: list[float]  # sums to 1
    # What the answer was about (a hash of the input): the samples of one input share a fold, so that a request
    # asked again is never judged by its own twin.
    group: str | None = None


def encode_features(values: Sequence[float]) -> str:
    """Features as stored: base64 of little-endian float32."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def decode_features(text: str) -> NDArray[np.float32]:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def prepare(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """A profile's parameters as ``predict`` reads them fastest: a head's weights and intercept as arrays."""
    if kind != "head":
        return params
    return {"weights": np.asarray(params["weights"], dtype=np.float64),
            "intercept": np.asarray(params["intercept"], dtype=np.float64)}


def predict(kind: str, params: dict[str, Any], base: Sequence[float],
            features: Sequence[float] | NDArray[Any] | None) -> list[float] | None:
    """A profile's probabilities for one answer; None where it cannot answer it (a head without the features, or
    of another width; an answer with another number of options)."""
    if kind == "calibration":
        bias = params["bias"]
        if len(bias) != len(base):
            return None
        z = (np.log(np.maximum(np.asarray(base, dtype=np.float64), FLOOR)) + np.asarray(bias)) / params["temperature"]
        return _softmax(z[None])[0].tolist()  # type: ignore[no-any-return]
    weights = np.asarray(params["weights"], dtype=np.float64)
    if features is None or weights.shape != (len(base), len(features)):
        return None
    z = weights @ np.asarray(features, dtype=np.float64) + np.asarray(params["intercept"])
    return _softmax(z[None])[0].tolist()  # type: ignore[no-any-return]


def _softmax(z: Array) -> Array:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def _cross_entropy(p: Array, y: Array) -> Array:
    """Per sample: − Σ y log p (p clamped at ``FLOOR``)."""
    return -(y * np.log(np.maximum(p, FLOOR))).sum(axis=1)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------------- fits


def _fit_calibration(base: Array, y: Array, strength: float) -> dict[str, Any]:
    """Temperature and bias minimising mean cross-entropy + strength · (log² T + |b|²), within the bounds."""
    from scipy import optimize

    z = np.log(np.maximum(base, FLOOR))
    n, k = z.shape

    def objective(x: Array) -> tuple[float, Array]:
        log_t, bias = float(x[0]), x[1:]
        scaled = (z + bias) / math.exp(log_t)
        p = _softmax(scaled)
        loss = float(_cross_entropy(p, y).mean()) + strength * (log_t ** 2 + float(bias @ bias))
        g = (p - y) / n
        return loss, np.concatenate(([-(g * scaled).sum() + 2 * strength * log_t],
                                     g.sum(axis=0) / math.exp(log_t) + 2 * strength * bias))

    bounds = [LOG_T_BOUNDS] + [(-BIAS_BOUND, BIAS_BOUND)] * k
    result = optimize.minimize(objective, np.zeros(1 + k), jac=True, method="L-BFGS-B", bounds=bounds,
                               options={"maxiter": 200})
    x = result.x if np.all(np.isfinite(result.x)) else np.zeros(1 + k)
    return {"temperature": math.exp(float(x[0])), "bias": [float(b) for b in x[1:]]}


def _fit_head(features: Array, y: Array, strength: float) -> dict[str, Any]:
    """Weights and intercepts minimising mean cross-entropy + strength · |W|² over standardised features, folded
    back so that the profile reads the features as they are."""
    from scipy import optimize

    mean = features.mean(axis=0)
    scale = features.std(axis=0)
    scale = np.where(scale > 1e-8, scale, 1.0)
    x = (features - mean) / scale
    n, d = x.shape
    k = y.shape[1]

    def objective(theta: Array) -> tuple[float, Array]:
        w, c = theta[:k * d].reshape(k, d), theta[k * d:]
        p = _softmax(x @ w.T + c)
        loss = float(_cross_entropy(p, y).mean()) + strength * float((w * w).sum())
        g = (p - y) / n
        return loss, np.concatenate(((g.T @ x + 2 * strength * w).ravel(), g.sum(axis=0)))

    result = optimize.minimize(objective, np.zeros(k * d + k), jac=True, method="L-BFGS-B",
                               options={"maxiter": 300})
    theta = result.x if np.all(np.isfinite(result.x)) else np.zeros(k * d + k)
    w, c = theta[:k * d].reshape(k, d) / scale, theta[k * d:]
    return {"weights": w.tolist(), "intercept": (c - w @ mean).tolist()}


@dataclass
class _Data:
    base: Array
    features: Array | None
    y: Array

    def rows(self, index: list[int]) -> "_Data":
        return _Data(self.base[index], None if self.features is None else self.features[index], self.y[index])

    def fit(self, kind: str, strength: float) -> dict[str, Any]:
        if kind == "calibration":
            return _fit_calibration(self.base, self.y, strength)
        assert self.features is not None
        return _fit_head(self.features, self.y, strength)

    def predict(self, kind: str, params: dict[str, Any]) -> Array:
        if kind == "calibration":
            z = (np.log(np.maximum(self.base, FLOOR)) + np.asarray(params["bias"])) / params["temperature"]
        else:
            assert self.features is not None
            z = self.features @ np.asarray(params["weights"]).T + np.asarray(params["intercept"])
        return _softmax(z)


# ---------------------------------------------------------------------------------------------- learning


@dataclass
class Candidate:
    """One kind's cross-validated showing: its strength, its held-out metrics, its log-loss gain over what is served
    now with the gain's standard error, and whether the rule accepts it (``reason`` when not)."""

    kind: str
    strength: float
    metrics: dict[str, float]
    gain: float
    gain_error: float
    accepted: bool
    reason: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "strength": self.strength, "cv": self.metrics, "log_loss_gain": self.gain,
                "gain_error": self.gain_error, "accepted": self.accepted, "reason": self.reason}


@dataclass
class Outcome:
    """What ``learn`` decided: the accepted kind and its parameters (fitted on every sample), or None with the
    reason; the cross-validated metrics of what is served now and of each candidate."""

    samples: int
    served: dict[str, float]
    candidates: list[Candidate] = field(default_factory=list)
    kind: str | None = None
    params: dict[str, Any] | None = None
    reason: str | None = None

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.kind == self.kind), None)

    def describe(self) -> dict[str, Any]:
        return {"samples": self.samples, "served": self.served,
                "candidates": [c.describe() for c in self.candidates], "accepted": self.kind, "reason": self.reason}


def measured(p: Array, y: Array) -> dict[str, float]:
    """Accuracy, log loss (cross-entropy against the targets), Brier score and ECE (``ECE_BINS``) of predictions
    ``p`` against targets ``y`` (their most probable option as the label where they are soft)."""
    pairs = [(row.tolist(), int(np.argmax(t))) for row, t in zip(p, y)]
    m = scores.metrics(pairs, bins=ECE_BINS)
    return {"n": len(pairs), "accuracy": m["accuracy"], "log_loss": float(_cross_entropy(p, y).mean()),
            "brier": m["brier"], "ece": m["ece"]}


def learn(samples: Sequence[Sample], served: Callable[[Sample], list[float]],
          kinds: Sequence[str] = KINDS) -> Outcome:
    """Fit every candidate kind to ``samples`` (one target's answers to one question) and accept the best one the
    rule allows (module docstring); ``served`` gives what is served now for a sample."""
    n = len(samples)
    width = len(samples[0].base) if samples else 0
    if n < MIN_FIT_QUESTIONS:
        return Outcome(n, {}, reason=f"{n} labelled answers; learning needs at least {MIN_FIT_QUESTIONS}")
    if any(len(s.base) != width or len(s.target) != width for s in samples):
        return Outcome(n, {}, reason="the answers do not all have the same options")
    dims = {len(s.features) if s.features is not None else None for s in samples}
    features = np.array([s.features for s in samples], dtype=np.float64) if None not in dims and len(dims) == 1 \
        else None
    data = _Data(np.array([s.base for s in samples], dtype=np.float64), features,
                 np.array([s.target for s in samples], dtype=np.float64))
    now = np.array([served(s) for s in samples], dtype=np.float64)
    parts = grouped_folds(samples)
    sizes = np.array([len(p) for p in parts], dtype=np.float64)
    weights = sizes / sizes.sum()
    now_folds = np.array([_cross_entropy(now[p], data.y[p]).mean() for p in parts])
    now_metrics = measured(now, data.y)
    outcome = Outcome(n, now_metrics)
    for kind in kinds:
        if kind == "head" and features is None:
            continue
        strength, held, per_fold = _cross_validated(data, kind, parts)
        gain = float(weights @ (now_folds - per_fold))
        error = standard_error(per_fold - now_folds)
        metrics = measured(held, data.y)
        reason = None
        if not gain > error:
            reason = (f"its cross-validated log-loss gain ({gain:.4f}) is not above one standard error "
                      f"({error:.4f})")
        elif metrics["accuracy"] < now_metrics["accuracy"]:
            reason = (f"its cross-validated accuracy ({metrics['accuracy']:.3f}) is below that of what is served now "
                      f"({now_metrics['accuracy']:.3f})")
        outcome.candidates.append(Candidate(kind, strength, metrics, gain, error, reason is None, reason))
    accepted = [c for c in outcome.candidates if c.accepted]
    if not accepted:
        outcome.reason = "no candidate passed the acceptance rule: what is served now stays"
        return outcome
    best = min(accepted, key=lambda c: c.metrics["log_loss"])
    outcome.kind, outcome.params = best.kind, data.fit(best.kind, best.strength)
    return outcome


def grouped_folds(samples: Sequence[Sample], k: int = FOLDS) -> list[list[int]]:
    """``folds`` over the samples' groups (in order of first appearance): the samples of one group share a fold.
    Samples without a group are each a group of their own."""
    order: dict[Any, int] = {}
    keys = [s.group if s.group is not None else ("sample", i) for i, s in enumerate(samples)]
    for key in keys:
        order.setdefault(key, len(order))
    by_group = folds(len(order), k)
    fold_of = {g: f for f, members in enumerate(by_group) for g in members}
    parts: list[list[int]] = [[] for _ in by_group]
    for i, key in enumerate(keys):
        parts[fold_of[order[key]]].append(i)
    return parts


def _cross_validated(data: _Data, kind: str, parts: list[list[int]]) -> tuple[float, Array, Array]:
    """The strength with the lowest cross-validated log loss (the strongest on ties), its held-out predictions and
    its per-fold log losses."""
    n = data.y.shape[0]
    best: tuple[float, float, Array, Array] | None = None
    for strength in (STRENGTHS if kind == "calibration" else HEAD_STRENGTHS):
        held = np.zeros_like(data.y)
        losses = []
        for part in parts:
            chosen = set(part)
            rest = [i for i in range(n) if i not in chosen]
            held[part] = data.rows(part).predict(kind, data.rows(rest).fit(kind, strength))
            losses.append(float(_cross_entropy(held[part], data.y[part]).mean()))
        mean = float(_cross_entropy(held, data.y).mean())
        if best is None or mean < best[1] - 1e-12:
            best = (strength, mean, held, np.array(losses))
    assert best is not None
    return best[0], best[2], best[3]
