"""Stage: a key's allowed models, checked on the resolved model, never on the spelling a request used. Patterns are
model names (any spelling of a model: ``fs1/secret-model`` means the entry that covers it), virtual model names,
``provider/*`` (every model that provider serves) and ``*``. A model outside them → 403 ``model_not_allowed``;
``GET /v1/models`` lists only what the caller may use (``allowed``).

A raw upstream (a ``<provider>/<upstream>`` no model entry covers, served only with ``allow_raw_upstreams``) is
allowed only to a key whose allowlist names it (the name itself or ``<provider>/*``; ``*`` does not), and to the
master key or, when no keys are configured, to anyone."""

from __future__ import annotations

from typing import Any

from ...errors import DecisionError, PermissionDenied
from ..catalog import Catalog
from ..types import Caller, Context, Next


def allowed(catalog: Catalog, caller: Caller, name: str) -> bool:
    """Whether ``caller`` may use the model ``name`` (any spelling). A virtual model is allowed only by its own name
    (or ``*``), since its targets may span providers."""
    try:
        canonical = catalog.canonical(name)
    except DecisionError:  # a spelling two entries share names no one model
        return False
    if canonical is None:
        return False
    raw = catalog.is_raw(canonical)
    if raw and not catalog.allow_raw_upstreams:
        return False
    patterns = caller.models
    if patterns is None:
        return not raw or caller.master or caller.key_id is None
    if "*" in patterns and not raw:
        return True
    target = None if canonical in catalog.virtual else catalog.known_target(canonical)
    for pattern in patterns:
        if pattern.endswith("/*"):
            if target is not None and target.provider.name == pattern[:-2]:
                return True
            continue
        try:
            if catalog.canonical(pattern) == canonical:
                return True
        except DecisionError:
            continue
    return False


class Allowlist:
    name = "allowlist"

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        name = context.resolved_model or ""
        if not allowed(self.catalog, context.caller, name):
            raise PermissionDenied(f"this API key may not use model {name!r}", ("model",), code="model_not_allowed")
        return await call_next(context, request)
