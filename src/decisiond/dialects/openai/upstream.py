"""The OpenAI dialect as decisiond's client: a canonical request → the body sent to an OpenAI-shaped upstream
(``render_request``), and that upstream's answer → a canonical result (``parse_response``); used by
``gateway/providers/openai.py``.

A request that came in on the OpenAI wire goes out as it came (its ``OpenAIWire`` record); one from another
dialect is given the plainest OpenAI spelling. Answers are read without assuming anything: a missing or mistyped
probability is the provider's fault, never a default.
"""

from __future__ import annotations

import base64
from typing import Any

from ...canonical import (
    Answer,
    DecisionRequest,
    DecisionResult,
    Image,
    Item,
    Json,
    Message,
    Part,
    Question,
    Text,
    ToolCall,
    ToolOutput,
    Usage,
)
from ...text import render_text
from ..common import answer_number, malformed_answer
from .schema import DIALECT_NAME, ItemShape, OpenAIWire

# Canonical question kind → the OpenAI question (and answer) type.
WIRE_TYPES = {"yes_no": "predicate", "choice": "choice", "score": "score"}


def render_request(request: DecisionRequest, model: str | None = None) -> dict[str, Any]:
    """The wire body for an upstream OpenAI-shaped provider, ``model`` replaced when given."""
    body: dict[str, Any] = {"model": model or request.model}
    body["input"] = _render_input(request.input, request.wire.get(DIALECT_NAME))
    body["questions"] = [_render_question(q) for q in request.questions]
    if request.prompt_cache_key is not None:
        body["prompt_cache_key"] = request.prompt_cache_key
    if request.prompt_cache_options is not None:
        body["prompt_cache_options"] = request.prompt_cache_options
    if request.safety_identifier is not None:
        body["safety_identifier"] = request.safety_identifier
    body.update(request.extra)
    return body


