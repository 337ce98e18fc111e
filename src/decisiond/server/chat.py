"""Guarded chat traffic: ``POST /v1/chat/completions`` and ``POST /v1/responses`` forwarded to OpenAI-shaped
providers (``openai``, ``azure``) through the gateway's pipeline, so behind the same keys, allowlists, rate limits,
budgets and prompt guardrails as decisions, and with one usage record each (request type ``chat`` or
``responses``) carrying the upstream's tokens and their cost. The body goes upstream as sent (model replaced,
redactions applied); the answer — server-sent events included — comes back as the upstream sends it, unbuffered
(``gateway.chat.ChatStream`` reads its usage on the way), from the first target of the model that answers before the
client has a byte (``Router.chat``). Errors are OpenAI-shaped."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..dialects import openai as openai_dialect
from ..errors import ClientGone, DecisionError, Timeout, invalid
from ..gateway.chat import ROUTES, ChatRequest, ChatResult, Relay, Slot
from ..gateway.service import Gateway
from ..gateway.types import Context
from .boundary import OpenAIRoute, openai_error
from .middleware import INTERNAL_ERROR
from .payload import read_payload
from .routes import TIMEOUT_HEADER, authenticate, client_timeout

log = logging.getLogger("decisiond.chat")
router = APIRouter(route_class=OpenAIRoute)

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


def _deadline(timeout: float | None) -> DecisionError:
    return Timeout(f"the request was not answered within the {(timeout or 0) * 1000:.0f} ms its {TIMEOUT_HEADER} "
                   "header allows")


def _parse(route: str, document: Any, relay: Relay) -> ChatRequest:
    if not isinstance(document, dict):
        raise invalid("The request body must be a JSON object.")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required", "model", code="missing_required_parameter")
    return ChatRequest(route, document, model, prompt_slots(route, document), relay)


async def _run(gateway: Gateway, route: str, context: Context, document: Any, relay: Relay,
               fields: dict[str, Any]) -> ChatResult:
    """The request through the gateway's pipeline — until its answer has passed to the client — then its usage
    record, whatever happened (an error, the client gone)."""
    status: int = 500
    code: str | None = INTERNAL_ERROR.code
    result: ChatResult | None = None
    body: Any = None
    request: ChatRequest | None = None
    try:
        request = _parse(route, document, relay)
        fields["model"] = request.model
        answered = await gateway.pipeline.run(context, request)
        if not isinstance(answered, ChatResult):
            raise TypeError(f"the pipeline answered chat traffic with a {type(answered).__name__}")
        result = answered
        status, body = result.status, result.document
        code = result.failure.code if result.failure is not None else None  # a stream that ended early
        return result
    except DecisionError as error:
        status, body = openai_dialect.render_error(error)
        code = error.code
        raise
    except asyncio.CancelledError:  # the client went away while the answer streamed: charged what was relayed
        status, code = ClientGone.status, ClientGone.code
        result = request.partial if request is not None else None
        raise
    except Exception:
        log.exception("unhandled error", extra={"request_id": context.request_id})
        raise
    finally:
        relay.close()
        gateway.record(ROUTES[route], context, status, code, result, document, body)


class _Relayed(StreamingResponse):
    """The upstream's answer as it comes. When the client leaves before its end, the request's work is cancelled
    (the upstream connection closed, what the stages hold released, the record written with 499); at the end, the
    response waits for the stages to settle and the record to be handed over."""

    def __init__(self, relay: Relay, work: asyncio.Task[ChatResult], headers: dict[str, str]):
        super().__init__(relay.chunks(), status_code=relay.status, headers=headers,
                         media_type=relay.headers.get("content-type", "application/json"))
        self.relay, self.work = relay, work

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.relay.closed:
                self.work.cancel()
            await asyncio.wait({self.work})
            if not self.work.cancelled() and self.work.exception() is not None:
                log.warning("chat answer ended early", extra={"error": str(self.work.exception())[:300]})


async def forward(request: Request, route: str) -> Response:
    """Authenticate, read, and run the request through the pipeline until its answer starts; then relay it. The
    client's ``x-decisiond-timeout-ms`` bounds the whole exchange: before the answer starts, a 504; after, the
    stream ends with an error event (``gateway.forward``)."""
    gateway: Gateway = request.app.state.gateway
    settings = request.app.state.settings
    fields = request.state.log
    fields["dialect"] = dialect = "openai_" + route.replace("/", "_")
    try:
        caller = await authenticate(request)
        timeout = client_timeout(request)
        payload = await read_payload(request, settings.max_body_bytes, settings.body_read_timeout)
    except DecisionError as error:  # answered by the route (``OpenAIRoute``); its code goes on the access line
        fields["error_code"] = error.code
        raise
    deadline = time.monotonic() + timeout if timeout is not None else None
    context = Context(request.state.request_id, "chat", dialect, caller, request_headers=request.headers,
                      deadline=deadline)
    relay = Relay()
    work = asyncio.create_task(_run(gateway, route, context, payload.document, relay, fields))
    started = asyncio.ensure_future(relay.started.wait())
    try:
        await asyncio.wait({work, started}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        started.cancel()
    if not relay.started.is_set():  # refused, failed before the upstream answered, or out of time
        if not work.done():
            work.cancel()
        await asyncio.wait({work})
        failure = work.exception() if not work.cancelled() else _deadline(timeout)
        refusal = failure if isinstance(failure, DecisionError) else INTERNAL_ERROR
        fields.update(error_code=refusal.code, outcomes=context.outcomes or None)
        return openai_error(refusal, context.response_headers)
    fields["provider"] = relay.provider
    return _Relayed(relay, work, {**context.response_headers, **relay.headers})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await forward(request, "chat/completions")


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await forward(request, "responses")
