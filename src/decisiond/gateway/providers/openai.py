"""OpenAI's native ``/v1/decisions`` (also vLLM's OpenAI-shaped route): the request as sent, model replaced."""

from __future__ import annotations

from typing import Any

import httpx

from ...canonical import DecisionRequest, DecisionResult
from ...dialects import openai as wire
from ...errors import provider_error
from ..settings import ProviderConfig
from .base import HttpProvider


class OpenAIProvider(HttpProvider):
    format = "openai"
    capabilities = frozenset({"decisions", "chat", "images"})

    @classmethod
    def images_by_default(cls, config: ProviderConfig) -> bool:
        return True

    def url(self, upstream: str, route: str = "decisions") -> str:
        """``route``: decisions, chat/completions or responses."""
        return f"{self.base_url}/{route}"

    async def open_chat(self, route: str, body: dict[str, Any], upstream: str) -> httpx.Response:
        """Chat traffic (``chat/completions``, ``responses``): ``body`` as given, the response opened as a stream so
        that server-sent events pass through as they come. Only connecting is bounded here (``chat.connect_timeout_s``);
        the wait for the first byte and between chunks is the caller's (``gateway.forward``). The caller closes it."""
        chat = self.config.chat
        request = self.client.build_request(
            "POST", self.url(upstream, route), headers=self.headers(self.auth()), json=body,
            timeout=httpx.Timeout(None, connect=chat.connect_timeout_s, pool=chat.connect_timeout_s))
        try:
            return await self.client.send(request, stream=True)
        except httpx.TimeoutException as e:
            raise provider_error(self.name, 504, f"provider {self.name!r} timed out: {type(e).__name__}",
                                 code="upstream_timeout") from e
        except httpx.HTTPError as e:
            raise provider_error(self.name, 502, f"provider {self.name!r} is unreachable: {type(e).__name__}",
                                 code="upstream_unavailable") from e

    async def decide(self, request: DecisionRequest, upstream: str) -> DecisionResult:
        data = await self.post(self.url(upstream), self.auth(), json=wire.render_request(request, upstream))
        return self.translate(wire.parse_response, data, request)
