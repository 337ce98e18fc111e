"""How big a request is, and whether it fits: OpenAI's limits (checked for every request whatever answers it, by
``stages.request_limits``), then the target provider's stricter ones (checked by the router for each target), and
the input-token estimate the rate limits and budgets reserve before a call. A request over a limit is refused with
400 ``limit_exceeded`` naming the limit; it is never split. The numbers live in ``decisiond.limits``."""

from __future__ import annotations

import math

from .. import limits as table
from ..canonical import DecisionRequest, Image, Json, Message, ScoreRequest, ToolOutput
from ..dialects.common import check_json_limits
from ..rules import limit_exceeded
from ..text import question_text, render_input
from .chat import ChatRequest
from .settings import Limits


def _provider_limits(wire: table.WireLimits) -> Limits:
    return Limits(max_questions=wire.max_questions, max_choices=wire.max_choices, max_levels=wire.max_levels,
                  max_tokens=wire.max_tokens, max_question_tokens=wire.max_question_tokens)


SYSTEM_ONE = _provider_limits(table.SYSTEM_ONE)
LOCAL = _provider_limits(table.LOCAL)

CHARS_PER_TOKEN = 4  # the estimate used for providers whose tokenizer decisiond does not have


def check_openai(request: DecisionRequest) -> None:
    """OpenAI's upper limits on every request, whatever dialect it came in and whatever answers it: questions,
    choices, images (in the input and in question instructions), and the input_json limits."""
    openai = table.OPENAI
    if openai.max_questions is None or openai.max_choices is None or openai.max_images is None:
        raise TypeError("decisiond.limits.OPENAI must set max_questions, max_choices and max_images")
    if len(request.questions) > openai.max_questions:
        raise limit_exceeded(f"at most {openai.max_questions} questions per request (OpenAI's limit), got "
                             f"{len(request.questions)}", ("questions",))
    for q in request.questions:
        if q.kind == "choice" and len(q.options) > openai.max_choices:
            raise limit_exceeded(f"at most {openai.max_choices} choices per question (OpenAI's limit), got "
                                 f"{len(q.options)}", q.source)
    images = request.images()
    if len(images) > openai.max_images:
        raise limit_exceeded(f"at most {openai.max_images} images per request (OpenAI's limit), got {len(images)}",
                             images[openai.max_images].source)
    for item in request.input:
        for part in item.parts if isinstance(item, (Message, ToolOutput)) else ():
            if isinstance(part, Json):
                check_json_limits(part.data, part.source)


def question_tokens(request: DecisionRequest) -> list[int]:
    """Tokens of each question's prompt (the input counted once per question), at 4 characters a token."""
    def placeholder(image: Image) -> str:
        return "<image>"

    state = len(render_input(request.input, placeholder))
    counts = []
    for q in request.questions:
        chars = state + len(question_text(q, placeholder))
        chars += sum(len(o.name) + len(str(o.description or "")) for o in q.options)
        chars += sum(len(str(lv.label)) + len(str(lv.description or "")) for lv in q.levels)
        counts.append(math.ceil(chars / CHARS_PER_TOKEN))
    return counts


def check_provider(request: DecisionRequest, limits: Limits, provider: str) -> None:
    """The provider's own limits; the message gives the provider's limit."""
    if limits.max_questions is not None and len(request.questions) > limits.max_questions:
        raise limit_exceeded(f"{provider} takes at most {limits.max_questions} questions per request, got "
                             f"{len(request.questions)}", ("questions",))
    for q in request.questions:
        if q.kind == "choice" and limits.max_choices is not None and len(q.options) > limits.max_choices:
            raise limit_exceeded(f"{provider} takes at most {limits.max_choices} choices per question, got "
                                 f"{len(q.options)}", q.options[limits.max_choices].source)
        if q.kind == "score" and limits.max_levels is not None and len(q.levels) > limits.max_levels:
            raise limit_exceeded(f"{provider} takes at most {limits.max_levels} levels per question, got "
                                 f"{len(q.levels)}", q.levels[limits.max_levels].source)
    if limits.max_tokens is None and limits.max_question_tokens is None:
        return
    counts = question_tokens(request)
    if limits.max_question_tokens is not None:
        for q, count in zip(request.questions, counts):
            if count > limits.max_question_tokens:
                raise limit_exceeded(f"{provider} takes at most {limits.max_question_tokens} tokens per question; "
                                     f"this one is about {count}", q.source)
    if limits.max_tokens is not None and sum(counts) > limits.max_tokens:
        raise limit_exceeded(f"{provider} takes at most {limits.max_tokens} tokens per request (the input counts "
                             f"once per question); this one is about {sum(counts)}")


def estimated_tokens(request: DecisionRequest | ScoreRequest | ChatRequest) -> int:
    """A request's input tokens before the call, at 4 characters a token (chat: its prompt text)."""
    if isinstance(request, ChatRequest):
        return math.ceil(sum(len(t) for t in request.texts()) / CHARS_PER_TOKEN)
    if isinstance(request, ScoreRequest):
        return sum(len(p) if isinstance(p, tuple) else math.ceil(len(p) / CHARS_PER_TOKEN) for p in request.prompts)
    return sum(question_tokens(request))
