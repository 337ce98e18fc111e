"""OpenAI's completions and chat completions routes, as decisiond's client of a served model's next-token
log-probabilities (``gateway/providers/logprobs.py``): the request body for one answer position, and the reply read
back as that position's candidates. Pure: no model, no network.

What goes out: one output token (``max_tokens: 1``), greedy (``temperature: 0``), the top ``k`` log-probabilities
(completions: ``logprobs: k``; chat: ``logprobs: true, top_logprobs: k``) and, for a read restricted to the labels,
``logit_bias`` (+100 on each label token, OpenAI's range) or vLLM's ``allowed_token_ids``.

What comes back, in the shapes servers use (all read, none assumed):

- completions, OpenAI's legacy shape (vLLM, SGLang, llama-cpp-python): ``choices[0].logprobs`` with ``tokens``,
  ``token_logprobs`` and ``top_logprobs`` (one ``{token text: logprob}`` map per position);
- chat completions (everywhere), and llama.cpp's own server on both routes: ``choices[0].logprobs.content[0]`` with
  ``token``, ``logprob`` and ``top_logprobs`` (``[{token, logprob, bytes}]``; llama.cpp adds each token's ``id``);
- vLLM with ``return_tokens_as_token_ids``: token texts spelled ``token_id:N``.

A reply without log-probabilities at its first position is refused (``NoLogprobs``), never read as anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..canonical import Candidate, Image, Usage
from .openai.upstream import image_url

Restriction = Literal["logit_bias", "allowed_token_ids", "none"]
# The bias that restricts an answer to the labels: the top of OpenAI's range, as llama.cpp, vLLM and SGLang take it.
LABEL_BIAS = 100
TOKEN_ID_PREFIX = "token_id:"


class NoLogprobs(ValueError):
    """The reply holds no log-probabilities for its first token."""


@dataclass
class Reply:
    """The answer position's candidates (the chosen token first), the usage, and the reasoning text a server split
    off its answer (``reasoning_content``, ``reasoning``: the answer was read after a reasoning block)."""

    candidates: list[Candidate]
    usage: Usage = field(default_factory=Usage)
    reasoning: str = ""


def restriction(kind: Restriction, label_ids: Sequence[int]) -> dict[str, Any]:
    """The body fields that restrict the answer to ``label_ids`` (none without ids or with ``none``)."""
    if kind == "none" or not label_ids:
        return {}
    if kind == "allowed_token_ids":
        return {"allowed_token_ids": list(label_ids)}
    return {"logit_bias": {str(i): LABEL_BIAS for i in label_ids}}


def completion_body(model: str, prompt: str | Sequence[int], k: int, restrict: dict[str, Any],
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``/v1/completions``: the rendered prompt, as text or as token ids; ``extra``: the server's own fields
    (``served_servers.Server.fields``)."""
    return {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt), "max_tokens": 1,
            "temperature": 0, "logprobs": k, "stream": False, **(extra or {}), **restrict}


def chat_body(model: str, text: str, images: Sequence[Image], k: int, restrict: dict[str, Any],
              template_kwargs: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``/v1/chat/completions``: one user message, the request's images first, then the rendered question;
    ``extra``: the server's own fields, which carry the template kwargs where the server takes them
    (``served_servers.Server.fields``); OpenAI's reasoning models take ``max_completion_tokens`` only."""
    content: str | list[dict[str, Any]] = text
    if images:
        parts: list[dict[str, Any]] = []
        for image in images:
            url: dict[str, Any] = {"url": image_url(image)}
            if image.detail is not None:
                url["detail"] = image.detail
            parts.append({"type": "image_url", "image_url": url})
        content = [*parts, {"type": "text", "text": text}]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
                            "temperature": 0, "logprobs": True, "top_logprobs": k, "stream": False, **(extra or {}),
                            **restrict}
    if "max_completion_tokens" in body:
        del body["max_tokens"]
    if template_kwargs and "chat_template_kwargs" not in body:
        body["chat_template_kwargs"] = template_kwargs
    return body


def number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"a log-probability must be a number, not {value!r}")
    return float(value)


def _candidate(text: Any, logprob: Any, id_: Any = None) -> Candidate:
    if isinstance(text, str) and text.startswith(TOKEN_ID_PREFIX) and text[len(TOKEN_ID_PREFIX):].isdigit():
        id_ = int(text[len(TOKEN_ID_PREFIX):])
    return Candidate(number(logprob), text if isinstance(text, str) else None,
                     id_ if isinstance(id_, int) and not isinstance(id_, bool) else None)


def _first_position(logprobs: dict[str, Any]) -> list[Candidate]:
    content = logprobs.get("content")
    if isinstance(content, list):
        if not content or not isinstance(content[0], dict):
            raise NoLogprobs("its logprobs.content is empty")
        first = content[0]
        out = [_candidate(first.get("token"), first.get("logprob"), first.get("id"))]
        for entry in first.get("top_logprobs") or []:
            out.append(_candidate(entry.get("token"), entry.get("logprob"), entry.get("id")))
        return out
    tops, tokens, chosen = logprobs.get("top_logprobs"), logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tops, list) or not tops:
        raise NoLogprobs("its logprobs hold neither content nor top_logprobs")
    out = [_candidate(text, lp) for text, lp in (tops[0] or {}).items()]
    if isinstance(tokens, list) and isinstance(chosen, list) and tokens and chosen and chosen[0] is not None:
        out.insert(0, _candidate(tokens[0], chosen[0]))
    return out


def read_reply(body: Any) -> Reply:
    """The first answer position's candidates and the usage of a completions or chat completions reply."""
    if not isinstance(body, dict):
        raise ValueError("the reply is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the reply has no choices")
    logprobs = choices[0].get("logprobs")
    if not isinstance(logprobs, dict):
        raise NoLogprobs("its choice has no logprobs")
    candidates = _first_position(logprobs)
    if not candidates:
        raise NoLogprobs("its first token has no log-probabilities")
    message = choices[0].get("message")
    reasoning = next((v for k in ("reasoning_content", "reasoning") if isinstance(message, dict)
                      and isinstance(v := message.get(k), str) and v), "")
    return Reply(candidates, _usage(body.get("usage")), reasoning)


def token_count(value: Any) -> int:
    """A count of tokens a server reported: a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(input_tokens=token_count(raw.get("prompt_tokens")), cached_tokens=token_count(cached),
                 output_tokens=token_count(raw.get("completion_tokens")))
