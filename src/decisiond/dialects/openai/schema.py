"""OpenAI's Decisions API wire models (``POST /v1/decisions``, openai-python 3.57 contract), and the record of how a
request was spelled (``OpenAIWire``) so that forwarding it upstream sends it as it came.

Input is a string or a list of message/tool items (``type`` optional on messages, told apart by ``role``);
questions are ``predicate``/``choice``/``score``; choice values are typed (``true`` ≠ ``"true"``). The decisiond
extensions (``EXTENSION_FIELDS``) are sent by the SDK through ``extra_body``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StrictBool, StrictStr, Tag

from ...errors import Path
from ...limits import OPENAI
from ..common import StrictModel

DIALECT_NAME = "openai"

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
    rewrites keeps its shape. Requests from other dialects have none: their shape is derived (``upstream._shape``)."""

    bare: bool = False  # the input was a string
    items: dict[Path, ItemShape] = field(default_factory=dict)
