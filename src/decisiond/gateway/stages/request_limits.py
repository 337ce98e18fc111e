"""Stage: OpenAI's limits on every decision request, first in the chain, so that a request over them costs nothing
downstream (the checks themselves are ``gateway.sizes.check_openai``)."""

from __future__ import annotations

from typing import Any

from ..sizes import check_openai
from ..types import Context, Next


class RequestLimits:
    name = "request_limits"

    async def __call__(self, context: Context, request: Any, call_next: Next) -> Any:
        if context.operation == "decide":
            check_openai(request)
        return await call_next(context, request)
