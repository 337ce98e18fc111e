"""Which model a name means: every spelling of a model resolves to one entry, and the entry carries the model's policy.

The catalog holds the configured models (``models:`` entries), the model each in-process provider runs itself (under
its served name, or ``<provider>/<model>`` where that name is taken), and the virtual models. Every other way of
naming a model is an alias of one of them:

- ``<provider>/<upstream>`` of a configured entry (``fs1/secret-upstream-model`` → ``s1m``);
- ``<provider>/<model>``, ``<model>`` and ``<provider>/default`` of a provider that runs its own model;
- ``default``: the default model.

A request may use any of them; the name it resolves to (``canonical``) is the one every policy is keyed on:
allowlists, guardrails, prices, rate limits, budgets and usage rows. A spelling that two entries share is refused
rather than guessed. A ``<provider>/<upstream>`` that no entry covers is a *raw upstream*: refused unless the config
says ``allow_raw_upstreams: true``, and then usable only by the keys whose allowlist names it (``stages.allowlist``).
The targets of virtual models may be raw upstreams: the operator named them, and a virtual model carries its own
policy besides its targets' entries.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..canonical import DecisionRequest
from ..errors import DecisionError, InvalidRequest, NotFound
from ..limits import DEFAULT_MAX_OUTPUT_TOKENS
from .config import ConfigError
from .pricing import Pricing
from .providers import build
from .providers.base import Provider
from .settings import GatewayConfig, ModelConfig, ProviderConfig
from .sizes import check_provider
from .virtual import VirtualModelConfig

DEFAULT_ALIAS = "default"
C = TypeVar("C", bound="Catalog")


@dataclass
class ModelInfo:
    name: str
    owned_by: str = "decisiond"
    description: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    release_date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))
    capabilities: tuple[str, ...] = ("decisions",)


@dataclass
class Target:
    """One model a provider serves, under its canonical name."""

    name: str
    provider: Provider
    upstream: str
    capabilities: tuple[str, ...] = ("decisions",)
    images: bool | None = None
    description: str = ""
    # The model's own price; else its provider's default (see ``price``).
    pricing: Pricing | None = None
    # The model's ``cache`` setting (None: its provider's).
    cache: bool | None = None
    # False for a raw upstream (a ``<provider>/<upstream>`` no entry covers): it has no policy of its own.
    configured: bool = True
    # The output tokens an answer may bill when the request sets no limit (budgets reserve it).
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS

    @property
    def price(self) -> Pricing | None:
        """What this target costs: its own price, else its provider's — a per-request default only for a model that
        serves nothing but decisions (a model that also serves chat stays unpriced behind it)."""
        if self.pricing is not None:
            return self.pricing
        default: Pricing | None = self.provider.config.pricing
        if default is not None and default.per_request is not None and set(self.capabilities) != {"decisions"}:
            return None
        return default

    @property
    def serves_chat(self) -> bool:
        """Chat traffic goes to an OpenAI-shaped provider's model that is not decisions-only (a raw upstream of such
        a provider may be either)."""
        return "chat" in self.provider.capabilities and (not self.configured or "chat" in self.capabilities)

    def unsupported(self, request: DecisionRequest) -> DecisionError | None:
        if "decisions" not in self.capabilities:
            return InvalidRequest(f"model {self.name!r} has no Decisions API; only decision models can answer "
                                  "decision requests", ("model",), code="model_not_supported")
        if self.images is False and request.images():
            return InvalidRequest(f"model {self.name!r} reads text only, so the request's images cannot be sent "
                                  "to it", request.images()[0].source, code="unsupported_input")
        if "engine_options" not in self.provider.capabilities:
            extension = next((name for name, value in (
                ("temperature", request.temperature), ("prompt_format_version", request.prompt_format_version),
                ("return_prompt_token_ids", request.return_prompt_token_ids or None),
                ("chat_template_kwargs", request.chat_template_kwargs or None), ("order", request.order),
                ("calibrate", request.calibrate)) if value is not None), None)
            if extension is not None:
                return InvalidRequest(f"{extension} is applied by decisiond's local engine; model {self.name!r} "
                                      f"({self.provider.name}) cannot honour it", (extension,),
                                      code="unsupported_parameter")
        if self.images is None:
            reason = self.provider.unsupported(request)
            if reason is not None:
                return reason
        try:
            check_provider(request, self.provider.limits, f"{self.name!r} ({self.provider.name})")
        except DecisionError as error:
            return error
        return None


class Ambiguous(str):
    """An alias two entries share: the canonical names it could mean (refused, never guessed)."""


class Catalog:
    def __init__(self, providers: dict[str, Provider], models: dict[str, Target],
                 virtual: dict[str, VirtualModelConfig] | None = None, default_model: str | None = None,
                 aliases: dict[str, str] | None = None, allow_raw_upstreams: bool = False):
        self.providers = providers
        self.models = models
        self.virtual = virtual or {}
        self.default_model = default_model
        self.aliases = aliases or {}
        self.allow_raw_upstreams = allow_raw_upstreams
        self.started = int(time.time())
        for v in self.virtual.values():  # known at start-up: e.g. local/<typo> names no model of its provider
            for name in v.targets:
                if name not in self.virtual and self._target(name, raw=True) is None:
                    raise ConfigError(f"virtual model {v.name!r} names {name!r}, which no provider serves")

    # --------------------------------------------------------------------------------- building

    @classmethod
    def local_only(cls: type[C], engine: Any) -> C:
        """No config: the local engine alone, under its served name and ``default``."""
        provider = build(ProviderConfig(name="local", type="local"), {"local": engine})
        own = provider.own_model
        if own is None:
            raise TypeError("a local provider names the model it runs")
        target = Target(own, provider, own, description=provider.describe())
        return cls({"local": provider}, {own: target}, default_model=own,
                   aliases={f"local/{own}": own, f"local/{DEFAULT_ALIAS}": own})

    @classmethod
    def from_config(cls: type[C], config: GatewayConfig, engines: Mapping[str, Any]) -> C:
        """``engines``: the in-process engines, by the name of the provider that runs each."""
        providers = {p.name: build(p, engines) for p in config.providers}
        models = {m.name: _entry(m, providers[m.provider]) for m in config.models}
        aliases: dict[str, str] = {}
        virtual_names = {v.name for v in config.virtual_models}

        def alias(spelling: str, canonical: str) -> None:
            if spelling in models or spelling in virtual_names or spelling == canonical:
                return
            known = aliases.get(spelling)
            if known is None:
                aliases[spelling] = canonical
            elif known != canonical:
                aliases[spelling] = Ambiguous(f"{known}, {canonical}")

        first_own: str | None = None
        owns = [providers[p.name].own_model for p in config.providers]
        for p in config.providers:
            provider, own = providers[p.name], providers[p.name].own_model
            if own is None:
                continue
            entries = [m.name for m in config.models if m.provider == p.name]
            # Its served name, unless another name or another provider's model takes it.
            plain = own if owns.count(own) == 1 and own not in models and own not in virtual_names else None
            canonical = entries[0] if len(entries) == 1 else plain or f"{p.name}/{own}"
            if not entries or len(entries) > 1:  # no entry (or several): the model is served under its own name
                models.setdefault(canonical, Target(canonical, provider, own, description=provider.describe()))
            for spelling in (f"{p.name}/{own}", own, f"{p.name}/{DEFAULT_ALIAS}"):
                alias(spelling, canonical)
            first_own = first_own or canonical
        for m in config.models:
            if providers[m.provider].own_model is None:
                alias(f"{m.provider}/{m.upstream or m.name}", m.name)
        default = config.default_model or first_own
        return cls(providers, models, {v.name: v for v in config.virtual_models}, default, aliases,
                   config.allow_raw_upstreams)

    # -------------------------------------------------------------------------------- resolving

    def canonical(self, name: str) -> str | None:
        """The name ``name`` stands for (a model entry, a virtual model or a raw upstream), or None when it names
        nothing. Raises for a spelling two entries share."""
        if name in self.virtual or name in self.models:
            return name
        if name == DEFAULT_ALIAS and self.default_model:
            return self.default_model
        known = self.aliases.get(name)
        if isinstance(known, Ambiguous):
            raise InvalidRequest(f"the model name {name!r} is shared by several configured models ({known}); name "
                                 "the one you mean", ("model",), code="model_ambiguous")
        if known is not None:
            return known
        return name if self._raw(name) is not None else None

    def is_raw(self, name: str) -> bool:
        """Whether ``name`` (canonical) is a raw upstream: a ``<provider>/<upstream>`` no entry covers."""
        return name not in self.models and name not in self.virtual and self._raw(name) is not None

    def _raw(self, name: str) -> Target | None:
        provider, _, upstream = name.partition("/")
        p = self.providers.get(provider)
        if not upstream or p is None or p.own_model is not None:
            return None
        return Target(name, p, upstream, configured=False)

    def _target(self, name: str, raw: bool = False) -> Target | None:
        """The concrete target behind a non-virtual name; raw upstreams only when ``raw``."""
        canonical = self.canonical(name)
        if canonical is None or canonical in self.virtual:
            return None
        if canonical in self.models:
            return self.models[canonical]
        return self._raw(canonical) if raw else None

    def known_target(self, name: str) -> Target | None:
        """The concrete target a (non-virtual) name stands for, raw upstreams included."""
        return self._target(name, raw=True)

    def chain(self, name: str) -> list[Target]:
        """The targets a name stands for, in failover order (virtual models expanded depth first). The targets of
        virtual models may be raw upstreams (the operator named them)."""
        canonical = self.canonical(name)
        if canonical in self.virtual:
            return [t for target in self.virtual[canonical].targets for t in self.chain(target)]
        target = self._target(name, raw=True)
        return [target] if target is not None else []

    def cascade_steps(self, name: str) -> list[str] | None:
        """The steps of the cascade ``name`` (canonical) stands for, or None when it is not a cascade. (Its
        ``chain`` is every step's targets in turn: each may answer, and each one's policy applies.)"""
        virtual = self.virtual.get(name)
        return list(virtual.targets) if virtual is not None and virtual.strategy == "cascade" else None

    def first_target(self, request: DecisionRequest, name: str) -> Target | None:
        """The target that will answer ``request`` when nothing fails: the first of the chain that can serve it."""
        return next((t for t in self.chain(name) if t.unsupported(request) is None), None)

    def policy_names(self, name: str) -> tuple[str, ...]:
        """Every entry whose policy applies to a request for ``name`` (canonical), in the order a request meets them:
        the name itself and every entry it may pass through, at any depth — the virtual models in between (a
        failover's targets, an alias's one, a cascade's steps, each expanded in turn) and the configured models the
        chain ends on. Raw upstreams carry no policy of their own and are left out. This is the one set every
        policy stage reads (guardrails, budgets, cache settings); rate limits of a model apply at each attempt on
        it, and the allowlist to the name asked."""
        names: dict[str, None] = {}

        def walk(entry: str) -> None:
            canonical = self.canonical(entry) or entry
            if canonical in names:
                return
            if canonical in self.virtual:
                names[canonical] = None
                for target in self.virtual[canonical].targets:
                    walk(target)
            elif canonical in self.models:
                names[canonical] = None

        names[name] = None
        if name in self.virtual:
            for target in self.virtual[name].targets:
                walk(target)
        return tuple(names)

    def resolve_name(self, name: str | None, strict: bool, internal: bool = False) -> str:
        """The canonical model to route. Lenient dialects (System One, SGLang) send unknown names to the default.
        A raw upstream is refused unless the config allows them (``internal``: a name from the config itself)."""
        if not self.model_list(capability="decisions"):  # nothing answers decisions: the endpoint is not served
            raise NotFound("No decision model is configured here, so decision requests are not served.", ("model",),
                           code="model_not_found")
        canonical = self.canonical(name) if name is not None else None
        if canonical is not None and self.is_raw(canonical) and not (internal or self.allow_raw_upstreams):
            raise InvalidRequest(f"{name!r} names an upstream model that no configured model covers; name a "
                                 "configured model (raw upstream names are off: allow_raw_upstreams)", ("model",),
                                 code="model_not_found")
        if canonical is not None:
            return canonical
        if not strict and self.default_model:
            return self.default_model
        served = ", ".join(repr(m.name) for m in self.model_list(capability="decisions"))
        raise InvalidRequest(f"The model {name!r} does not exist or is not served here; served models: {served}.",
                             ("model",), code="model_not_found")

    # ------------------------------------------------------------------------------------ listing

    def model_list(self, capability: str | None = None) -> list[ModelInfo]:
        out = []
        for target in self.models.values():
            out.append(ModelInfo(target.name, owned_by=target.provider.name, description=target.description,
                                 created=self.started, release_date=_release(target),
                                 capabilities=target.capabilities))
        for v in self.virtual.values():
            caps = sorted({c for t in self.chain(v.name) for c in t.capabilities})
            out.append(ModelInfo(v.name, owned_by="decisiond", created=self.started,
                                 description=f"{v.strategy} over {', '.join(v.targets)}", capabilities=tuple(caps)))
        return [m for m in out if capability is None or capability in m.capabilities]


def _entry(m: ModelConfig, provider: Provider) -> Target:
    description = m.description or (provider.describe() if provider.own_model is not None else "")
    return Target(m.name, provider, m.upstream or m.name, tuple(m.capabilities), m.images, description,
                  pricing=m.pricing, cache=m.cache, max_output_tokens=m.max_output_tokens)


def _release(target: Target) -> str:
    return target.provider.release_date() or time.strftime("%Y-%m-%d")
