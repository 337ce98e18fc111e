"""Stage: the model a request names, resolved to the name the router serves (aliases, ``default``, and the
served model for lenient dialects that accept any name). Unknown names on OpenAI's shape → 400 ``model_not_found``.
``/v1/score`` needs a local model. Chat traffic names its model as it is (no default): a chat-capable model of an
OpenAI-shaped provider, else 404 (unknown) or 400 (a decision model)."""

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
            self.router.chat_target(request.model)
            context.resolved_model = request.model
        else:
            context.resolved_model = self.router.resolve_name(request.model, context.strict_model)
        return await call_next(context, request)
