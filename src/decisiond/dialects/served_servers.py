"""The OpenAI-compatible servers a ``type: logprobs`` provider reads, and what each takes beyond OpenAI's own fields,
as each server's own source reads its requests. Pure: no model, no network.

- ``vllm``: ``logprob_token_ids`` (0.32 and later, both routes): the log-probabilities of the given token ids at the
  answer position, whatever ``--logprobs-mode`` and ``--max-logprobs`` are, in one request; an older vLLM ignores the
  field (its request models take unknown fields) and answers the top ``k``. ``return_tokens_as_token_ids`` prints
  every token as ``token_id:N``. Its defaults come from the model's ``generation_config.json`` (Qwen2.5 ships
  ``repetition_penalty: 1.05``), which ``processed_logprobs`` would include, so the neutral values are sent.
- ``sglang``: its native ``/generate`` route reads given token ids (``token_ids_logprob``), where decisiond sends
  token ids (``api: completions`` with a tokenizer); its OpenAI routes print each token by a lone ``decode``
  (SentencePiece's ``▁A`` as ``A``). The same neutral sampling fields; thinking off through ``chat_template_kwargs``.
- ``llamacpp`` (llama.cpp's own server and llama-cpp-python's): ``repeat_penalty`` (its default is 1.1).
- ``ollama``: thinking on by default for thinking models; its OpenAI route turns it off with ``reasoning_effort:
  "none"``; no ``logit_bias``.
- ``openai`` (a hosted API): OpenAI's fields only (an unknown field is a 400), and ``max_completion_tokens``, the
  only output bound its reasoning models take; any other server (``generic``): OpenAI's fields only.

Which server a provider talks to is ``logprobs.server`` in its config, or, with ``auto``, read from its ``/v1/models``
reply (``owned_by``), and read again every few minutes (``gateway.providers.served_facts``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

ServerName = Literal["vllm", "sglang", "llamacpp", "ollama", "openai", "generic"]
# Chat template variables that switch a model's reasoning on (engine.prompt.THINKING_TOGGLES): sent false.
THINKING_OFF = MappingProxyType({"enable_thinking": False, "thinking": False})
# vLLM's bound on logprob_token_ids (sampling_params.MAX_LOGPROB_TOKEN_IDS).
MAX_LABEL_IDS = 128
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0}
# What vLLM and SGLang take to read the model's own distribution: no penalty, no truncation (both default to the model's
# generation_config.json).
_SAMPLING_OFF = MappingProxyType({**_NEUTRAL, "repetition_penalty": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0})
# "Requested sample logprobs of 1000, which is greater than max allowed: 20" (vLLM); "... at most 20" (others).
_MAXIMUM = re.compile(r"(?:max(?:imum)? allowed:?|at most|must be (?:<=|less than or equal to)) *(\d+)", re.I)


@dataclass(frozen=True)
class Server:
    """What one kind of server takes: ``label_ids`` (vLLM's ``logprob_token_ids``), ``generate_route`` (SGLang's
    native ``/generate`` with ``token_ids_logprob``: ``dialects.generate_route``), the fields that keep a read
    exact (``exact``), its own chat fields (``chat_fields``: thinking off, the output bound its reasoning models take;
    ``template_kwargs``: it reads ``chat_template_kwargs``, sent with thinking off), the most top log-probabilities it
    gives where that is fixed, and which of its options makes a label readable that is not (named in the error)."""

    name: ServerName
    label_ids: bool = False
    generate_route: bool = False
    exact: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType(dict(_NEUTRAL)))
    chat_fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    template_kwargs: bool = False
    max_logprobs: int | None = None
    fix: str = ""

    def fields(self, chat: bool, label_ids: list[int], template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The extra body fields of one read: the exact sampling settings, the label ids to read (where the server
        reads them), and, on the chat route, thinking off and the request's template kwargs."""
        out: dict[str, Any] = dict(self.exact)
        if self.label_ids and label_ids and len(label_ids) <= MAX_LABEL_IDS:
            out["logprob_token_ids"] = list(label_ids)
            out["return_tokens_as_token_ids"] = True
        if chat:
            out.update(self.chat_fields)
            if self.template_kwargs:
                out["chat_template_kwargs"] = {**THINKING_OFF, **template_kwargs}
        return out


SERVERS: dict[str, Server] = {
    "vllm": Server("vllm", label_ids=True, template_kwargs=True, exact=_SAMPLING_OFF,
                   fix="vLLM 0.32 or later reads each label by its token id (logprob_token_ids); on an older vLLM, "
                       "raise --max-logprobs, or start it with --logprobs-mode processed_logprobs and set "
                       "logprobs.restrict: allowed_token_ids"),
    "sglang": Server("sglang", generate_route=True, template_kwargs=True, exact=_SAMPLING_OFF,
                     fix="set logprobs.restrict: logit_bias (SGLang applies it before its log-probabilities)"),
    "llamacpp": Server("llamacpp", exact=MappingProxyType({**_NEUTRAL, "repeat_penalty": 1.0}),
                       fix="raise logprobs.widen_to (llama.cpp's servers give any number of log-probabilities)"),
    "ollama": Server("ollama", chat_fields=MappingProxyType({"reasoning_effort": "none"}), max_logprobs=20,
                     fix="Ollama gives at most 20 log-probabilities and no logit_bias: use a question with fewer, "
                         "likelier labels, or serve the model with vLLM"),
    "openai": Server("openai", max_logprobs=20, chat_fields=MappingProxyType({"max_completion_tokens": 1}),
                     fix="OpenAI gives at most 20 log-probabilities; logit_bias restricts the answer "
                         "(logprobs.restrict: logit_bias)"),
    "generic": Server("generic"),
}
# /v1/models' owned_by, as each server writes it.
OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "me": "llamacpp", "library": "ollama",
          "ollama": "ollama", "openai": "openai", "system": "openai", "openai-internal": "openai"}


def detect(models: Any) -> Server:
    """The server behind a ``/v1/models`` reply, by its first model's ``owned_by`` (``generic`` where unknown)."""
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    owner = first.get("owned_by")
    return SERVERS[OWNERS.get(owner, "generic")] if isinstance(owner, str) else SERVERS["generic"]


def maximum(message: str) -> int | None:
    """The most log-probabilities a server's refusal says it gives (``max allowed: 20``), or None."""
    match = _MAXIMUM.search(message)
    return int(match.group(1)) if match else None


def about_images(message: str) -> bool:
    """Whether a server's refusal is about a request's images (not its text)."""
    lowered = message.lower()
    return any(word in lowered for word in ("image", "vision", "multimodal", "multi-modal"))
