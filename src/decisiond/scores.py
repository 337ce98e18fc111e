"""How good answers were, against the labels: accuracy, log loss, Brier score, expected calibration error and the
reliability diagram's bins. Pure: what ``decisiond eval`` reports (``evaluation``) and what the gateway measures of
its stored decisions (``gateway.decisions``) are computed here, one way.

A pair is (the answer's probabilities, the index of the label among them). The bins are ``bins`` equal-width bins
of the top probability, (b/bins, (b+1)/bins], 0 in the first.
"""

from __future__ import annotations

import math

# The bins of ``decisiond eval``'s reports.
BINS = 10


def predicted(p: list[float]) -> int:
    """The answer: the most probable option, the first on ties."""
    return max(range(len(p)), key=lambda i: (p[i], -i))


def bin_of(top: float, bins: int = BINS) -> int:
    """The reliability bin of a top probability."""
    return min(bins - 1, max(0, math.ceil(top * bins) - 1))


def metrics(pairs: list[tuple[list[float], int]], threshold: float = 0.5, coverage: float = 0.5,
            bins: int = BINS) -> dict[str, float]:
    """Accuracy, log loss, Brier, ECE (``bins`` bins), how many answers — and how accurately — clear
    ``threshold`` on the top probability, and the accuracy of the ``coverage`` share of answers the model is most
    confident about (ceil(coverage · n) of them; ties in the order given)."""
    if not pairs:
        return {"n": 0}
    n = len(pairs)
    top = [max(p) for p, _ in pairs]
    right = [predicted(p) == g for p, g in pairs]
    log_loss = -math.fsum(math.log(max(p[g], 1e-12)) for p, g in pairs) / n
    brier = math.fsum(math.fsum((pi - (i == g)) ** 2 for i, pi in enumerate(p)) for p, g in pairs) / n
    gap = [0.0] * bins
    for t, r in zip(top, right):
        gap[bin_of(t, bins)] += r - t
    answered = [k for k, t in enumerate(top) if t >= threshold]
    confident = sorted(range(n), key=lambda k: -top[k])[: max(1, math.ceil(coverage * n))]
    return {
        "n": n,
        "accuracy": sum(right) / n,
        "log_loss": log_loss,
        "brier": brier,
        "ece": math.fsum(abs(g) for g in gap) / n,
        "answered": len(answered) / n,
        "answered_accuracy": sum(right[k] for k in answered) / len(answered) if answered else float("nan"),
        "coverage_accuracy": sum(right[k] for k in confident) / len(confident),
    }


def reliability(pairs: list[tuple[list[float], int]], bins: int = BINS) -> list[dict[str, float]]:
    """Per non-empty bin of the top probability: count, mean confidence, accuracy."""
    members: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for p, g in pairs:
        members[bin_of(max(p), bins)].append((max(p), predicted(p) == g))
    return [{"bin": b, "count": len(m), "confidence": sum(c for c, _ in m) / len(m),
             "accuracy": sum(r for _, r in m) / len(m)} for b, m in enumerate(members) if m]
