"""Upstream decision providers: one small module each, one interface (canonical request in, result out), and
one registration line each in ``REGISTRY``. A new provider type is a module with a ``Provider`` subclass and a
line here::

    from .acme import AcmeProvider
    REGISTRY["acme"] = AcmeProvider      # then `type: acme` in the YAML
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..settings import ProviderConfig
from .azure import AzureProvider
from .base import Provider
from .local import LocalProvider
from .logprobs import LogprobsProvider
from .openai import OpenAIProvider
from .systemone import SystemOneProvider

REGISTRY: dict[str, type[Provider]] = {
    "openai": OpenAIProvider,
    "azure": AzureProvider,
    "systemone": SystemOneProvider,
    "local": LocalProvider,
    "logprobs": LogprobsProvider,
}


def provider_class(type_name: str) -> type[Provider]:
    try:
        return REGISTRY[type_name]
    except KeyError:
        raise ValueError(f"unknown provider type {type_name!r}; registered types: {', '.join(REGISTRY)}") from None


def build(config: ProviderConfig, engines: Mapping[str, Any] | None = None) -> Provider:
    return provider_class(config.type).from_config(config, engines or {})
