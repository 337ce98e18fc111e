"""The in-process engine as a provider."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...canonical import DecisionRequest, DecisionResult, ScoreRequest, ScoreResult
from ...engine.prompt import PROMPT_FORMAT_VERSION
from ..fingerprint import request_tree
from ..settings import ProviderConfig
from ..sizes import LOCAL
from .base import Provider

if TYPE_CHECKING:  # the engine (torch, transformers) is imported by whoever builds one, not by the gateway
    from ...engine.local import LocalEngine


class LocalProvider(Provider):
    format = "local"
    capabilities = frozenset({"decisions", "score", "engine_options"})
    default_limits = LOCAL
    needs_base_url = False
    timed_by_router = False  # the engine bounds its own work (admission, x-decisiond-timeout-ms)
    cached_by_default = True  # a decision is a pure function of the weights and the request

    def __init__(self, config: ProviderConfig, engine: LocalEngine):
        super().__init__(config)
        self.engine = engine

    @classmethod
    def from_config(cls, config: ProviderConfig, engines: Mapping[str, Any]) -> "LocalProvider":
        return cls(config, engines[config.name])

    @property
    def own_model(self) -> str:
        return self.engine.name

    def describe(self) -> str:
        return self.engine.describe()

    def release_date(self) -> str:
        return self.engine.release_date

    def cache_identity(self) -> dict[str, Any]:
        engine = self.engine
        profile = engine.profile
        return {
            "name": engine.name, "path": str(engine.loaded.path), "dtype": engine.loaded.dtype,
            "context_length": engine.loaded.context_length, "order": engine.order, "calibrate": engine.calibrate,
            "prompt_format_version": PROMPT_FORMAT_VERSION,
            "profile": request_tree(dataclasses.asdict(profile)) if profile is not None else None}

    def engines(self) -> dict[str, Any]:
        return {self.engine.name: self.engine}

    async def input_tokens(self, request: DecisionRequest) -> int:
        """Exactly what the engine will count: every rendered prompt of every question (and order variant)."""
        prepared = await asyncio.to_thread(self.engine.prepare, request)
        return sum(len(v.prompt.ids) for q in prepared.questions for v in q.variants)

    def detokenize(self, ids: tuple[int, ...]) -> str:
        return str(self.engine.tokenizer.decode(list(ids)))

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        result = await self.engine.decide_async(request)
        result.model = upstream
        return result

    async def score(self, request: ScoreRequest) -> ScoreResult:
        return await self.engine.score_async(request)
