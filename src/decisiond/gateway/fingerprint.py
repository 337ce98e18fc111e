"""A canonical request as JSON-able data, for keys that must change when and only when the request's meaning does
(the response cache's key; a local engine's identity)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any


def request_tree(value: Any, ordered: bool = True) -> Any:
    """A JSON-able form of a canonical request: every dataclass field that takes part in equality (never ``wire``
    nor ``source``), tagged with its type; bytes by their SHA-256; mappings as ``[key, value]`` pairs, in their
    order unless the field is marked ``UNORDERED`` (options rather than text the model reads)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: request_tree(getattr(value, f.name), not f.metadata.get("unordered", False))
                  for f in dataclasses.fields(value) if f.compare}
        return [type(value).__name__, fields]
    if isinstance(value, dict):
        pairs = [[str(k), request_tree(v, ordered)] for k, v in value.items()]
        return {"map": pairs if ordered else sorted(pairs, key=lambda p: p[0])}
    if isinstance(value, (list, tuple)):
        return [request_tree(v, ordered) for v in value]
    if isinstance(value, bytes):
        return {"sha256": hashlib.sha256(value).hexdigest()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"cannot key a {type(value).__name__}")
