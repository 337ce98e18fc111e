"""Everything of a decision but the model's forward passes: the request's checks, its renderings (one per option
order, with the content-free prompts of contextual calibration), the evidence read back from label log-probs, and
the answers assembled from it. The in-process engine (``engine.local``) computes the label log-probs with its
backend; a served model's provider (``gateway.providers.logprobs``) reads them from the server. Both go through this
one class, so that a question is rendered, checked and answered the same way whoever computes its log-probs.

What renders the prompts is a ``Prompter``: ``prompt.ChatPrompter`` (a tokenizer and its chat template: token ids
and label tokens) or ``plain_prompt.PlainPrompter`` (the user message text alone, for a chat server that applies
its own template and whose tokenizer decisiond does not have)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..canonical import Answer, DecisionRequest, Image, Item, Message, Question
from ..errors import invalid, refused
from ..rules import check_temperature
from ..text import render_input
from .assembly import Prepared, PreparedQuestion, Variant, build_answer, reorder
from .bounds import check_fits
from .calibration import CALIBRATIONS, CONTENT_FREE, ORDERS, Profile, VariantEvidence, shifts
from .prefix_cache import Lru
from .prompt import (
    MAX_SINGLE_LETTER,
    PROMPT_FORMAT_VERSION,
    EncodedPrompt,
    check_renderable,
    labels_for,
    render_question,
    text_only_check,
)
from .sandbox import request_deadline

PRIOR_CACHE_ENTRIES = 4096


class Prompter(Protocol):
    """What renders a question's user message into a prompt and finds its label tokens."""

    def template_kwargs(self, request_kwargs: dict[str, Any],
                        source: tuple[str | int, ...] = ("chat_template_kwargs",)) -> dict[str, Any]: ...

    def encode(self, content: str, labels: Sequence[str], kwargs: dict[str, Any],
               source: tuple[str | int, ...] = ()) -> EncodedPrompt: ...

    def one_token_labels(self, content: str, n: int, kwargs: dict[str, Any], question: Question) -> list[str]: ...


@dataclass(frozen=True)
class Scoring:
    """One prompt to score, with the question and rendering it belongs to; ``prior``: a content-free prompt of
    contextual calibration (its input replaced)."""

    prompt: EncodedPrompt
    question: PreparedQuestion
    variant: Variant
    prior: bool


class Decider:
    """Checks, prepares and answers decisions for one model named ``name``, rendering through ``prompter``.

    ``order`` and ``calibrate`` are the model's defaults (a request may override them); ``profile`` holds the mode
    it was fitted under and fitted temperatures and biases per question type (``calibration``): it sets the defaults
    and is refused, with ``ProfileError``, when fitted for another model or prompt format version. ``token_chars``
    bounds the characters of one token (``bounds``; None: no bound). ``reads_images``: the model is sent the
    request's images beside the rendered text (a served vision model); otherwise a request with images is refused."""

    def __init__(self, name: str, prompter: Prompter, context_length: int, token_chars: int | None = None,
                 order: str | None = None, calibrate: str | None = None, profile: Profile | None = None,
                 reads_images: bool = False):
        if profile is not None:
            profile.check(name, PROMPT_FORMAT_VERSION)
            order, calibrate = profile.mode(order, calibrate)
        self.name = name
        self.prompter = prompter
        self.context_length = context_length
        self.token_chars = token_chars
        self.order = order or "given"
        self.calibrate = calibrate or "none"
        self.profile = profile
        self.reads_images = reads_images
        self._priors: Lru[list[float]] = Lru(PRIOR_CACHE_ENTRIES)

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
            raise invalid(f"Unknown parameter: '{name}'. decisiond's engine does not read it.", name,
                          code="unknown_parameter")
        if request.order not in (None, *ORDERS):
            raise invalid(f"order must be one of {', '.join(ORDERS)}", "order")
        if request.calibrate not in (None, *CALIBRATIONS):
            raise invalid(f"calibrate must be one of {', '.join(CALIBRATIONS)}", "calibrate")
        if not self.reads_images:
            text_only_check(request.images(), self.name)
        if not request.questions:
            raise invalid("at least one question is required", "questions", code="empty_array")
        for question in request.questions:
            check_renderable(question)

    def input_text(self, request: DecisionRequest) -> str:
        """The input as the prompt shows it; a model that reads images is sent them apart, so they are left out."""
        items = request.input if not self.reads_images else tuple(_without_images(item) for item in request.input)
        return render_input(items)

    def prepare(self, request: DecisionRequest, order: str | None = None, calibrate: str | None = None) -> Prepared:
        self.check(request)
        order = order or request.order or self.order
        calibrate = calibrate or request.calibrate or self.calibrate
        kwargs = self.prompter.template_kwargs(request.chat_template_kwargs)
        text = self.input_text(request)
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
                    cached = self._priors.get(key)
                    variant.priors[key] = cached if cached is not None else \
                        self.prompter.encode(content, labels, kwargs, question.source)
            variants.append(variant)
        return PreparedQuestion(question, variants)

    # ------------------------------------------------------------------------------------- evidence

    @staticmethod
    def prompts(prepared: Prepared) -> tuple[list[Scoring], list[str]]:
        """What to score for ``prepared``: every variant's prompt in order, then the content-free prompts whose
        priors are not cached yet; and the cache keys of the latter."""
        scorings: list[Scoring] = []
        pending: dict[str, Scoring] = {}
        for q in prepared.questions:
            for v in q.variants:
                scorings.append(Scoring(v.prompt, q, v, False))
                for key, p in v.priors.items():
                    if isinstance(p, EncodedPrompt) and key not in pending:
                        pending[key] = Scoring(p, q, v, True)
        return scorings + list(pending.values()), list(pending)

    def evidence_of(self, prepared: Prepared, pending: list[str],
                    logprobs: Sequence[list[float]]) -> list[list[VariantEvidence]]:
        """What the model said about each rendering, from the label log-probs of ``prompts(prepared)`` in order (the
        priors it scored are cached for later requests)."""
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

    def answers(self, request: DecisionRequest, prepared: Prepared, evidence: list[list[VariantEvidence]],
                features: Sequence[Any] | None = None) -> list[Answer]:
        """Each question's answer from its evidence, through the profile's fit for its type where there is one;
        ``features``: the hidden state at each prompt's answer position, where the model gives it."""
        answers = []
        k = 0  # each question's first prompt: its given order, on the real input
        for q, variants in zip(prepared.questions, evidence):
            fitted = None
            if self.profile:
                fitted = self.profile.for_kind(q.question.kind, prepared.order, prepared.calibrate)
            temperature = request.temperature or (fitted.temperature if fitted else 1.0)
            answer = build_answer(q, variants, prepared.calibrate == "contextual", temperature,
                                  fitted.bias if fitted else None, request.return_prompt_token_ids)
            vector = features[k] if features else None
            answer.features = vector.tolist() if vector is not None and hasattr(vector, "tolist") else vector
            answers.append(answer)
            k += len(q.variants)
        return answers


def _without_images(item: Item) -> Item:
    if isinstance(item, Message) and any(isinstance(p, Image) for p in item.parts):
        return replace(item, parts=tuple(p for p in item.parts if not isinstance(p, Image)))
    return item
