"""Learning from outcomes: a profile per target and question fitted from labelled answers, and the rule that accepts
it. Pure (numpy, scipy): ``gateway.learning_fits`` makes the fits, ``gateway.profile_store`` reads the samples and
stores what this decides.

- **A sample** is one answer a target gave to the question: the probabilities it gave before any learned profile
  (``base``), the model's final hidden state at the answer position where a local model gave it (``features``), and
  what it should have said (``target``): a label, one-hot, or a cascade's teacher, the later step's probabilities;
  and the input it was about (``group``).
- **Enough to learn from**: at least ``MIN_FIT_QUESTIONS`` samples about at least ``MIN_INPUTS`` distinct inputs, and
  at least ``MIN_OPTIONS`` options that are the label (the target's most probable option) of ``MIN_PER_OPTION``
  samples or more. Else nothing is fitted, and the verdict says which is missing.
- **Cross-validation** is grouped and repeated: the distinct inputs (not the samples) are dealt into ``FOLDS`` folds,
  ``REPEATS`` times (first in order of appearance, then shuffled with fixed seeds), and every sample about a held-out
  input is predicted by a fit made without any sample about that input, in every repeat.
- **Candidates** (``learning_fits``): ``calibration`` and, where every sample has features, ``head``; each one's
  strength is the one with the lowest cross-validated log loss over every repeat (the strongest on ties).
- **What is served now** (the baseline) is scored out of fold too: the active profile is fitted again in each fold,
  its kind at its strength on its own samples less the held-out inputs (``Baseline``); without a profile, the base
  answers (nothing was fitted to them). A profile scored on the samples it learned from would look better than it
  is and block a candidate that would serve better.
- **Gain and its standard error**, one weighting: per sample and repeat, the baseline's held-out log loss less the
  candidate's; the gain is their mean (every sample weighs the same), and its standard error that of the folds'
  gains (each fold weighing its samples; a fold is one fit), corrected for the overlap of the repeats' training sets
  (Nadeau and Bengio): finite with two folds or more, never NaN (``gain_and_error``).
- **Acceptance** (``learn``): a candidate is accepted only where its gain exceeds one standard error and its
  cross-validated accuracy is not lower than the baseline's; of those accepted, the lowest cross-validated log loss
  wins, fitted again on every sample. Else nothing changes. A bias that buys log loss by answering the most common
  option always can lower accuracy: it is refused. The strength is chosen on the folds that judge the candidate
  (not nested): the one-standard-error margin is what stands between that optimism and an accepted profile.
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
from ..engine.calibration import FOLDS, MIN_FIT_QUESTIONS, STRENGTHS, folds
from ..limits import ECE_BINS
from .learning_fits import FLOOR, Array, Table, cross_entropy, fit, predict_rows, softmax

KINDS = ("calibration", "head")
HEAD_STRENGTHS = (1.0, 0.1, 0.01, 0.001, 0.0001)  # L2 on a head's weights over standardised features, strongest first
MIN_INPUTS = 10  # distinct inputs a learning needs
MIN_OPTIONS, MIN_PER_OPTION = 2, 5  # options that are the label of at least MIN_PER_OPTION samples each
REPEATS = 3  # of the grouped cross-validation


@dataclass
class Sample:
    base: list[float]
    features: Sequence[float] | NDArray[Any] | None
    target: list[float]  # sums to 1
    # What the answer was about (a hash of the input): the samples of one input share a fold, so that a request
    # asked again is never judged by its own twin. None: an input of its own.
    group: str | None = None


def table(samples: Sequence[Sample]) -> Table:
    """``samples`` as columns (features only where every sample has them, all of one width)."""
    dims = {len(s.features) if s.features is not None else None for s in samples}
    features = np.array([np.asarray(s.features, dtype=np.float32) for s in samples]) \
        if samples and None not in dims and len(dims) == 1 else None
    return Table(np.array([s.base for s in samples], dtype=np.float64),
                 np.array([s.target for s in samples], dtype=np.float64), features,
                 [s.group if s.group is not None else f"sample:{i}" for i, s in enumerate(samples)])


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
        return softmax(z[None])[0].tolist()  # type: ignore[no-any-return]
    weights = np.asarray(params["weights"], dtype=np.float64)
    if features is None or weights.shape != (len(base), len(features)):
        return None
    z = weights @ np.asarray(features, dtype=np.float64) + np.asarray(params["intercept"])
    return softmax(z[None])[0].tolist()  # type: ignore[no-any-return]


@dataclass
class Baseline:
    """What is served now, as a fit to make again in each fold: the active profile's ``kind`` at its ``strength``,
    fitted on its own samples (``samples``: those it learned from; None: the samples being judged) less those about
    held-out inputs. ``params`` are what it serves: used as they are only where it cannot be fitted again (no
    strength known), and then it is scored on the samples it may have learned from (``Outcome.served_out_of_fold``
    says so)."""

    kind: str
    params: dict[str, Any]
    strength: float | None = None
    samples: Table | None = None


# --------------------------------------------------------------------------------------------- the verdict


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
    inputs: int = 0
    served_out_of_fold: bool = True

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.kind == self.kind), None)

    def describe(self) -> dict[str, Any]:
        return {"samples": self.samples, "inputs": self.inputs, "served": self.served,
                "served_out_of_fold": self.served_out_of_fold, "candidates": [c.describe() for c in self.candidates],
                "accepted": self.kind, "reason": self.reason}


def measured(p: Array, y: Array) -> dict[str, float]:
    """Accuracy, log loss (cross-entropy against the targets), Brier score and ECE (``ECE_BINS``) of predictions
    ``p`` against targets ``y`` (their most probable option as the label where they are soft)."""
    pairs = [(row.tolist(), int(np.argmax(t))) for row, t in zip(p, y)]
    m = scores.metrics(pairs, bins=ECE_BINS)
    return {"n": len(pairs), "accuracy": m["accuracy"], "log_loss": float(cross_entropy(p, y).mean()),
            "brier": m["brier"], "ece": m["ece"]}


# ---------------------------------------------------------------------------------------------- learning


def learn(samples: Sequence[Sample] | Table, served: Callable[[Sample], list[float]] | Baseline | None = None,
          kinds: Sequence[str] = KINDS) -> Outcome:
    """Fit every candidate kind to ``samples`` (one target's answers to one question) and accept the best one the
    rule allows (module docstring). ``served``: what is served now — a ``Baseline`` (an active profile, fitted
    again in each fold), a function of a sample (answers nothing was fitted to here, scored as they are), or None
    (the base answers)."""
    if isinstance(samples, Table) and callable(served) and not isinstance(served, Baseline):
        raise TypeError("what is served now, as a function of a sample, needs the samples as Sample objects")
    n = samples.size if isinstance(samples, Table) else len(samples)
    if n < MIN_FIT_QUESTIONS:
        return Outcome(n, {}, reason=f"{n} labelled answers; learning needs at least {MIN_FIT_QUESTIONS}")
    if isinstance(samples, Table):
        data = samples
    else:
        width = len(samples[0].base)
        if any(len(s.base) != width or len(s.target) != width for s in samples):
            return Outcome(n, {}, reason="the answers do not all have the same options")
        data = table(samples)
    inputs = len(set(data.inputs))
    refusal = too_little(data)
    if refusal is not None:
        return Outcome(n, {}, reason=refusal, inputs=inputs)
    plan = fold_plan(data.inputs)
    if callable(served) and not isinstance(served, Baseline) and not isinstance(samples, Table):
        held_now: NDArray[np.float64] = np.broadcast_to(
            np.array([served(s) for s in samples], dtype=np.float64), (len(plan), *data.base.shape))
        out_of_fold = True  # nothing was fitted to these samples here: as they are is out of fold
    else:
        held_now, out_of_fold = _baseline_held(data, served if isinstance(served, Baseline) else None, plan)
    now_loss = _losses(held_now, data.target)
    folds = np.array([[fold_of[key] for key in data.inputs] for fold_of in plan])
    outcome = Outcome(n, _pooled(held_now, data.target), inputs=inputs, served_out_of_fold=out_of_fold)
    for kind in kinds:
        if kind == "head" and data.features is None:
            continue
        strength, held = _cross_validated(data, kind, plan)
        gain, error = gain_and_error(now_loss - _losses(held, data.target), folds)
        metrics = _pooled(held, data.target)
        outcome.candidates.append(_judged(kind, strength, metrics, gain, error, outcome.served))
    accepted = [c for c in outcome.candidates if c.accepted]
    if not accepted:
        outcome.reason = "no candidate passed the acceptance rule: what is served now stays"
        return outcome
    best = min(accepted, key=lambda c: c.metrics["log_loss"])
    outcome.kind, outcome.params = best.kind, fit(best.kind, data, best.strength)
    return outcome


def too_little(data: Table) -> str | None:
    """Why ``data`` is too little to learn from (``MIN_INPUTS``, ``MIN_OPTIONS``, ``MIN_PER_OPTION``); None if it is
    enough."""
    inputs = len(set(data.inputs))
    if inputs < MIN_INPUTS:
        return f"{inputs} distinct inputs; learning needs at least {MIN_INPUTS}"
    counts = np.bincount(np.argmax(data.target, axis=1), minlength=data.target.shape[1])
    enough = int((counts >= MIN_PER_OPTION).sum())
    if enough < MIN_OPTIONS:
        return (f"{enough} option(s) are the label of at least {MIN_PER_OPTION} answers; learning needs at least "
                f"{MIN_OPTIONS} such options")
    return None


def _judged(kind: str, strength: float, metrics: dict[str, float], gain: float, error: float,
            now: dict[str, float]) -> Candidate:
    """The acceptance rule on one candidate."""
    reason = None
    if not gain > error:
        reason = f"its cross-validated log-loss gain ({gain:.4f}) is not above one standard error ({error:.4f})"
    elif metrics["accuracy"] < now["accuracy"]:
        reason = (f"its cross-validated accuracy ({metrics['accuracy']:.3f}) is below that of what is served now "
                  f"({now['accuracy']:.3f})")
    return Candidate(kind, strength, metrics, gain, error, reason is None, reason)


def gain_and_error(differences: NDArray[np.float64], folds: NDArray[np.intp]) -> tuple[float, float]:
    """The gain and its standard error from per-sample ``differences`` (repeats × samples; what is served now less
    the candidate, held out) and the fold each sample was held out in (``folds``, the same shape). The gain is the
    mean of every difference (each sample weighs the same, in every repeat). Its error treats each fold of each
    repeat as one unit, as a fitted profile is one per fold: the spread of the folds' gains (each weighing its
    samples, as in the gain) with the correction of Nadeau and Bengio for repeated cross-validation, whose training
    sets overlap: ``sqrt((1 / m + 1 / (k − 1)) · s²)`` over m folds in all, k a repeat's. Infinite below two folds,
    never NaN."""
    repeats = differences.shape[0]
    k = int(folds.max()) + 1 if folds.size else 0
    if differences.size == 0 or k < 2:
        return (float(differences.mean()) if differences.size else 0.0), math.inf
    units = (np.arange(repeats)[:, None] * k + folds).ravel()
    sums = np.bincount(units, weights=differences.ravel(), minlength=repeats * k)
    sizes = np.bincount(units, minlength=repeats * k).astype(np.float64)
    sums, sizes = sums[sizes > 0], sizes[sizes > 0]
    gain = float(sums.sum() / sizes.sum())
    weights = sizes / sizes.sum()
    m = len(sizes)
    spread = float(weights @ (sums / sizes - gain) ** 2) * m / (m - 1)
    return gain, math.sqrt((1.0 / m + 1.0 / (k - 1)) * spread)


def fold_plan(inputs: Sequence[str], k: int = FOLDS, repeats: int = REPEATS) -> list[dict[str, int]]:
    """Per repeat, the fold of each distinct input: ``engine.calibration.folds`` over the inputs in order of first
    appearance, then over fixed-seed shuffles of them (at most ``k`` folds, none empty)."""
    order = list(dict.fromkeys(inputs))
    plans = []
    for repeat in range(repeats):
        ranked = order if repeat == 0 else [order[i] for i in np.random.default_rng(repeat).permutation(len(order))]
        plans.append({ranked[i]: f for f, members in enumerate(folds(len(ranked), k)) for i in members})
    return plans


def grouped_folds(samples: Sequence[Sample], k: int = FOLDS) -> list[list[int]]:
    """The first repeat's folds of ``samples`` (``fold_plan``): the samples of one group share a fold; samples
    without a group are each a group of their own."""
    keys = table(samples).inputs
    plan = fold_plan(keys, k, 1)[0]
    parts: list[list[int]] = [[] for _ in range(len(set(plan.values())))]
    for i, key in enumerate(keys):
        parts[plan[key]].append(i)
    return parts


def _held_out(data: Table, plan: list[dict[str, int]],
              fitted: Callable[[Table], dict[str, Any] | None], kind: str,
              training: Table | None = None) -> NDArray[np.float64]:
    """Per repeat, each sample of ``data`` predicted by ``kind`` as ``fitted`` on ``training`` (default ``data``)
    without the samples about its fold's inputs; where ``fitted`` gives None (nothing to fit on), the base answers."""
    training = data if training is None else training
    held = np.empty((len(plan), *data.base.shape))
    for r, fold_of in enumerate(plan):
        mine = np.array([fold_of[key] for key in data.inputs])
        theirs = np.array([fold_of.get(key, -1) for key in training.inputs])
        for f in range(max(fold_of.values()) + 1):
            test = np.flatnonzero(mine == f)
            params = fitted(training.rows(np.flatnonzero(theirs != f)))
            held[r, test] = data.base[test] if params is None else predict_rows(kind, params, data.rows(test))
    return held


