"""Upstream decision providers: one small module each, one interface (canonical request in, result out)."""

from __future__ import annotations

from ..config import ProviderConfig
from .base import Provider


def build(config: ProviderConfig, engines: dict | None = None) -> Provider:
    if config.type == "openai":
        from .openai import OpenAIProvider

        return OpenAIProvider(config)
    if config.type == "azure":
        from .azure import AzureProvider

        return AzureProvider(config)
    if config.type == "systemone":
        from .systemone import SystemOneProvider

        return SystemOneProvider(config)
    from .local import LocalProvider

    return LocalProvider(config, (engines or {})[config.name])
