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
- **fitted** temperature (and optionally a per-position bias) per question type, fitted by ``decisiond
  calibrate`` to minimise log loss on labeled data: ``softmax((z + bias) / T)``.

``label_mass`` stays the raw full-vocabulary mass; ``confidence`` is computed from the final probabilities.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import probability

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
    assert variant.priors
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


@dataclass
class Fit:
    temperature: float = 1.0
    bias: list[float] = field(default_factory=list)


@dataclass
class Sample:
    kind: str
    variants: list[VariantEvidence]
    gold: int  # original candidate index


def fit(samples: list[Sample], contextual: bool = False, with_bias: bool = False, steps: int = 200) -> Fit:
    """Temperature (and per-position bias) minimising log loss over ``samples`` (one question type)."""
    import torch

    if not samples:
        return Fit()
    width = max(len(s.variants[0].order) for s in samples)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(width, dtype=torch.float64, requires_grad=with_bias)
    prepared = []
    for s in samples:
        zs = torch.tensor([logits(v, contextual) for v in s.variants], dtype=torch.float64)
        back = torch.tensor([v.order.index(s.gold) for v in s.variants])  # where the gold option was shown
        prepared.append((zs, back))
    params = [log_t] + ([bias] if with_bias else [])
    optimiser = torch.optim.LBFGS(params, lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def loss_fn():
        optimiser.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for zs, back in prepared:
            n = zs.shape[1]
            probs = torch.softmax((zs + bias[:n]) / log_t.exp(), dim=-1)  # variants × shown positions
            p_gold = probs[torch.arange(len(back)), back].mean()
            total = total - torch.log(p_gold.clamp_min(1e-300))
        total = total / len(prepared) + (1e-3 * (bias ** 2).sum() if with_bias else 0.0)
        total.backward()
        return total

    optimiser.step(loss_fn)
    t = float(log_t.detach().exp())
    if not math.isfinite(t) or t <= 0:
        t = 1.0
    return Fit(temperature=t, bias=[float(b) for b in bias.detach()] if with_bias else [])


# ------------------------------------------------------------------------------------------- profile


@dataclass
class Profile:
    """A calibration profile: fitted corrections per question type, for one model and prompt format."""

    model: str
    prompt_format_version: int
    order: str = "given"
    calibrate: str = "none"
    fits: dict[str, Fit] = field(default_factory=dict)
    data: dict = field(default_factory=dict)

    def for_kind(self, kind: str) -> Fit | None:
        return self.fits.get(kind)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        data = json.loads(Path(path).read_text())
        fits = {kind: Fit(**f) for kind, f in data.pop("fits", {}).items()}
        return cls(fits=fits, **data)
