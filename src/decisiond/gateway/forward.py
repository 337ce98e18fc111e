"""Chat traffic's last step: one attempt on one target (``attempt``), which the router's failover loop calls for each
target in turn (``Router.chat``).

An attempt sends the body to an OpenAI-shaped provider (model replaced; a streamed chat completion always asks for
``stream_options.include_usage``, so that every answer is metered) and passes its answer to the request's ``Relay``.
Until the client has received a first byte, any failure is the attempt's (raised, so that the router may fail over):
a connect error, no response within ``first_byte_timeout_s``, an error status, a JSON answer that breaks off. A JSON
answer is therefore read whole (up to ``CHAT_USAGE_SCAN_BYTES``) before it is relayed. Once a stream has started, a
failure — the upstream breaking off, ``idle_timeout_s`` between chunks, the request's deadline — ends the stream
with an error event in the route's own shape, and the result says how much was relayed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from ..canonical import Usage
from ..errors import DecisionError, ServerError, Timeout, provider_error, retry_headers
from ..limits import CHAT_USAGE_SCAN_BYTES, UPSTREAM_ERROR_BODY_BYTES
from .catalog import Target
from .chat import ChatRequest, ChatResult, ChatStream
from .providers.base import error_message
from .providers.openai import OpenAIProvider
from .sizes import CHARS_PER_TOKEN, estimated_tokens

log = logging.getLogger("decisiond.chat")


def upstream_body(request: ChatRequest, upstream: str) -> tuple[dict[str, Any], bool]:
    """The body sent upstream, and whether the usage it is asked for must be hidden from the client (a streamed chat
    completion whose client did not ask ``stream_options.include_usage``)."""
    body = {**request.body, "model": upstream}
    if request.route != "chat/completions" or body.get("stream") is not True:
        return body, False
    options = body.get("stream_options")
    asked = isinstance(options, dict) and options.get("include_usage") is True
    if not asked:
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return body, not asked


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _bounded(limit: float, deadline: float | None) -> tuple[float, bool]:
    """The time to wait: ``limit``, or less when the request's deadline comes first (then True)."""
    left = _remaining(deadline)
    return (limit, False) if left is None or left >= limit else (max(0.0, left), True)


def _deadline_passed() -> Timeout:
    return Timeout("the request was not answered within the time its x-decisiond-timeout-ms header allows")


async def _open(provider: OpenAIProvider, request: ChatRequest, body: dict[str, Any], upstream: str,
                deadline: float | None) -> httpx.Response:
    wait, capped = _bounded(provider.config.chat.first_byte_timeout_s, deadline)
    try:
        return await asyncio.wait_for(provider.open_chat(request.route, body, upstream), wait)
    except asyncio.TimeoutError:
        if capped:
            raise _deadline_passed() from None
        raise provider_error(provider.name, 504, f"provider {provider.name!r} did not start its answer within "
                             f"{wait:g} s (first_byte_timeout_s)", code="upstream_timeout") from None


async def _chunks(provider: OpenAIProvider, response: httpx.Response, deadline: float | None) -> AsyncIterator[bytes]:
    """The response's (decoded) bytes, each within ``idle_timeout_s`` of the last and before the deadline."""
    iterator = response.aiter_bytes().__aiter__()
    while True:
        wait, capped = _bounded(provider.config.chat.idle_timeout_s, deadline)
        try:
            yield await asyncio.wait_for(iterator.__anext__(), wait)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            if capped:
                raise _deadline_passed() from None
            raise provider_error(provider.name, 504, f"provider {provider.name!r} sent nothing for {wait:g} s "
                                 "(idle_timeout_s)", code="upstream_timeout") from None
        except httpx.HTTPError as error:
            raise provider_error(provider.name, 502, f"provider {provider.name!r} broke off its answer: "
                                 f"{type(error).__name__}", code="upstream_unavailable") from error


async def _refusal(provider: OpenAIProvider, response: httpx.Response, deadline: float | None) -> DecisionError:
    body = bytearray()
    async for chunk in _chunks(provider, response, deadline):
        body += chunk[: max(0, UPSTREAM_ERROR_BODY_BYTES - len(body))]
    text = bytes(body).decode(errors="replace")
    try:
        json.loads(text)
        message = error_message(text)
    except ValueError:
        message = text.strip()[:512] or "(no body)"
    kept = retry_headers(response.headers)
    return provider_error(provider.name, response.status_code, message, kept, secrets=provider.secrets)


