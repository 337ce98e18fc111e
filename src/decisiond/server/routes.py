"""The decision routes. Each authenticates the caller, reads the body, picks its dialect, parses to the canonical
form, runs the gateway pipeline and renders the answer — or the error, raised anywhere — in the caller's own
dialect. The route table is ``ROUTES``; ``until_done`` cancels the work when the client leaves or its deadline
passes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from .. import tracing
from ..canonical import DecisionResult, ScoreResult
from ..dialects import detect
from ..dialects import openai as openai_dialect
from ..dialects import score as score_dialect
from ..dialects import sglang as sglang_dialect
from ..dialects import systemone as systemone_dialect
from ..dialects.base import Dialect
from ..errors import ClientGone, DecisionError, InvalidRequest, Timeout
from ..gateway.profiles import PROFILE_HEADER
from ..gateway.service import Gateway
from ..gateway.types import Caller, Context
from ..limits import MAX_CLIENT_TIMEOUT_MS
from .boundary import error_response
from .middleware import INTERNAL_ERROR
from .payload import Payload, read_payload
from .settings import Settings

log = logging.getLogger("decisiond.server")
T = TypeVar("T")

ErrorRenderer = Callable[[DecisionError, Any], tuple[int, dict[str, Any]]]

COST_HEADER = "x-decisiond-cost"
TIMEOUT_HEADER = "x-decisiond-timeout-ms"


@dataclass(frozen=True)
class DecisionRoute:
    """A POST route: which dialect a body speaks, how errors look before that is known, and the wire models its
    bodies follow (for ``/openapi.json``: the same models the dialects validate with)."""

    path: str
    choose: Callable[[Any], Dialect]
    # Errors before the dialect is known (401, an unreadable body, mixed shapes).
    early_error: ErrorRenderer
    # The request type of usage records and audit filters: decisions, system_one, score.
    request_type: str = "decisions"
    bodies: tuple[type[BaseModel], ...] = ()
    summary: str = ""

    def openapi(self) -> dict[str, Any]:
        """The request body schema (one of the wire models) and the error statuses, for schema-driven clients."""
        schemas = [m.model_json_schema(ref_template="#/components/schemas/{model}") for m in self.bodies]
        defs: dict[str, Any] = {}
        for schema in schemas:
            defs.update(schema.pop("$defs", {}))
        body = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
        return {
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {str(status): {"description": text} for status, text in (
                (400, "invalid request, in the route's error shape"), (401, "no or bad API key"),
                (403, "model not allowed"), (413, "body too large"), (422, "System One validation error"),
                (429, "rate limited"), (502, "upstream failed"))},
            "x-components": defs,
        }


def _decisions_dialect(document: Any) -> Dialect:
    """``POST /v1/decisions`` serves OpenAI's and SGLang's shapes; the body's own keys tell which (see detect)."""
    return sglang_dialect.DIALECT if detect.decisions_dialect(document) == "sglang" else openai_dialect.DIALECT


ROUTES = (
    DecisionRoute("/v1/decisions", _decisions_dialect, detect.render_error, "decisions",
                  (openai_dialect.DecisionBody, sglang_dialect.SGLangBody),
                  "OpenAI's Decisions API or SGLang's /v1/decisions (the body's keys tell which)"),
    DecisionRoute("/v1/systemone", lambda document: systemone_dialect.DIALECT, systemone_dialect.render_error,
                  "system_one", (systemone_dialect.SystemOneBody,), "TypeSafe's System One API"),
    DecisionRoute("/v1/score", lambda document: score_dialect.DIALECT, sglang_dialect.render_error, "score",
                  (score_dialect.ScoreBody,), "SGLang's /v1/score"),
)


def endpoint(route: DecisionRoute) -> Callable[[Request], Any]:
    """The route's endpoint, for ``add_api_route``."""
    async def decision_endpoint(request: Request) -> JSONResponse:
        return await serve(request, route)

    return decision_endpoint


