"""``decisiond eval`` and ``decisiond calibrate``: how good the probabilities are on labeled data, and fitting
temperatures that make them better.

Labeled data is JSON Lines, one object per line::

    {"input": "<text, or OpenAI input items>",
     "questions": [<OpenAI Decisions questions, each with a name>],
     "gold": {"<question name>": <true/false for a predicate, the choice value, or the level index or label>}}

Every item is scored once with every rendering the modes need (all cyclic shifts of choice options, and the
content-free inputs of contextual calibration); the modes are then computed side by side from the same numbers:
``raw`` (given order), ``cyclic``, ``contextual``, ``both``, and ``fitted`` (raw with a temperature per question
type fitted by 2-fold cross-fitting, so no item is scored with a temperature fitted on itself).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .canonical import DecisionRequest
from .dialects import openai as openai_wire
from .engine.calibration import Fit, Profile, Sample, combine, fit
from .engine.prompt import PROMPT_FORMAT_VERSION
from .errors import DecisionError

MODES = {"raw": (False, False), "cyclic": (True, False), "contextual": (False, True), "both": (True, True)}
ALL_MODES = (*MODES, "fitted")
KINDS = ("choice", "score", "yes_no")
BINS = 10


@dataclass
class LabeledItem:
    request: DecisionRequest
    gold: list[int]  # per question: the correct candidate index


def load(path: str | Path) -> list[LabeledItem]:
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
            request = openai_wire.parse_request({"model": "default", "input": data["input"],
                                                 "questions": data["questions"]})
            golds = [gold_index(q, data["gold"][q.name]) for q in request.questions]
        except (ValueError, KeyError, TypeError, DecisionError) as e:
            raise ValueError(f"{where}: {e}") from e
        items.append(LabeledItem(request, golds))
    if not items:
        raise ValueError(f"{path}: no labeled items")
    return items


def gold_index(question, value: Any) -> int:
    if question.kind == "yes_no":
        if not isinstance(value, bool):
            raise ValueError(f"gold for predicate {question.name!r} must be true or false")
        return 0 if value else 1
    if question.kind == "choice":
        for i, option in enumerate(question.options):
            if type(option.value) is type(value) and option.value == value:
                return i
        raise ValueError(f"gold {value!r} is not a choice of {question.name!r}")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(question.levels):
        return value
    for i, level in enumerate(question.levels):
        if level.label == value:
            return i
    raise ValueError(f"gold {value!r} is not a level (index or label) of {question.name!r}")


def collect(engine, items: list[LabeledItem], progress: bool = True) -> list[Sample]:
    """Score every item once with every rendering any mode needs."""
    from tqdm import tqdm

    samples = []
    for item in tqdm(items, desc="scoring", unit="item", disable=not progress):
        prepared, evidence = engine.evidence(item.request, order="cyclic", calibrate="contextual")
        for q, variants, gold in zip(prepared.questions, evidence, item.gold):
            samples.append(Sample(q.question.kind, variants, gold))
    return samples


def probabilities(sample: Sample, mode: str, fitted: Fit | None = None) -> list[float]:
    cyclic, contextual = MODES["raw" if mode == "fitted" else mode]
    variants = sample.variants if cyclic else sample.variants[:1]
    if fitted is None:
        return combine(variants, contextual)[0]
    return combine(variants, contextual, fitted.temperature, fitted.bias or None)[0]


def cross_fitted(samples: list[Sample], with_bias: bool = False) -> list[list[float]]:
    """Raw-mode probabilities with a temperature (and bias) per question type fitted on the other half."""
    out: list[list[float] | None] = [None] * len(samples)
    for kind in KINDS:
        index = [i for i, s in enumerate(samples) if s.kind == kind]
        folds = [index[0::2], index[1::2]]
        for k, fold in enumerate(folds):
            other = [samples[i] for i in folds[1 - k]]
            fitted = fit([Sample(s.kind, s.variants[:1], s.gold) for s in other], with_bias=with_bias) if other else Fit()
            for i in fold:
                out[i] = probabilities(samples[i], "fitted", fitted)
    return out  # type: ignore[return-value]


def metrics(pairs: list[tuple[list[float], int]], threshold: float) -> dict[str, float]:
    """Accuracy, log loss, Brier, ECE (10 equal-width bins of the top probability), and how many answers — and how
    accurately — clear ``threshold`` on the top probability."""
    if not pairs:
        return {"n": 0}
    n = len(pairs)
    top = [max(p) for p, _ in pairs]
    right = [max(range(len(p)), key=lambda i: (p[i], -i)) == g for p, g in pairs]
    log_loss = -math.fsum(math.log(max(p[g], 1e-12)) for p, g in pairs) / n
    brier = math.fsum(math.fsum((pi - (i == g)) ** 2 for i, pi in enumerate(p)) for p, g in pairs) / n
    ece = 0.0
    for b in range(BINS):
        members = [k for k, t in enumerate(top) if (b / BINS < t <= (b + 1) / BINS) or (b == 0 and t == 0)]
        if members:
            ece += len(members) / n * abs(sum(right[k] for k in members) / len(members)
                                          - sum(top[k] for k in members) / len(members))
    answered = [k for k, t in enumerate(top) if t >= threshold]
    return {
        "n": n,
        "accuracy": sum(right) / n,
        "log_loss": log_loss,
        "brier": brier,
        "ece": ece,
        "answered": len(answered) / n,
        "answered_accuracy": sum(right[k] for k in answered) / len(answered) if answered else float("nan"),
    }


def evaluate(engine, items: list[LabeledItem], threshold: float = 0.5, with_bias: bool = False,
             progress: bool = True) -> dict[str, Any]:
    samples = collect(engine, items, progress)
    per_mode = {mode: [probabilities(s, mode) for s in samples] for mode in MODES}
    per_mode["fitted"] = cross_fitted(samples, with_bias)
    report: dict[str, Any] = {"model": engine.name, "items": len(items), "questions": len(samples),
                              "threshold": threshold, "modes": {}, "reliability": {}}
    for mode, probs in per_mode.items():
        pairs = list(zip(probs, [s.gold for s in samples]))
        by_kind = {kind: metrics([pr for pr, s in zip(pairs, samples) if s.kind == kind], threshold)
                   for kind in KINDS}
        report["modes"][mode] = {"all": metrics(pairs, threshold), **by_kind}
        report["reliability"][mode] = reliability(pairs)
    return report


def reliability(pairs: list[tuple[list[float], int]]) -> list[dict[str, float]]:
    """Per bin of the top probability: count, mean confidence, accuracy."""
    rows = []
    for b in range(BINS):
        members = [(max(p), max(range(len(p)), key=lambda i: (p[i], -i)) == g) for p, g in pairs
                   if b / BINS < max(p) <= (b + 1) / BINS]
        if members:
            rows.append({"bin": b, "count": len(members), "confidence": sum(c for c, _ in members) / len(members),
                         "accuracy": sum(r for _, r in members) / len(members)})
    return rows


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6), dpi=100)
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfectly calibrated")
    for mode, rows in report["reliability"].items():
        if rows:
            ax.plot([r["confidence"] for r in rows], [r["accuracy"] for r in rows], marker="o",
                    label=f"{mode} (ECE {report['modes'][mode]['all']['ece']:.3f})")
    ax.set_xlabel("top probability (bin mean)")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(f"Reliability: {report['model']}, {report['questions']} questions")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(report: dict[str, Any]) -> str:
    t = report["threshold"]
    lines = [f"| mode | questions | accuracy | log loss | Brier | ECE | answered at p ≥ {t:g} | accuracy when answered |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for scope in ("all", *KINDS):
        for mode in ALL_MODES:
            m = report["modes"][mode][scope]
            if not m.get("n"):
                continue
            label = mode if scope == "all" else f"{mode} — {scope}"
            lines.append(f"| {label} | {m['n']} | {m['accuracy']:.3f} | {m['log_loss']:.3f} | {m['brier']:.3f} | "
                         f"{m['ece']:.3f} | {m['answered']:.2f} | {m['answered_accuracy']:.3f} |")
    return "\n".join(lines)


def calibrate(engine, items: list[LabeledItem], order: str = "given", calibrate_mode: str = "none",
              with_bias: bool = False, progress: bool = True, source: str = "") -> tuple[Profile, dict[str, Any]]:
    """Fit a temperature (and bias) per question type under the given mode; report log loss before and after."""
    samples = collect(engine, items, progress)
    cyclic, contextual = order == "cyclic", calibrate_mode == "contextual"
    profile = Profile(engine.name, PROMPT_FORMAT_VERSION, order, calibrate_mode,
                      data={"file": source, "items": len(items), "questions": len(samples)})
    summary = {}
    for kind in KINDS:
        chosen = [Sample(s.kind, s.variants if cyclic else s.variants[:1], s.gold) for s in samples if s.kind == kind]
        if not chosen:
            continue
        fitted = fit(chosen, contextual, with_bias)
        profile.fits[kind] = fitted
        before = metrics([(combine(s.variants, contextual)[0], s.gold) for s in chosen], 0.5)["log_loss"]
        after = metrics([(combine(s.variants, contextual, fitted.temperature, fitted.bias or None)[0], s.gold)
                         for s in chosen], 0.5)["log_loss"]
        summary[kind] = {"questions": len(chosen), "temperature": fitted.temperature, "bias": fitted.bias,
                         "log_loss_before": before, "log_loss_after": after}
    return profile, summary
