"""TypeSafe's System One wire models (``POST /v1/systemone``, typesafe-sdk 0.7.5 contract): the request body
(``SystemOneBody``: a ``state``, ``noul``/``choice``/``score``/``box`` questions keyed by the caller's ids, image
``assets``), and how a level is spelled on this wire (``level_text``), shared by both directions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ...canonical import Level
from ...limits import SYSTEM_ONE
from ...text import is_blank, render_text
from ..common import StrictModel

Content = Union[str, dict[str, Any], list[Any]]


class NoulCriteria(StrictModel):
    true: Content | None = None
    false: Content | None = None


class NoulQuestion(StrictModel):
    type: Literal["noul"]
    instructions: Content | None = None
    criteria: NoulCriteria | None = None

    @model_validator(mode="after")
    def _asks_something(self) -> "NoulQuestion":
        described = self.criteria is not None and (
            not is_blank(self.criteria.true) or not is_blank(self.criteria.false))
        if is_blank(self.instructions) and not described:
            raise ValueError("a noul question needs instructions, or a non-empty criteria.true or criteria.false")
        return self


class ChoiceQuestion(StrictModel):
    type: Literal["choice"]
    instructions: Content | None = None
    criteria: dict[str, Content | None] = Field(min_length=1, max_length=SYSTEM_ONE.max_choices)


class ScoreQuestion(StrictModel):
    type: Literal["score"]
    instructions: Content | None = None
    criteria: list[Content] = Field(min_length=1, max_length=SYSTEM_ONE.max_levels)


class BoxQuestion(StrictModel):
    type: Literal["box"]
    instructions: Content | None = None


QuestionModel = Annotated[Union[NoulQuestion, ChoiceQuestion, ScoreQuestion, BoxQuestion], Field(discriminator="type")]


class AssetModel(StrictModel):
    type: Literal["image"] | None = None
    format: Literal["png", "jpg", "jpeg"] | None = None
    data_base64: str | None = None
    part: str | None = None


_DECISIONS_ONLY = ("temperature", "prompt_format_version", "return_prompt_token_ids")


class SystemOneBody(StrictModel):
    # Unknown top-level fields are ignored, as the System One API does.
    model_config = ConfigDict(strict=True, extra="ignore")

    state: Content
    model: str
    questions: dict[str, QuestionModel] = Field(min_length=1)
    assets: dict[str, AssetModel] | None = Field(default=None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    # decisiond extensions (the SDK sends them through extra_body)
    order: Literal["given", "cyclic"] | None = None
    calibrate: Literal["none", "contextual"] | None = None
    temperature: Any = None
    prompt_format_version: Any = None
    return_prompt_token_ids: Any = None

    @field_validator(*_DECISIONS_ONLY)
    @classmethod
    def _null_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is a /v1/decisions field; /v1/systemone accepts it only as null")
        return value


def level_text(level: Level) -> Any:
    """A level as System One criteria and legends spell it: the label, or ``label - description``."""
    if level.description is None:
        return level.label
    return f"{render_text(level.label)} - {render_text(level.description)}"
