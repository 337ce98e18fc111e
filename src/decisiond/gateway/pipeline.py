"""The gateway's spine: every decision and score request, whatever its route and dialect, runs through one
ordered chain of small stages between parsing and rendering.

    request limits → resolve model → allowlist → cache → rate limits → budgets → guardrails → route (failover)

Chat traffic (``/v1/chat/completions``, ``/v1/responses``: operation ``chat``, a ``gateway.chat.ChatRequest``) runs
through the same chain: request limits and the cache leave it alone, the other stages apply as to decisions, and
the route forwards it; the chain returns once the answer has passed to the client, so the stages settle with the
upstream's real usage.

The cache sits before the rate limits so that an answer served from it costs no rate-limit tokens nor budget; its
key covers the guardrails in force (they are deterministic functions of the request), so an entry is only ever
an answer to what those guardrails let through.

Each stage is an async callable ``stage(context, request, call_next) -> result``: it may look at or change the
context, refuse by raising a ``DecisionError`` (which the server renders in the caller's dialect), or wrap the
rest of the chain (reserve before, settle after). A new stage is one module plus one line in ``build``::

    class Stamp:
        name = "stamp"

        async def __call__(self, context, request, call_next):
            context.response_headers["x-stamp"] = "1"
            return await call_next(context, request)

The caller (key id, user path, allowed models, limits) is established before the body is read, by
``gateway.stages.auth``: an unauthenticated client never makes the server read, decompress or parse its body.

Traces (``decisiond.tracing``): with a tracer, a run is one span (``decide``, ``score`` or ``chat``: the model, the
provider and target that answered, questions, tokens, cost, cache hit, escalated questions) and each stage one span
inside it, made here for every stage alike — a stage knows nothing of tracing. A stage's span wraps the rest of the
chain as the stage does (its time includes the stages after it, as ``context.timings``), and carries its outcome;
only the stage that refused is marked failed. Without a tracer the chain is built without them: nothing is added.
"""

from __future__ import annotations

import time
from typing import Any

from .. import tracing
from ..canonical import DecisionRequest, ScoreRequest, ScoreResult, Usage
from ..errors import ServerError
from .types import Context, Next, Request, Result, Stage


class Observer:
    """Told of every answer a pipeline gives — whatever the route and dialect, cache hits included — before it is
    rendered (``server.decision_metrics`` records the decisions' quality); does nothing itself."""

    def answered(self, context: Context, request: Request, result: Result) -> None:
        return None


class Pipeline:
    """Stages in order, then the terminal handler (the router)."""

    def __init__(self, stages: list[Stage], terminal: Next, tracer: tracing.Tracer | None = None):
        self.stages = stages
        self.terminal = terminal
        self.tracer = tracer
        self.observer = Observer()
        # Build the chain once: each link calls its stage with the next link; the router is the last link.
        chain: Next = _link(_Terminal(terminal), _unreachable, tracer)
        for stage in reversed(stages):
            chain = _link(stage, chain, tracer)
        self._chain = chain

    async def run(self, context: Context, request: Request) -> Result:
        context.requested_model = request.model
        if self.tracer is None:
            result: Result = await self._chain(context, request)
            self.observer.answered(context, request, result)
            return result
        with self.tracer.current(context.operation, {
                tracing.KIND: "CHAIN", tracing.OPERATION: context.operation, tracing.DIALECT: context.dialect,
                tracing.REQUEST_ID: context.request_id}) as span:
            try:
                answer: Result = await self._chain(context, request)
            except BaseException:
                _describe(span, context, request, None)
                raise
            _describe(span, context, request, answer)
            self.observer.answered(context, request, answer)
            return answer


class _Terminal:
    name = "route"

    def __init__(self, handler: Next):
        self.handler = handler

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        return await self.handler(context, request)


async def _unreachable(context: Context, request: Any) -> Any:
    raise ServerError("the pipeline's terminal stage called a next stage, and there is none")


def _link(stage: Stage, call_next: Next, tracer: tracing.Tracer | None = None) -> Next:
    async def link(context: Context, request: Any) -> Any:
        start = time.perf_counter()
        try:
            result = await stage(context, request, call_next)
        except Exception as error:
            _refused(context, stage.name, error)
            raise
        finally:
            context.timings[stage.name] = round(time.perf_counter() - start, 6)
        context.outcomes.setdefault(stage.name, "ok")
        return result

    if tracer is None:
        return link
    spans = tracer

    async def traced(context: Context, request: Any) -> Any:
        """``link``, in a span of the stage's name with the stage's outcome (one coroutine, not two a stage)."""
        with spans.current(stage.name, failures=False) as span:
            start = time.perf_counter()
            try:
                result = await stage(context, request, call_next)
            except Exception as error:
                _refused(context, stage.name, error)
                _outcome(span, context.outcomes[stage.name])
                raise
            finally:
                context.timings[stage.name] = round(time.perf_counter() - start, 6)
            _outcome(span, context.outcomes.setdefault(stage.name, "ok"))
            return result

    return traced


def _outcome(span: tracing.Span, outcome: str) -> None:
    """A stage's outcome on its span, failed only where the stage refused."""
    tracing.outcome(span, outcome, outcome.removeprefix("refused: ") if outcome.startswith("refused: ") else None)


def _refused(context: Context, name: str, error: Exception) -> None:
    """The stage's outcome when an error leaves it: refused where the stage raised it (the innermost stage an
    error passes through is the one that raised it), ok where it only passed through."""
    if not hasattr(error, "stage"):
        try:
            error.stage = name  # type: ignore[attr-defined]
        except AttributeError:
            pass
    raised_here = getattr(error, "stage", name) == name
    context.outcomes[name] = f"refused: {getattr(error, 'code', type(error).__name__)}" if raised_here else "ok"


def _describe(span: tracing.Span, context: Context, request: Request, result: Result | None) -> None:
    """A run's attributes, once it has ended (answered or not): what was asked, who answered, what it cost. Never
    the request's text."""
    attributes: dict[str, Any] = {tracing.CACHE_HIT: context.cache_hit}
    if context.requested_model:
        attributes[tracing.REQUESTED_MODEL] = context.requested_model
    if context.resolved_model:
        attributes[tracing.MODEL] = context.resolved_model
    if context.answered_by is not None:
        attributes[tracing.PROVIDER_NAME], attributes[tracing.TARGET] = context.answered_by
    if context.cost is not None:
        attributes[tracing.COST] = context.cost
    if context.escalated is not None:
        attributes[tracing.ESCALATED] = context.escalated
    if isinstance(request, DecisionRequest):
        attributes[tracing.QUESTIONS] = len(request.questions)
    elif isinstance(request, ScoreRequest):
        attributes[tracing.ITEMS] = len(request.prompts)
    usage = getattr(result, "usage", None)
    if isinstance(usage, Usage):
        attributes.update({tracing.PROMPT_TOKENS: usage.input_tokens, tracing.COMPLETION_TOKENS: usage.output_tokens,
                           tracing.TOTAL_TOKENS: usage.total_tokens, tracing.CACHED_TOKENS: usage.cached_tokens})
    elif isinstance(result, ScoreResult):
        attributes[tracing.PROMPT_TOKENS] = attributes[tracing.TOTAL_TOKENS] = result.prompt_tokens
    span.set_attributes(attributes)
