"""Numbers of an answer, computed in float64 from the labels' full-vocabulary log-probabilities.

- ``probabilities``: softmax of the label log-probs divided by the temperature. The vocabulary normaliser
  cancels, so this equals a softmax of the label logits / T.
- ``label_mass``: Σ exp(lp), independent of the temperature.
- ``confidence``: the formulas TypeSafe publishes, as SGLang implements them:
  choice ``clip((n·max p − 1)/(n − 1), 0, 1)``; score ``max(0, 1 − Σ p_i·|i − mode| / U)`` with
  ``U = mean_i |i − (n−1)/2|``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def label_probabilities(logprobs: Sequence[float], temperature: float = 1.0) -> list[float]:
    if not logprobs:
        raise ValueError("no labels to normalise")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError("temperature must be a finite number above 0")
    scaled = [float(lp) / temperature for lp in logprobs]
    top = max(scaled)
    if top == -math.inf:
        # Every label has probability 0 under the model (masked vocabulary): no preference among them.
        return [1.0 / len(scaled)] * len(scaled)
    weights = [math.exp(s - top) for s in scaled]
    total = math.fsum(weights)
    return [w / total for w in weights]


def label_mass(logprobs: Sequence[float]) -> float:
    return min(1.0, math.fsum(math.exp(float(lp)) for lp in logprobs))


def argmax(probabilities: Sequence[float]) -> int:
    return max(range(len(probabilities)), key=lambda i: (probabilities[i], -i))


def choice_confidence(probabilities: Sequence[float]) -> float:
    n = len(probabilities)
    if n <= 1:
        return 1.0
    value = (n * max(probabilities) - 1.0) / (n - 1)
    return min(1.0, max(0.0, value))


def score_confidence(probabilities: Sequence[float]) -> float:
    n = len(probabilities)
    if n <= 1:
        return 1.0
    mode = argmax(probabilities)
    spread = math.fsum(p * abs(i - mode) for i, p in enumerate(probabilities))
    centre = (n - 1) / 2
    unit = math.fsum(abs(i - centre) for i in range(n)) / n
    return max(0.0, min(1.0, 1.0 - spread / unit))


def confidence(kind: str, probabilities: Sequence[float]) -> float | None:
    """An answer's confidence from its probabilities: a choice's or a score's; a predicate has none of its own
    (None: the dialects read its probability)."""
    if kind == "choice":
        return choice_confidence(probabilities)
    if kind == "score":
        return score_confidence(probabilities)
    return None


def expected_level(probabilities: Sequence[float]) -> float:
    return math.fsum(i * p for i, p in enumerate(probabilities))
