"""Request limits: OpenAI's, checked for every request whatever answers it, then the target provider's stricter
ones. A request over a limit is refused with 400 ``limit_exceeded`` naming the limit; it is never split."""

from __future__ import annotations

import math

from ..canonical import DecisionRequest, Image, Json, Message, ToolOutput
from ..dialects.common import check_json_limits
from ..errors import DecisionError
from ..text import question_text, render_input
from .config import Limits

OPENAI_MAX_QUESTIONS = 400
OPENAI_MAX_CHOICES = 255
OPENAI_MAX_IMAGES = 128

# TypeSafe's published limits, which System One servers (Jev, Kev, OpenRouter's decision models, SGLang's and
# decisiond's /v1/systemone) share.
SYSTEM_ONE = Limits(max_choices=255, max_levels=10, max_tokens=64 * 1024, max_question_tokens=32 * 1024)
# The local engine labels levels 0-9.
LOCAL = Limits(max_levels=10)

CHARS_PER_TOKEN = 4  # the estimate used for providers whose tokenizer decisiond does not have


def limit_exceeded(message: str, path: tuple = ()) -> DecisionError:
    return DecisionError(message, path, code="limit_exceeded")


def check_openai(request: DecisionRequest) -> None:
    """OpenAI's upper limits: 400 questions, 255 choices, 128 images, and the input_json size limits."""
    if len(request.questions) > OPENAI_MAX_QUESTIONS:
        raise limit_exceeded(f"at most {OPENAI_MAX_QUESTIONS} questions per request (OpenAI's limit), got "
                             f"{len(request.questions)}", ("questions",))
    for q in request.questions:
        if q.kind == "choice" and len(q.options) > OPENAI_MAX_CHOICES:
            raise limit_exceeded(f"at most {OPENAI_MAX_CHOICES} choices per question (OpenAI's limit), got "
                                 f"{len(q.options)}", q.source)
    images = request.images()
    if len(images) > OPENAI_MAX_IMAGES:
        raise limit_exceeded(f"at most {OPENAI_MAX_IMAGES} images per request (OpenAI's limit), got {len(images)}",
                             images[OPENAI_MAX_IMAGES].source)
    for item in request.input:
        for part in item.parts if isinstance(item, (Message, ToolOutput)) else ():
            if isinstance(part, Json):
                check_json_limits(part.data, part.source)


def estimated_tokens(request: DecisionRequest) -> list[int]:
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
    counts = estimated_tokens(request)
    if limits.max_question_tokens is not None:
        for q, count in zip(request.questions, counts):
            if count > limits.max_question_tokens:
                raise limit_exceeded(f"{provider} takes at most {limits.max_question_tokens} tokens per question; "
                                     f"this one is about {count}", q.source)
    if limits.max_tokens is not None and sum(counts) > limits.max_tokens:
        raise limit_exceeded(f"{provider} takes at most {limits.max_tokens} tokens per request (the input counts "
                             f"once per question); this one is about {sum(counts)}")