def _cross_validated(data: Table, kind: str, plan: list[dict[str, int]]) -> tuple[float, NDArray[np.float64]]:
    """The strength with the lowest cross-validated log loss over every repeat (the strongest on ties), and its
    held-out predictions (repeats × samples × options)."""
    best: tuple[float, float, NDArray[np.float64]] | None = None
    for strength in (STRENGTHS if kind == "calibration" else HEAD_STRENGTHS):
        def fitted(rows: Table, s: float = strength) -> dict[str, Any]:
            return fit(kind, rows, s)

        held = _held_out(data, plan, fitted, kind)
        mean = float(_losses(held, data.target).mean())
        if best is None or mean < best[1] - 1e-12:
            best = (strength, mean, held)
    if best is None:
        raise ValueError("no strength to choose among")
    return best[0], best[2]


def _baseline_held(data: Table, baseline: Baseline | None,
                   plan: list[dict[str, int]]) -> tuple[NDArray[np.float64], bool]:
    """What is served now, held out (repeats × samples × options), and whether out of fold: the base answers where
    nothing is served or the profile cannot read these samples (the router then serves the base answers); the
    profile fitted again per fold where its strength is known and its samples fit; else its parameters as they
    are."""
    shape = (len(plan), *data.base.shape)
    if baseline is None or not _reads(baseline.kind, baseline.params, data):
        return np.broadcast_to(data.base, shape), True
    training = baseline.samples if baseline.samples is not None else data
    if baseline.strength is None or not _alike(training, data, baseline.kind):
        return np.broadcast_to(predict_rows(baseline.kind, baseline.params, data), shape), False
    kind, strength = baseline.kind, baseline.strength

    def fitted(rows: Table) -> dict[str, Any] | None:
        return fit(kind, rows, strength) if rows.size else None

    return _held_out(data, plan, fitted, kind, training), True


