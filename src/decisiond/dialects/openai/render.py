"""OpenAI answer rendering: a canonical result → the ``/v1/decisions`` response (answers as an ordered list,
``name`` always present, integer Responses-style usage), and a DecisionError → ``{"error": {message, type, param,
code}}`` with ``param`` naming the field (``questions[1].choices[0]``).

Each answer also carries the decisiond extensions ``label_mass`` (and ``order_spread`` under cyclic order).
"""

from __future__ import annotations

from typing import Any

from ... import probability
from ...canonical import Answer, DecisionRequest, DecisionResult, Question
from ...errors import DecisionError, openai_param
from ...text import render_text


def render_response(result: DecisionResult, request: DecisionRequest) -> dict[str, Any]:
    answers = [_render_answer(a, q) for a, q in zip(result.answers, request.questions)]
    u = result.usage
    return {
        "answers": answers,
        "model": result.model,
        "usage": {
            "input_tokens": int(u.input_tokens),
            "input_tokens_details": {"cached_tokens": int(u.cached_tokens),
                                     "cache_write_tokens": int(u.cache_write_tokens)},
            "output_tokens": int(u.output_tokens),
            "output_tokens_details": {"reasoning_tokens": int(u.reasoning_tokens)},
            "total_tokens": int(u.total_tokens),
            **({"cost": u.cost} if u.cost is not None else {}),
        },
    }


def _render_answer(a: Answer, q: Question) -> dict[str, Any]:
    if a.refusal:
        return {"type": "refusal", "name": q.name}
    p = a.probabilities
    if q.kind == "yes_no":
        out: dict[str, Any] = {"type": "predicate", "name": q.name, "probability": p[0]}
    elif q.kind == "choice":
        out = {
            "type": "choice",
            "name": q.name,
            "choice": q.options[probability.argmax(p)].value,
            "confidence": a.confidence if a.confidence is not None else probability.choice_confidence(p),
            "probabilities": [{"value": o.value, "probability": pi} for o, pi in zip(q.options, p)],
        }
    else:
        out = {
            "type": "score",
            "name": q.name,
            "score": probability.expected_level(p),
            "confidence": a.confidence if a.confidence is not None else probability.score_confidence(p),
            "probabilities": [
                {"label": render_text(lv.label), "value": j, "probability": pi}
                for j, (lv, pi) in enumerate(zip(q.levels, p))
            ],
        }
    if a.label_mass is not None:
        out["label_mass"] = a.label_mass
    out.update(a.extensions)
    return out


# ------------------------------------------------------------------------------------------- errors


def error_message(error: DecisionError) -> str:
    """Schema errors read the OpenAI way (``Missing required parameter: 'x'.``); others as raised."""
    if error.details is None:
        return error.message
    param = openai_param(error.path)
    if error.code == "missing_required_parameter":
        return f"Missing required parameter: '{param}'."
    if error.code == "unknown_parameter":
        return f"Unknown parameter: '{param}'."
    return f"Invalid value for '{param}': {error.message}." if param else f"Invalid request: {error.message}."


def error_body(error: DecisionError, document: Any = None) -> dict[str, Any]:
    return {
        "error": {
            "message": error_message(error),
            "type": error.type,
            "param": openai_param(error.path),
            "code": error.code,
        }
    }


def render_error(error: DecisionError, document: Any = None) -> tuple[int, dict[str, Any]]:
    return error.status, error_body(error)

