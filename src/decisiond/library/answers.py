"""The library's typed answers (``PredicateAnswer``, ``ChoiceAnswer``, ``ScoreAnswer``, ``Refusal``) and
``Decision``, the answers to one request as read from a ``POST /v1/decisions`` response body (OpenAI's shape)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from .. import probability


@dataclass(frozen=True)
class PredicateAnswer:
    """``probability`` is P(yes); ``probabilities`` is ``{True: P(yes), False: P(no)}``."""

    name: str | None
    probability: float
    label_mass: float | None = None

    @property
    def probabilities(self) -> dict[bool, float]:
        return {True: self.probability, False: 1.0 - self.probability}

    @property
    def confidence(self) -> float:
        """The choice confidence of the two answers: 0 at 50/50, 1 when certain."""
        return probability.choice_confidence([self.probability, 1.0 - self.probability])

    @property
    def value(self) -> bool:
        return self.probability >= 0.5


@dataclass(frozen=True)
class ChoiceAnswer:
    """``choice`` is the most probable option; ``probabilities`` maps each option's value to its probability."""

    name: str | None
    choice: str | bool
    probabilities: dict[str | bool, float]
    confidence: float
    label_mass: float | None = None

    @property
    def value(self) -> str | bool:
        return self.choice


@dataclass(frozen=True)
class ScoreAnswer:
    """``score`` is the expected level (0 … n−1); ``level`` the most probable one, ``label`` its label;
    ``probabilities`` maps each level's label to its probability, lowest level first."""

    name: str | None
    score: float
    probabilities: dict[str, float]
    confidence: float
    label_mass: float | None = None

    @property
    def level(self) -> int:
        return probability.argmax(list(self.probabilities.values()))

    @property
    def label(self) -> str:
        return list(self.probabilities)[self.level]

    @property
    def value(self) -> int:
        return self.level


@dataclass(frozen=True)
class Refusal:
    """The model (an upstream provider) did not answer this question."""

    name: str | None
    label_mass: float | None = None

    @property
    def probabilities(self) -> dict[Any, float]:
        return {}

    @property
    def confidence(self) -> float:
        return 0.0

    @property
    def value(self) -> None:
        return None


Answer = Union[PredicateAnswer, ChoiceAnswer, ScoreAnswer, Refusal]


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    """The answers to one request, in question order; ``decision["name"]`` or ``decision[0]`` picks one."""

    answers: list[Answer]
    model: str
    usage: Usage = field(default_factory=Usage)
    # Wall time of the call as the caller saw it.
    latency_s: float = 0.0

    def __getitem__(self, key: str | int) -> Answer:
        if isinstance(key, int):
            return self.answers[key]
        for answer in self.answers:
            if answer.name == key:
                return answer
        raise KeyError(key)

    @classmethod
    def from_response(cls, body: Mapping[str, Any], latency_s: float = 0.0) -> "Decision":
        """From a ``POST /v1/decisions`` response body (OpenAI's shape)."""
        usage = body.get("usage") or {}
        return cls([_answer(a) for a in body["answers"]], str(body.get("model", "")), Usage(
            input_tokens=int(usage.get("input_tokens", 0)),
            cached_tokens=int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0)),
            output_tokens=int(usage.get("output_tokens", 0)),
            total_tokens=int(usage.get("total_tokens", 0))), latency_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what ``decisiond batch`` writes per line."""
        out = []
        for a in self.answers:
            row: dict[str, Any] = {"name": a.name, "type": type(a).__name__.removesuffix("Answer").lower(),
                                   "confidence": a.confidence, "label_mass": a.label_mass}
            if isinstance(a, PredicateAnswer):
                row["probability"] = a.probability
            elif isinstance(a, ChoiceAnswer):
                row.update(choice=a.choice, probabilities=[{"value": v, "probability": p}
                                                           for v, p in a.probabilities.items()])
            elif isinstance(a, ScoreAnswer):
                row.update(score=a.score, label=a.label, probabilities=[{"label": k, "probability": p}
                                                                        for k, p in a.probabilities.items()])
            out.append(row)
        return {"model": self.model, "answers": out, "usage": {"input_tokens": self.usage.input_tokens,
                                                               "total_tokens": self.usage.total_tokens},
                "latency_s": round(self.latency_s, 6)}


def _answer(raw: Mapping[str, Any]) -> Answer:
    kind, name, mass = raw.get("type"), raw.get("name"), raw.get("label_mass")
    if kind == "predicate":
        return PredicateAnswer(name, float(raw["probability"]), mass)
    if kind == "choice":
        return ChoiceAnswer(name, raw["choice"], {p["value"]: float(p["probability"]) for p in raw["probabilities"]},
                            float(raw["confidence"]), mass)
    if kind == "score":
        return ScoreAnswer(name, float(raw["score"]), {str(p["label"]): float(p["probability"])
                                                       for p in raw["probabilities"]}, float(raw["confidence"]), mass)
    return Refusal(name, mass)
