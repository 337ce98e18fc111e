"""Better probabilities from the same model: order debiasing, contextual calibration and fitted temperatures.

Small chat models read through letter labels favour early labels whatever the options. Three corrections, all
applied to the labels' log-probabilities (``z``) before the softmax over the labels:

- **order** ``cyclic``: a choice question is scored under every cyclic shift of its options (option i shown at
  position (i − k) mod n, labels re-assigned), each shift's probabilities are mapped back to the options and
  averaged; ``order_spread`` (the largest range, over options, of an option's probability across shifts) says how
  much the order mattered.
- **calibrate** ``contextual`` (Zhao et al., 2021): the question is also scored on content-free inputs
  (``N/A``, empty, ``[MASK]``); their mean label probabilities are the model's prior for that rendered question,
  which is divided out: ``z_i − log prior_i``. The prior is cached per rendered question.
- **fitted** temperature (and optionally a per-position bias) per question type, on top of any of the modes
  above: ``softmax((z + bias) / T)``. ``decisiond calibrate`` minimises log loss on labeled data plus an L2 penalty
  toward the identity (T = 1, b = 0) whose strength is chosen by cross-validation, within bounds (T in [0.2, 100],
  |b| ≤ 5); the identity (the base mode unchanged) is kept unless a fit beats it in cross-validated log loss by more
  than one standard error of its fold-to-fold gain, so a fit that would help on some folds and hurt on others is not
  kept, and with few items the profile stays the identity.
  A ``Profile`` records the whole mode, the fits, and the model and prompt format version they belong to.

``label_mass`` stays the raw full-vocabulary mass; ``confidence`` is computed from the final probabilities.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .. import probability
from ..errors import InputError

CONTENT_FREE = ("N/A", "", "[MASK]")
ORDERS = ("given", "cyclic")
CALIBRATIONS = ("none", "contextual")


@dataclass
class VariantEvidence:
    """One rendering of a question: which option sits at each shown position, and what the model said."""

    order: list[int]  # shown position j -> original candidate index
    logprobs: list[float]  # label log-probs, shown order
    priors: list[list[float]] | None = None  # label log-probs on each content-free input, shown order


def prior_logs(variant: VariantEvidence) -> list[float]:
    """log of the mean (over content-free inputs) label probabilities at T = 1."""
    if not variant.priors:
        raise ValueError("contextual calibration needs the label log-probs of at least one content-free input")
    per_input = [probability.label_probabilities(lps) for lps in variant.priors]
    return [math.log(max(sum(p[j] for p in per_input) / len(per_input), 1e-300)) for j in range(len(variant.order))]


def logits(variant: VariantEvidence, contextual: bool) -> list[float]:
    if not contextual:
        return list(variant.logprobs)
    return [lp - pr for lp, pr in zip(variant.logprobs, prior_logs(variant))]


def combine(variants: list[VariantEvidence], contextual: bool = False, temperature: float = 1.0,
            bias: list[float] | None = None) -> tuple[list[float], float]:
    """Final probabilities in the question's own candidate order, and the spread across variants."""
    n = len(variants[0].order)
    mapped = []
    for variant in variants:
        z = logits(variant, contextual)
        if bias:
            z = [v + (bias[j] if j < len(bias) else 0.0) for j, v in enumerate(z)]
        shown = probability.label_probabilities(z, temperature)
        original = [0.0] * n
        for j, i in enumerate(variant.order):
            original[i] = shown[j]
        mapped.append(original)
    probs = [math.fsum(p[i] for p in mapped) / len(mapped) for i in range(n)]
    spread = max(max(p[i] for p in mapped) - min(p[i] for p in mapped) for i in range(n)) if len(mapped) > 1 else 0.0
    return probs, spread


def shifts(n: int, cyclic: bool) -> list[list[int]]:
    """The option orders to score: the given one, or all n cyclic shifts."""
    if not cyclic or n < 2:
        return [list(range(n))]
    return [[(k + j) % n for j in range(n)] for k in range(n)]


