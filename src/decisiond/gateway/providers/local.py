"""The in-process engine as a provider."""

from __future__ import annotations

from typing import Any

from ...canonical import DecisionRequest, DecisionResult
from ...engine.local import LocalEngine
from ..config import ProviderConfig
from ..limits import LOCAL
from .base import Provider

__all__ = ["LocalProvider"]


class LocalProvider(Provider):
    format = "local"
    capabilities = frozenset({"decisions", "score"})
    default_limits = LOCAL
    needs_base_url = False

    def __init__(self, config: ProviderConfig, engine: LocalEngine):
        super().__init__(config)
        self.engine = engine

    @classmethod
    def from_config(cls, config: ProviderConfig, engines: dict[str, Any]) -> "LocalProvider":
        return cls(config, engines[config.name])

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        return await self.engine.decide_async(request)
