"""The local decision engine: canonical request in, canonical result out.

This is the backend-neutral part — prompt wording and chat templating (``prompt``), label checks, order and
calibration modes (``calibration``), batching across requests (``scheduler``), answer assembly (``answers``) — over
a ``Backend`` that computes label log-probs (``backend``; by default the transformers backend on the loaded model).
The path, top to bottom: check and prepare a request, submit its prompts, read the evidence, assemble the result;
then raw scoring (SGLang's /v1/score) on the same scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .. import probability, tracing
from ..canonical import DecisionRequest, DecisionResult, Question, ScoreRequest, ScoreResult, Usage
from ..errors import invalid, refused
from ..limits import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUED_TOKENS, DEFAULT_MAX_REQUEST_TOKENS
from ..rules import check_temperature
from ..text import render_input
from .assembly import Prepared, PreparedQuestion, Variant, build_answer, cached_tokens, reorder
from .backends.base import Backend, Scored
from .backends.transformers import TransformersBackend
from .bounds import check_fits, max_token_chars
from .calibration import CALIBRATIONS, CONTENT_FREE, ORDERS, Profile, VariantEvidence, shifts
from .model import LoadedModel
from .prefix_cache import Lru
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
from .sandbox import request_deadline
from .scheduler import DEFAULT_MAX_WAIT_S, Scheduler, Ticket

T = TypeVar("T")

PRIOR_CACHE_ENTRIES = 4096


class LocalEngine:
    """Answers decisions from one loaded chat model. Thread-safe: all model work runs on the scheduler's worker,
    which batches concurrent requests; preparing (templating, tokenizing, label checks) runs in the caller, which
    for the ``*_async`` methods is a thread off the event loop.

    ``order`` and ``calibrate`` are this model's defaults (a request may override them); ``profile`` holds the
    mode it was fitted under and fitted temperatures and biases per question type (see ``calibration``): it sets
    the defaults (an explicit ``order``/``calibrate`` may only repeat them) and is refused, with ``ProfileError``,
    when fitted for another model or prompt format version. ``backend`` computes label log-probs (the
    transformers backend on ``loaded.model`` by default, with ``max_batch_tokens`` and ``prefix_cache_mb``).
    ``max_request_tokens`` and ``max_queued_tokens`` are the scheduler's admission limits; ``allow_templates`` lets
    a request's ``chat_template_kwargs`` replace the chat template (rendered in a bounded child process)."""

    def __init__(self, loaded: LoadedModel, order: str | None = None, calibrate: str | None = None,
                 profile: Profile | None = None, backend: Backend | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 prefix_cache_mb: float | None = None, max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
                 max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS, allow_templates: bool = False):
        self.loaded = loaded
        self.name = loaded.name
        self.release_date = loaded.release_date
        self.tokenizer = loaded.tokenizer
        self.context_length = loaded.context_length
        self.token_chars = max_token_chars(loaded.tokenizer)  # None: the tokenizer gives no bound
        if profile is not None:
            profile.check(self.name, PROMPT_FORMAT_VERSION)
            order, calibrate = profile.mode(order, calibrate)
        self.order = order or "given"
        self.calibrate = calibrate or "none"
        self.profile = profile
        self.prompter = ChatPrompter(loaded.tokenizer, loaded.context_length, allow_templates)
        self.backend: Backend = backend or TransformersBackend(
            loaded.model, loaded.name, max_batch_tokens,
            None if prefix_cache_mb is None else int(prefix_cache_mb * 2**20),
            f"{loaded.name} ({loaded.parameters / 1e6:.0f}M parameters, {loaded.dtype}, {loaded.device}) answering "
            "decisions locally")
        self.scheduler = Scheduler(self.backend, max_batch_tokens, max_wait_s, max_request_tokens, max_queued_tokens)
        self._priors: Lru[list[float]] = Lru(PRIOR_CACHE_ENTRIES)

    @property
    def scorer(self) -> Backend:
        """The backend (its old name)."""
        return self.backend

    def describe(self) -> str:
        return self.backend.describe()

    # ------------------------------------------------------------------------------------ preparing

    def check(self, request: DecisionRequest) -> None:
        """Refusals that need no tokenizer work."""
        if request.prompt_format_version is not None and request.prompt_format_version != PROMPT_FORMAT_VERSION:
            raise refused(
                f"prompt_format_version {request.prompt_format_version} is not served; this server uses "
                f"version {PROMPT_FORMAT_VERSION}",
                "prompt_format_version",
            )
        check_temperature(request.temperature)
        for name in request.extra:
            raise invalid(f"Unknown parameter: '{name}'. The local engine does not read it.", name,
                          code="unknown_parameter")
        if request.order not in (None, *ORDERS):
            raise invalid(f"order must be one of {', '.join(ORDERS)}", "order")
        if request.calibrate not in (None, *CALIBRATIONS):
            raise invalid(f"calibrate must be one of {', '.join(CALIBRATIONS)}", "calibrate")
        text_only_check(request.images(), self.name)
        if not request.questions:
            raise invalid("at least one question is required", "questions", code="empty_array")
        for question in request.questions:
            check_renderable(question)

    def prepare(self, request: DecisionRequest, order: str | None = None, calibrate: str | None = None) -> Prepared:
        self.check(request)
        order = order or request.order or self.order
        calibrate = calibrate or request.calibrate or self.calibrate
        kwargs = self.prompter.template_kwargs(request.chat_template_kwargs)
        text = render_input(request.input)
        check_fits(text, self.token_chars, self.context_length, "input")
        # A template the request brought renders in child processes, under one time budget for the request.
        with request_deadline() if "chat_template" in kwargs else contextlib.nullcontext():
            prepared = [self._prepare_question(text, question, order, calibrate, kwargs)
                        for question in request.questions]
        return Prepared(prepared, order, calibrate)

    def _prepare_question(self, text: str, question: Question, order: str, calibrate: str,
                          kwargs: dict[str, Any]) -> PreparedQuestion:
        """The question's renderings: one per option order, each with its content-free priors when calibrating."""
        labels = labels_for(question)
        if question.kind == "choice" and len(labels) > MAX_SINGLE_LETTER:
            content = render_question(text, question, labels)
            labels = self.prompter.one_token_labels(content, len(labels), kwargs, question)
        kwargs_key = json.dumps(kwargs, sort_keys=True, default=str)
        variants = []
        for perm in shifts(question.candidates, order == "cyclic" and question.kind == "choice"):
            shown = reorder(question, perm)
            prompt = self.prompter.encode(render_question(text, shown, labels), labels, kwargs, question.source)
            variant = Variant(perm, labels, prompt)
            if calibrate == "contextual":
                for free in CONTENT_FREE:
                    content = render_question(free, shown, labels)
                    key = kwargs_key + "\x00" + content
                    cached = self._prior(key)
                    variant.priors[key] = cached if cached is not None else \
                        self.prompter.encode(content, labels, kwargs, question.source)
            variants.append(variant)
        return PreparedQuestion(question, variants)

    def _prior(self, key: str) -> list[float] | None:
        return self._priors.get(key)

    # -------------------------------------------------------------------------------------- scoring

    def _submit(self, prepared: Prepared) -> tuple[Ticket, list[str]]:
        """One job: every variant's prompt, then the content-free prompts whose priors are not cached yet."""
        prompts, labels = [], []
        pending: dict[str, EncodedPrompt] = {}
        for q in prepared.questions:
            for v in q.variants:
                prompts.append(v.prompt.ids)
                labels.append(v.prompt.label_ids)
                pending.update((k, p) for k, p in v.priors.items() if isinstance(p, EncodedPrompt))
        for prompt in pending.values():
            prompts.append(prompt.ids)
            labels.append(prompt.label_ids)
        return self.scheduler.submit(prompts, labels), list(pending)

    def _prepare_and_submit(self, request: DecisionRequest, order: str | None = None,
                            calibrate: str | None = None) -> tuple[Prepared, Ticket, list[str]]:
        prepared = self.prepare(request, order, calibrate)
        return (prepared, *self._submit(prepared))

    def _evidence(self, prepared: Prepared, pending: list[str],
                  logprobs: list[list[float]]) -> list[list[VariantEvidence]]:
        count = sum(len(q.variants) for q in prepared.questions)
        scored = dict(zip(pending, logprobs[count:]))
        for key, lps in scored.items():
            self._priors.put(key, lps)
        out, k = [], 0
        for q in prepared.questions:
            evidence = []
            for v in q.variants:
                priors = [scored[key] if isinstance(p, EncodedPrompt) else p for key, p in v.priors.items()]
                evidence.append(VariantEvidence(v.order, logprobs[k], priors or None))
                k += 1
            out.append(evidence)
        return out

    def evidence(self, request: DecisionRequest, order: str | None = None,
                 calibrate: str | None = None) -> tuple[Prepared, list[list[VariantEvidence]]]:
        """What the model says about each rendering of each question (also for eval and calibrate)."""
        prepared, job, pending = self._prepare_and_submit(request, order, calibrate)
        return prepared, self._evidence(prepared, pending, job.future.result().logprobs)

    def _result(self, request: DecisionRequest, prepared: Prepared, evidence: list[list[VariantEvidence]],
                job: Ticket, scored: Scored) -> DecisionResult:
        answers = []
        k = 0  # each question's first prompt: its given order, on the real input
        for q, variants in zip(prepared.questions, evidence):
            fitted = None
            if self.profile:
                fitted = self.profile.for_kind(q.question.kind, prepared.order, prepared.calibrate)
            temperature = request.temperature or (fitted.temperature if fitted else 1.0)
            answer = build_answer(q, variants, prepared.calibrate == "contextual", temperature,
                                  fitted.bias if fitted else None, request.return_prompt_token_ids)
            vector = scored.features[k] if scored.features else None
            answer.features = vector.tolist() if vector is not None and hasattr(vector, "tolist") else vector
            answers.append(answer)
            k += len(q.variants)
        total = sum(a.prompt_tokens for a in answers)
        return DecisionResult(
            model=self.name,
            answers=answers,
            usage=Usage(input_tokens=total, cached_tokens=cached_tokens(job, scored, total)),
            prompt_format_version=PROMPT_FORMAT_VERSION,
            provider_format="local",
        )

    def decide(self, request: DecisionRequest) -> DecisionResult:
        prepared, job, pending = self._prepare_and_submit(request)
        scored = job.future.result()
        return self._result(request, prepared, self._evidence(prepared, pending, scored.logprobs), job, scored)

    async def decide_async(self, request: DecisionRequest) -> DecisionResult:
        """Prepare and submit off the event loop, then wait for the scheduler without blocking the loop."""
        prepared, job, pending = await _off_loop(self._prepare_and_submit, request)
        scored = await asyncio.wrap_future(job.future)
        _traced(job)
        return self._result(request, prepared, self._evidence(prepared, pending, scored.logprobs), job, scored)

    # -------------------------------------------------------------------------------- raw scoring

    def _score_prompts(self, request: ScoreRequest) -> list[list[int]]:
        vocab = self.backend.vocab_size
        prompts: list[list[int]] = []
        for i, prompt in enumerate(request.prompts):
            if isinstance(prompt, str):
                check_fits(prompt, self.token_chars, self.context_length, "items", i)
            ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"token id {bad} is outside the vocabulary (0 to {vocab - 1})", "items", i)
            if not ids:
                raise invalid("a prompt must have at least one token", "items", i)
            if len(ids) >= self.context_length:
                raise refused(f"the prompt has {len(ids)} tokens, which does not fit the context length of "
                              f"{self.context_length} tokens", "items", i, code="context_length_exceeded")
            prompts.append(ids)
        for labels in request.label_token_ids:
            bad = next((t for t in labels if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"label token id {bad} is outside the vocabulary (0 to {vocab - 1})", "label_token_ids")
        return prompts

    def _score_submit(self, request: ScoreRequest) -> tuple[list[list[int]], Ticket]:
        prompts = self._score_prompts(request)
        return prompts, self.scheduler.submit(prompts, request.label_token_ids)

    def _score_result(self, request: ScoreRequest, prompts: list[list[int]],
                      logprobs: list[list[float]]) -> ScoreResult:
        if request.apply_softmax:
            scores = [probability.label_probabilities(lps, request.temperature) for lps in logprobs]
        else:
            scores = [[math.exp(lp) for lp in lps] for lps in logprobs]
        return ScoreResult(scores, logprobs, self.name, sum(len(p) for p in prompts))

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Label-token probabilities after given prompts (SGLang's /v1/score), on the same scoring path."""
        prompts, job = self._score_submit(request)
        return self._score_result(request, prompts, job.future.result().logprobs)

    async def score_async(self, request: ScoreRequest) -> ScoreResult:
        prompts, job = await _off_loop(self._score_submit, request)
        scored = await asyncio.wrap_future(job.future)
        _traced(job)
        return self._score_result(request, prompts, scored.logprobs)


def _traced(ticket: Ticket) -> None:
    """When this request is traced: its wait for the model's worker (``engine queue``) and the run of forward
    passes that answered it (``engine forward``, with the run's size), two spans timed on the worker."""
    tracer = tracing.recording()
    run = ticket.job.run
    if tracer is None or run is None or run.finished is None:
        return
    began = max(ticket.submitted, run.started)
    tracer.past("engine queue", ticket.submitted, began, {tracing.ENGINE_JOINED: ticket.joined})
    tracer.past("engine forward", began, run.finished, {
        tracing.ENGINE_PASSES: run.passes, tracing.ENGINE_RUN_REQUESTS: len(run.jobs),
        tracing.ENGINE_RUN_TOKENS: run.size, tracing.ENGINE_TOKENS: ticket.job.size})


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread; if the caller is cancelled meanwhile, the ticket it submitted is cancelled too, so
    a request abandoned while being prepared is not computed."""
    abandoned = threading.Event()

    def run() -> T:
        value = fn(*args)
        if abandoned.is_set():
            _cancel_tickets(value)
        return value

    task = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        abandoned.set()
        task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else _cancel_tickets(t.result()))
        raise


def _cancel_tickets(value: Any) -> None:
    for item in value if isinstance(value, tuple) else ():
        if isinstance(item, Ticket):
            item.future.cancel()
