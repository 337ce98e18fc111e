"""The local decision engine: canonical request in, canonical result out, answered by a transformers model."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from .. import probability
from ..canonical import Answer, DecisionRequest, DecisionResult, Question, ScoreRequest, ScoreResult, Usage
from ..errors import invalid, refused
from .model import LoadedModel
from .prompt import (
    MAX_SINGLE_LETTER,
    PROMPT_FORMAT_VERSION,
    ChatPrompter,
    EncodedPrompt,
    check_renderable,
    labels_for,
    render_input,
    render_question,
    text_only_check,
)
from .scorer import Scorer


@dataclass
class PreparedQuestion:
    question: Question
    labels: list[str]
    prompt: EncodedPrompt


class LocalEngine:
    """Answers decisions from one loaded chat model. Thread-safe: forward passes are serialised."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.name = loaded.name
        self.prompter = ChatPrompter(loaded.tokenizer, loaded.context_length)
        self.scorer = Scorer(loaded.model)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ preparing

    def check(self, request: DecisionRequest) -> None:
        """Refusals that need no tokenizer work."""
        if request.prompt_format_version is not None and request.prompt_format_version != PROMPT_FORMAT_VERSION:
            raise refused(
                f"prompt_format_version {request.prompt_format_version} is not served; this server uses "
                f"version {PROMPT_FORMAT_VERSION}",
                "prompt_format_version",
            )
        temperature = request.temperature
        if temperature is not None and not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise invalid("temperature must be a finite number above 0", "temperature")
        for name in request.extra:
            raise invalid(f"Unknown parameter: '{name}'. The local engine does not read it.", name,
                          code="unknown_parameter")
        text_only_check(request.images(), self.name)
        if not request.questions:
            raise invalid("at least one question is required", "questions", code="empty_array")
        for question in request.questions:
            check_renderable(question)

    def prepare(self, request: DecisionRequest) -> list[PreparedQuestion]:
        self.check(request)
        kwargs = self.prompter.template_kwargs(request.chat_template_kwargs)
        text = render_input(request.input)
        prepared = []
        for question in request.questions:
            labels = labels_for(question)
            content = render_question(text, question, labels)
            if question.kind == "choice" and len(labels) > MAX_SINGLE_LETTER:
                labels = self.prompter.one_token_labels(content, len(labels), kwargs, question)
                content = render_question(text, question, labels)
            prompt = self.prompter.encode(content, labels, kwargs, question.source)
            prepared.append(PreparedQuestion(question, labels, prompt))
        return prepared

    # -------------------------------------------------------------------------------------- scoring

    def decide(self, request: DecisionRequest) -> DecisionResult:
        prepared = self.prepare(request)
        with self._lock:
            logprobs = self.scorer.label_logprobs(
                [p.prompt.ids for p in prepared], [p.prompt.label_ids for p in prepared]
            )
        temperature = request.temperature or 1.0
        answers = [
            build_answer(p, lps, temperature, request.return_prompt_token_ids) for p, lps in zip(prepared, logprobs)
        ]
        return DecisionResult(
            model=self.name,
            answers=answers,
            usage=Usage(input_tokens=sum(a.prompt_tokens for a in answers)),
            prompt_format_version=PROMPT_FORMAT_VERSION,
            provider_format="local",
        )


    # -------------------------------------------------------------------------------- raw scoring

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Label-token probabilities after given prompts (SGLang's /v1/score), on the same scoring path."""
        vocab = int(self.loaded.model.config.vocab_size)
        prompts: list[list[int]] = []
        for i, prompt in enumerate(request.prompts):
            ids = list(self.loaded.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"token id {bad} is outside the vocabulary (0 to {vocab - 1})", "items", i)
            if len(ids) >= self.loaded.context_length:
                raise refused(f"the prompt has {len(ids)} tokens, which does not fit the context length of "
                              f"{self.loaded.context_length} tokens", "items", i, code="context_length_exceeded")
            prompts.append(ids)
        for i, labels in enumerate(request.label_token_ids):
            bad = next((t for t in labels if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"label token id {bad} is outside the vocabulary (0 to {vocab - 1})", "label_token_ids")
        with self._lock:
            logprobs = self.scorer.label_logprobs(prompts, [list(ids) for ids in request.label_token_ids])
        if request.apply_softmax:
            scores = [probability.label_probabilities(lps, request.temperature) for lps in logprobs]
        else:
            scores = [[math.exp(lp) for lp in lps] for lps in logprobs]
        return ScoreResult(scores, logprobs, self.name, sum(len(p) for p in prompts))


def build_answer(prepared: PreparedQuestion, logprobs: list[float], temperature: float, with_ids: bool) -> Answer:
    question = prepared.question
    probabilities = probability.label_probabilities(logprobs, temperature)
    confidence = None
    if question.kind == "choice":
        confidence = probability.choice_confidence(probabilities)
    elif question.kind == "score":
        confidence = probability.score_confidence(probabilities)
    return Answer(
        kind=question.kind,
        name=question.name,
        probabilities=probabilities,
        label_logprobs=list(logprobs),
        label_mass=probability.label_mass(logprobs),
        confidence=confidence,
        prompt_tokens=len(prepared.prompt.ids),
        prompt_token_ids=list(prepared.prompt.ids) if with_ids else None,
        label_token_ids=list(prepared.prompt.label_ids) if with_ids else None,
    )