# ------------------------------------------------------------------------------------------- fitting

# L2 strengths toward the identity (T = 1, b = 0) tried by cross-validation, strongest first; the identity itself
# (no fit) is always a candidate, so a fitted correction is kept only when it beats the base mode.
STRENGTHS = (10.0, 1.0, 0.1, 0.01, 0.001)
FOLDS = 5
# What a fit may do at most: T within [0.2, 100], each bias within ±5. Past them a fit on a few dozen questions is
# chasing noise: T → 0 makes every answer certain, and one held-out mistake then costs ~27 nats (p clamped at 1e-12).
LOG_T_BOUNDS = (math.log(0.2), math.log(100.0))
BIAS_BOUND = 5.0
# Fewer labeled questions of a type than this (4 a fold) and its folds cannot tell a gain from noise: no fit.
MIN_FIT_QUESTIONS = 20


@dataclass
class Fit:
    temperature: float = 1.0
    bias: list[float] = field(default_factory=list)

    @property
    def identity(self) -> bool:
        return self.temperature == 1.0 and not any(self.bias)


@dataclass
class Sample:
    kind: str
    variants: list[VariantEvidence]
    gold: int  # original candidate index


class _Batch:
    """Samples of one question type as padded arrays, so a fit's loss and gradient are a few array operations.

    ``z``: samples × variants × shown positions (padding 0), ``valid``: real positions, ``weight``: 1 / variants on
    real variants (0 on padding), ``gold``: where each variant showed the gold option."""

    def __init__(self, samples: list[Sample], contextual: bool):
        self.size = len(samples)
        self.width = max(len(s.variants[0].order) for s in samples)
        depth = max(len(s.variants) for s in samples)
        self.z = np.zeros((self.size, depth, self.width))
        self.valid = np.zeros((self.size, depth, self.width), dtype=bool)
        self.weight = np.zeros((self.size, depth))
        self.gold = np.zeros((self.size, depth), dtype=np.int64)
        for i, s in enumerate(samples):
            for v, variant in enumerate(s.variants):
                n = len(variant.order)
                self.z[i, v, :n] = logits(variant, contextual)
                self.valid[i, v, :n] = True
                self.weight[i, v] = 1.0 / len(s.variants)
                self.gold[i, v] = variant.order.index(s.gold)

    def subset(self, index: list[int]) -> "_Batch":
        part = object.__new__(_Batch)
        part.size, part.width = len(index), self.width
        for name in ("z", "valid", "weight", "gold"):
            setattr(part, name, getattr(self, name)[index])
        return part

    def loss(self, log_t: float, bias: NDArray[np.float64], gradient: bool = False
             ) -> tuple[float, float, NDArray[np.float64]]:
        """Mean negative log-probability of the gold option under ``softmax((z + bias) / exp(log_t))``, averaged
        over variants as ``combine`` does (probabilities clamped at 1e-12, as the metrics do); with ``gradient``
        also its derivatives by ``log_t`` and by ``bias``."""
        scaled = np.where(self.valid, (self.z + bias) / math.exp(log_t), -np.inf)
        top = scaled.max(axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)  # padding variants: every position invalid
        e = np.where(self.valid, np.exp(scaled - top), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        p = e / np.where(total > 0, total, 1.0)
        p_gold = np.take_along_axis(p, self.gold[..., None], axis=-1)[..., 0]
        q = (p_gold * self.weight).sum(axis=-1)
        loss = float(-np.log(np.maximum(q, 1e-12)).mean())
        if not gradient:
            return loss, 0.0, np.zeros(self.width)
        # d loss / d scaled = a · (p − onehot(gold)), a = weight · p_gold / (n · q) where q is not clamped.
        a = np.where((q >= 1e-12)[:, None], self.weight * p_gold / (self.size * np.maximum(q, 1e-12))[:, None], 0.0)
        onehot = np.zeros_like(p)
        np.put_along_axis(onehot, self.gold[..., None], 1.0, axis=-1)
        g = np.where(self.valid, a[..., None] * (p - onehot), 0.0)
        d_log_t = float(-(g * np.where(self.valid, scaled, 0.0)).sum())  # g is 0 where scaled is -inf
        d_bias = g.sum(axis=(0, 1)) / math.exp(log_t)
        return loss, d_log_t, d_bias


ScalingLoss = Callable[[float, NDArray[np.float64]], tuple[float, float, NDArray[np.float64]]]


def fit_scaling(loss: ScalingLoss, width: int, with_bias: bool, strength: float,
                steps: int) -> tuple[float, list[float]] | None:
    """The temperature ``T`` and, with ``with_bias``, the ``width`` biases ``b`` (else none) minimising
    ``loss(log T, b) + strength · (log² T + |b|²)`` within ``LOG_T_BOUNDS`` and ``BIAS_BOUND``, by L-BFGS-B on the
    analytic gradient: ``loss`` gives its value and its derivatives by ``log T`` and by ``b``. None when the
    optimiser ends off the finite numbers. The one fitter of temperature and bias: the engine's calibration here,
    learned calibration profiles (``gateway.learning_fits``)."""
    from scipy import optimize  # only fits need it: serving does not import it

    def objective(x: NDArray[np.float64]) -> tuple[float, NDArray[np.float64]]:
        log_t = float(x[0])
        bias = x[1:] if with_bias else np.zeros(width)
        value, d_log_t, d_bias = loss(log_t, bias)
        value += strength * (log_t ** 2 + float(bias @ bias))
        grad = np.concatenate(([d_log_t + 2 * strength * log_t], d_bias + 2 * strength * bias if with_bias else []))
        return value, grad

    x0 = np.zeros(1 + (width if with_bias else 0))
    bounds = [LOG_T_BOUNDS] + [(-BIAS_BOUND, BIAS_BOUND)] * (width if with_bias else 0)
    result = optimize.minimize(objective, x0, jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": steps})
    if not np.all(np.isfinite(result.x)):
        return None
    return math.exp(float(result.x[0])), [float(b) for b in result.x[1:]]


def _fit_batch(batch: _Batch, with_bias: bool, strength: float, steps: int = 100) -> Fit:
    """Minimise ``loss + strength · (log² T + |b|²)`` over ``batch`` (``fit_scaling``)."""
    fitted = fit_scaling(lambda log_t, bias: batch.loss(log_t, bias, gradient=True), batch.width, with_bias,
                         strength, steps)
    return Fit() if fitted is None else Fit(temperature=fitted[0], bias=fitted[1])


def _log_loss(batch: _Batch, fitted: Fit) -> float:
    bias = np.array(fitted.bias or [0.0] * batch.width, dtype=np.float64)
    return batch.loss(math.log(fitted.temperature), bias)[0]


def fit(samples: list[Sample], contextual: bool = False, with_bias: bool = False, strength: float = 0.0,
        steps: int = 100) -> Fit:
    """Temperature (and per-position bias) minimising ``mean log loss + strength · (log² T + |b|²)`` over
    ``samples`` (one question type, each with the variants of the mode it is fitted on)."""
    if not samples:
        return Fit()
    return _fit_batch(_Batch(samples, contextual), with_bias, strength, steps)


def folds(n: int, k: int = FOLDS) -> list[list[int]]:
    """Deterministic interleaved folds of ``range(n)``: at most ``k``, none empty."""
    k = min(k, n)
    return [list(range(j, n, k)) for j in range(k)]


def _fold_losses(batch: _Batch, with_bias: bool, strength: float | None) -> NDArray[np.float64]:
    """The held-out log loss of each fold: of a fit on the other folds, or of the base mode (``strength`` None)."""
    out = []
    for held in folds(batch.size):
        held_set = set(held)
        rest = [i for i in range(batch.size) if i not in held_set]
        fitted = Fit() if strength is None else _fit_batch(batch.subset(rest), with_bias, strength)
        out.append(_log_loss(batch.subset(held), fitted))
    return np.array(out)


@dataclass
class Selection:
    """The outcome of a regularised fit: the fit (the identity when no strength beat the base mode), the strength
    chosen (None: the base mode was kept), the cross-validated log loss of every candidate, and per fold the
    held-out log loss of the base mode and of the chosen candidate (the fold-to-fold spread)."""

    fit: Fit
    strength: float | None
    base_log_loss: float
    cv_log_loss: float  # of the chosen candidate (== base_log_loss when the base mode is kept)
    candidates: dict[str, float] = field(default_factory=dict)  # str(strength) -> CV log loss
    fold_base: list[float] = field(default_factory=list)
    fold_chosen: list[float] = field(default_factory=list)

    @property
    def kept_base(self) -> bool:
        return self.strength is None

    @property
    def gain_error(self) -> float:
        """The standard error of the chosen candidate's per-fold gain over the base mode (0 with the base kept)."""
        return standard_error(np.array(self.fold_chosen) - np.array(self.fold_base)) if not self.kept_base else 0.0


def standard_error(values: NDArray[np.float64]) -> float:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.inf


def regularised_fit(samples: list[Sample], contextual: bool = False, with_bias: bool = False) -> Selection:
    """Fit toward the identity, or keep the base mode (no fit). A strength of ``STRENGTHS`` is admitted only when
    its cross-validated gain over the base mode (paired, fold by fold) exceeds one standard error of that gain: a
    gain the folds disagree on is noise, and a fit chosen on noise hurts held-out data. Of those admitted, the
    strongest penalty whose cross-validated log loss is within one standard error of the best one's wins (the
    one-standard-error rule: the minimum of a few noisy candidates is optimistic). With fewer than
    ``MIN_FIT_QUESTIONS`` samples the base mode is kept."""
    if len(samples) < MIN_FIT_QUESTIONS:
        loss = _log_loss(_Batch(samples, contextual), Fit()) if samples else float("nan")
        return Selection(Fit(), None, loss, loss)
    batch = _Batch(samples, contextual)
    sizes = np.array([len(held) for held in folds(batch.size)], dtype=np.float64)
    weights = sizes / sizes.sum()
    base = _fold_losses(batch, with_bias, None)
    per_fold = {s: _fold_losses(batch, with_bias, s) for s in STRENGTHS}
    mean = {s: float(weights @ per_fold[s]) for s in STRENGTHS}
    base_mean = float(weights @ base)
    candidates = {str(s): mean[s] for s in STRENGTHS}
    admitted = [s for s in STRENGTHS if mean[s] - base_mean + standard_error(per_fold[s] - base) < 0]
    if not admitted:
        return Selection(Fit(), None, base_mean, base_mean, candidates, base.tolist(), base.tolist())
    best = min(admitted, key=lambda s: mean[s])
    within = mean[best] + standard_error(per_fold[best] - base)
    strength = next(s for s in admitted if mean[s] <= within)  # the strongest penalty within one standard error
    return Selection(_fit_batch(batch, with_bias, strength), strength, base_mean, mean[strength], candidates,
                     base.tolist(), per_fold[strength].tolist())


# ------------------------------------------------------------------------------------------- profile


class ProfileError(InputError):
    """A calibration profile that cannot be read, or was fitted for another model, prompt format or mode."""


# A profile's fields: the JSON type each holds (a bool is not an integer here), and how a refusal names it.
_PROFILE_FIELDS: dict[str, tuple[type, str]] = {
    "model": (str, "a string"), "prompt_format_version": (int, "an integer"), "order": (str, "a string"),
    "calibrate": (str, "a string"), "fits": (dict, "an object"), "data": (dict, "an object")}
_PROFILE_REQUIRED = ("model", "prompt_format_version")
_PROFILE_CHOICES = {"order": ORDERS, "calibrate": CALIBRATIONS}


@dataclass
class Profile:
    """A calibration profile: the whole mode it was fitted under (option order, calibration) and the fitted
    corrections per question type, for one model and prompt format version."""

    model: str
    prompt_format_version: int
    order: str = "given"
    calibrate: str = "none"
    fits: dict[str, Fit] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def check(self, model: str, prompt_format_version: int) -> None:
        """Refuse a profile fitted for another model or prompt format version: its corrections would be wrong."""
        if self.model != model:
            raise ProfileError(f"the calibration profile was fitted for model {self.model!r}, not {model!r}; run "
                               f"'decisiond calibrate' with this model (the same --model and --served-model-name)")
        if self.prompt_format_version != prompt_format_version:
            raise ProfileError(f"the calibration profile was fitted for prompt format version "
                               f"{self.prompt_format_version}, but this decisiond renders version "
                               f"{prompt_format_version}; run 'decisiond calibrate' again")

    def mode(self, order: str | None = None, calibrate: str | None = None) -> tuple[str, str]:
        """The serving mode: the profile's own, which an explicit ``order``/``calibrate`` may only repeat."""
        for name, given, own in (("order", order, self.order), ("calibrate", calibrate, self.calibrate)):
            if given is not None and given != own:
                raise ProfileError(f"the calibration profile was fitted with {name} {own!r}, not {given!r}; drop "
                                   f"the {name} setting (the profile sets it) or calibrate under {name} {given!r}")
        return self.order, self.calibrate

    def for_kind(self, kind: str, order: str | None = None, calibrate: str | None = None) -> Fit | None:
        """The fit for a question type, when the question is answered under the mode it was fitted on (a request
        that overrides the mode gets no fitted correction; order matters for choice questions only)."""
        if calibrate is not None and calibrate != self.calibrate:
            return None
        if kind == "choice" and order is not None and order != self.order:
            return None
        return self.fits.get(kind)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """The profile ``save`` wrote to ``path``; a ``ProfileError`` naming the file (and the line or the field)
        where it is not one."""
        text = ProfileError.read_text(path)

        def wrong(message: str, field: str | None = None, line: int | None = None) -> ProfileError:
            return ProfileError(f"{message}: not a decisiond calibration profile (one is written by 'decisiond "
                                f"calibrate')", path, line, field)

        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise wrong(ProfileError.not_json(e), line=e.lineno) from None
        if not isinstance(data, dict):
            raise wrong("not a JSON object")
        for name in data:
            if name not in _PROFILE_FIELDS:
                raise wrong("unknown field", name)
        for name, (kind, described) in _PROFILE_FIELDS.items():
            if name not in data:
                if name in _PROFILE_REQUIRED:
                    raise wrong("missing", name)
            elif not isinstance(data[name], kind) or isinstance(data[name], bool):
                raise wrong(f"must be {described}", name)
            elif name in _PROFILE_CHOICES and data[name] not in _PROFILE_CHOICES[name]:
                raise wrong(f"{data[name]!r} is not one of {', '.join(_PROFILE_CHOICES[name])}", name)
        fits = {}
        for kind, fit in data.pop("fits", {}).items():
            temperature, bias = (fit.get("temperature", 1.0), fit.get("bias", [])) if isinstance(fit, dict) else (0, 0)
            if not (isinstance(fit, dict) and set(fit) <= {"temperature", "bias"} and _number(temperature)
                    and isinstance(bias, list) and all(_number(b) for b in bias)):
                raise wrong("must be an object with a temperature (a number) and a bias (a list of numbers)",
                            f"fits.{kind}")
            fits[kind] = Fit(float(temperature), [float(b) for b in bias])
        return cls(fits=fits, **data)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