def _render_part(part: Part, context: str) -> dict[str, Any]:
    if isinstance(part, Text):
        out: dict[str, Any] = {"type": "output_text" if context == "assistant" else "input_text", "text": part.text}
        if part.cache_breakpoint and context == "input":
            out["prompt_cache_breakpoint"] = {"mode": "explicit"}
        return out
    if isinstance(part, Json):
        return {"type": "input_json", "data": part.data}
    out = {"type": "input_image", "image_url": image_url(part)}
    if part.detail is not None:
        out["detail"] = part.detail
    if part.cache_breakpoint and context == "input":
        out["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return out


def image_url(image: Image) -> str:
    """The URL an image is sent by: its own, or its bytes as a data: URL."""
    if image.url:
        return image.url
    return f"data:{image.media_type or 'image/png'};base64," + base64.b64encode(image.data or b"").decode()


def _render_content(parts: tuple[Part, ...], plain: bool, context: str, refusals: tuple[int, ...] = ()) -> Any:
    if plain and len(parts) == 1 and isinstance(parts[0], Text):
        return parts[0].text
    rendered = []
    for j, p in enumerate(parts):
        if j in refusals and isinstance(p, Text):
            rendered.append({"type": "refusal", "refusal": p.text})
        else:
            rendered.append(_render_part(p, context))
    return rendered


def _one_text(item: Item) -> bool:
    return isinstance(item, (Message, ToolOutput)) and len(item.parts) == 1 and isinstance(item.parts[0], Text)


def _shape(item: Item, wire: OpenAIWire | None) -> ItemShape:
    """The item's recorded shape, or — for a request from another dialect — one text part as a string."""
    if wire is not None and item.source in wire.items:
        return wire.items[item.source]
    return ItemShape(plain=wire is None and _one_text(item))


def _render_input(items: tuple[Item, ...], wire: OpenAIWire | None) -> Any:
    first = items[0] if len(items) == 1 else None
    if isinstance(first, Message) and first.role == "user" and _one_text(first) and (wire is None or wire.bare):
        text = first.parts[0]
        if isinstance(text, Text):
            return text.text
    out = []
    for item in items:
        if isinstance(item, Message):
            context = "assistant" if item.role == "assistant" else "input"
            shape = _shape(item, wire)
            entry: dict[str, Any] = {"type": "message"} if shape.typed else {}
            entry.update(role=item.role, content=_render_content(item.parts, shape.plain, context, shape.refusals))
            if shape.phase is not None:
                entry["phase"] = shape.phase
        elif isinstance(item, ToolCall):
            entry = {"type": "custom_tool_call" if item.custom else "function_call", "call_id": item.call_id,
                     "name": item.name, ("input" if item.custom else "arguments"): item.arguments}
            entry.update({k: v for k, v in (("id", item.id), ("namespace", item.namespace), ("status", item.status))
                          if v is not None})
        else:
            entry = {"type": "custom_tool_call_output" if item.custom else "function_call_output",
                     "call_id": item.call_id, "output": _render_content(item.parts, _shape(item, wire).plain, "input")}
            entry.update({k: v for k, v in (("id", item.id), ("status", item.status)) if v is not None})
        out.append(entry)
    return out


def _render_instructions(parts: tuple[Part, ...]) -> Any:
    if len(parts) == 1 and isinstance(parts[0], Text) and parts[0].source[-1:] == ("instructions",):
        return parts[0].text
    out = []
    for p in parts:
        rendered = _render_part(p, "instructions")
        rendered.pop("prompt_cache_breakpoint", None)
        out.append(rendered)
    return out


def _render_question(q: Question) -> dict[str, Any]:
    out: dict[str, Any] = {"type": WIRE_TYPES[q.kind]}
    if q.name is not None:
        out["name"] = q.name
    out["instructions"] = _render_instructions(q.instructions)
    if q.kind == "choice":
        out["choices"] = [
            {"value": o.value, **({"description": render_text(o.description)} if o.description is not None else {})}
            for o in q.options
        ]
    elif q.kind == "score":
        out["levels"] = [
            {"label": render_text(lv.label),
             **({"description": render_text(lv.description)} if lv.description is not None else {})}
            for lv in q.levels
        ]
    return out


# ----------------------------------------------------------------------------------- parse response


def parse_response(body: Any, request: DecisionRequest) -> DecisionResult:
    """An upstream provider's OpenAI-shaped answer, matched to the request's questions by position."""
    if not isinstance(body, dict) or not isinstance(body.get("answers"), list):
        raise malformed_answer("the upstream response has no answers list")
    answers = []
    for i, q in enumerate(request.questions):
        raw = body["answers"][i] if i < len(body["answers"]) else {"type": "refusal"}
        answers.append(_parse_answer(raw, q))
    u = body.get("usage") or {}
    details = u.get("input_tokens_details") or {}
    usage = Usage(
        input_tokens=int(u.get("input_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        cache_write_tokens=int(details.get("cache_write_tokens") or 0),
        output_tokens=int(u.get("output_tokens") or 0),
        reasoning_tokens=int((u.get("output_tokens_details") or {}).get("reasoning_tokens") or 0),
        cost=u.get("cost") if isinstance(u.get("cost"), (int, float)) else None,
    )
    return DecisionResult(model=str(body.get("model") or request.model), answers=answers, usage=usage,
                          provider_format="openai")


def _parse_answer(raw: Any, q: Question) -> Answer:
    """One answer, nothing assumed: a missing or mistyped probability is the provider's fault, never a default."""
    if not isinstance(raw, dict) or raw.get("type") == "refusal":
        return Answer(q.kind, q.name, refusal=True)
    where = f"the answer to question {q.name or q.source}"
    if raw.get("type") != WIRE_TYPES[q.kind]:
        raise malformed_answer(f"{where} has type {raw.get('type')!r}, not {WIRE_TYPES[q.kind]!r}")
    mass = raw.get("label_mass")
    mass = float(mass) if isinstance(mass, (int, float)) else None
    if q.kind == "yes_no":
        p = answer_number(raw.get("probability"), f"{where}: probability")
        return Answer(q.kind, q.name, probabilities=[p, 1.0 - p], label_mass=mass)
    probs = raw.get("probabilities")
    if not isinstance(probs, list) or not all(isinstance(e, dict) for e in probs):
        raise malformed_answer(f"{where} has no probabilities list")
    if q.kind == "choice":
        by_value = {(type(e.get("value")), e.get("value")): e.get("probability") for e in probs}
        keys = [(type(o.value), o.value) for o in q.options]
        stray = [v for _, v in by_value if (type(v), v) not in keys]
        if stray:
            raise malformed_answer(f"{where} gives a probability to {stray[0]!r}, which is not one of its choices")
        if raw.get("choice") is not None and (type(raw["choice"]), raw["choice"]) not in keys:
            raise malformed_answer(f"{where} chose {raw['choice']!r}, which is not one of its choices")
        values = [answer_number(by_value.get(k), f"{where}: the probability of {k[1]!r}") for k in keys]
    else:
        by_index = {e.get("value"): e.get("probability") for e in probs}
        values = [answer_number(by_index.get(j), f"{where}: the probability of level {j}")
                  for j in range(len(q.levels))]
    confidence = raw.get("confidence")
    return Answer(q.kind, q.name, probabilities=values, label_mass=mass,
                  confidence=float(confidence) if isinstance(confidence, (int, float)) else None)