def decision_asgi(route: DecisionRoute) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The route's endpoint as a plain ASGI app (``app.App`` calls it directly)."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await serve(Request(scope, receive, send), route)
        await response(scope, receive, send)

    return app


async def authenticate(request: Request) -> Caller:
    """The caller, from the request's headers (in an ``auth`` span when the gateway traces); its key and user path go
    on the access line."""
    gateway: Gateway = request.app.state.gateway
    with tracing.span(gateway.tracer, "auth"):
        caller = await gateway.auth.authenticate(request.headers)
    fields = request.state.log
    if caller.key_id is not None:
        fields["key_id"] = caller.key_id
    fields["user_path"] = caller.user_path
    return caller


async def caller_or_none(gateway: Gateway, headers: Mapping[str, str]) -> Caller | None:
    """The caller whose key ``headers`` carry, or None when they carry no valid one: for answers that say less to a
    caller without a key, rather than refuse it."""
    try:
        return await gateway.auth.authenticate(headers)
    except DecisionError:
        return None


async def serve(request: Request, route: DecisionRoute) -> JSONResponse:
    """Authenticate, read, pick the dialect, parse, run the pipeline, render — errors in the caller's dialect."""
    gateway: Gateway = request.app.state.gateway
    fields = request.state.log
    try:
        caller, payload, dialect = await _read(request, route)
    except DecisionError as error:
        fields["error_code"] = error.code
        return error_response(route.early_error(error, None), error.headers)
    except ClientDisconnect:  # gone while sending its body: nothing to answer, nothing to log as a fault
        fields["error_code"] = ClientGone.code
        return JSONResponse(None, status_code=ClientGone.status)
    fields["dialect"] = dialect.name
    context = Context(request.state.request_id, dialect.operation, dialect.name, caller,
                      strict_model=dialect.strict_model, request_headers=request.headers)
    answer = await respond(gateway, dialect, context, payload.document, payload.files, fields, request)
    if answer.status == ClientGone.status:
        response = JSONResponse(None, status_code=ClientGone.status)
    else:
        try:
            response = error_response((answer.status, answer.body), answer.headers)
        except Exception:  # a body JSON cannot carry (a NaN): a fault, answered in the caller's dialect
            log.exception("unrenderable answer", extra={"request_id": context.request_id})
            fields["error_code"] = INTERNAL_ERROR.code
            status, rendered = dialect.render_error(INTERNAL_ERROR, payload.document)
            answer = Answer(status, rendered, {}, error_code=INTERNAL_ERROR.code)
            response = error_response((status, rendered))
    gateway.record(route.request_type, context, answer.status, answer.error_code, answer.result, payload.document,
                   answer.body)
    return response


@dataclass
class Answer:
    """What a decision route answers: status, body and headers, and for the usage record the result (None for an
    error) and the error's code."""

    status: int
    body: Any
    headers: dict[str, str]
    result: Any = None
    error_code: str | None = None


async def respond(gateway: Gateway, dialect: Dialect, context: Context, document: Any,
                  files: dict[str, Any] | None, fields: dict[str, Any], request: Request | None = None) -> Answer:
    """Parse ``document`` in ``dialect``, run the pipeline, render the answer — or the error, raised anywhere — in
    the dialect. With ``request``, the work is cancelled when its client leaves or its deadline passes
    (``until_done``). ``fields`` gets the access line's fields. The caller records the usage (``Gateway.record``):
    a route at once, a batch line once it is final."""
    try:
        parsed = dialect.parse(document, files or {})
        fields["model"] = parsed.model
        if dialect.operation == "score":
            fields["items"] = len(parsed.prompts)
        else:
            fields["questions"] = len(parsed.questions)
        if request is not None:
            timeout = client_timeout(request)
            result = await until_done(request, gateway.pipeline.run(context, parsed), timeout)
        else:
            result = await gateway.pipeline.run(context, parsed)
        headers = _answer_headers(context, result, fields)
        return Answer(200, dialect.render(result, parsed), headers, result)
    except ClientGone:  # nobody reads the answer: its work was cancelled, and the record says so
        fields["error_code"] = ClientGone.code
        return Answer(ClientGone.status, None, {}, error_code=ClientGone.code)
    except DecisionError as error:
        fields.update(error_code=error.code, outcomes=context.outcomes or None,
                      resolved_model=context.resolved_model)  # a refusal's model, once the pipeline knew it
        status, rendered = dialect.render_error(error, document)
        return Answer(status, rendered, {**context.response_headers, **error.headers}, error_code=error.code)
    except Exception:  # a bug: answered in the caller's dialect, never with a traceback
        log.exception("unhandled error", extra={"request_id": context.request_id})
        fields["error_code"] = INTERNAL_ERROR.code
        status, rendered = dialect.render_error(INTERNAL_ERROR, document)
        return Answer(status, rendered, {}, error_code=INTERNAL_ERROR.code)


