"""System One request parsing: a ``/v1/systemone`` body (and its multipart files) → the canonical
``DecisionRequest``. The state becomes one user message; image assets (a multipart part or base64 data) are put
wherever their key appears inside a string state; ``box`` questions are refused.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Mapping

from ...canonical import DecisionRequest, Image, Json, Level, Message, Option, Part, Question, Text
from ...errors import Path, invalid, refused
from ...rules import check_model_name
from ...text import is_blank
from ..common import validate_body
from .schema import AssetModel, ChoiceQuestion, NoulCriteria, NoulQuestion, ScoreQuestion, SystemOneBody


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

