"""Which model answers a request: names, virtual models, limits, skip rules and failover.

A request names a model: a configured model, ``provider/upstream`` (any model of a configured provider), a
virtual model (an alias, or a failover chain of targets, possibly other virtual models), or — with no config —
the local engine under its served name or ``default``. The router expands the name into its chain of targets and
tries them in order:

- every request has been checked against OpenAI's limits by the pipeline, whatever answers it;
- a target that cannot serve the request — no Decisions API, images to a text-only provider, over the
  provider's own limits — is skipped without spending an attempt;
- a target that is unavailable (429, 5xx, 529, a timeout or a dropped connection) hands over to the next one;
- any other upstream error (a validation 4xx) ends the chain with the provider's status and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, Callable, Coroutine

from ..canonical import DecisionRequest, DecisionResult, ScoreRequest, ScoreResult
from ..errors import DecisionError, InvalidRequest, NotFound, ProviderError, provider_error
from .config import ConfigError
from .pricing import Pricing
from .providers import build
from .providers.base import Provider
from .result_check import check_result
from .settings import DEFAULT_DEADLINE, GatewayConfig, ModelConfig, ProviderConfig, VirtualModelConfig
from .sizes import check_provider

log = logging.getLogger("decisiond.gateway")

DEFAULT_ALIAS = "default"

# Admission for one attempt on a target (its model and provider rate limits): an async context manager that
# raises a failover-able ProviderError when the target is at its limit, and yields something with
# ``settle(input_tokens)`` or None.
Gate = Callable[["Target"], AsyncContextManager[Any]]


def _open_gate(target: "Target") -> AsyncContextManager[Any]:
    return contextlib.nullcontext()


class Observer:
    """Told about each attempt on a target (``decisiond.metrics.Metrics`` counts them); does nothing itself."""

    def attempt(self, target: "Target") -> float:
        return 0.0

    def attempt_done(self, target: "Target", started: float, error: ProviderError | None = None) -> None:
        return None


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
    """One model a provider serves, under the name clients use."""

    name: str
    provider: Provider
    upstream: str
    capabilities: tuple[str, ...] = ("decisions",)
    images: bool | None = None
    description: str = ""
    # The model's own price; else its provider's default (see ``price``).
    pricing: Pricing | None = None

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
    # The model's ``cache`` setting (None: its provider's).
    cache: bool | None = None

    def unsupported(self, request: DecisionRequest) -> DecisionError | None:
        if "decisions" not in self.capabilities:
            return InvalidRequest(f"model {self.name!r} has no Decisions API; only decision models can answer "
                                 "decision requests", ("model",), code="model_not_supported")
        if self.images is False and request.images():
            return InvalidRequest(f"model {self.name!r} reads text only, so the request's images cannot be sent to it",
                                 request.images()[0].source, code="unsupported_input")
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


class Router:
    def __init__(self, providers: dict[str, Provider], models: dict[str, Target],
                 virtual: dict[str, VirtualModelConfig] | None = None, default_model: str | None = None,
                 deadline: float = DEFAULT_DEADLINE):
        self.providers = providers
        self.models = models
        self.virtual = virtual or {}
        self.default_model = default_model
        self.deadline = deadline
        self.started = int(time.time())
        self.observer = Observer()
        for v in self.virtual.values():  # known at start-up: e.g. local/<typo> names no model of its provider
            for name in v.targets:
                if name not in self.virtual and self._target(name) is None:
                    raise ConfigError(f"virtual model {v.name!r} names {name!r}, which no provider serves")
        self.serves_decisions = bool(self.model_list(capability="decisions"))

    # --------------------------------------------------------------------------------- building

    @classmethod
    def local_only(cls, engine: Any) -> "Router":
        """No config: the local engine alone, under its served name and ``default``."""
        provider = build(ProviderConfig(name="local", type="local"), {"local": engine})
        own = provider.own_model
        if own is None:
            raise TypeError("a local provider names the model it runs")
        target = Target(own, provider, own, description=provider.describe())
        return cls({"local": provider}, {own: target}, default_model=own)

    @classmethod
    def from_config(cls, config: GatewayConfig, engines: dict[str, Any]) -> "Router":
        """``engines``: the in-process engines, by the name of the provider that runs each."""
        providers = {p.name: build(p, engines) for p in config.providers}
        models: dict[str, Target] = {}
        first_own: str | None = None
        for p in config.providers:
            provider = providers[p.name]
            own = provider.own_model
            if own is not None:  # a provider running its own model serves it as <provider>/<model> and <model>
                target = Target(f"{p.name}/{own}", provider, own, description=provider.describe())
                models[target.name] = target
                models.setdefault(own, Target(own, provider, own, description=target.description))
                first_own = first_own or target.name
        for m in config.models:
            models[m.name] = _target(m, providers[m.provider])
        default = config.default_model or first_own
        return cls(providers, models, {v.name: v for v in config.virtual_models}, default, config.deadline)

    # -------------------------------------------------------------------------------- resolving

    def _target(self, name: str) -> Target | None:
        if name in self.models:
            return self.models[name]
        if name == DEFAULT_ALIAS and self.default_model:
            return self._target(self.default_model)
        provider, _, upstream = name.partition("/")
        if upstream and provider in self.providers:
            p = self.providers[provider]
            own = p.own_model
            if own is not None:
                return self.models.get(f"{provider}/{own}") if upstream in (DEFAULT_ALIAS, own) else None
            return Target(name, p, upstream)
        return None

    def known_target(self, name: str) -> Target | None:
        """The concrete target a (non-virtual) model name stands for."""
        return self._target(name)

    def known(self, name: str | None) -> bool:
        return name is not None and (name in self.virtual or self._target(name) is not None)

    def first_target(self, request: DecisionRequest, name: str) -> Target | None:
        """The target that will answer ``request`` when nothing fails: the first of the chain that can serve it."""
        return next((t for t in self.chain(name) if t.unsupported(request) is None), None)

    def chain(self, name: str) -> list[Target]:
        """The targets a name stands for, in failover order (virtual models expanded depth first)."""
        if name in self.virtual:
            return [t for target in self.virtual[name].targets for t in self.chain(target)]
        target = self._target(name)
        return [target] if target is not None else []

    def resolve_name(self, name: str | None, strict: bool) -> str:
        """The model name to route. Lenient dialects (System One, SGLang) send unknown names to the default."""
        if not self.serves_decisions:  # no provider answers decisions at all: the endpoint itself is not served
            raise NotFound("No decision model is configured here, so decision requests are not served.", ("model",),
                           code="model_not_found")
        if name == DEFAULT_ALIAS and name not in self.models and name not in self.virtual and self.default_model:
            return self.default_model
        if name is not None and self.known(name):
            return name
        if not strict and self.default_model:
            return self.default_model
        served = ", ".join(repr(m.name) for m in self.model_list(capability="decisions"))
        raise InvalidRequest(f"The model {name!r} does not exist or is not served here; served models: {served}.",
                            ("model",), code="model_not_found")

    # -------------------------------------------------------------------------------- answering

    async def decide(self, request: DecisionRequest, name: str, gate: Gate = _open_gate) -> DecisionResult:
        """Answer ``request`` from the targets ``name`` (resolved by ``resolve_name``) stands for. OpenAI's limits
        were checked by the pipeline (``limits.RequestLimits``); each target's own are checked here."""
        skipped: list[DecisionError] = []
        failure: ProviderError | None = None
        virtual = self.virtual.get(name)
        budget = virtual.deadline if virtual is not None and virtual.deadline is not None else self.deadline
        ends = time.monotonic() + budget
        for target in self.chain(name):
            reason = target.unsupported(request)
            if reason is not None:
                if name in self.virtual:
                    log.warning("skipping target",
                                extra={"model": name, "target": target.name, "reason": reason.message})
                skipped.append(reason)
                continue
            remaining = ends - time.monotonic()
            if remaining <= 0:
                failure = provider_error(target.provider.name, 504, f"no answer from {name!r} within its "
                                         f"{budget:g} s deadline", code="deadline_exceeded")
                break
            timeout = None if not target.provider.timed_by_router else min(remaining, (
                virtual.attempt_timeout if virtual is not None and virtual.attempt_timeout is not None
                else target.provider.config.timeout))
            started = self.observer.attempt(target)
            try:
                async with gate(target) as admission:
                    result = await _within(target.provider.decide(request, target.upstream), timeout, target)
                    if admission is not None:
                        await admission.settle(result.usage.input_tokens)
                check_result(request, result, target.provider.name)
                self.observer.attempt_done(target, started)
            except ProviderError as error:
                self.observer.attempt_done(target, started, error)
                log.warning("upstream error", extra={"model": name, "target": target.name, "status": error.status,
                                                     "failover": error.failover, "reason": error.message})
                if not error.failover:
                    raise
                failure = error
                continue
            result.provider_format = target.provider.format
            return result
        if failure is not None:
            raise failure
        raise skipped[0] if len(skipped) == 1 or name not in self.virtual else InvalidRequest(
            f"no target of {name!r} can answer this request: " + "; ".join(s.message for s in skipped),
            skipped[0].path, code=skipped[0].code)

    def chat_target(self, name: str) -> Target:
        """The target for chat traffic: an OpenAI-shaped provider's model that is not decisions-only. A decision model
        is refused with a pointer to /v1/decisions (as a chat model is refused there)."""
        candidates = self.chain(name)
        if not candidates:
            raise NotFound(f"The model {name!r} does not exist or is not served here.", ("model",),
                           code="model_not_found")
        for target in candidates:
            configured = target.name in self.models
            if "chat" in target.provider.capabilities and (not configured or "chat" in target.capabilities):
                return target
        raise InvalidRequest(f"model {name!r} is a decision model: send its requests to /v1/decisions", ("model",),
                            code="model_not_supported")

    def score_target(self, name: str | None) -> Target:
        """The target that answers ``/v1/score`` for ``name``: the first of its chain whose provider has the
        ``score`` capability (today the local engine)."""
        chosen = self.resolve_name(name, strict=False)
        for target in self.chain(chosen):
            if "score" in target.provider.capabilities:
                return target
        raise InvalidRequest(f"model {chosen!r} is not a local model; /v1/score needs one", ("model",),
                            code="model_not_supported")

    async def score(self, request: ScoreRequest, name: str | None = None, gate: Gate = _open_gate) -> ScoreResult:
        target = self.score_target(name if name is not None else request.model)
        async with gate(target) as admission:
            result = await target.provider.score(request)
            if admission is not None:
                await admission.settle(result.prompt_tokens)
        return result

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

    async def aclose(self) -> None:
        for provider in self.providers.values():
            await provider.aclose()


async def _within(attempt: Coroutine[Any, Any, DecisionResult], seconds: float | None,
                  target: Target) -> DecisionResult:
    """One attempt, cancelled (its upstream request closed) when it runs past ``seconds``."""
    if seconds is None:
        return await attempt
    try:
        return await asyncio.wait_for(attempt, seconds)
    except asyncio.TimeoutError:
        name = target.provider.name
        raise provider_error(name, 504, f"provider {name!r} timed out: no answer within {seconds:.3g} s",
                             code="upstream_timeout") from None


def _target(m: ModelConfig, provider: Provider) -> Target:
    return Target(m.name, provider, m.upstream or m.name, tuple(m.capabilities), m.images, m.description,
                  pricing=m.pricing, cache=m.cache)


def _release(target: Target) -> str:
    return target.provider.release_date() or time.strftime("%Y-%m-%d")
