"""OpenAI's native ``/v1/decisions`` (also vLLM's OpenAI-shaped route): the request as sent, model replaced."""

from __future__ import annotations

from ...canonical import DecisionRequest, DecisionResult
from ...dialects import openai as wire
from ..config import ProviderConfig
from .base import HttpProvider

__all__ = ["OpenAIProvider"]


class OpenAIProvider(HttpProvider):
    format = "openai"
    capabilities = frozenset({"decisions", "chat", "images"})

    @classmethod
    def images_by_default(cls, config: ProviderConfig) -> bool:
        return True

    def url(self, upstream: str) -> str:
        return f"{self.base_url}/decisions"

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        data = await self.post(self.url(upstream), self.auth(), json=wire.render_request(request, upstream))
        return self.translate(wire.parse_response, data, request)
