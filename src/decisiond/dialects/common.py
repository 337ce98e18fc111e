"""Helpers every dialect shares: JSON bodies, pydantic errors turned into one DecisionError, JSON limits."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import DecisionError, InvalidRequest, Path, ProviderError, invalid
from ..limits import JSON, MAX_DOCUMENT_DEPTH

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class StrictModel(BaseModel):
    """Wire models: no coercion (``1`` is not ``"1"``, ``"true"`` is not ``true``), no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid")


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, refused before any other work when it is not JSON, nests deeper than
    ``MAX_DOCUMENT_DEPTH`` levels, or holds text that is not valid Unicode (a lone surrogate escape)."""
    if not raw.strip():
        raise invalid("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        document = json.loads(raw)
    except RecursionError:
        raise _too_deep(()) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise invalid(f"The request body is not valid JSON: {e}", code="invalid_json") from e
    # Only a \ud800-\udfff escape makes a lone surrogate: without one in the raw body, no text needs looking at.
    check_document(document, texts=_SURROGATE_ESCAPE.search(raw) is not None)
    return document


def _too_deep(path: Path) -> DecisionError:
    return invalid(f"the request nests deeper than {MAX_DOCUMENT_DEPTH} levels", *path, code="limit_exceeded")


def check_document(document: Any, texts: bool = True) -> None:
    """Depth and Unicode (``texts``: every key and string is looked at too), checked without recursion; the error
    names the first field at fault. Numbers and the like are never visited: a body of millions of values is walked
    in a fraction of a second."""
    kinds: tuple[type, ...] = (dict, list, str) if texts else (dict, list)
    stack: list[tuple[Any, Path]] = [(document, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DOCUMENT_DEPTH:
            raise _too_deep(path[:MAX_DOCUMENT_DEPTH])
        if isinstance(node, dict):
            for key, value in node.items():
                if texts:
                    _check_text(key, path)
                if isinstance(value, kinds):
                    stack.append((value, (*path, key)))
        elif isinstance(node, list) and not set(map(type, node)).isdisjoint(kinds):  # (json.loads' own types)
            stack.extend((value, (*path, i)) for i, value in enumerate(node) if isinstance(value, kinds))
        elif isinstance(node, str):
            _check_text(node, path)


def _check_text(text: str, path: Path) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("text holds an unpaired surrogate (\\ud800-\\udfff), which is not valid Unicode", *path,
                      code="invalid_unicode") from None


def json_path(loc: Path, document: Any) -> Path:
    """Keep the parts of a pydantic ``loc`` that name keys and indices of ``document``; drop union tags.

    A last part that names a missing key is kept too (it is the missing field).
    """
    path: list[str | int] = []
    node = document
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif i == len(loc) - 1 and isinstance(node, dict) and isinstance(part, str) and not _is_tag(part):
            path.append(part)
    return tuple(path)


_TYPE_LABELS = ("str", "bool", "int", "float", "dict", "list", "none")


def _is_tag(part: str) -> bool:
    return "[" in part or ":" in part or part in _TYPE_LABELS


def fastapi_loc(loc: Path, document: Any) -> list[str | int]:
    """A pydantic ``loc`` as FastAPI reports it, minus the type labels of plain unions (``str``, ``list[any]``):
    keys, indices and discriminator tags (``["questions", "q1", "score", "criteria"]``) stay."""
    out: list[str | int] = []
    node = document
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and ("[" in part or part in _TYPE_LABELS):
            continue
        out.append(part)
    return out


_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "too_short": "array_below_min_length",
    "too_long": "array_above_max_length",
    "union_tag_invalid": "invalid_value",
    "union_tag_not_found": "missing_required_parameter",
    "literal_error": "invalid_value",
    "value_error": "invalid_value",
    "string_too_long": "string_above_max_length",
    "string_too_short": "string_below_min_length",
}


Body = TypeVar("Body", bound=BaseModel)


def validate_body(schema: type[Body], body: Any, code: str = "invalid_type") -> Body:
    """A request body parsed by its dialect's schema; anything else is refused naming the field at fault."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code=code)
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise from_validation(e, body) from None


def from_validation(error: ValidationError, document: Any) -> DecisionError:
    """One DecisionError for a pydantic error: the deepest problem, named by its JSON path."""
    errors = error.errors(include_url=False)
    scored = [(len(json_path(e["loc"], document)), -i, e) for i, e in enumerate(errors)]
    _, _, best = max(scored, key=lambda s: (s[0], s[1]))
    path = json_path(best["loc"], document)
    if best["type"] in ("union_tag_invalid", "union_tag_not_found"):
        # The discriminator field itself is at fault: questions[0].type, not questions[0].
        field = str(best.get("ctx", {}).get("discriminator", "")).strip("'")
        if field.isidentifier():
            path = (*path, field)
    code = _CODES.get(best["type"], "invalid_type" if best["type"].endswith("_type") else "invalid_value")
    if best["type"] == "missing":
        reason = "Field required"
    elif best["type"] == "extra_forbidden":
        reason = "Unknown field"
    else:
        # Union members fail at the same place: say every way the value could have been right.
        msgs = list(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in errors
                                  if json_path(e["loc"], document) == json_path(best["loc"], document)))
        reason = ", or ".join([msgs[0], *(m[:1].lower() + m[1:] for m in msgs[1:])])
    details: list[dict[str, Any]] = []
    for e in errors:
        loc, msg = fastapi_loc(e["loc"], document), e["msg"].removeprefix("Value error, ")
        same = next((d for d in details if d["loc"] == loc), None)
        if same is None:
            details.append({"loc": loc, "msg": msg, "type": e["type"]})
        elif msg not in same["msg"]:  # the members of one union failing at one place
            same["msg"] += ", or " + msg[:1].lower() + msg[1:]
    return InvalidRequest(reason, path, code=code, validation=True, details=details)


def malformed_answer(message: str) -> DecisionError:
    """An upstream answer that does not answer the question asked: the provider's failure (502, failover)."""
    return ProviderError(message, code="upstream_invalid_response")


def answer_number(value: Any, what: str) -> float:
    """A number an upstream answer must hold; a missing or non-numeric one is never replaced by a default."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise malformed_answer(f"{what} is {value!r}, not a number")
    return float(value)


def check_json_limits(data: Any, path: Path) -> None:
    """OpenAI's input_json limits (``limits.JSON``): container levels, values, bytes of compact UTF-8 JSON."""
    values = 0
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        values += 1
        if isinstance(node, (dict, list)):
            if depth > JSON.max_depth:
                raise invalid(f"JSON data nests deeper than {JSON.max_depth} container levels", *path,
                              code="limit_exceeded")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
        if values > JSON.max_values:
            raise invalid(f"JSON data holds more than {JSON.max_values} values", *path, code="limit_exceeded")
    size = len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode())
    if size > JSON.max_bytes:
        raise invalid(f"JSON data is {size} bytes of compact UTF-8, above the {JSON.max_bytes} byte limit", *path,
                      code="limit_exceeded")
