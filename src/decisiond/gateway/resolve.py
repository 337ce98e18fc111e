"""Stage: the model a request names, resolved to the name the router serves (aliases, ``default``, and the
served model for lenient dialects that accept any name). Unknown names on OpenAI's shape → 400 ``model_not_found``.
``/v1/score`` needs a local model."""

from __future__ import annotations

from typing import Any

from .pipeline import Context, Next
from .router import Router

__all__ = ["ResolveModel"]


class ResolveModel:
    name = "resolve"

    def __init__(self, router: Router):
        self.router = router

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        if context.operation == "score":
            context.resolved_model = self.router.score_target(request.model).name
        else:
            context.resolved_model = self.router.resolve_name(request.model, context.strict_model)
        return await call_next(context, request)
