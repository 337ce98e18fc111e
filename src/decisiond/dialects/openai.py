"""OpenAI's Decisions API wire format (``POST /v1/decisions``, openai-python 3.57 contract). Pure translation.

Request → canonical: string or message/tool-item input (``type`` optional on messages, told apart by
``role``), ``predicate``/``choice``/``score`` questions, typed choice values (``true`` ≠ ``"true"``).
Canonical → response: answers as an ordered list, ``name`` always present, integer Responses-style usage.
Errors: ``{"error": {message, type, param, code}}``, ``param`` naming the field (``questions[1].choices[0]``).

decisiond extensions, sent by the SDK through ``extra_body``: ``temperature``, ``chat_template_kwargs``,
``prompt_format_version``, ``return_prompt_token_ids``, ``order``, ``calibrate``; each answer also carries
``label_mass`` (and ``order_spread`` under cyclic order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StrictBool, StrictStr, Tag

from .. import probability
from ..canonical import (
    Answer,
    DecisionRequest,
    DecisionResult,
    Image,
    Item,
    Json,
    Level,
    Message,
    Option,
    Part,
    Question,
    Text,
    ToolCall,
    ToolOutput,
)
from ..errors import DecisionError, Path, invalid, openai_param
from ..limits import OPENAI
from ..rules import check_temperature, check_unique
from ..text import render_text
from .base import WireDialect
from .common import StrictModel, answer_number, malformed_answer, validate_body

Status = Literal["in_progress", "completed", "incomplete"]


class Breakpoint(StrictModel):
    mode: Literal["explicit"]


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Breakpoint | None = None


class InputImage(StrictModel):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["low", "high", "auto", "original"] | None = None
    prompt_cache_breakpoint: Breakpoint | None = None


class InputJson(StrictModel):
    type: Literal["input_json"]
    data: Union[dict[str, Any], list[dict[str, Any]]]


class InstructionText(StrictModel):
    type: Literal["input_text"]
    text: str


class InstructionImage(StrictModel):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["low", "high", "auto", "original"] | None = None


class OutputText(StrictModel):
    type: Literal["output_text"]
    text: str


class RefusalPart(StrictModel):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[Union[InputText, InputImage, InputJson], Field(discriminator="type")]
ToolOutputPart = Annotated[Union[InputText, InputImage], Field(discriminator="type")]
AssistantPart = Annotated[Union[OutputText, RefusalPart], Field(discriminator="type")]
InstructionPart = Annotated[Union[InstructionText, InstructionImage, InputJson], Field(discriminator="type")]


class UserMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["user"]
    content: Union[str, list[UserPart]]


class SystemMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["system"]
    content: Union[str, list[InputText]]


class DeveloperMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["developer"]
    content: Union[str, list[InputText]]


class AssistantMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["assistant"]
    content: Union[str, list[AssistantPart]]
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCall(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    namespace: str | None = None
    status: Status | None = None


class FunctionCallOutput(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ToolOutputPart]]
    id: str | None = None
    status: Status | None = None


class CustomToolCall(StrictModel):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    namespace: str | None = None
    status: Status | None = None


class CustomToolCallOutput(StrictModel):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: Union[str, list[ToolOutputPart]]
    id: str | None = None
    status: Status | None = None


def _item_tag(value: Any) -> str | None:
    """Messages may omit ``type``: tell them apart by ``role``; other items by ``type``."""
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind in (None, "message"):
        return f"message:{value.get('role')}"
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Union[
        Annotated[UserMessage, Tag("message:user")],
        Annotated[SystemMessage, Tag("message:system")],
        Annotated[DeveloperMessage, Tag("message:developer")],
        Annotated[AssistantMessage, Tag("message:assistant")],
        Annotated[FunctionCall, Tag("function_call")],
        Annotated[FunctionCallOutput, Tag("function_call_output")],
        Annotated[CustomToolCall, Tag("custom_tool_call")],
        Annotated[CustomToolCallOutput, Tag("custom_tool_call_output")],
    ],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_input_item",
        custom_error_message="Each input item must be a message with role user, system, developer or assistant, "
        "or a function_call, function_call_output, custom_tool_call or custom_tool_call_output item",
    ),
]

Instructions = Union[str, list[InstructionPart]]


class PredicateQuestion(StrictModel):
    type: Literal["predicate"]
    instructions: Instructions
    name: str | None = None


class ChoiceItem(StrictModel):
    value: Union[StrictStr, StrictBool]
    description: str | None = None


class ChoiceQuestion(StrictModel):
    type: Literal["choice"]
    instructions: Instructions
    choices: list[ChoiceItem] = Field(min_length=OPENAI.min_choices, max_length=OPENAI.max_choices)
    name: str | None = None


class LevelItem(StrictModel):
    label: str
    description: str | None = None


class ScoreQuestion(StrictModel):
    type: Literal["score"]
    instructions: Instructions
    levels: list[LevelItem] = Field(min_length=1)
    name: str | None = None


QuestionModel = Annotated[Union[PredicateQuestion, ChoiceQuestion, ScoreQuestion], Field(discriminator="type")]


class CacheOptions(StrictModel):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] = "30m"


class DecisionBody(StrictModel):
    model_config = {"extra": "allow", "strict": True}

    model: str
    input: Union[str, list[InputItem]]
    questions: list[QuestionModel] = Field(min_length=1, max_length=OPENAI.max_questions)
    prompt_cache_key: str | None = None
    prompt_cache_options: CacheOptions | None = None
    safety_identifier: str | None = Field(default=None, max_length=OPENAI.max_safety_identifier)
    # decisiond extensions (sent through the SDK's extra_body)
    temperature: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_format_version: int | None = None
    return_prompt_token_ids: bool | None = None
    order: Literal["given", "cyclic"] | None = None
    calibrate: Literal["none", "contextual"] | None = None


EXTENSION_FIELDS = ("temperature", "chat_template_kwargs", "prompt_format_version", "return_prompt_token_ids",
                    "order", "calibrate")


DIALECT_NAME = "openai"


# ------------------------------------------------------------------------------------ parse request


def parse_request(body: Any, files: Any = None) -> DecisionRequest:
    parsed = validate_body(DecisionBody, body)
    items, wire = _input(parsed.input)
    questions = tuple(_question(q, i) for i, q in enumerate(parsed.questions))
    check_unique(((q.name, (*q.source, "name")) for q in questions), "question name")
    _check_call_ids(items)
    check_temperature(parsed.temperature)
    return DecisionRequest(
        input=items,
        questions=questions,
        model=parsed.model,
        temperature=parsed.temperature,
        chat_template_kwargs=dict(parsed.chat_template_kwargs or {}),
        prompt_format_version=parsed.prompt_format_version,
        return_prompt_token_ids=bool(parsed.return_prompt_token_ids),
        order=parsed.order,
        calibrate=parsed.calibrate,
        prompt_cache_key=parsed.prompt_cache_key,
        prompt_cache_options=body.get("prompt_cache_options"),
        safety_identifier=parsed.safety_identifier,
        extra=dict(parsed.model_extra or {}),
        wire={DIALECT_NAME: wire},
    )


def _text(text: str, path: Path, breakpoint: Any = None) -> Text:
    return Text(text, cache_breakpoint=breakpoint is not None, source=path)


def _part(part: Any, path: Path) -> Part:
    if isinstance(part, (InputText, InstructionText, OutputText)):
        return _text(part.text, path, getattr(part, "prompt_cache_breakpoint", None))
    if isinstance(part, RefusalPart):
        return Text(part.refusal, source=path)
    if isinstance(part, (InputImage, InstructionImage)):
        return Image(url=part.image_url, detail=part.detail,
                     cache_breakpoint=getattr(part, "prompt_cache_breakpoint", None) is not None, source=path)
    return Json(part.data, source=path)


@dataclass(frozen=True)
class ItemShape:
    """How one input item was spelled: its content as a string (``plain``), ``"type": "message"`` present
    (``typed``), an assistant message's ``phase``, and which of its parts were refusals."""

    plain: bool = False
    typed: bool = False
    phase: str | None = None
    refusals: tuple[int, ...] = ()


