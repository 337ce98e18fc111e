"""Text values as prompts and wire formats show them: a string as is, an object or array as compact JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .canonical import Image, Item, Json, Message, Part, Question, Text, ToolCall, ToolOutput
from .errors import refused


def render_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def is_blank(value: Any) -> bool:
    """Empty or whitespace text, an empty object or array, or None."""
    return not (value.strip() if isinstance(value, str) else value)


ImageText = Callable[[Image], str]


def _no_images(image: Image) -> str:
    raise refused("images cannot be rendered as text", *image.source, code="unsupported_input")


def render_part(part: Part, image: ImageText = _no_images) -> str:
    """Text as is, JSON compact; an image through ``image`` (a placeholder for providers that take assets)."""
    if isinstance(part, Text):
        return part.text
    if isinstance(part, Json):
        return render_text(part.data)
    return image(part)


def render_input(items: Sequence[Item], image: ImageText = _no_images) -> str:
    """The input as text: user message parts joined by a blank line; anything else as a transcript.

    A conversation (several roles, tool calls and results) becomes one block per item — ``user: …``,
    ``assistant: …``, ``tool_call name: arguments``, ``tool_result: output`` — joined by blank lines.
    """
    def parts(ps: Sequence[Part]) -> str:
        return "\n\n".join(render_part(p, image) for p in ps)

    if all(isinstance(item, Message) and item.role == "user" for item in items):
        return "\n\n".join(render_part(p, image) for item in items if isinstance(item, Message) for p in item.parts)
    blocks = []
    for item in items:
        if isinstance(item, Message):
            blocks.append(f"{item.role}: " + parts(item.parts))
        elif isinstance(item, ToolCall):
            blocks.append(f"tool_call {item.name}: {item.arguments}")
        elif isinstance(item, ToolOutput):
            blocks.append("tool_result: " + parts(item.parts))
    return "\n\n".join(blocks)


def question_text(question: Question, image: ImageText = _no_images) -> str:
    """A question's instructions as one text: its parts, one per line (blank parts left out)."""
    rendered = (render_part(p, image) for p in question.instructions)
    return "\n".join(r for r in rendered if not is_blank(r))
