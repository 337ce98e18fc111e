"""Stage: a key's allowed models, checked on the resolved model. Patterns are model names, virtual model
names, ``provider/*`` (every model that provider serves) and ``*``. A model outside them → 403
``model_not_allowed``; ``GET /v1/models`` lists only what the caller may use (``allowed``)."""

from __future__ import annotations

from typing import Any

from ...errors import PermissionDenied
from ..router import Router
from ..types import Caller, Context, Next


def allowed(router: Router, caller: Caller, name: str) -> bool:
    """Whether ``caller`` may use the model ``name``. A concrete model is also allowed under another name for the
    same provider and upstream model (``tiny`` and ``local/tiny``); a virtual model only by its own name, since
    its targets may span providers."""
    patterns = caller.models
    if patterns is None or name in patterns or "*" in patterns:
        return True
    if name in router.virtual:
        return False
    target = router.known_target(name)
    if target is None:
        return False
    for pattern in patterns:
        if pattern.endswith("/*"):
            if target.provider.name == pattern[:-2]:
                return True
        elif pattern not in router.virtual:
            same = router.known_target(pattern)
            if same is not None and same.provider is target.provider and same.upstream == target.upstream:
                return True
    return False


class Allowlist:
    name = "allowlist"

    def __init__(self, router: Router):
        self.router = router

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        name = context.resolved_model or ""
        if not allowed(self.router, context.caller, name):
            raise PermissionDenied(f"this API key may not use model {name!r}", ("model",), code="model_not_allowed")
        return await call_next(context, request)
