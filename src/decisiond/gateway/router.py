"""Which model answers a request. Today: the local engine, under its served name or ``default``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..canonical import DecisionRequest, DecisionResult, ScoreRequest, ScoreResult
from ..engine.local import LocalEngine
from ..errors import DecisionError

DEFAULT_ALIAS = "default"


@dataclass
class ModelInfo:
    name: str
    owned_by: str = "decisiond"
    description: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    release_date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))
    capabilities: tuple[str, ...] = ("decisions",)


class Router:
    def __init__(self, local: LocalEngine):
        self.local = local
        self.started = int(time.time())

    def resolve(self, name: str | None, strict: bool = True) -> LocalEngine:
        """The provider for ``name``. Lenient routes (System One, SGLang) accept any name for the local model."""
        if not strict or name in (None, DEFAULT_ALIAS, self.local.name):
            return self.local
        raise DecisionError(
            f"The model {name!r} does not exist or is not served here; served models: "
            f"{', '.join(repr(m.name) for m in self.models())} (or {DEFAULT_ALIAS!r}).",
            ("model",),
            code="model_not_found",
        )

    async def decide(self, request: DecisionRequest, strict: bool = True) -> DecisionResult:
        engine = self.resolve(request.model, strict)
        # Tokenization and forward passes run off the event loop.
        return await engine.decide_async(request)

    async def score(self, request: ScoreRequest) -> ScoreResult:
        engine = self.resolve(request.model, strict=False)
        return await engine.score_async(request)

    def models(self) -> list[ModelInfo]:
        loaded = self.local.loaded
        return [
            ModelInfo(
                name=self.local.name,
                description=f"{loaded.name} ({loaded.parameters / 1e6:.0f}M parameters, {loaded.dtype}, "
                f"{loaded.device}) answering decisions locally",
                created=self.started,
                release_date=loaded.release_date,
            )
        ]