async def _read(request: Request, route: DecisionRoute) -> tuple[Caller, Payload, Dialect]:
    """The caller, the body and the dialect it speaks: what ``serve`` knows before any dialect's error shape."""
    settings: Settings = request.app.state.settings
    caller = await authenticate(request)
    payload = await read_payload(request, settings.max_body_bytes, settings.body_read_timeout)
    if payload.content_encoding != "identity" or payload.multipart:
        request.state.log.update(content_encoding=payload.content_encoding, multipart=payload.multipart)
    return caller, payload, route.choose(payload.document)


def _answer_headers(context: Context, result: Any, fields: dict[str, Any]) -> dict[str, str]:
    """The answer's headers (the pipeline's, the provider format, the cost), and its fields on the access line."""
    headers = dict(context.response_headers)
    fields["resolved_model"] = context.resolved_model
    if "x-cache" in headers:  # a hit costs nothing: the access line is the record of it
        fields["cache"] = headers["x-cache"].lower()
    if isinstance(result, ScoreResult):
        fields["input_tokens"] = result.prompt_tokens
    elif isinstance(result, DecisionResult):
        fields.update(served_model=result.model, input_tokens=result.usage.input_tokens,
                      provider_format=result.provider_format)
        headers["x-decisiond-provider-format"] = result.provider_format
        applied = sorted({a.profile for a in result.answers if a.profile is not None})
        if applied:
            headers[PROFILE_HEADER] = ",".join(applied)
    if context.cost is not None:
        headers[COST_HEADER] = f"{context.cost:.10f}"
        fields["cost_usd"] = context.cost
    return headers


def client_timeout(request: Request) -> float | None:
    """Seconds the client allows (``x-decisiond-timeout-ms``), or None."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        ms = int(value.strip())
    except ValueError:
        ms = 0
    if not 1 <= ms <= MAX_CLIENT_TIMEOUT_MS:
        raise InvalidRequest(f"the {TIMEOUT_HEADER} header must be a whole number of milliseconds from 1 to "
                            f"{MAX_CLIENT_TIMEOUT_MS}", (TIMEOUT_HEADER,), code="invalid_header")
    return ms / 1000


async def until_done(request: Request, work: Awaitable[T], timeout: float | None) -> T:
    """``work``, cancelled when the client disconnects (``ClientGone``) or its deadline passes (504): queued model
    work is then dropped, running work stops between forward passes, upstream calls are abandoned. The deadline
    counts from here: after the body is read and parsed."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    waiting: set[asyncio.Future[Any]] = {task, gone}
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
            done, _ = await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                if task.cancelled():  # cancelled from inside, not by this handler: a fault, not a departure
                    raise RuntimeError("the request's work was cancelled")
                return task.result()
            if gone in done and (gone.cancelled() or gone.exception() is not None):
                waiting = {task}  # the watcher failed; that is not the client leaving
                continue
            task.cancel()
            await asyncio.wait({task})
            if gone in done:
                raise ClientGone()
            raise Timeout(f"the request was not answered within the {(timeout or 0) * 1000:.0f} ms its "
                          f"{TIMEOUT_HEADER} header allows")
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