def error_event(route: str, error: DecisionError) -> bytes:
    """The event that ends a stream that failed after it started, in the route's own streaming shape."""
    if route == "responses":
        event: dict[str, Any] = {"type": "error", "code": error.code, "message": error.message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    chunk = {"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def attempt(request: ChatRequest, target: Target, deadline: float | None = None) -> ChatResult:
    """Send ``request`` to ``target`` and pass its answer to the request's relay; return once it has passed. A
    failure before the client's first byte is raised; one after it ends the stream (``ChatResult.failure``)."""
    provider = target.provider
    if not isinstance(provider, OpenAIProvider):
        raise ServerError(f"chat traffic reached provider {provider.name!r}, which cannot forward it")
    body, hide_usage = upstream_body(request, target.upstream)
    response = await _open(provider, request, body, target.upstream, deadline)
    try:
        if response.status_code >= 400:
            raise await _refusal(provider, response, deadline)
        stream = ChatStream(response.headers.get("content-type", "application/json"), hide_usage)
        headers = {"content-type": response.headers.get("content-type", "application/json")}
        if "x-request-id" in response.headers:
            headers["x-upstream-request-id"] = response.headers["x-request-id"]
        relay = _relay_events if stream.events else _relay_json
        try:
            failure = await relay(request, provider, response, stream, headers, deadline)
        except asyncio.CancelledError:  # the client left: what was relayed is what it cost
            if request.relay.started.is_set():
                request.partial = _result(request, stream, response.status_code, None)
            raise
        request.relay.close()  # the answer has passed (or broken off): the client's response ends now
    finally:
        await response.aclose()
    return _result(request, stream, response.status_code, failure)


async def _relay_json(request: ChatRequest, provider: OpenAIProvider, response: httpx.Response, stream: ChatStream,
                      headers: dict[str, str], deadline: float | None) -> DecisionError | None:
    """A JSON answer: held until it is whole (or over the scan limit), so that a break before then fails over."""
    held: list[bytes] = []
    size = 0
    chunks = _chunks(provider, response, deadline)
    async for chunk in chunks:
        held.append(stream.feed(chunk))
        size += len(chunk)
        if size > CHAT_USAGE_SCAN_BYTES:
            break
    request.relay.start(response.status_code, headers, provider.name)
    for part in held:
        await request.relay.send(part)
    try:
        async for chunk in chunks:  # only an answer over the scan limit is still coming
            await request.relay.send(stream.feed(chunk))
    except DecisionError as error:  # a JSON body cannot carry an error once begun: it ends where it broke
        return error
    return None


async def _relay_events(request: ChatRequest, provider: OpenAIProvider, response: httpx.Response,
                        stream: ChatStream, headers: dict[str, str], deadline: float | None) -> DecisionError | None:
    request.relay.start(response.status_code, headers, provider.name)
    try:
        async for chunk in _chunks(provider, response, deadline):
            out = stream.feed(chunk)
            if out:
                await request.relay.send(out)
    except DecisionError as error:
        tail = stream.finish()
        await request.relay.send(tail + error_event(request.route, error))
        return error
    tail = stream.finish()
    if tail:
        await request.relay.send(tail)
    return None


def _result(request: ChatRequest, stream: ChatStream, status: int, failure: DecisionError | None) -> ChatResult:
    if stream.events is False:
        stream.finish()
    if stream.overflow:
        log.warning("chat usage not read: the answer is too large to scan", extra={"route": request.route})
    if stream.usage is not None:
        return ChatResult(stream.usage, stream.model, status, True, stream.document, failure=failure)
    # No usage reported (or the stream broke before it): counted from the prompt and the text relayed.
    usage = Usage(input_tokens=estimated_tokens(request), output_tokens=math.ceil(stream.text_chars / CHARS_PER_TOKEN))
    return ChatResult(usage, stream.model, status, False, stream.document, estimated=True, failure=failure)
