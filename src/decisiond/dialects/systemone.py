"""TypeSafe's System One wire format (``POST /v1/systemone``, typesafe-sdk 0.7.5 contract). Pure translation.

Request → canonical: a ``state`` (string, object or array), a map of ``noul``/``choice``/``score`` questions keyed
by the caller's ids, optional image ``assets`` (a multipart part or base64 data, substituted wherever their key
appears inside a string of the state). Canonical → response: answers keyed by id, ``usage`` as integers.
Errors: 422 with a FastAPI ``detail`` list whose ``loc`` names the field (the discriminator tag included, as in
``["body", "questions", "q1", "score", "criteria"]``) for invalid requests; 400 ``{"error": …}`` for other refusals.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping, Union

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .. import probability
from ..canonical import (
    Answer,
    DecisionRequest,
    DecisionResult,
    Image,
    Json,
    Level,
    Message,
    Option,
    Part,
    Question,
    Text,
    Usage,
)
from ..errors import DecisionError, Path, invalid, refused
from ..limits import SYSTEM_ONE
from ..rules import check_model_name
from ..text import is_blank, render_input, render_part, render_text
from .base import WireDialect
from .common import StrictModel, answer_number, malformed_answer, validate_body

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


# ------------------------------------------------------------------------------------ parse request


def parse_request(body: Any, files: Any = None) -> DecisionRequest:
    parsed = validate_body(SystemOneBody, body, code="model_attributes_type")
    check_model_name(parsed.model)
    images = _assets(parsed.assets or {}, files or {})
    questions = tuple(_question(qid, q) for qid, q in parsed.questions.items())
    return DecisionRequest(
        input=(_state(parsed.state, images),),
        questions=questions,
        model=parsed.model,
        chat_template_kwargs=dict(parsed.chat_template_kwargs or {}),
        order=parsed.order,
        calibrate=parsed.calibrate,
    )


def _assets(assets: dict[str, AssetModel], files: Mapping[str, Any]) -> dict[str, Image]:
    images = {}
    for key, asset in assets.items():
        path = ("assets", key)
        if asset.part is not None:
            upload = files.get(asset.part)
            if upload is None:
                raise invalid(f"no multipart part named {asset.part!r} was sent", *path, "part")
            data, media_type = upload.data, upload.content_type
        elif asset.data_base64 is not None:
            if asset.format is None:
                raise invalid("format is required with data_base64", *path, "format", code="missing")
            try:
                data = base64.b64decode(asset.data_base64, validate=True)
            except (binascii.Error, ValueError) as e:
                raise invalid(f"data_base64 is not valid base64: {e}", *path, "data_base64") from e
            media_type = "image/png" if asset.format == "png" else "image/jpeg"
        else:
            raise invalid("an asset needs a multipart part or data_base64", *path, code="missing")
        images[key] = Image(data=data, media_type=media_type, source=path)
    return images


def _state(state: Any, images: dict[str, Image]) -> Message:
    """The state as one user message; asset keys inside a string state become image parts in place."""
    source = ("state",)
    if isinstance(state, str):
        parts: list[Part] = [Text(state, source=source)]
        for key, image in images.items():
            split: list[Part] = []
            for part in parts:
                if isinstance(part, Text) and key in part.text:
                    pieces = part.text.split(key)
                    for i, piece in enumerate(pieces):
                        if i:
                            split.append(image)
                        if piece:
                            split.append(Text(piece, source=source))
                else:
                    split.append(part)
            parts = split
        placed = {id(p) for p in parts if isinstance(p, Image)}
        parts += [img for img in images.values() if id(img) not in placed]
        return Message("user", tuple(parts), source=source)
    return Message("user", (Json(state, source=source), *images.values()), source=source)


def _instructions(value: Any, path: Path) -> tuple[Part, ...]:
    if is_blank(value):
        return ()
    if isinstance(value, str):
        return (Text(value, source=path),)
    return (Json(value, source=path),)


def _question(qid: str, q: Any) -> Question:
    path = ("questions", qid, q.type)
    instructions = _instructions(q.instructions, (*path, "instructions"))
    if isinstance(q, NoulQuestion):
        criteria = q.criteria or NoulCriteria()
        return Question("yes_no", qid, instructions, yes=criteria.true, no=criteria.false, source=path)
    if isinstance(q, ChoiceQuestion):
        options = tuple(Option(name, desc, source=(*path, "criteria", name)) for name, desc in q.criteria.items())
        return Question("choice", qid, instructions, options=options, source=path)
    if isinstance(q, ScoreQuestion):
        levels = tuple(Level(c, source=(*path, "criteria", i)) for i, c in enumerate(q.criteria))
        return Question("score", qid, instructions, levels=levels, source=path)
    raise refused("box questions locate things in an image; decisiond answers noul, choice and score questions",
                  *path, code="unsupported_question")


# ---------------------------------------------------------------------------------- render response


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
            "legend": {str(i): _legend(lv) for i, lv in enumerate(q.levels)},
            "probabilities": {str(i): pi for i, pi in enumerate(p)},
        }
    if a.label_mass is not None:
        out["x_label_mass"] = a.label_mass
    out.update({f"x_{k}": v for k, v in a.extensions.items()})
    return out


def _legend(level: Level) -> Any:
    if level.description is None:
        return level.label
    return f"{render_text(level.label)} - {render_text(level.description)}"


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


DIALECT = WireDialect("system_one", parse_request, render_response, render_error, strict_model=False)


def models_body(models: list[Any]) -> dict[str, Any]:
    return {"models": [{"name": m.name, "description": m.description, "release_date": m.release_date}
                       for m in models]}


# ------------------------------------------------------------------- outbound (gateway → System One)

IMAGE_TYPES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}


@dataclass
class Outbound:
    """A System One request built from the canonical form, with what is needed to map the answers back."""

    body: dict[str, Any]
    # question key on the wire, in question order
    keys: list[str]
    # (multipart part name, bytes, media type) for each image asset, in ``assets`` order
    files: list[tuple[str, bytes, str]] = field(default_factory=list)


def image_bytes(image: Image) -> tuple[bytes, str]:
    """The bytes of a base64 PNG or JPEG data URL (or of an asset); links are not fetched."""
    if image.data is not None:
        data = image.data
    else:
        url = image.url or ""
        if not url.startswith("data:"):
            raise refused("images must be base64 PNG or JPEG data URLs here: System One providers are sent the "
                          "image itself, and decisiond does not fetch links", *image.source, code="unsupported_input")
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise refused("image data URLs must be base64-encoded", *image.source, code="unsupported_input")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise refused(f"the image data URL is not valid base64: {e}", *image.source,
                          code="unsupported_input") from e
    for media_type, magic in IMAGE_TYPES.items():
        if data.startswith(magic):
            return data, media_type
    raise refused("only PNG and JPEG images can be sent to System One providers", *image.source,
                  code="unsupported_input")


def _content(parts: tuple[Part, ...], image: Callable[[Image], str]) -> Any:
    """Parts as System One content: one text part as a string, one JSON part as JSON, else joined text."""
    if len(parts) == 1 and isinstance(parts[0], Json):
        return parts[0].data
    return "\n".join(render_part(p, image) for p in parts)


def render_request(request: DecisionRequest, model: str) -> Outbound:
    """The canonical request as a System One body (GoModel's and Bud's translation rules):

    - ``state``: a string input or a single JSON part as is; otherwise user text parts joined by a blank line, or
      a transcript of a conversation (``text.render_input``); images become assets placed where they were;
    - ``questions``: keyed by name, or ``question_<n>`` (n = position) when unnamed; predicate → noul,
      choice values as names (booleans as ``"true"``/``"false"``; a boolean and a string with the same text in
      one question cannot both be sent), level descriptions joined to their labels (``label - description``).
    """
    outbound = Outbound({}, [])
    placeholders: dict[int, str] = {}

    def image(img: Image) -> str:
        if id(img) not in placeholders:
            data, media_type = image_bytes(img)
            key = f"<image:{uuid.uuid4().hex}>"
            placeholders[id(img)] = key
            outbound.files.append((f"asset-{len(outbound.files)}", data, media_type))
            outbound.body.setdefault("assets", {})[key] = {"type": "image", "part": outbound.files[-1][0]}
        return placeholders[id(img)]

    items = request.input
    single = items[0].parts if len(items) == 1 and isinstance(items[0], Message) and items[0].role == "user" else ()
    state = single[0].data if len(single) == 1 and isinstance(single[0], Json) else render_input(items, image)
    questions: dict[str, Any] = {}
    for i, q in enumerate(request.questions):
        key = q.name if q.name is not None else f"question_{i}"
        if key in questions:
            raise refused(f"question key {key!r} would be used twice in the System One request", *q.source,
                          code="duplicate_value")
        questions[key] = _outbound_question(q, image)
        outbound.keys.append(key)
    body = {"state": state, "model": model, "questions": questions}
    if "assets" in outbound.body:
        body["assets"] = outbound.body["assets"]
    outbound.body = body
    return outbound


def _outbound_question(q: Question, image: Callable[[Image], str]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": {"yes_no": "noul", "choice": "choice", "score": "score"}[q.kind]}
    if q.instructions:
        out["instructions"] = _content(q.instructions, image)
    if q.kind == "yes_no":
        if q.yes is not None or q.no is not None:
            out["criteria"] = {k: v for k, v in (("true", q.yes), ("false", q.no)) if v is not None}
    elif q.kind == "choice":
        criteria: dict[str, Any] = {}
        for option in q.options:
            if option.name in criteria:
                raise refused(f"the boolean and the string choice {option.name!r} would be the same System One "
                              "criteria name", *option.source)
            criteria[option.name] = option.description
        out["criteria"] = criteria
    else:
        out["criteria"] = [
            level.label if level.description is None
            else f"{render_text(level.label)} - {render_text(level.description)}"
            for level in q.levels
        ]
    return out


def parse_response(body: Any, request: DecisionRequest, keys: list[str]) -> DecisionResult:
    """A System One answer mapped back to the questions: choice probabilities by name (booleans restored), level
    probabilities by index; a question without an answer becomes a refusal."""
    if not isinstance(body, dict) or not isinstance(body.get("answers"), dict):
        raise malformed_answer("the System One provider answered without an answers object")
    answers = []
    for key, q in zip(keys, request.questions):
        raw = body.get("answers", {}).get(key)
        if not isinstance(raw, dict):
            answers.append(Answer(q.kind, q.name, refusal=True))
            continue
        mass = raw.get("x_label_mass")
        confidence = raw.get("confidence")
        answer = Answer(q.kind, q.name, label_mass=float(mass) if isinstance(mass, (int, float)) else None,
                        confidence=float(confidence) if isinstance(confidence, (int, float)) else None)
        where = f"the answer to {key!r}"
        wire_type = {"yes_no": "noul", "choice": "choice", "score": "score"}[q.kind]
        if raw.get("type", wire_type) != wire_type:
            raise malformed_answer(f"{where} has type {raw.get('type')!r}, not {wire_type!r}")
        if q.kind == "yes_no":
            p = answer_number(raw.get("noul"), f"{where}: noul")
            answer.probabilities = [p, 1.0 - p]
        else:
            probs = raw.get("probabilities")
            if not isinstance(probs, dict):
                raise malformed_answer(f"{where} has no probabilities object")
            names = [o.name for o in q.options] if q.kind == "choice" else [str(i) for i in range(len(q.levels))]
            stray = [k for k in probs if k not in names]
            if stray:
                raise malformed_answer(f"{where} gives a probability to {stray[0]!r}, which it was not asked about")
            answer.probabilities = [answer_number(probs.get(n), f"{where}: the probability of {n!r}") for n in names]
        answers.append(answer)
    usage = body.get("usage") or {}
    return DecisionResult(
        model=str(body.get("model") or request.model),
        answers=answers,
        usage=Usage(input_tokens=int(usage.get("input_tokens") or 0),
                    output_tokens=int(usage.get("output_tokens") or 0),
                    cost=usage.get("cost") if isinstance(usage.get("cost"), (int, float)) else None),
        provider_format="system_one",
    )
