"""Loading the gateway's YAML config: read the file, replace ``${ENV}``, validate the models (``gateway.settings``),
then check every provider entry against its registered type (``gateway.providers.REGISTRY``).

```yaml
providers:
  - {name: openai, type: openai, base_url: "https://api.openai.com/v1", api_key: "${OPENAI_API_KEY}"}
  - {name: azure, type: azure, base_url: "https://res.openai.azure.com", api_key: "${AZURE_KEY}",
     api_version: "2026-06-01"}
  - {name: jev, type: systemone, base_url: "https://api.typesafe.ai", api_key: "${TYPESAFE_API_KEY}"}
  - {name: kev, type: systemone, base_url: "http://kev.internal:8008"}
  - {name: local, type: local, model: default}
models:                       # optional: extra names and per-model settings; "provider/upstream" always works
  - {name: luna, provider: openai, upstream: gpt-6-luna}
  - {name: gpt-chat, provider: openai, upstream: gpt-6, capabilities: [chat]}
virtual_models:
  - {name: classifier, strategy: failover, targets: [kev/kev-latest, openai/gpt-6-luna]}
  - {name: fast, strategy: alias, targets: [local/default]}
```

``${VAR}`` and ``${VAR:-default}`` are replaced in every string; a missing variable without a default is an error
that names it. Everything is validated at start-up, with messages that name the entry at fault
(``providers.0.type: …``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .pricing import check_pricing
from .providers import provider_class
from .settings import GatewayConfig

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """A config that cannot be used, with one line naming the entry at fault."""


def interpolate(value: Any, where: str = "") -> Any:
    if isinstance(value, str):
        def replace(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return str(default)
            raise ConfigError(f"{where or 'config'}: environment variable {name} is not set")

        return _VAR.sub(replace, value)
    if isinstance(value, list):
        return [interpolate(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: interpolate(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    return value


def check_types(config: GatewayConfig) -> None:
    """Each provider entry against its registered type (its own fields, its default price), and each model's price
    against what its provider reports. Raises ConfigError naming the entry."""
    kinds = {}
    for i, p in enumerate(config.providers):
        try:
            kind = provider_class(p.type)
        except ValueError as e:
            raise ConfigError(f"providers.{i}.type: {e}") from None
        kinds[p.name] = kind
        try:
            kind.check_config(p)
            # A provider's per-request default prices only its decisions-only models (see Target.price).
            check_pricing(f"provider {p.name!r}", p.pricing, reports_tokens=kind.reports_tokens)
        except ValueError as e:
            raise ConfigError(f"providers.{i}: {e}") from None
    for i, m in enumerate(config.models):
        try:
            check_pricing(f"model {m.name!r}", m.pricing, m.capabilities, kinds[m.provider].reports_tokens)
        except ValueError as e:
            raise ConfigError(f"models.{i}: {e}") from None


def parse(data: Any) -> GatewayConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("the config must be a YAML mapping with providers, models and virtual_models")
    try:
        config = GatewayConfig.model_validate(interpolate(data))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        raise ConfigError(problems) from None
    check_types(config)
    return config


def load(path: str | Path) -> GatewayConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    return parse(data)
