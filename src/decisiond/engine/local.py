"""The local decision engine: canonical request in, canonical result out, answered by a transformers model."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from .. import probability
from ..canonical import Answer, DecisionRequest, DecisionResult, Question, ScoreRequest, ScoreResult, Usage
from ..errors import invalid, refused
from ..text import render_input
from .model import LoadedModel
from .prompt import (
    MAX_SINGLE_LETTER,
    PROMPT_FORMAT_VERSION,
    ChatPrompter,
    EncodedPrompt,
    check_renderable,
    labels_for,
    render_question,
    text_only_check,
)
from .scheduler import Job, Scheduler
from .scorer import Scorer


@dataclass
class PreparedQuestion:
    question: Question
    labels: list[str]
    prompt: EncodedPrompt


@dataclass
class Prepared:
    questions: list[PreparedQuestion]
    # Tokens every prompt starts with that the scheduler may serve from its prefix cache.
    header: tuple[int, ...]


class LocalEngine:
    """Answers decisions from one loaded chat model. Thread-safe: all model work runs on the scheduler's worker,
    which batches concurrent requests; preparing (templating, tokenizing, label checks) runs in the caller."""

    def __init__(self, loaded: LoadedModel, **scheduling):
        self.loaded = loaded
        self.name = loaded.name
        self.prompter = ChatPrompter(loaded.tokenizer, loaded.context_length)
        self.scorer = Scorer(loaded.model)
        self.scheduler = Scheduler(self.scorer, **scheduling)

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

    def prepare(self, request: DecisionRequest) -> Prepared:
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
        return Prepared(prepared, self.prompter.header_ids(kwargs))

    def _submit(self, prepared: Prepared) -> Job:
        questions = prepared.questions
        return self.scheduler.submit([p.prompt.ids for p in questions], [p.prompt.label_ids for p in questions],
                                     prepared.header)

    @staticmethod
    def _result(request: DecisionRequest, prepared: Prepared, job: Job, logprobs: list[list[float]]) -> DecisionResult:
        temperature = request.temperature or 1.0
        answers = [build_answer(p, lps, temperature, request.return_prompt_token_ids)
                   for p, lps in zip(prepared.questions, logprobs)]
        total = sum(a.prompt_tokens for a in answers)
        return DecisionResult(
            model="",
            answers=answers,
            # Shared tokens are computed once per request and the template header comes from the prefix cache:
            # the rest of the prompt tokens count as cached.
            usage=Usage(input_tokens=total, cached_tokens=max(0, total - job.computed_tokens)),
            prompt_format_version=PROMPT_FORMAT_VERSION,
            provider_format="local",
        )

    def decide(self, request: DecisionRequest) -> DecisionResult:
        prepared = self.prepare(request)
        job = self._submit(prepared)
        result = self._result(request, prepared, job, job.future.result())
        result.model = self.name
        return result

    async def decide_async(self, request: DecisionRequest) -> DecisionResult:
        """Prepare off the event loop, then wait for the scheduler without blocking the loop."""
        prepared = await asyncio.to_thread(self.prepare, request)
        job = self._submit(prepared)
        result = self._result(request, prepared, job, await asyncio.wrap_future(job.future))
        result.model = self.name
        return result

    # -------------------------------------------------------------------------------- raw scoring

    def _score_prompts(self, request: ScoreRequest) -> list[list[int]]:
        vocab = int(self.loaded.model.config.get_text_config().vocab_size)
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
        for labels in request.label_token_ids:
            bad = next((t for t in labels if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"label token id {bad} is outside the vocabulary (0 to {vocab - 1})", "label_token_ids")
        return prompts

    def _score_result(self, request: ScoreRequest, prompts: list[list[int]], logprobs: list[list[float]]) -> ScoreResult:
        if request.apply_softmax:
            scores = [probability.label_probabilities(lps, request.temperature) for lps in logprobs]
        else:
            scores = [[math.exp(lp) for lp in lps] for lps in logprobs]
        return ScoreResult(scores, logprobs, self.name, sum(len(p) for p in prompts))

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Label-token probabilities after given prompts (SGLang's /v1/score), on the same scoring path."""
        prompts = self._score_prompts(request)
        job = self.scheduler.submit(prompts, request.label_token_ids)
        return self._score_result(request, prompts, job.future.result())

    async def score_async(self, request: ScoreRequest) -> ScoreResult:
        prompts = await asyncio.to_thread(self._score_prompts, request)
        job = self.scheduler.submit(prompts, request.label_token_ids)
        return self._score_result(request, prompts, await asyncio.wrap_future(job.future))


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
