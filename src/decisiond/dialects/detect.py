"""Which dialect a ``POST /v1/decisions`` body speaks, told from the request's own keys.

OpenAI's shape is marked by top-level ``prompt_cache_key``/``prompt_cache_options``/``safety_identifier``, by
question keys ``instructions``/``name``/``choices`` and by question type ``predicate``; SGLang's by question keys
``id``/``question``/``options``/``yes``/``no`` and by question type ``yes_no``. Keys both share (``input``,
``questions``, ``type`` choice/score, ``levels``, ``model``, ``temperature``, ``chat_template_kwargs``,
``prompt_format_version``, ``return_prompt_token_ids``) mark neither. SGLang markers alone → SGLang; OpenAI markers
alone, or none → OpenAI; both → 400 that names one marker of each.
"""

from __future__ import annotations

from typing import Any

from ..errors import DecisionError, InvalidRequest

OPENAI_TOP = ("prompt_cache_key", "prompt_cache_options", "safety_identifier")
OPENAI_QUESTION = ("instructions", "name", "choices")
SGLANG_QUESTION = ("id", "question", "options", "yes", "no")


def decisions_dialect(document: Any) -> str:
    openai: list[str] = []
    sglang: list[str] = []
    if isinstance(document, dict):
        openai += [key for key in OPENAI_TOP if key in document]
        questions = document.get("questions")
        for i, q in enumerate(questions if isinstance(questions, list) else []):
            if not isinstance(q, dict):
                continue
            openai += [f"questions[{i}].{key}" for key in OPENAI_QUESTION if key in q]
            sglang += [f"questions[{i}].{key}" for key in SGLANG_QUESTION if key in q]
            if q.get("type") == "predicate":
                openai.append(f"questions[{i}].type 'predicate'")
            elif q.get("type") == "yes_no":
                sglang.append(f"questions[{i}].type 'yes_no'")
    if openai and sglang:
        raise InvalidRequest(
            f"This request mixes OpenAI's Decisions shape ({openai[0]}) with SGLang's /v1/decisions shape "
            f"({sglang[0]}); send one or the other.",
            code="mixed_dialects",
        )
    return "sglang" if sglang else "openai"


def render_error(error: DecisionError, document: Any = None) -> tuple[int, dict[str, Any]]:
    """Errors on ``/v1/decisions`` before its dialect is known (a 401, mixed shapes), readable by both kinds of
    client: OpenAI's SDK reads ``error``, SGLang clients the top-level ``ErrorResponse`` fields."""
    kind = "BadRequestError" if error.status == 400 else error.type
    return error.status, {
        "error": {"message": error.message, "type": error.type, "param": None, "code": error.code},
        "object": "error",
        "message": error.message,
        "type": kind,
        "param": None,
        "code": error.status,
    }
