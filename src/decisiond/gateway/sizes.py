"""How big a request is, and whether it fits: OpenAI's limits (checked for every request whatever answers it, by
``stages.request_limits``), then the target provider's stricter ones (checked by the router for each target), and
the input-token estimate the rate limits and budgets reserve before a call. A request over a limit is refused with
400 ``limit_exceeded`` naming the limit; it is never split. The numbers live in ``decisiond.limits``."""

from __future__ import annotations

import json
import math
import weakref

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


def _placeholder(image: Image) -> str:
    return "<image>"


# ``_question_sizes`` of the requests alive, by identity (a request is measured by the rate limits, the budgets and
# the router in turn; a request object never changes): (a weak reference to it, its sizes).
_measured: dict[int, tuple[weakref.ref[DecisionRequest], list[tuple[int, int]]]] = {}


def _question_sizes(request: DecisionRequest) -> list[tuple[int, int]]:
    """Each question's prompt text — the input (once per question), the instructions, the options or levels — as
    (characters, UTF-8 bytes), measured without copying the input once per question (a 10 MB input asked 400
    questions would be 4 GB of copies), and once per request object."""
    known = _measured.get(id(request))
    if known is not None and known[0]() is request:
        return known[1]
    sizes = _measure(request)
    key = id(request)
    _measured[key] = (weakref.ref(request, lambda _, key=key: _measured.pop(key, None)), sizes)  # type: ignore[misc]
    return sizes


def _measure(request: DecisionRequest) -> list[tuple[int, int]]:
    state = render_input(request.input, _placeholder)
    chars, size = len(state), _bytes(state)
    sizes = []
    for q in request.questions:
        parts = [question_text(q, _placeholder)]
        parts += [o.name + str(o.description or "") for o in q.options]
        parts += [str(lv.label) + str(lv.description or "") for lv in q.levels]
        rest = "".join(parts)
        sizes.append((chars + len(rest), size + _bytes(rest)))
    return sizes


def question_tokens(request: DecisionRequest) -> list[int]:
    """Tokens of each question's prompt (the input counted once per question), at 4 characters a token: the
    estimate providers' limits are checked with (the way TypeSafe publishes them)."""
    return [math.ceil(chars / CHARS_PER_TOKEN) for chars, _ in _question_sizes(request)]


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


# The worst case a request can cost, for budget reservations (``stages.budget``). Input tokens are bounded by bytes:
# a byte-level BPE token spans at least one byte of UTF-8 text, so no tokenizer counts more tokens than bytes, plus
# the special tokens a chat template wraps each message or question in (PROMPT_OVERHEAD_TOKENS) and an image's
# tokens (IMAGE_TOKENS, above what OpenAI bills for a 2048x2048 image at high detail). A local model counts exactly
# (``Provider.input_tokens``).
PROMPT_OVERHEAD_TOKENS = 32
IMAGE_TOKENS = 2_000
# Output a decision answer may bill, per question (System One and local answers report a few tokens a question).
DECISION_OUTPUT_TOKENS = 16
_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def max_input_tokens(request: DecisionRequest | ScoreRequest | ChatRequest) -> int:
    """No tokenizer counts more input tokens than this for ``request`` (see above)."""
    if isinstance(request, ChatRequest):
        images = json.dumps(request.body.get("messages") or request.body.get("input") or []).count('"image_url"')
        texts = request.texts()
        return sum(_bytes(t) for t in texts) + PROMPT_OVERHEAD_TOKENS * (len(texts) + 1) + IMAGE_TOKENS * images
    if isinstance(request, ScoreRequest):
        return sum(len(p) if isinstance(p, tuple) else _bytes(p) + PROMPT_OVERHEAD_TOKENS for p in request.prompts)
    images = len(request.images())
    return sum(size + PROMPT_OVERHEAD_TOKENS for _, size in _question_sizes(request)) + IMAGE_TOKENS * images


def max_output_tokens(request: DecisionRequest | ScoreRequest | ChatRequest, model_default: int) -> int:
    """The output tokens ``request`` can still make its model produce: a chat request's own ``max_tokens`` /
    ``max_completion_tokens`` / ``max_output_tokens`` when it sets one, else the model's ``max_output_tokens``; a
    decision's few tokens a question; none for ``/v1/score``."""
    if isinstance(request, ChatRequest):
        asked = [v for k in _OUTPUT_FIELDS if isinstance(v := request.body.get(k), int) and not isinstance(v, bool)
                 and v >= 0]
        return min(asked) if asked else model_default
    if isinstance(request, ScoreRequest):
        return 0
    return DECISION_OUTPUT_TOKENS * len(request.questions)
