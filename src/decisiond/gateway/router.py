"""Which target answers a request: skip rules and failover over the chain of targets a model name stands for (the
names themselves, and the policy each carries, are ``gateway.catalog``'s). The router tries the chain in order:

- every request has been checked against OpenAI's limits by the pipeline, whatever answers it;
- a target that cannot serve the request — no Decisions API, images to a text-only provider, over the
  provider's own limits — is skipped without spending an attempt;
- a target that is unavailable (429, 5xx, 529, a timeout or a dropped connection) hands over to the next one;
- any other upstream error (a validation 4xx) ends the chain with the provider's status and message.

With a tracer (``decisiond.tracing``), each attempt is a span (target, provider, outcome, tokens) and each step of a
cascade a span around its attempts. The answer of a target with learned profiles goes out through them
(``gateway.profiles``), before a cascade reads its threshold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping
from typing import Any, AsyncContextManager, Callable, Coroutine

from .. import tracing
from ..canonical import DecisionRequest, DecisionResult, ScoreRequest, ScoreResult, Usage
from ..errors import DecisionError, InvalidRequest, NotFound, ProviderError, provider_error
from . import cascade
from .cascade import Gate, Step
from .catalog import Catalog, Target
from .chat import ChatRequest, ChatResult
from .forward import attempt
from .profiles import ProfileBook
from .result_check import check_result
from .settings import DEFAULT_DEADLINE, GatewayConfig
from .virtual import VirtualModelConfig

log = logging.getLogger("decisiond.gateway")
_timeout = getattr(asyncio, "timeout", None)

def _open_gate(target: "Target") -> AsyncContextManager[Any]:
    return contextlib.nullcontext()


def _unreported(step: Step) -> None:
    return None


# Told of an attempt whose provider answered — and billed — but whose answer failed its check (the attempt then
# fails over as any other failure): the target, the answer and the error.
Billed = Callable[["Target", DecisionResult, ProviderError], None]


def _unbilled(target: "Target", result: DecisionResult, error: ProviderError) -> None:
    return None


class Observer:
    """Told about each attempt on a target and each call of a cascade (``server.metrics.Metrics`` counts them); does
    nothing itself."""

    def attempt(self, target: "Target") -> float:
        return 0.0

    def attempt_done(self, target: "Target", started: float, error: ProviderError | None = None) -> None:
        return None

    def cascade_step(self, cascade: str, step: Step) -> None:
        return None


class Router:
    """How a request is answered from the targets a name stands for, in ``catalog`` (``gateway.catalog``: the
    names, entries and virtual models)."""

    def __init__(self, catalog: Catalog, deadline: float = DEFAULT_DEADLINE):
        self.catalog = catalog
        self.deadline = deadline
        self.observer = Observer()
        # Spans of attempts and cascade steps, when the gateway traces (``Gateway`` sets it).
        self.tracer: tracing.Tracer | None = None
        # The learned profiles applied to each target's answers (``gateway.profiles``; ``Gateway`` sets it).
        self.profiles: ProfileBook | None = None

    @classmethod
    def local_only(cls, engine: Any) -> "Router":
        """No config: the local engine alone, under its served name and ``default``."""
        return cls(Catalog.local_only(engine))

    @classmethod
    def from_config(cls, config: GatewayConfig, engines: Mapping[str, Any]) -> "Router":
        """``engines``: the in-process engines, by the name of the provider that runs each."""
        return cls(Catalog.from_config(config, engines), config.deadline)

    # -------------------------------------------------------------------------------- answering

    async def decide(self, request: DecisionRequest, name: str, gate: Gate = _open_gate,
                     report: Callable[[Step], None] | None = None, ends: float | None = None,
                     billed: Billed = _unbilled, user_path: str = "/") -> DecisionResult:
        """Answer ``request`` from the targets ``name`` (resolved by ``resolve_name``) stands for. OpenAI's limits
        were checked by the pipeline (``limits.RequestLimits``); each target's own are checked here. A cascade
        (``gateway.cascade``) tells ``report`` of each call it makes; ``ends``: an outer deadline
        (``time.monotonic()``), a cascade's over its steps; ``billed`` hears of every answer that failed its check
        (the provider billed it all the same); ``user_path``: the caller's, which picks the learned profiles that
        may serve it (``ProfileBook.apply``; ``/``: the operator's alone)."""
        skipped: list[DecisionError] = []
        failure: ProviderError | None = None
        virtual = self.catalog.virtual.get(name)
        budget = virtual.deadline if virtual is not None and virtual.deadline is not None else self.deadline
        ends = min(time.monotonic() + budget, ends if ends is not None else math.inf)
        if virtual is not None and virtual.strategy == "cascade":
            return await self._cascade(request, virtual, gate, report or _unreported, ends, billed, user_path)
        for target in self.catalog.chain(name):
            reason = target.unsupported(request)
            if reason is not None:
                if name in self.catalog.virtual:
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
            with self._attempt(target, len(request.questions)) as span:
                try:
                    async with gate(target) as admission:
                        result = await _within(target.provider.decide(request, target.upstream), timeout, target)
                        if admission is not None:
                            await admission.settle(result.usage.input_tokens)
                    result.provider_format = target.provider.format
                    _checked(request, result, target, billed)
                    if self.profiles is not None:
                        self.profiles.apply(target.name, request, result, user_path)
                    self.observer.attempt_done(target, started)
                except ProviderError as error:
                    self.observer.attempt_done(target, started, error)
                    _attempt_failed(span, error)
                    log.warning("upstream error", extra={"model": name, "target": target.name, "status": error.status,
                                                         "failover": error.failover, "reason": error.message})
                    if not error.failover:
                        raise
                    failure = error
                    continue
                _attempt_answered(span, result.usage)
            return result
        if failure is not None:
            raise failure
        raise skipped[0] if len(skipped) == 1 or name not in self.catalog.virtual else InvalidRequest(
            f"no target of {name!r} can answer this request: " + "; ".join(s.message for s in skipped),
            skipped[0].path, code=skipped[0].code)

    async def _cascade(self, request: DecisionRequest, virtual: VirtualModelConfig, gate: Gate,
                       report: Callable[[Step], None], ends: float, billed: Billed,
                       user_path: str) -> DecisionResult:
        async def ask(asked: DecisionRequest, step: Step, step_gate: Gate) -> DecisionResult:
            with self._step(step.name, step.position, len(asked.questions)):
                return await self.decide(asked, self.catalog.canonical(step.name) or step.name, step_gate, ends=ends,
                                         billed=billed, user_path=user_path)

        def reported(step: Step) -> None:
            report(step)
            self.observer.cascade_step(virtual.name, step)

        return await cascade.run(request, virtual.targets, virtual.thresholds, ask,
                                 lambda asked, step: self.catalog.first_target(asked, step) is not None, gate,
                                 reported)

    def resolve_chat(self, name: str) -> str:
        """The canonical model for chat traffic (no default, no lenient fallback): 404 for a name that names nothing
        (or a raw upstream the config does not allow), 400 for a decision model."""
        canonical = self.catalog.canonical(name)
        if canonical is None or (self.catalog.is_raw(canonical) and not self.catalog.allow_raw_upstreams):
            raise NotFound(f"The model {name!r} does not exist or is not served here.", ("model",),
                           code="model_not_found")
        self.chat_target(canonical)
        return canonical

    def chat_target(self, name: str) -> Target:
        """The first target for chat traffic: an OpenAI-shaped provider's model that is not decisions-only. A
        decision model is refused with a pointer to /v1/decisions (as a chat model is refused there)."""
        candidates = self.catalog.chain(name)
        if not candidates:
            raise NotFound(f"The model {name!r} does not exist or is not served here.", ("model",),
                           code="model_not_found")
        for target in candidates:
            if target.serves_chat:
                return target
        raise InvalidRequest(f"model {name!r} is a decision model: send its requests to /v1/decisions", ("model",),
                             code="model_not_supported")

    async def chat(self, request: ChatRequest, name: str, gate: Gate = _open_gate,
                   deadline: float | None = None) -> ChatResult:
        """Forward chat traffic to the targets ``name`` stands for, on the failover rules of decisions, but only
        until the client has its first byte (``gateway.forward``). Targets that cannot serve chat are skipped
        without an attempt. ``deadline``: the client's (``time.monotonic()``), for the whole exchange."""
        failure: ProviderError | None = None
        for target in self.catalog.chain(name):
            if not target.serves_chat:
                continue
            started = self.observer.attempt(target)
            with self._attempt(target, None) as span:
                try:
                    async with gate(target) as admission:
                        result = await attempt(request, target, deadline)
                        if admission is not None:
                            await admission.settle(result.usage.input_tokens)
                except ProviderError as error:
                    self.observer.attempt_done(target, started, error)
                    _attempt_failed(span, error)
                    log.warning("upstream error", extra={"model": name, "target": target.name, "status": error.status,
                                                         "failover": error.failover, "reason": error.message})
                    if request.relay.started.is_set() or not error.failover:
                        raise
                    failure = error
                    continue
                self.observer.attempt_done(target, started, result.failure
                                           if isinstance(result.failure, ProviderError) else None)
                _attempt_answered(span, result.usage)
            return result
        if failure is not None:
            raise failure
        self.chat_target(name)  # raises: no target of ``name`` serves chat
        raise NotFound(f"The model {name!r} does not exist or is not served here.", ("model",),
                       code="model_not_found")

    def score_target(self, name: str | None) -> Target:
        """The target that answers ``/v1/score`` for ``name``: the first of its chain whose provider has the
        ``score`` capability (today the local engine)."""
        chosen = self.catalog.resolve_name(name, strict=False)
        for target in self.catalog.chain(chosen):
            if "score" in target.provider.capabilities:
                return target
        raise InvalidRequest(f"model {chosen!r} is not a local model; /v1/score needs one", ("model",),
                            code="model_not_supported")

    async def score(self, request: ScoreRequest, name: str | None = None, gate: Gate = _open_gate) -> ScoreResult:
        target = self.score_target(name if name is not None else request.model)
        with self._attempt(target, None) as span:
            async with gate(target) as admission:
                result = await target.provider.score(request)
                if admission is not None:
                    await admission.settle(result.prompt_tokens)
            _attempt_answered(span, Usage(input_tokens=result.prompt_tokens))
        return result

    def _attempt(self, target: Target, questions: int | None) -> tracing.Block:
        """An attempt's span (the current one while the provider answers: its upstream request carries it), or a
        block that does nothing when the gateway does not trace."""
        if self.tracer is None:
            return tracing.OFF
        attributes: dict[str, Any] = {
            tracing.KIND: "LLM", tracing.TARGET: target.name, tracing.MODEL: target.upstream,
            tracing.PROVIDER: target.provider.config.type, tracing.PROVIDER_NAME: target.provider.name}
        if questions is not None:
            attributes[tracing.QUESTIONS] = questions
        return self.tracer.current(f"attempt {target.name}", attributes)

    def _step(self, name: str, number: int, questions: int) -> tracing.Block:
        """A cascade step's span, around the attempts of its one call."""
        if self.tracer is None:
            return tracing.OFF
        return self.tracer.current(f"cascade step {number}", {
            tracing.KIND: "CHAIN", tracing.CASCADE_STEP: number, tracing.MODEL: name, tracing.QUESTIONS: questions})

    async def aclose(self) -> None:
        for provider in self.catalog.providers.values():
            await provider.aclose()


def _attempt_failed(span: tracing.Span | None, error: ProviderError) -> None:
    if span is not None:
        tracing.outcome(span, f"{'failover' if error.failover else 'error'}: {error.code}", error.code)
        span.set_attribute(tracing.UPSTREAM_STATUS, error.status)


def _attempt_answered(span: tracing.Span | None, usage: Usage) -> None:
    if span is not None:
        tracing.outcome(span, "ok")
        span.set_attributes({tracing.PROMPT_TOKENS: usage.input_tokens, tracing.COMPLETION_TOKENS: usage.output_tokens,
                             tracing.TOTAL_TOKENS: usage.total_tokens})


def _checked(request: DecisionRequest, result: DecisionResult, target: Target, billed: Billed) -> None:
    """``check_result``; an answer that fails it is told to ``billed`` before the error goes on."""
    try:
        check_result(request, result, target.provider.name)
    except ProviderError as error:
        billed(target, result, error)
        raise


async def _within(attempt: Coroutine[Any, Any, DecisionResult], seconds: float | None,
                  target: Target) -> DecisionResult:
    """One attempt, cancelled (its upstream request closed) when it runs past ``seconds``."""
    if seconds is None:
        return await attempt
    try:
        if _timeout is None:  # Python 3.10
            return await asyncio.wait_for(attempt, seconds)
        async with _timeout(seconds):  # in this task: no task of its own, no extra turn of the event loop
            return await attempt
    except asyncio.TimeoutError:
        name = target.provider.name
        raise provider_error(name, 504, f"provider {name!r} timed out: no answer within {seconds:.3g} s",
                             code="upstream_timeout") from None
