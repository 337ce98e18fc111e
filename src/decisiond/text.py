"""Text values as prompts and wire formats show them: a string as is, an object or array as compact JSON."""

from __future__ import annotations

import json
from typing import Any


def render_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def is_blank(value: Any) -> bool:
    """Empty or whitespace text, an empty object or array, or None."""
    return not (value.strip() if isinstance(value, str) else value)
