"""Stage: the model a request names, resolved to the name the router serves (aliases, ``default``, and the
served model for lenient dialects that accept any name). Unknown names on OpenAI's shape → 400 ``model_not_found``.
``/v1/score`` needs a local model. Chat traffic names a chat-capable model of an OpenAI-shaped provider (no
default), else 404 (unknown) or 400 (a decision model). Every spelling resolves to the one model it means
(``gateway.catalog``), and every later stage keys its policy on that name."""

from __future__ import annotations

from typing import Any

from ..router import Router
from ..types import Context, Next


class ResolveModel:
    name = "resolve"

    def __init__(self, router: Router):
        self.router = router

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        if context.operation == "score":
            context.resolved_model = self.router.score_target(request.model).name
        elif context.operation == "chat":
            context.resolved_model = self.router.resolve_chat(request.model)
        else:
            context.resolved_model = self.router.catalog.resolve_name(request.model, context.strict_model)
        return await call_next(context, request)
