"""``decisiond eval`` and ``decisiond calibrate``: how good the probabilities are on labeled data, and fitting
corrections that make them better.

Labeled data is JSON Lines, one object per line::

    {"input": "<text, or OpenAI input items>",
     "questions": [<OpenAI Decisions questions, each with a name>],
     "gold": {"<question name>": <true/false for a predicate, the choice value, or the level index or label>}}

Every item is scored once with every rendering the modes need (all cyclic shifts of choice options, and the
content-free inputs of contextual calibration); the modes are then computed side by side from the same numbers: the
base modes ``raw`` (given order), ``cyclic``, ``contextual``, ``both``, and each base mode with a regularised fit on
top (``raw+fit``, …: temperature, and with ``--bias`` a per-position bias, per question type). A ``+fit`` mode is
judged by nested cross-fitting: each of ``FOLDS`` folds is scored by a fit (strength chosen by an inner
cross-validation, or no fit at all when none beats the base mode by more than the fold-to-fold spread of its gain:
``calibration.regularised_fit``) on the other folds, so no item is judged by a correction fitted on itself; each
``+fit`` mode is reported beside its base, fold by fold (``beside_base``). The mode with the lowest
(cross-validated) log loss is the best mode; ``calibrate --auto`` writes a profile for it. The tables and the
diagram are ``evaluation_report``'s.

Uncertainty: a percentile bootstrap over items (all questions of an item resampled together), ``resamples`` draws
``numpy.random.default_rng(seed).integers(0, items, size=(resamples, items))``, 95% intervals by linear
interpolation (``numpy.quantile``'s default); the paired difference against ``raw`` uses the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .canonical import DecisionRequest, Question
from .dialects import openai as openai_wire
from .engine.calibration import FOLDS, STRENGTHS, Fit, Profile, Sample, combine, folds, regularised_fit
from .engine.prompt import PROMPT_FORMAT_VERSION
from .errors import DecisionError, InputError, openai_param
from .scores import BINS, bin_of, metrics, predicted, reliability

if TYPE_CHECKING:
    from .engine.local import LocalEngine


MODES = {"raw": ("given", "none"), "cyclic": ("cyclic", "none"), "contextual": ("given", "contextual"),
         "both": ("cyclic", "contextual")}  # base mode -> (order, calibrate)
FIT = "+fit"
ALL_MODES = (*MODES, *(mode + FIT for mode in MODES))
KINDS = ("choice", "score", "yes_no")
REFERENCE = "raw"  # the mode paired differences are taken against


@dataclass
class LabeledItem:
    request: DecisionRequest
    gold: list[int]  # per question: the correct candidate index


LABELED_FIELDS = ("input", "questions", "gold")


def load(path: str | Path) -> list[LabeledItem]:
    """The labeled items of the JSON Lines file ``path``; an ``InputError`` naming the file, the line and the field
    (as the server names it: ``questions[0].choices``, ``gold.billing``) at fault."""
    items = [_labeled(data, path, number) for number, data in InputError.json_lines(path)]
    if not items:
        raise InputError("no labeled items (JSON Lines: input, questions and gold on each line)", path)
    return items


def _labeled(data: Any, path: str | Path, number: int) -> LabeledItem:
    """One line of a labeled file (its JSON value)."""
    if not isinstance(data, dict):
        raise InputError("not a JSON object with input, questions and gold", path, number)
    for name in LABELED_FIELDS:
        if name not in data:
            others = [key for key in data if key not in LABELED_FIELDS]
            raise InputError("missing: each line holds input, questions and gold"
                             + (f" (this one has {', '.join(map(str, others))})" if others else ""), path, number, name)
    try:
        request = openai_wire.parse_request({"model": "default", "input": data["input"],
                                             "questions": data["questions"]})
    except DecisionError as e:
        raise InputError(e.message, path, number, openai_param(e.path)) from None
    gold = data["gold"]
    if not isinstance(gold, dict):
        raise InputError("must be an object: each question's name and its right answer", path, number, "gold")
    golds = []
    for q in request.questions:
        if q.name not in gold:
            raise InputError("missing: every question needs its right answer", path, number, f"gold.{q.name}")
        try:
            golds.append(gold_index(q, gold[q.name]))
        except ValueError as e:
            raise InputError(str(e), path, number, f"gold.{q.name}") from None
    return LabeledItem(request, golds)


def gold_index(question: Question, value: Any) -> int:
    """The index of the candidate ``value`` names; a ValueError saying what the question's gold may be."""
    if question.kind == "yes_no":
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false (a predicate's answer), not {value!r}")
        return 0 if value else 1
    if question.kind == "choice":
        for i, option in enumerate(question.options):
            if type(option.value) is type(value) and option.value == value:
                return i
        raise ValueError(f"{value!r} is not one of the choices "
                         f"({', '.join(repr(option.value) for option in question.options)})")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(question.levels):
        return value
    for i, level in enumerate(question.levels):
        if level.label == value:
            return i
    raise ValueError(f"{value!r} is not a level: its index from 0 or one of the labels "
                     f"({', '.join(repr(level.label) for level in question.levels)})")


def mode_name(order: str, calibrate_mode: str, fitted: bool = False) -> str:
    """The mode's name in reports: ``both`` for cyclic order with contextual calibration, ``both+fit`` with a fit."""
    base = next(name for name, mode in MODES.items() if mode == (order, calibrate_mode))
    return base + FIT if fitted else base


def parse_mode(name: str) -> tuple[str, str, bool]:
    """``(order, calibrate, fitted)`` of a mode name."""
    fitted = name.endswith(FIT)
    order, calibrate_mode = MODES[name[: -len(FIT)] if fitted else name]
    return order, calibrate_mode, fitted


def collect(engine: LocalEngine, items: list[LabeledItem], progress: bool = True) -> tuple[list[Sample], list[int]]:
    """Score every item once with every rendering any mode needs: the samples, and each one's item index."""
    from tqdm import tqdm

    samples, groups = [], []
    for number, item in enumerate(tqdm(items, desc="scoring", unit="item", disable=not progress)):
        prepared, evidence = engine.evidence(item.request, order="cyclic", calibrate="contextual")
        for q, variants, gold in zip(prepared.questions, evidence, item.gold):
            samples.append(Sample(q.question.kind, variants, gold))
            groups.append(number)
    return samples, groups


def in_order(sample: Sample, order: str) -> Sample:
    """The sample as a given mode sees it: every cyclic shift, or only the given order."""
    return sample if order == "cyclic" else Sample(sample.kind, sample.variants[:1], sample.gold)


def probabilities(sample: Sample, order: str, calibrate_mode: str, fitted: Fit | None = None) -> list[float]:
    """The sample's probabilities under a mode, with a fitted correction when given."""
    variants = in_order(sample, order).variants
    contextual = calibrate_mode == "contextual"
    if fitted is None:
        return combine(variants, contextual)[0]
    return combine(variants, contextual, fitted.temperature, fitted.bias or None)[0]


@dataclass
class CrossFitted:
    """A ``+fit`` mode's held-out probabilities, the outer fold that scored each sample, and per question type the
    strength each fold's fit chose (None: that fold kept the base mode)."""

    probabilities: list[list[float]]
    fold: list[int]
    strengths: dict[str, list[float | None]]


def cross_fitted(samples: list[Sample], order: str, calibrate_mode: str, with_bias: bool = False) -> CrossFitted:
    """Probabilities under a base mode with a regularised fit per question type, each of ``FOLDS`` folds scored by
    a fit on the others (fold j of every type together make outer fold j)."""
    out: list[list[float]] = [[] for _ in samples]
    fold = [0] * len(samples)
    chosen: dict[str, list[float | None]] = {}
    contextual = calibrate_mode == "contextual"
    for kind in KINDS:
        index = [i for i, s in enumerate(samples) if s.kind == kind]
        if not index:
            continue
        chosen[kind] = []
        for number, held in enumerate(folds(len(index))):
            held_set = set(held)
            rest = [in_order(samples[index[j]], order) for j in range(len(index)) if j not in held_set]
            selection = regularised_fit(rest, contextual, with_bias)
            chosen[kind].append(selection.strength)
            for j in held:
                out[index[j]] = probabilities(samples[index[j]], order, calibrate_mode, selection.fit)
                fold[index[j]] = number
    return CrossFitted(out, fold, chosen)


def beside_base(base: list[list[float]], fitted: CrossFitted, golds: list[int]) -> dict[str, Any]:
    """A ``+fit`` mode against its base mode, outer fold by outer fold: each fold's held-out log loss under both,
    and the spread of the difference (mean, standard deviation, range, folds where the fit lost)."""
    import numpy as np

    per_fold = []
    for number in sorted(set(fitted.fold)):
        members = [i for i, f in enumerate(fitted.fold) if f == number]
        per_fold.append({"questions": len(members),
                         "base": metrics([(base[i], golds[i]) for i in members], 0.5)["log_loss"],
                         "fit": metrics([(fitted.probabilities[i], golds[i]) for i in members], 0.5)["log_loss"]})
    delta = np.array([f["fit"] - f["base"] for f in per_fold])
    return {"folds": per_fold, "delta_mean": float(delta.mean()), "delta_sd": float(delta.std(ddof=1))
            if len(delta) > 1 else 0.0, "delta_min": float(delta.min()), "delta_max": float(delta.max()),
            "folds_worse": int((delta > 0).sum()), "strengths": fitted.strengths}


INTERVAL_METRICS = ("accuracy", "log_loss", "ece")


def bootstrap(per_mode: dict[str, list[list[float]]], golds: list[int], groups: list[int], resamples: int = 1000,
              seed: int = 0, reference: str = REFERENCE) -> dict[str, dict[str, dict[str, list[float]]]]:
    """95% percentile intervals of accuracy, log loss and ECE per mode, and of the paired difference (mode minus
    ``reference``) on the same draws. Items (``groups``: each question's item) are resampled with replacement; a
    draw's metrics weigh each question by how often its item was drawn, which equals ``metrics`` on the
    resampled list. Returns ``{mode: {"interval": {metric: [lo, hi]}, "vs_<reference>": {metric: [lo, hi]}}}``."""
    import numpy as np

    n_items = max(groups) + 1
    draws = np.random.default_rng(seed).integers(0, n_items, size=(resamples, n_items))
    counts = np.zeros((resamples, n_items))
    np.add.at(counts, (np.arange(resamples)[:, None], draws), 1.0)
    weights = counts[:, groups]  # resamples × questions
    total = weights.sum(axis=1)

    def per_draw(probs: list[list[float]]) -> dict[str, np.ndarray]:
        top = np.array([max(p) for p in probs])
        right = np.array([predicted(p) == g for p, g in zip(probs, golds)], dtype=float)
        loss = np.array([-math.log(max(p[g], 1e-12)) for p, g in zip(probs, golds)])
        gaps = np.zeros((len(probs), BINS))
        gaps[np.arange(len(probs)), [bin_of(t) for t in top]] = right - top
        return {"accuracy": weights @ right / total, "log_loss": weights @ loss / total,
                "ece": np.abs(weights @ gaps).sum(axis=1) / total}

    def interval(values: np.ndarray) -> list[float]:
        return [float(v) for v in np.quantile(values, [0.025, 0.975])]

    draws_per_mode = {mode: per_draw(probs) for mode, probs in per_mode.items()}
    base = draws_per_mode[reference]
    return {mode: {"interval": {k: interval(v[k]) for k in INTERVAL_METRICS},
                   f"vs_{reference}": {k: interval(v[k] - base[k]) for k in INTERVAL_METRICS}}
            for mode, v in draws_per_mode.items()}


def assess(samples: list[Sample], groups: list[int], threshold: float = 0.5, coverage: float = 0.5,
           with_bias: bool = False, resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Every mode's probabilities from the same scored samples, their metrics per question type and overall,
    bootstrap intervals (overall), reliability bins, and the best mode."""
    per_mode = {mode: [probabilities(s, *MODES[mode]) for s in samples] for mode in MODES}
    golds = [s.gold for s in samples]
    fits = {}
    for mode in MODES:
        fitted = cross_fitted(samples, *MODES[mode], with_bias)
        per_mode[mode + FIT] = fitted.probabilities
        fits[mode + FIT] = {"base": mode, **beside_base(per_mode[mode], fitted, golds)}
    report: dict[str, Any] = {"questions": len(samples), "items": max(groups) + 1 if groups else 0,
                              "threshold": threshold, "coverage": coverage, "bias": with_bias,
                              "bootstrap": {"resamples": resamples, "seed": seed, "unit": "item"},
                              "modes": {}, "reliability": {}, "fits": fits}
    intervals = bootstrap(per_mode, golds, groups, resamples, seed)
    for mode, probs in per_mode.items():
        pairs = list(zip(probs, golds))
        by_kind = {kind: metrics([pr for pr, s in zip(pairs, samples) if s.kind == kind], threshold, coverage)
                   for kind in KINDS}
        report["modes"][mode] = {"all": {**metrics(pairs, threshold, coverage), **intervals[mode]}, **by_kind}
        report["reliability"][mode] = reliability(pairs)
    report["best_mode"] = best_mode(report)
    return report


def best_mode(report: dict[str, Any]) -> str:
    """The mode with the lowest overall (cross-validated, for ``+fit``) log loss; ties go to the simpler mode."""
    return min(ALL_MODES, key=lambda mode: (report["modes"][mode]["all"]["log_loss"], ALL_MODES.index(mode)))


def evaluate(engine: LocalEngine, items: list[LabeledItem], threshold: float = 0.5, with_bias: bool = False,
             coverage: float = 0.5, resamples: int = 1000, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    samples, groups = collect(engine, items, progress)
    return {"model": engine.name, **assess(samples, groups, threshold, coverage, with_bias, resamples, seed)}


def fit_profile(samples: list[Sample], order: str, calibrate_mode: str, with_bias: bool, model: str,
                data: dict[str, Any]) -> tuple[Profile, dict[str, Any]]:
    """A profile for one mode: a regularised fit per question type on all ``samples`` (a type whose fit does not
    beat the base mode in cross-validated log loss keeps the base mode: no entry), and per type what was chosen."""
    profile = Profile(model, PROMPT_FORMAT_VERSION, order, calibrate_mode, data=data)
    summary = {}
    for kind in KINDS:
        chosen = [in_order(s, order) for s in samples if s.kind == kind]
        if not chosen:
            continue
        selection = regularised_fit(chosen, calibrate_mode == "contextual", with_bias)
        if not selection.kept_base:
            profile.fits[kind] = selection.fit
        summary[kind] = {"questions": len(chosen), "kept_base": selection.kept_base, "strength": selection.strength,
                         "temperature": selection.fit.temperature, "bias": selection.fit.bias,
                         "cv_log_loss_base": selection.base_log_loss, "cv_log_loss": selection.cv_log_loss,
                         "cv_gain_se": selection.gain_error, "cv_log_loss_by_strength": selection.candidates,
                         "fold_log_loss_base": selection.fold_base, "fold_log_loss": selection.fold_chosen}
    profile.data["fits"] = summary
    return profile, summary


def calibrate(engine: LocalEngine, items: list[LabeledItem], order: str = "given", calibrate_mode: str = "none",
              with_bias: bool = False, auto: bool = False, progress: bool = True, source: str = "",
              resamples: int = 1000, seed: int = 0) -> tuple[Profile, dict[str, Any]]:
    """A profile fitted on labeled data under the given mode, or (``auto``) under the mode ``eval`` finds best.

    The summary has, per question type, the chosen strength and cross-validated log loss with and without the fit;
    with ``auto`` also ``best_mode`` and the overall log loss of every mode."""
    samples, groups = collect(engine, items, progress)
    data = {"file": source, "items": len(items), "questions": len(samples), "bias": with_bias,
            "strengths": list(STRENGTHS), "folds": FOLDS}
    extra: dict[str, Any] = {}
    fitted = True
    if auto:
        report = assess(samples, groups, with_bias=with_bias, resamples=resamples, seed=seed)
        order, calibrate_mode, fitted = parse_mode(report["best_mode"])
        extra = {"best_mode": report["best_mode"],
                 "log_loss_by_mode": {m: report["modes"][m]["all"]["log_loss"] for m in ALL_MODES}}
        data.update(extra)
    if not fitted:  # the best mode is a base mode: the profile sets the mode only
        return Profile(engine.name, PROMPT_FORMAT_VERSION, order, calibrate_mode, data=data), {**extra, "kinds": {}}
    profile, summary = fit_profile(samples, order, calibrate_mode, with_bias, engine.name, data)
    return profile, {**extra, "kinds": summary}
