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
(``providers.0.type: …``; from ``load``, the file and the entry's line too: ``gateway.yaml:3: providers.0.type: …``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import InputError
from .pricing import check_pricing
from .providers import provider_class
from .settings import GatewayConfig

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(InputError):
    """A config that cannot be used, with one line naming the entry at fault (``field``; ``path`` and ``line`` when
    it was read from a file)."""


def interpolate(value: Any, where: str = "") -> Any:
    if isinstance(value, str):
        def replace(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return str(default)
            raise ConfigError(f"environment variable {name} is not set", field=where or "config")

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
            raise ConfigError(str(e), field=f"providers.{i}.type") from None
        kinds[p.name] = kind
        try:
            kind.check_config(p)
            # A provider's per-request default prices only its decisions-only models (see Target.price).
            check_pricing(f"provider {p.name!r}", p.pricing, reports_tokens=kind.reports_tokens)
        except ValueError as e:
            raise ConfigError(str(e), field=f"providers.{i}") from None
    for i, m in enumerate(config.models):
        try:
            check_pricing(f"model {m.name!r}", m.pricing, m.capabilities, kinds[m.provider].reports_tokens)
        except ValueError as e:
            raise ConfigError(str(e), field=f"models.{i}") from None


def parse(data: Any) -> GatewayConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("the config must be a YAML mapping with providers, models and virtual_models")
    try:
        config = GatewayConfig.model_validate(interpolate(data))
    except ValidationError as e:
        problems = [(".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, "))
                    for err in e.errors()]
        # The first problem's field (and, from ``load``, its line), then the others, each after its own field.
        raise ConfigError("; ".join([problems[0][1], *(f"{field}: {msg}" if field else msg
                                                       for field, msg in problems[1:])]),
                          field=problems[0][0] or None) from None
    check_types(config)
    return config


def load(path: str | Path) -> GatewayConfig:
    """The config in the YAML file ``path``; a ``ConfigError`` naming the file, the line and the entry at fault."""
    text = ConfigError.read_text(path)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()  # kept for the lines of the entries
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"not YAML: {getattr(e, 'problem', None) or e}", path,
                          mark.line + 1 if mark is not None else None) from None
    finally:
        loader.dispose()
    try:
        return parse(data)
    except ConfigError as e:
        raise e.at(path, line_of(node, e.field)) from None


def line_of(node: yaml.Node | None, field: str | None) -> int | None:
    """The line of the entry ``field`` names (``providers.0.type``, ``providers[0].api_key``) in the YAML ``node``,
    or of the deepest part of it the file has (the entry that lacks a required field); None when not even its first
    part is there."""
    line = None
    for part in re.findall(r"[^.\[\]]+", field or ""):
        if isinstance(node, yaml.MappingNode):
            entry = next(((key, value) for key, value in node.value
                          if isinstance(key, yaml.ScalarNode) and key.value == part), None)
            if entry is None:
                break
            line, node = entry[0].start_mark.line + 1, entry[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return line
