"""SGLang's native ``/generate`` route, as decisiond's client of a served model's next-token log-probabilities
(``gateway/providers/label_reads.py``): the request body for one answer position with the labels' token ids, and the
reply read back as that position's candidates. Pure: no model, no network.

What goes out (``GenerateReqInput``, top-level fields): the prompt's ``input_ids``, ``sampling_params`` for one greedy
token with the settings that keep the read exact, ``return_logprob``, ``top_logprobs_num: k``, ``logprob_start_len:
-1`` (the output position only) and ``token_ids_logprob``: the labels' ids, whose log-probabilities SGLang returns
whatever their rank.

What comes back (``tokenizer_manager``'s ``meta_info``): ``output_token_logprobs`` (the chosen token, ``[logprob, id,
text]``), ``output_top_logprobs`` and ``output_token_ids_logprobs`` (one list per output position, of ``[logprob, id,
text]``; text ``null`` unless ``return_text_in_logprobs``), and ``prompt_tokens``, ``cached_tokens``,
``completion_tokens``. A reply without the labels' entries is read as the top ``k`` alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..canonical import Candidate, Usage
from .completions import NoLogprobs, Reply, number, token_count


def root(base_url: str) -> str:
    """The server's root, where ``/generate`` is, from its OpenAI base URL (``…/v1``)."""
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url


def generate_body(prompt: Sequence[int], k: int, label_ids: Sequence[int],
                  sampling: Mapping[str, Any]) -> dict[str, Any]:
    """One greedy token, with ``sampling`` (the server's settings that keep the read exact: ``Server.exact``)."""
    return {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": 1, "temperature": 0, **sampling},
            "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": -1,
            "token_ids_logprob": list(label_ids), "stream": False}


def _entries(position: Any) -> list[Candidate]:
    if not isinstance(position, list):
        return []
    out = []
    for entry in position:
        if not isinstance(entry, list) or len(entry) < 2 or not isinstance(entry[1], int):
            raise ValueError(f"a log-probability entry must be [logprob, token id, text], not {entry!r}")
        out.append(Candidate(number(entry[0]), entry[2] if len(entry) > 2 and isinstance(entry[2], str) else None,
                             entry[1]))
    return out


def _first(values: Any) -> Any:
    return values[0] if isinstance(values, list) and values else None


def read_generate_reply(body: Any) -> Reply:
    """The output position's candidates (the chosen token first, then the labels', then the top ``k``) and usage."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("the reply has no meta_info")
    chosen = _first(meta.get("output_token_logprobs"))
    if chosen is None:
        raise NoLogprobs("its meta_info has no output_token_logprobs")
    candidates = _entries([chosen]) + _entries(_first(meta.get("output_token_ids_logprobs"))) + \
        _entries(_first(meta.get("output_top_logprobs")))
    return Reply(candidates, Usage(input_tokens=token_count(meta.get("prompt_tokens")),
                                   cached_tokens=token_count(meta.get("cached_tokens")),
                                   output_tokens=token_count(meta.get("completion_tokens"))))
