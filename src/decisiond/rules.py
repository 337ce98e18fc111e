"""Validation rules more than one dialect applies, each in one place. A dialect decides only how the error is
worded for its callers and where it points (the path), by passing the path in its own wire terms."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .errors import DecisionError, LimitExceeded, Path, invalid, refused


def check_temperature(value: Any, path: Path = ("temperature",)) -> None:
    """A temperature divides the label log-probs: a finite number above 0 (booleans are not numbers)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise invalid("temperature must be a finite number above 0", *path)


def check_unique(names: Iterable[tuple[str | None, Path]], what: str) -> None:
    """Question names (OpenAI) or ids (SGLang) must not repeat; unnamed questions (None) are not compared."""
    seen: set[str] = set()
    for name, path in names:
        if name is None:
            continue
        if name in seen:
            raise invalid(f"{what} {name!r} repeats another question; {what}s must be unique", *path,
                          code="duplicate_value")
        seen.add(name)


def check_model_name(model: str | None, path: Path = ("model",)) -> None:
    """``base:adapter`` names a LoRA adapter, which decision routes do not serve."""
    if model and ":" in model:
        adapter = model.split(":", 1)[1]
        raise refused(f"model {model!r} names the LoRA adapter {adapter!r} after a colon, which decision routes do "
                      "not support", *path)


def limit_exceeded(message: str, path: Path = ()) -> DecisionError:
    return LimitExceeded(message, path)
