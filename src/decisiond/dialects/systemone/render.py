"""System One answer rendering: a canonical result → answers keyed by question id with integer ``usage``, and a
DecisionError → 422 with a FastAPI ``detail`` list whose ``loc`` names the field (the discriminator tag included,
as in ``["body", "questions", "q1", "score", "criteria"]``) for invalid requests, or ``{"error": …}`` otherwise.
Also the ``/v1/systemone/models`` listing (``models_body``).
"""

from __future__ import annotations

from typing import Any

from ... import probability
from ...canonical import Answer, DecisionRequest, DecisionResult, Question
from ...errors import DecisionError
from .schema import level_text


def render_response(result: DecisionResult, request: DecisionRequest) -> dict[str, Any]:
    answers = {}
    for a, q in zip(result.answers, request.questions):
        if not a.refusal:
            answers[q.name or ""] = _render_answer(a, q)
    return {
        "model": result.model,
        "answers": answers,
        "usage": {"input_tokens": int(result.usage.input_tokens), "output_tokens": int(result.usage.output_tokens)},
    }


def _render_answer(a: Answer, q: Question) -> dict[str, Any]:
    p = a.probabilities
    if q.kind == "yes_no":
        out: dict[str, Any] = {"type": "noul", "noul": p[0]}
    elif q.kind == "choice":
        out = {
            "type": "choice",
            "choice": q.options[probability.argmax(p)].name,
            "confidence": a.confidence if a.confidence is not None else probability.choice_confidence(p),
            "probabilities": {o.name: pi for o, pi in zip(q.options, p)},
        }
    else:
        out = {
            "type": "score",
            "score": probability.expected_level(p),
            "confidence": a.confidence if a.confidence is not None else probability.score_confidence(p),
            "legend": {str(i): level_text(lv) for i, lv in enumerate(q.levels)},
            "probabilities": {str(i): pi for i, pi in enumerate(p)},
        }
    if a.label_mass is not None:
        out["x_label_mass"] = a.label_mass
    out.update({f"x_{k}": v for k, v in a.extensions.items()})
    return out


# ------------------------------------------------------------------------------------------- errors


def render_error(error: DecisionError, document: Any = None) -> tuple[int, dict[str, Any]]:
    """422 FastAPI ``detail`` list for invalid requests; the error's own status and an error object otherwise."""
    if error.validation and error.status == 400:
        if error.details:
            detail = [{**d, "loc": ["body", *d["loc"]]} for d in error.details]
        else:
            detail = [{"loc": ["body", *error.path], "msg": error.message, "type": error.code}]
        return 422, {"detail": detail}
    inner: dict[str, Any] = {"message": error.message, "type": error.type, "code": error.code}
    if error.path:
        inner["loc"] = ["body", *error.path]
    return error.status, {"error": inner}


def models_body(models: list[Any]) -> dict[str, Any]:
    return {"models": [{"name": m.name, "description": m.description, "release_date": m.release_date}
                       for m in models]}

