"""The prompter of a chat server whose tokenizer decisiond does not have (a hosted model, ``api: chat`` with no
``tokenizer:``): the user message is the question rendered in the wording of ``prompt`` and nothing else. The server
applies its own chat template; there are no token ids, and the labels are found in the reply by their text
(``engine.served``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..canonical import Question
from ..errors import refused
from .prompt import MAX_SINGLE_LETTER, EncodedPrompt, check_template_kwargs


class PlainPrompter:
    """A ``decider.Prompter`` without a tokenizer: text in, text out."""

    def template_kwargs(self, request_kwargs: dict[str, Any],
                        source: tuple[str | int, ...] = ("chat_template_kwargs",)) -> dict[str, Any]:
        """The request's kwargs, checked as for a local model (thinking stays off); the server's template reads
        them."""
        check_template_kwargs(request_kwargs, source)
        return dict(request_kwargs)

    def encode(self, content: str, labels: Sequence[str], kwargs: dict[str, Any],
               source: tuple[str | int, ...] = ()) -> EncodedPrompt:
        return EncodedPrompt(content, [], [], content)

    def one_token_labels(self, content: str, n: int, kwargs: dict[str, Any], question: Question) -> list[str]:
        """Two-letter labels need the tokenizer (which of them is one token): without it, 26 options at most."""
        raise refused(
            f"without the model's tokenizer (tokenizer: in the provider's config) a choice takes at most "
            f"{MAX_SINGLE_LETTER} options here (labels A to Z); this one has {n}",
            *question.options[MAX_SINGLE_LETTER].source, code="limit_exceeded")
