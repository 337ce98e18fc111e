"""Chat traffic's last step in the pipeline: the body to an OpenAI-shaped provider (``forward``), its answer back
to the client through the request's ``Relay`` as it comes, and the usage read on the way (``chat.UsageMeter``).

The pipeline's stages hold what they reserved (rate-limit tokens and slots, budget reservations) until ``forward``
returns, that is until the last chunk has passed; so a streamed answer is settled with its real usage.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncContextManager

import httpx

from ..canonical import Usage
from ..errors import ServerError, provider_error, retry_headers
from .chat import ChatRequest, ChatResult, UsageMeter
from .providers.base import error_message
from .providers.openai import OpenAIProvider
from .router import Target

log = logging.getLogger("decisiond.chat")


def _message(text: str) -> str:
    try:
        json.loads(text)
    except ValueError:
        return text.strip()[:512] or "(no body)"
    return error_message(text)


async def forward(request: ChatRequest, target: Target, gate: AsyncContextManager[Any]) -> ChatResult:
    """Send ``request`` to ``target`` (through the target's rate-limit ``gate``) and pass its answer to the
    request's relay as it comes; return once the last chunk has passed. An upstream error before the answer
    starts is raised (OpenAI-shaped for the route to render); one during it ends the stream and is raised too."""
    provider = target.provider
    if not isinstance(provider, OpenAIProvider):
        raise ServerError(f"chat traffic reached provider {provider.name!r}, which cannot forward it")
    relay = request.relay
    async with gate as admission:
        upstream = await provider.forward(request.route, request.body, target.upstream)
        try:
            if upstream.status_code >= 400:
                text = (await upstream.aread()).decode(errors="replace")
                kept = retry_headers(upstream.headers)
                raise provider_error(provider.name, upstream.status_code, _message(text), kept,
                                     secrets=provider.secrets)
            content_type = upstream.headers.get("content-type", "application/json")
            headers = {"content-type": content_type}
            if "x-request-id" in upstream.headers:
                headers["x-upstream-request-id"] = upstream.headers["x-request-id"]
            meter = UsageMeter(content_type)
            relay.start(upstream.status_code, headers, provider.name)
            try:
                # Decoded bytes: the client gets no content-encoding header, so it must get the plain answer.
                async for chunk in upstream.aiter_bytes():
                    meter.feed(chunk)
                    await relay.send(chunk)
            except httpx.HTTPError as error:
                raise provider_error(provider.name, 502, f"provider {provider.name!r} broke off its answer: "
                                     f"{type(error).__name__}", code="upstream_unavailable") from error
        finally:
            relay.close()
            await upstream.aclose()
        meter.finish()
        if meter.overflow:
            log.warning("chat usage not read: the answer is too large to scan", extra={"route": request.route})
        usage = meter.usage or Usage()
        if admission is not None:
            await admission.settle(usage.input_tokens)
    return ChatResult(usage, meter.model, upstream.status_code, meter.usage is not None, meter.document)
