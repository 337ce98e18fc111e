"""SGLang's ``/v1/score`` wire format. Pure translation.

Request: ``query`` (text or token ids), ``items`` (text, texts, or token-id lists), ``label_token_ids`` (one list
shared by every item, or one list per item), ``apply_softmax``, ``temperature``, ``return_token_logprobs``,
``item_first``, ``model``. Each prompt is ``query + item`` (``item + query`` with ``item_first``): text is
concatenated then tokenized, token ids are concatenated. Response: ``{scores, token_logprobs, model, usage,
object: "scoring"}``. Errors: SGLang's ``ErrorResponse``.
"""

from __future__ import annotations

from typing import Any, Union

from ..canonical import ScoreRequest, ScoreResult
from ..errors import invalid
from ..limits import SCORE_MAX_ITEMS
from ..rules import check_temperature
from .base import WireDialect
from .common import StrictModel, validate_body
from .sglang import DEFAULT_MODEL, render_error


class ScoreBody(StrictModel):
    query: Union[str, list[int], None] = None
    items: Union[str, list[str], list[list[int]], None] = None
    label_token_ids: Union[list[int], list[list[int]], None] = None
    apply_softmax: bool = False
    item_first: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False
    model: str | None = None


def parse_request(body: Any, files: Any = None) -> ScoreRequest:
    parsed = validate_body(ScoreBody, body)
    check_temperature(parsed.temperature)
    if parsed.temperature != 1.0 and not parsed.apply_softmax:
        raise invalid("temperature scales the softmax over the labels, so it needs apply_softmax: true", "temperature")
    items = parsed.items
    if items is None or items == [] or items == "":
        raise invalid("items must hold at least one item", "items", code="missing_required_parameter")
    if isinstance(items, str):
        items = [items]
    if len(items) > SCORE_MAX_ITEMS:
        raise invalid(f"at most {SCORE_MAX_ITEMS} items per request", "items", code="limit_exceeded")
    text = isinstance(items[0], str)
    query = parsed.query if parsed.query is not None else ("" if text else [])
    if isinstance(query, str) != text:
        raise invalid("query and items must both be text or both be token ids", "query")
    prompts: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        joined: str | tuple[int, ...]
        if isinstance(query, str) and isinstance(item, str):
            joined = (item + query) if parsed.item_first else (query + item)
        elif isinstance(query, list) and isinstance(item, list):
            joined = tuple(item + query) if parsed.item_first else tuple(query + item)
        else:
            raise invalid("query and items must both be text or both be token ids", "items", i)
        if not joined:
            raise invalid("the prompt (query and item together) is empty", "items", i)
        prompts.append(joined)
    labels = parsed.label_token_ids
    if not labels:
        raise invalid("label_token_ids must name at least one token", "label_token_ids",
                      code="missing_required_parameter")
    if isinstance(labels[0], int):
        per_item = [tuple(labels)] * len(prompts)
    else:
        if len(labels) != len(prompts):
            raise invalid(f"label_token_ids has {len(labels)} lists for {len(prompts)} items; send one list per item "
                          "or one list for all", "label_token_ids")
        per_item = [tuple(ids) for ids in labels]
        for i, ids in enumerate(per_item):
            if not ids:
                raise invalid("each label list must name at least one token", "label_token_ids", i)
    return ScoreRequest(tuple(prompts), tuple(per_item), apply_softmax=parsed.apply_softmax,
                        temperature=parsed.temperature, return_token_logprobs=parsed.return_token_logprobs,
                        model=parsed.model or DEFAULT_MODEL)


def render_response(result: ScoreResult, request: ScoreRequest) -> dict[str, Any]:
    return {
        "scores": result.scores,
        "token_logprobs": result.token_logprobs if request.return_token_logprobs else None,
        "model": request.model or DEFAULT_MODEL,
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": 0, "total_tokens": result.prompt_tokens},
        "object": "scoring",
    }


DIALECT = WireDialect("sglang_score", parse_request, render_response, render_error, strict_model=False,
                      operation="score")