def _reads(kind: str, params: dict[str, Any], data: Table) -> bool:
    """Whether a profile of ``kind`` with ``params`` answers the samples of ``data`` (``predict``'s conditions)."""
    width = data.base.shape[1]
    if kind == "head":
        return data.features is not None and tuple(np.shape(params["weights"])) == (width, data.features.shape[1])
    return bool(len(params["bias"]) == width)


def _alike(training: Table, data: Table, kind: str) -> bool:
    """Whether a ``kind`` fitted on ``training`` reads ``data``: the same options, and for a head the same features."""
    if training.base.shape[1] != data.base.shape[1]:
        return False
    if kind != "head":
        return True
    return training.features is not None and data.features is not None and \
        training.features.shape[1] == data.features.shape[1]


def _losses(held: NDArray[np.float64], y: Array) -> NDArray[np.float64]:
    """Per repeat and sample, the log loss of its held-out prediction (repeats × samples)."""
    return np.array([cross_entropy(h, y) for h in held])


def _pooled(held: NDArray[np.float64], y: Array) -> dict[str, float]:
    """``measured`` over every repeat's held-out predictions together (``n``: the samples, not the predictions)."""
    out = measured(held.reshape(-1, y.shape[1]), np.tile(y, (held.shape[0], 1)))
    return {**out, "n": int(y.shape[0])}
