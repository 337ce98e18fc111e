"""SGLang's own ``/v1/decisions`` dialect. Pure translation.

Request: ``input`` (string, object or array; not blank), ``questions`` with ``id``, ``type`` ``choice`` (2–26
``options`` ``{name, description}``), ``score`` (2–10 ``levels``) or ``yes_no`` (optional ``yes``/``no``
descriptions), ``question`` text; ``temperature``, ``chat_template_kwargs``, ``prompt_format_version``,
``return_prompt_token_ids``, ``model``. Unknown fields anywhere are refused.
Response: ``{object: "decisions", model, prompt_format_version, answers: {id: …}, usage}``.
Errors: 400 ``ErrorResponse`` ``{object: "error", message, type, param, code}``, naming the question id or position.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Field

from .. import probability
from ..canonical import Answer, DecisionRequest, DecisionResult, Json, Level, Message, Option, Part, Question, Text
from ..errors import DecisionError, Path, ProviderError, openai_param
from ..limits import SGLANG
from ..rules import check_model_name, check_temperature, check_unique
from ..text import is_blank
from .base import WireDialect
from .common import StrictModel, validate_body

DecisionText = Union[str, dict[str, Any], list[Any]]


def _nonblank(value: Any) -> Any:
    if is_blank(value):
        raise ValueError("must not be blank")
    return value


RequiredText = Annotated[DecisionText, AfterValidator(_nonblank)]
QuestionId = Annotated[str, AfterValidator(_nonblank)]


class OptionModel(StrictModel):
    name: str
    description: DecisionText | None = None


class ChoiceQuestion(StrictModel):
    id: QuestionId
    type: Literal["choice"]
    question: RequiredText
    options: list[OptionModel] = Field(min_length=SGLANG.min_choices, max_length=SGLANG.max_choices)


class ScoreQuestion(StrictModel):
    id: QuestionId
    type: Literal["score"]
    question: RequiredText
    levels: list[RequiredText] = Field(min_length=SGLANG.min_levels, max_length=SGLANG.max_levels)


class YesNoQuestion(StrictModel):
    id: QuestionId
    type: Literal["yes_no"]
    question: RequiredText
    yes: DecisionText | None = None
    no: DecisionText | None = None


QuestionModel = Annotated[Union[ChoiceQuestion, ScoreQuestion, YesNoQuestion], Field(discriminator="type")]


class SGLangBody(StrictModel):
    input: RequiredText
    questions: list[QuestionModel] = Field(min_length=1, max_length=SGLANG.max_questions)
    temperature: float | None = None  # 1 when unset; checked by rules.check_temperature
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    prompt_format_version: int | None = None
    return_prompt_token_ids: bool = False
    model: str | None = None
    # decisiond extensions
    order: Literal["given", "cyclic"] | None = None
    calibrate: Literal["none", "contextual"] | None = None


DEFAULT_MODEL = "default"


# ------------------------------------------------------------------------------------ parse request


def parse_request(body: Any, files: Any = None) -> DecisionRequest:
    parsed = validate_body(SGLangBody, body)
    check_model_name(parsed.model)
    check_unique(((q.id, ("questions", i, "id")) for i, q in enumerate(parsed.questions)), "question id")
    check_temperature(parsed.temperature)
    return DecisionRequest(
        input=(_input(parsed.input),),
        questions=tuple(_question(q, i) for i, q in enumerate(parsed.questions)),
        model=parsed.model or DEFAULT_MODEL,
        temperature=parsed.temperature,
        chat_template_kwargs=dict(parsed.chat_template_kwargs),
        prompt_format_version=parsed.prompt_format_version,
        return_prompt_token_ids=parsed.return_prompt_token_ids,
        order=parsed.order,
        calibrate=parsed.calibrate,
    )


def _text_part(value: Any, path: Path) -> Part:
    return Text(value, source=path) if isinstance(value, str) else Json(value, source=path)


def _input(value: Any) -> Message:
    return Message("user", (_text_part(value, ("input",)),), source=("input",))


def _question(q: Any, i: int) -> Question:
    path = ("questions", i)
    instructions = (_text_part(q.question, (*path, "question")),)
    if isinstance(q, ChoiceQuestion):
        options = tuple(Option(o.name, o.description, source=(*path, "options", j)) for j, o in enumerate(q.options))
        return Question("choice", q.id, instructions, options=options, source=path)
    if isinstance(q, ScoreQuestion):
        levels = tuple(Level(lv, source=(*path, "levels", j)) for j, lv in enumerate(q.levels))
        return Question("score", q.id, instructions, levels=levels, source=path)
    return Question("yes_no", q.id, instructions, yes=q.yes, no=q.no, source=path)


# ---------------------------------------------------------------------------------- render response


def render_response(result: DecisionResult, request: DecisionRequest) -> dict[str, Any]:
    refused_by = next((q for a, q in zip(result.answers, request.questions) if a.refusal), None)
    if refused_by is not None:  # SGLang's answers have no refusal: the question went unanswered upstream
        raise ProviderError(f"the provider did not answer question {refused_by.name!r}", code="upstream_refusal")
    answers = {q.name: _render_answer(a, q) for a, q in zip(result.answers, request.questions)}
    tokens = int(result.usage.input_tokens)
    usage: dict[str, Any] = {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    if result.usage.cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": int(result.usage.cached_tokens)}
    return {
        "object": "decisions",
        "model": request.model or DEFAULT_MODEL,
        "prompt_format_version": result.prompt_format_version,
        "answers": answers,
        "usage": usage,
    }


def _names(q: Question) -> list[str]:
    if q.kind == "choice":
        return [o.name for o in q.options]
    if q.kind == "score":
        return [str(i) for i in range(len(q.levels))]
    return ["yes", "no"]


def _render_answer(a: Answer, q: Question) -> dict[str, Any]:
    p = a.probabilities
    out: dict[str, Any] = {"type": q.kind, "probabilities": dict(zip(_names(q), p)), "label_mass": a.label_mass}
    if q.kind == "choice":
        out["choice"] = q.options[probability.argmax(p)].name
    elif q.kind == "score":
        out["score"] = probability.expected_level(p)
    if a.prompt_token_ids is not None:
        out["prompt_token_ids"] = a.prompt_token_ids
        out["label_token_ids"] = a.label_token_ids
    out.update(a.extensions)
    return out


# ------------------------------------------------------------------------------------------- errors


def where(path: Path, questions: Any = None) -> str:
    """``question 'team' (questions[1]).options[0]`` when the path enters a question, else the field."""
    param = openai_param(path) or ""
    if len(path) >= 2 and path[0] == "questions" and isinstance(path[1], int):
        qid = None
        if isinstance(questions, list) and path[1] < len(questions) and isinstance(questions[path[1]], dict):
            qid = questions[path[1]].get("id")
        rest = openai_param(path[2:]) or ""
        rest = rest if rest.startswith("[") or not rest else "." + rest
        named = isinstance(qid, str) and not is_blank(qid)
        label = f"question {qid!r} (questions[{path[1]}])" if named else f"questions[{path[1]}]"
        return label + rest
    return param


def error_body(error: DecisionError, questions: Any = None) -> dict[str, Any]:
    message = error.message
    if error.path:
        message = f"{where(error.path, questions)}: {message}"
    return {"object": "error", "message": message, "type": "BadRequestError" if error.status == 400 else error.type,
            "param": openai_param(error.path), "code": error.status}


def render_error(error: DecisionError, document: Any = None) -> tuple[int, dict[str, Any]]:
    questions = document.get("questions") if isinstance(document, dict) else None
    return error.status, error_body(error, questions)


DIALECT = WireDialect("sglang", parse_request, render_response, render_error, strict_model=False)
