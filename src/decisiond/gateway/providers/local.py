"""The in-process engine as a provider."""

from __future__ import annotations

from ...canonical import DecisionRequest, DecisionResult
from ...engine.local import LocalEngine
from ..config import ProviderConfig
from ..limits import LOCAL
from .base import Provider


class LocalProvider(Provider):
    format = "local"
    default_limits = LOCAL

    def __init__(self, config: ProviderConfig, engine: LocalEngine):
        super().__init__(config)
        self.engine = engine

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        return await self.engine.decide_async(request)
