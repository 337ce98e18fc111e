"""Answer assembly: the prepared request (each question's renderings, ``Variant``, with the options in the order
shown and the content-free prompts of contextual calibration), and, from what the model said about each rendering,
the question's ``Answer`` (probabilities, confidence, spread across orders) and the request's cached tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .. import probability
from ..canonical import Answer, Question
from .backends.base import Scored
from .calibration import VariantEvidence, combine
from .prompt import EncodedPrompt
from .scheduler import Ticket


@dataclass
class Variant:
    """One rendering of a question: its options in ``order`` (shown position -> original index)."""

    order: list[int]
    labels: list[str]
    prompt: EncodedPrompt
    # Content-free renderings (contextual calibration), by cache key: their label log-probs when cached (taken
    # at preparation, so a cache eviction later cannot lose them), else the prompt still to score.
    priors: dict[str, list[float] | EncodedPrompt] = field(default_factory=dict)


@dataclass
class PreparedQuestion:
    question: Question
    variants: list[Variant]

    @property
    def labels(self) -> list[str]:
        return self.variants[0].labels

    @property
    def prompt(self) -> EncodedPrompt:
        """The prompt with the options in the given order."""
        return self.variants[0].prompt


@dataclass
class Prepared:
    questions: list[PreparedQuestion]
    order: str = "given"
    calibrate: str = "none"


def reorder(question: Question, order: list[int]) -> Question:
    """The question with its options shown in ``order`` (sources kept, so errors still name the right option)."""
    if question.kind != "choice" or order == list(range(len(question.options))):
        return question
    return replace(question, options=tuple(question.options[i] for i in order))


def build_answer(prepared: PreparedQuestion, variants: list[VariantEvidence], contextual: bool, temperature: float,
                 bias: list[float] | None, with_ids: bool) -> Answer:
    question = prepared.question
    probabilities, spread = combine(variants, contextual, temperature, bias)
    given = prepared.variants[0].prompt
    return Answer(
        kind=question.kind,
        name=question.name,
        probabilities=probabilities,
        label_logprobs=list(variants[0].logprobs),
        label_mass=math.fsum(probability.label_mass(v.logprobs) for v in variants) / len(variants),
        confidence=probability.confidence(question.kind, probabilities),
        prompt_tokens=sum(len(v.prompt.ids) for v in prepared.variants),
        prompt_token_ids=list(given.ids) if with_ids else None,
        label_token_ids=list(given.label_ids) if with_ids else None,
        extensions={"order_spread": spread} if len(variants) > 1 else {},
    )


def cached_tokens(job: Ticket, scored: Scored, input_tokens: int) -> int:
    """Prompt tokens the request did not compute: shared tokens of its own prompts (computed once) and prefixes
    reused from the prefix cache, as the backend counted them (at most ``input_tokens``)."""
    if job.joined:  # another request's computation answered this one: nothing was computed for it
        return input_tokens
    scored_tokens = sum(len(p) for p in job.group.prompts)
    return max(0, min(input_tokens, scored_tokens - scored.computed_tokens))