@dataclass(frozen=True)
class OpenAIWire:
    """How an OpenAI-shaped request looked (``DecisionRequest.wire["openai"]``), so that forwarding it to an
    OpenAI-shaped upstream sends it as it came. Items are found by their ``source`` path, so an item a guardrail
    rewrites keeps its shape. Requests from other dialects have none: their shape is derived (``_shape``)."""

    bare: bool = False  # the input was a string
    items: dict[Path, ItemShape] = field(default_factory=dict)


def _content(content: Any, path: Path) -> tuple[tuple[Part, ...], bool]:
    if isinstance(content, str):
        return (Text(content, source=path),), True
    return tuple(_part(p, (*path, j)) for j, p in enumerate(content)), False


def _input(value: Any) -> tuple[tuple[Item, ...], OpenAIWire]:
    if isinstance(value, str):
        if not value.strip():
            raise invalid("input must not be blank", "input", code="empty_string")
        return (Message("user", (Text(value, source=("input",)),), source=("input",)),), OpenAIWire(bare=True)
    if not value:
        raise invalid("input must hold at least one item", "input", code="empty_array")
    items: list[Item] = []
    shapes: dict[Path, ItemShape] = {}
    for i, item in enumerate(value):
        path = ("input", i)
        if isinstance(item, (UserMessage, SystemMessage, DeveloperMessage, AssistantMessage)):
            parts, plain = _content(item.content, (*path, "content"))
            refusals = tuple(j for j, p in enumerate(item.content) if isinstance(p, RefusalPart)) if not plain else ()
            items.append(Message(item.role, parts, source=path))
            shapes[path] = ItemShape(plain, item.type is not None, getattr(item, "phase", None), refusals)
        elif isinstance(item, (FunctionCall, CustomToolCall)):
            custom = isinstance(item, CustomToolCall)
            arguments = item.input if isinstance(item, CustomToolCall) else item.arguments
            items.append(ToolCall(item.call_id, item.name, arguments, custom=custom, id=item.id,
                                  namespace=item.namespace, status=item.status, source=path))
        else:
            parts, plain = _content(item.output, (*path, "output"))
            items.append(ToolOutput(item.call_id, parts, custom=isinstance(item, CustomToolCallOutput),
                                    id=item.id, status=item.status, source=path))
            shapes[path] = ItemShape(plain)
    return tuple(items), OpenAIWire(items=shapes)


