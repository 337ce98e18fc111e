"""Guarded chat traffic: ``POST /v1/chat/completions`` and ``POST /v1/responses`` forwarded to OpenAI-shaped
providers (``openai``, ``azure``) behind the same keys, allowlists, rate limits and prompt guardrails as decisions.
The body goes upstream as sent (model replaced, redactions applied); the answer — server-sent events included —
comes back as the upstream sends it, unbuffered. Errors are OpenAI-shaped."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .dialects import openai as openai_dialect
from .errors import DecisionError, invalid, upstream_error
from .gateway.allowlist import allowed
from .gateway.auth import forbidden
from .gateway.guardrails import verdict
from .gateway.limits import CHARS_PER_TOKEN
from .gateway.providers.openai import OpenAIProvider
from .gateway.service import Gateway
from .transport import read_payload

__all__ = ["prompt_slots", "router"]

log = logging.getLogger("decisiond.chat")
router = APIRouter()

# (container, key): a place in the JSON body holding prompt text, so a redaction can be written back in place.
Slot = tuple[Any, Any]
_TEXT_PARTS = ("text", "input_text")


def _content_slots(holder: dict[str, Any], key: str) -> list[Slot]:
    value = holder.get(key)
    if isinstance(value, str):
        return [(holder, key)]
    if isinstance(value, list):
        return [(part, "text") for part in value if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
                and isinstance(part.get("text"), str)]
    return []


def prompt_slots(route: str, body: dict[str, Any]) -> list[Slot]:
    """Where the prompt's text is: chat messages' content, or the Responses API's instructions and input."""
    slots: list[Slot] = []
    if route == "chat/completions":
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                slots += _content_slots(message, "content")
        return slots
    slots += _content_slots(body, "instructions") + _content_slots(body, "input")
    items = body.get("input")
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict):
            slots += _content_slots(item, "content") + _content_slots(item, "output")
    return slots


def _error(error: DecisionError, headers: dict[str, str] | None = None) -> JSONResponse:
    status, body = openai_dialect.render_error(error)
    return JSONResponse(body, status_code=status, headers={**(headers or {}), **error.headers} or None)


async def forward(request: Request, route: str) -> Response:
    gateway: Gateway = request.app.state.gateway
    settings = request.app.state.settings
    fields = request.state.log
    fields["dialect"] = "openai_" + route.replace("/", "_")
    headers: dict[str, str] = {}
    try:
        caller = await gateway.auth.authenticate(request.headers)
        payload = await read_payload(request, settings.max_body_bytes, settings.body_read_timeout)
        body = payload.document
        if not isinstance(body, dict):
            raise invalid("The request body must be a JSON object.")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("model is required", "model", code="missing_required_parameter")
        fields["model"] = model
        target = gateway.router.chat_target(model)
        if not allowed(gateway.router, caller, model):
            raise forbidden(f"this API key may not use model {model!r}", "model", code="model_not_allowed")
        slots = prompt_slots(route, body)
        texts = tuple(str(c[k]) for c, k in slots)
        tokens = math.ceil(sum(len(t) for t in texts) / CHARS_PER_TOKEN)
        scopes = gateway.limiter.caller_scopes(caller) + gateway.limiter.target_scopes(target.name,
                                                                                      target.provider.name)
        admission = await gateway.limiter.admit(scopes, tokens)
        headers.update(admission.headers)
    except DecisionError as error:
        fields["error_code"] = error.code
        return _error(error, headers)
    try:
        configs = gateway.guardrails.for_request(model, caller.guardrails)
        if configs:
            outcomes: dict[str, str] = {}
            redacted, results = await gateway.guardrails.run(configs, texts, request.state.request_id)
            try:
                verdict(results, headers, outcomes)
            finally:
                fields["guardrails"] = outcomes
            for (container, key), text in zip(slots, redacted):
                container[key] = text
        provider = target.provider
        assert isinstance(provider, OpenAIProvider)
        upstream = await provider.forward(route, body, target.upstream)
    except DecisionError as error:
        await admission.release()
        fields["error_code"] = error.code
        return _error(error, headers)
    if upstream.status_code >= 400:
        text = (await upstream.aread()).decode(errors="replace")
        await upstream.aclose()
        await admission.release()
        kept = {k: v for k, v in upstream.headers.items() if k.lower() in ("retry-after", "retry-after-ms")}
        failed = upstream_error(provider.name, upstream.status_code, _message(text), kept, secrets=provider.secrets)
        fields["error_code"] = failed.code
        return _error(failed, headers)
    fields["provider"] = provider.name

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await admission.release()

    kept = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "x-request-id")}
    if "x-request-id" in kept:
        headers["x-upstream-request-id"] = kept.pop("x-request-id")
    return StreamingResponse(relay(), status_code=upstream.status_code, headers={**headers, **kept},
                             media_type=kept.get("content-type", "application/json"))


def _message(text: str) -> str:
    from .gateway.providers.base import error_message

    try:
        json.loads(text)
    except ValueError:
        return text.strip()[:512] or "(no body)"
    return error_message(text)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await forward(request, "chat/completions")


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await forward(request, "responses")
