"""The System One dialect as decisiond's client (gateway → a System One provider): a canonical request → the body,
question keys and image files to send (``render_request``), and the provider's answer → a canonical result
(``parse_response``); used by ``gateway/providers/systemone.py``. Images travel as PNG or JPEG assets
(``image_bytes``); links are not fetched.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...canonical import Answer, DecisionRequest, DecisionResult, Image, Json, Message, Part, Question, Usage
from ...errors import refused
from ...text import ImageText, render_input, render_part
from ..common import answer_number, malformed_answer
from .schema import level_text

# Canonical question kind → the System One question (and answer) type.
WIRE_TYPES = {"yes_no": "noul", "choice": "choice", "score": "score"}

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


def _content(parts: tuple[Part, ...], image: ImageText) -> Any:
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


def _outbound_question(q: Question, image: ImageText) -> dict[str, Any]:
    out: dict[str, Any] = {"type": WIRE_TYPES[q.kind]}
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
        out["criteria"] = [level_text(level) for level in q.levels]
    return out


def parse_response(body: Any, request: DecisionRequest, keys: list[str]) -> DecisionResult:
    """A System One answer mapped back to the questions: choice probabilities by name (booleans restored), level
    probabilities by index; a question without an answer becomes a refusal."""
    if not isinstance(body, dict) or not isinstance(body.get("answers"), dict):
        raise malformed_answer("the System One provider answered without an answers object")
    answers = [_parse_answer(body["answers"].get(key), key, q) for key, q in zip(keys, request.questions)]
    usage = body.get("usage") or {}
    return DecisionResult(
        model=str(body.get("model") or request.model),
        answers=answers,
        usage=Usage(input_tokens=int(usage.get("input_tokens") or 0),
                    output_tokens=int(usage.get("output_tokens") or 0),
                    cost=usage.get("cost") if isinstance(usage.get("cost"), (int, float)) else None),
        provider_format="system_one",
    )


def _parse_answer(raw: Any, key: str, q: Question) -> Answer:
    """One answer, nothing assumed: a missing or mistyped probability is the provider's fault, never a default."""
    if not isinstance(raw, dict):
        return Answer(q.kind, q.name, refusal=True)
    mass = raw.get("x_label_mass")
    confidence = raw.get("confidence")
    answer = Answer(q.kind, q.name, label_mass=float(mass) if isinstance(mass, (int, float)) else None,
                    confidence=float(confidence) if isinstance(confidence, (int, float)) else None)
    where = f"the answer to {key!r}"
    wire_type = WIRE_TYPES[q.kind]
    if raw.get("type", wire_type) != wire_type:
        raise malformed_answer(f"{where} has type {raw.get('type')!r}, not {wire_type!r}")
    if q.kind == "yes_no":
        p = answer_number(raw.get("noul"), f"{where}: noul")
        answer.probabilities = [p, 1.0 - p]
        return answer
    probs = raw.get("probabilities")
    if not isinstance(probs, dict):
        raise malformed_answer(f"{where} has no probabilities object")
    names = [o.name for o in q.options] if q.kind == "choice" else [str(i) for i in range(len(q.levels))]
    stray = [k for k in probs if k not in names]
    if stray:
        raise malformed_answer(f"{where} gives a probability to {stray[0]!r}, which it was not asked about")
    answer.probabilities = [answer_number(probs.get(n), f"{where}: the probability of {n!r}") for n in names]
    return answer