def _question(q: Any, i: int) -> Question:
    path = ("questions", i)
    if isinstance(q.instructions, str):
        if not q.instructions.strip():
            raise invalid("instructions must not be blank", *path, "instructions", code="empty_string")
        instructions: tuple[Part, ...] = (Text(q.instructions, source=(*path, "instructions")),)
    else:
        if not q.instructions:
            raise invalid("instructions must hold at least one part", *path, "instructions", code="empty_array")
        instructions = tuple(_part(p, (*path, "instructions", j)) for j, p in enumerate(q.instructions))
    if q.name is not None and not q.name.strip():
        raise invalid("name must not be empty when set", *path, "name", code="empty_string")
    if isinstance(q, PredicateQuestion):
        return Question("yes_no", q.name, instructions, source=path)
    if isinstance(q, ChoiceQuestion):
        seen: set[tuple[type, str | bool]] = set()
        options = []
        for j, c in enumerate(q.choices):
            key = (type(c.value), c.value)
            if key in seen:
                raise invalid(f"choice value {c.value!r} repeats another choice; each choice must be unique",
                              *path, "choices", j, "value")
            seen.add(key)
            options.append(Option(c.value, c.description, source=(*path, "choices", j)))
        return Question("choice", q.name, instructions, options=tuple(options), source=path)
    levels = tuple(Level(lv.label, lv.description, source=(*path, "levels", j)) for j, lv in enumerate(q.levels))
    return Question("score", q.name, instructions, levels=levels, source=path)


def _check_call_ids(items: tuple[Item, ...]) -> None:
    calls: dict[str, bool] = {}
    for item in items:
        if isinstance(item, ToolCall):
            calls[item.call_id] = item.custom
        elif isinstance(item, ToolOutput):
            if calls.get(item.call_id) is not item.custom:
                kind = "custom_tool_call" if item.custom else "function_call"
                raise invalid(f"no earlier {kind} item has call_id {item.call_id!r}; each tool output must "
                              "identify a matching call by call ID", *item.source, "call_id")


# ----------------------------------------------------------------------------------- render request


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
    out = {"type": "input_image", "image_url": part.url or _data_url(part)}
    if part.detail is not None:
        out["detail"] = part.detail
    if part.cache_breakpoint and context == "input":
        out["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return out


def _data_url(image: Image) -> str:
    import base64

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
    out: dict[str, Any] = {"type": {"yes_no": "predicate", "choice": "choice", "score": "score"}[q.kind]}
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
    from ..canonical import Usage

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


_WIRE_TYPES = {"yes_no": "predicate", "choice": "choice", "score": "score"}


def _parse_answer(raw: Any, q: Question) -> Answer:
    """One answer, nothing assumed: a missing or mistyped probability is the provider's fault, never a default."""
    if not isinstance(raw, dict) or raw.get("type") == "refusal":
        return Answer(q.kind, q.name, refusal=True)
    where = f"the answer to question {q.name or q.source}"
    if raw.get("type") != _WIRE_TYPES[q.kind]:
        raise malformed_answer(f"{where} has type {raw.get('type')!r}, not {_WIRE_TYPES[q.kind]!r}")
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


# ---------------------------------------------------------------------------------- render response


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


DIALECT = WireDialect(DIALECT_NAME, parse_request, render_response, render_error)
