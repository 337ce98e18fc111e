"""The configuration of prompt guardrails (``GatewayConfig.guardrails``; ``stages.guardrails`` runs them). Pure
configuration models, as ``settings``."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .access_settings import check_user_path

Action = Literal["block", "warn", "redact"]
Detector = Literal["email", "phone", "card", "iban", "ip"]
DETECTOR_NAMES: tuple[Detector, ...] = ("email", "phone", "card", "iban", "ip")


class PatternConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    pattern: str = Field(min_length=1, max_length=1000)
    """A Python regular expression."""
    action: Action | None = None
    """What a match does; unset: the guardrail's action."""
    replacement: str = "[REDACTED]"
    """What a redacted match is replaced with."""


class GuardrailConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The name models, virtual models and keys list it by."""
    type: Literal["regex", "pii", "decision_judge"]
    """``regex`` (patterns), ``pii`` (detectors) or ``decision_judge`` (a decision model asked a yes/no question)."""
    order: int = 0
    """Guardrails run in ascending order."""
    action: Action = "block"
    """``block`` (400), ``warn`` (a header, the request goes on) or ``redact`` (matches replaced)."""
    fail_mode: Literal["closed", "open"] = "closed"
    """When the guardrail itself fails (a judge that errors or times out): ``closed`` refuses the request, ``open``
    lets it through.
    """
    timeout_ms: int = Field(default=5000, ge=1)
    """How long a judge may take."""
    patterns: list[PatternConfig] = Field(default_factory=list)
    """regex: the patterns."""
    detectors: list[Detector] = Field(default_factory=lambda: list(DETECTOR_NAMES))
    """pii: which detectors run."""
    model: str | None = None
    """decision_judge: the model (or virtual model) that judges."""
    instructions: str | None = None
    """decision_judge: the yes/no question asked of the request's text."""
    yes: str | None = None
    """decision_judge: what yes means (a description of the option)."""
    no: str | None = None
    """decision_judge: what no means."""
    threshold: float = Field(default=0.5, ge=0, le=1)
    """decision_judge: P(yes) at or above which the guardrail acts."""
    user_path: str = "/guardrails"
    """decision_judge: the user path the judge's own usage rows are charged to."""

    @model_validator(mode="after")
    def _complete(self) -> "GuardrailConfig":
        if self.type == "regex":
            if not self.patterns:
                raise ValueError(f"guardrail {self.name!r} (regex) needs patterns")
            for p in self.patterns:
                try:
                    re.compile(p.pattern)
                except re.error as e:
                    raise ValueError(f"guardrail {self.name!r}: pattern {p.pattern!r} is not a regex: {e}") from None
        if self.type == "decision_judge" and not (self.model and self.instructions):
            raise ValueError(f"guardrail {self.name!r} (decision_judge) needs a model and instructions")
        if self.type == "decision_judge" and self.action == "redact":
            raise ValueError(f"guardrail {self.name!r}: a judge blocks or warns; it cannot redact")
        check_user_path(self.user_path)
        return self


def unknown_guardrail(names: Iterable[str], defined: Collection[str]) -> str | None:
    """The first of ``names`` that is not a configured guardrail, else None: models, virtual models and keys (static
    or managed) may only name configured guardrails."""
    return next((n for n in names if n not in defined), None)
