"""Azure OpenAI: the OpenAI request on the deployment's URL, with the ``api-key`` header and ``api-version``."""

from __future__ import annotations

from urllib.parse import quote

from ..settings import ProviderConfig
from .openai import OpenAIProvider


class AzureProvider(OpenAIProvider):
    @classmethod
    def check_config(cls, config: ProviderConfig) -> None:
        super().check_config(config)
        if not config.api_version:
            raise ValueError(f"provider {config.name!r} (azure) needs an api_version")

    def url(self, upstream: str, route: str = "decisions") -> str:
        deployment = quote(upstream, safe="")
        if route == "responses":  # Azure's Responses API is per resource, the deployment named in the body
            return f"{self.base_url}/openai/responses?api-version={self.config.api_version}"
        return f"{self.base_url}/openai/deployments/{deployment}/{route}?api-version={self.config.api_version}"

    def auth(self) -> dict[str, str]:
        return {"api-key": self.config.api_key} if self.config.api_key else {}
