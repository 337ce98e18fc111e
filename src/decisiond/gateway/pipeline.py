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
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import ServerError
from .types import Context, Next, Request, Result, Stage


class Pipeline:
    """Stages in order, then the terminal handler (the router)."""

    def __init__(self, stages: list[Stage], terminal: Next):
        self.stages = stages
        self.terminal = terminal
        # Build the chain once: each link calls its stage with the next link; the router is the last link.
        chain: Next = _link(_Terminal(terminal), _unreachable)
        for stage in reversed(stages):
            chain = _link(stage, chain)
        self._chain = chain

    async def run(self, context: Context, request: Request) -> Result:
        context.requested_model = request.model
        result: Result = await self._chain(context, request)
        return result


class _Terminal:
    name = "route"

    def __init__(self, handler: Next):
        self.handler = handler

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        return await self.handler(context, request)


async def _unreachable(context: Context, request: Any) -> Any:
    raise ServerError("the pipeline's terminal stage called a next stage, and there is none")


def _link(stage: Stage, call_next: Next) -> Next:
    async def link(context: Context, request: Any) -> Any:
        start = time.perf_counter()
        try:
            result = await stage(context, request, call_next)
        except Exception as error:
            # The innermost stage an error passes through is the one that raised it.
            if not hasattr(error, "stage"):
                try:
                    error.stage = stage.name  # type: ignore[attr-defined]
                except AttributeError:
                    pass
            raised_here = getattr(error, "stage", stage.name) == stage.name
            context.outcomes[stage.name] = f"refused: {getattr(error, 'code', type(error).__name__)}" \
                if raised_here else "ok"
            raise
        finally:
            context.timings[stage.name] = round(time.perf_counter() - start, 6)
        context.outcomes.setdefault(stage.name, "ok")
        return result

    return link
