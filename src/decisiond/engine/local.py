"""The local decision engine: canonical request in, canonical result out.

The checks, renderings, evidence and answers are the ``Decider``'s (``decider``: prompt wording and chat templating,
label checks, order and calibration modes, answer assembly), shared with served models; this module adds batching
across requests (``scheduler``) over a ``Backend`` that computes label log-probs (``backend``; by default the
transformers backend on the loaded model). The path, top to bottom: check and prepare a request, submit its prompts,
read the evidence, assemble the result; then raw scoring (SGLang's /v1/score) on the same scheduler."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .. import probability, tracing
from ..canonical import DecisionRequest, DecisionResult, ScoreRequest, ScoreResult, Usage
from ..errors import invalid, refused
from ..limits import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUED_TOKENS, DEFAULT_MAX_REQUEST_TOKENS
from .assembly import Prepared, cached_tokens
from .backends.base import Backend, Scored
from .backends.transformers import TransformersBackend
from .bounds import check_fits, max_token_chars
from .calibration import Profile, VariantEvidence
from .decider import Decider
from .model import LoadedModel
from .prompt import PROMPT_FORMAT_VERSION, ChatPrompter
from .scheduler import DEFAULT_MAX_WAIT_S, Scheduler, Ticket

T = TypeVar("T")


class LocalEngine(Decider):
    """Answers decisions from one loaded chat model. Thread-safe: all model work runs on the scheduler's worker,
    which batches concurrent requests; preparing (templating, tokenizing, label checks: ``Decider``) runs in the
    caller, which for the ``*_async`` methods is a thread off the event loop.

    ``order``, ``calibrate`` and ``profile``: the model's defaults and fits (see ``Decider``). ``backend`` computes
    label log-probs (the transformers backend on ``loaded.model`` by default, with ``max_batch_tokens`` and
    ``prefix_cache_mb``). ``max_request_tokens`` and ``max_queued_tokens`` are the scheduler's admission limits;
    ``allow_templates`` lets a request's ``chat_template_kwargs`` replace the chat template (rendered in a bounded
    child process)."""

    prompter: ChatPrompter

    def __init__(self, loaded: LoadedModel, order: str | None = None, calibrate: str | None = None,
                 profile: Profile | None = None, backend: Backend | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 prefix_cache_mb: float | None = None, max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
                 max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS, allow_templates: bool = False):
        self.prompter = ChatPrompter(loaded.tokenizer, loaded.context_length, allow_templates)
        super().__init__(loaded.name, self.prompter, loaded.context_length, max_token_chars(loaded.tokenizer), order,
                         calibrate, profile)
        self.loaded = loaded
        self.release_date = loaded.release_date
        self.tokenizer = loaded.tokenizer
        self.backend: Backend = backend or TransformersBackend(
            loaded.model, loaded.name, max_batch_tokens,
            None if prefix_cache_mb is None else int(prefix_cache_mb * 2**20),
            f"{loaded.name} ({loaded.parameters / 1e6:.0f}M parameters, {loaded.dtype}, {loaded.device}) answering "
            "decisions locally")
        self.scheduler = Scheduler(self.backend, max_batch_tokens, max_wait_s, max_request_tokens, max_queued_tokens)

    @property
    def scorer(self) -> Backend:
        """The backend (its old name)."""
        return self.backend

    def describe(self) -> str:
        return self.backend.describe()

    # -------------------------------------------------------------------------------------- scoring

    def _submit(self, prepared: Prepared) -> tuple[Ticket, list[str]]:
        """One job: every variant's prompt, then the content-free prompts whose priors are not cached yet."""
        scorings, pending = self.prompts(prepared)
        return self.scheduler.submit([s.prompt.ids for s in scorings], [s.prompt.label_ids for s in scorings]), pending

    def _prepare_and_submit(self, request: DecisionRequest, order: str | None = None,
                            calibrate: str | None = None) -> tuple[Prepared, Ticket, list[str]]:
        prepared = self.prepare(request, order, calibrate)
        return (prepared, *self._submit(prepared))

    def evidence(self, request: DecisionRequest, order: str | None = None,
                 calibrate: str | None = None) -> tuple[Prepared, list[list[VariantEvidence]]]:
        """What the model says about each rendering of each question (also for eval and calibrate)."""
        prepared, job, pending = self._prepare_and_submit(request, order, calibrate)
        return prepared, self.evidence_of(prepared, pending, job.future.result().logprobs)

    def _result(self, request: DecisionRequest, prepared: Prepared, job: Ticket, pending: list[str],
                scored: Scored) -> DecisionResult:
        evidence = self.evidence_of(prepared, pending, scored.logprobs)
        answers = self.answers(request, prepared, evidence, scored.features)
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
        return self._result(request, prepared, job, pending, job.future.result())

    async def decide_async(self, request: DecisionRequest) -> DecisionResult:
        """Prepare and submit off the event loop, then wait for the scheduler without blocking the loop."""
        prepared, job, pending = await _off_loop(self._prepare_and_submit, request)
        scored = await asyncio.wrap_future(job.future)
        _traced(job)
        return self._result(request, prepared, job, pending, scored)

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
    offset = tracing.wall_offset_ns()  # one for both: the queue ends exactly where the run begins
    tracer.past("engine queue", ticket.submitted, began, {tracing.ENGINE_JOINED: ticket.joined}, offset)
    tracer.past("engine forward", began, run.finished, {
        tracing.ENGINE_PASSES: run.passes, tracing.ENGINE_RUN_REQUESTS: len(run.jobs),
        tracing.ENGINE_RUN_TOKENS: run.size, tracing.ENGINE_TOKENS: ticket.job.size}, offset)


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
