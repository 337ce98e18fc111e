"""OpenAI request parsing: a ``/v1/decisions`` body → the canonical ``DecisionRequest``.

Each canonical part keeps its ``source`` path, so an error raised later names the field the OpenAI way
(``questions[1].choices[0]``); how the input was spelled is kept in ``request.wire["openai"]`` (``OpenAIWire``).
"""

from __future__ import annotations

from typing import Any

from ...canonical import (
    DecisionRequest,
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
from ...errors import Path, invalid
from ...rules import check_temperature, check_unique
from ..common import validate_body
from .schema import (
    DIALECT_NAME,
    AssistantMessage,
    ChoiceQuestion,
    CustomToolCall,
    CustomToolCallOutput,
    DecisionBody,
    DeveloperMessage,
    FunctionCall,
    InputImage,
    InputText,
    InstructionImage,
    InstructionText,
    ItemShape,
    OpenAIWire,
    OutputText,
    PredicateQuestion,
    RefusalPart,
    SystemMessage,
    UserMessage,
)


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
