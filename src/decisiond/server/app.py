"""The HTTP server. Each decision route authenticates the caller, reads the body, picks its dialect, parses to
the canonical form, runs the gateway pipeline and renders the answer — or the error, raised anywhere — in the
caller's own dialect. The route table is ``ROUTES``; the admin API lives in ``admin``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..canonical import DecisionResult, ScoreResult
from ..dialects import detect
from ..dialects import openai as openai_dialect
from ..dialects import score as score_dialect
from ..dialects import sglang as sglang_dialect
from ..dialects import systemone as systemone_dialect
from ..dialects.base import Dialect
from ..errors import ClientGone, DecisionError, InvalidRequest, ServerError, Timeout
from ..gateway.router import Router
from ..gateway.service import Gateway
from ..gateway.stages.allowlist import allowed
from ..gateway.types import Caller, Context
from ..limits import BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, MAX_CLIENT_TIMEOUT_MS
from ..version import __version__
from . import admin, chat
from . import mcp as mcp_server
from .metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from .payload import read_payload

log = logging.getLogger("decisiond.server")
T = TypeVar("T")
access = logging.getLogger("decisiond.access")

ErrorRenderer = Callable[[DecisionError, Any], tuple[int, dict[str, Any]]]


@dataclass
class Settings:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout: float = BODY_READ_TIMEOUT_S


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

INTERNAL_ERROR = ServerError("Internal server error.")


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


class RequestContext:
    """Pure-ASGI middleware: a request id on every response (``x-request-id``, ``x-typesafe-request-id``), one JSON
    access line per request, and a last-resort 500 that never carries a traceback."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        fields: dict[str, Any] = {}
        state = scope.setdefault("state", {})
        state["request_id"], state["log"] = request_id, fields
        start = time.perf_counter()
        started = False

        def log_access(status: int) -> None:
            access.info("%s %s %d", scope["method"], scope["path"], status, extra={
                "request_id": request_id, "method": scope["method"], "path": scope["path"], "status": status,
                "duration_ms": round((time.perf_counter() - start) * 1000, 2), **fields})

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = request_id
                headers["x-typesafe-request-id"] = request_id
                # Logged as the response starts, so that a client that has its answer finds the line written.
                log_access(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # a bug: never leak a traceback to the client
            log.exception("unhandled error", extra={"request_id": request_id})
            if not started:
                _, body = detect.render_error(INTERNAL_ERROR)
                await JSONResponse(body, status_code=500)(scope, receive, send_with_id)


def _error_response(rendered: tuple[int, dict[str, Any]], *header_sets: dict[str, str]) -> JSONResponse:
    status, body = rendered
    headers = {k: v for h in header_sets for k, v in h.items()}
    return JSONResponse(body, status_code=status, headers=headers or None)


async def _caller(request: Request) -> Caller:
    gateway: Gateway = request.app.state.gateway
    caller = await gateway.auth.authenticate(request.headers)
    fields = request.state.log
    if caller.key_id is not None:
        fields["key_id"] = caller.key_id
    fields["user_path"] = caller.user_path
    return caller


async def serve(request: Request, route: DecisionRoute) -> JSONResponse:
    """Authenticate, read, pick the dialect, parse, run the pipeline, render — errors in the caller's dialect."""
    gateway: Gateway = request.app.state.gateway
    settings: Settings = request.app.state.settings
    fields = request.state.log
    try:
        caller = await _caller(request)
        payload = await read_payload(request, settings.max_body_bytes, settings.body_read_timeout)
        if payload.content_encoding != "identity" or payload.multipart:
            fields.update(content_encoding=payload.content_encoding, multipart=payload.multipart)
        dialect = route.choose(payload.document)
    except DecisionError as error:
        fields["error_code"] = error.code
        return _error_response(route.early_error(error, None), error.headers)
    except ClientDisconnect:  # gone while sending its body: nothing to answer, nothing to log as a fault
        fields["error_code"] = ClientGone.code
        return JSONResponse(None, status_code=ClientGone.status)
    document = payload.document
    fields["dialect"] = dialect.name
    context = Context(request.state.request_id, dialect.operation, dialect.name, caller,
                      strict_model=dialect.strict_model, request_headers=request.headers)
    try:
        parsed = dialect.parse(document, payload.files)
        fields["model"] = parsed.model
        if dialect.operation == "score":
            fields["items"] = len(parsed.prompts)
        else:
            fields["questions"] = len(parsed.questions)
        timeout = client_timeout(request)
        result = await until_done(request, gateway.pipeline.run(context, parsed), timeout)
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
        if context.cost is not None:
            headers[COST_HEADER] = f"{context.cost:.10f}"
            fields["cost_usd"] = context.cost
        body = dialect.render(result, parsed)
        gateway.record(route.request_type, context, 200, None, result, document, body)
        return JSONResponse(body, headers=headers)
    except ClientGone:  # nobody reads the answer: its work was cancelled, and the record says so
        fields["error_code"] = ClientGone.code
        gateway.record(route.request_type, context, ClientGone.status, ClientGone.code, None, document, None)
        return JSONResponse(None, status_code=ClientGone.status)
    except DecisionError as error:
        fields.update(error_code=error.code, outcomes=context.outcomes or None)
        status, rendered = dialect.render_error(error, document)
        gateway.record(route.request_type, context, status, error.code, None, document, rendered)
        return _error_response((status, rendered), context.response_headers, error.headers)
    except Exception:  # a bug: answered in the caller's dialect, never with a traceback
        log.exception("unhandled error", extra={"request_id": context.request_id})
        fields["error_code"] = INTERNAL_ERROR.code
        rendered_error = dialect.render_error(INTERNAL_ERROR, document)
        gateway.record(route.request_type, context, rendered_error[0], INTERNAL_ERROR.code, None, document,
                       rendered_error[1])
        return _error_response(rendered_error)


COST_HEADER = "x-decisiond-cost"
TIMEOUT_HEADER = "x-decisiond-timeout-ms"


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


def _endpoint(route: DecisionRoute) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> JSONResponse:
        return await serve(request, route)

    return endpoint


# The playground's files, shipped in the package (web/): no build step, no CDN.
WEB_FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
             "playground.css": "text/css; charset=utf-8"}


def _web_file(name: str) -> bytes:
    from importlib.resources import files

    return files("decisiond").joinpath("web", name).read_bytes()


def create_app(router: Router, settings: Settings | None = None, gateway: Gateway | None = None) -> FastAPI:
    gateway = gateway or Gateway(router)
    mcp = mcp_server.build(gateway)
    mcp_endpoint = mcp_server.http_endpoint(mcp, gateway)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            async with mcp.session_manager.run():
                yield
        finally:
            await gateway.aclose()  # upstream connection pools, Redis, the database

    app = FastAPI(title="decisiond", version=__version__, lifespan=lifespan)
    app.state.router = router
    app.state.gateway = gateway
    app.state.settings = settings or Settings()
    app.state.metrics = metrics = Metrics(router)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # inside RequestContext: it reads the access fields
    app.add_middleware(RequestContext)

    components: dict[str, Any] = {}
    for route in ROUTES:
        extra = route.openapi()
        components.update(extra.pop("x-components"))
        app.add_api_route(route.path, _endpoint(route), methods=["POST"], name=route.path.rsplit("/", 1)[-1],
                          summary=route.summary, openapi_extra=extra)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/v1/models")
    async def models(request: Request, capability: str | None = None) -> Any:
        try:
            caller = await _caller(request)
        except DecisionError as error:
            return _error_response(openai_dialect.render_error(error), error.headers)
        listed = [m for m in router.model_list(capability) if allowed(router, caller, m.name)]
        if request.headers.get("x-typesafe-sdk"):
            # The TypeSafe SDK reads {"models": [{name, description, release_date}]}: decision models only.
            return systemone_dialect.models_body([m for m in listed if "decisions" in m.capabilities])
        return {
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owned_by,
                 "capabilities": list(m.capabilities)}
                for m in listed
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": [m.name for m in router.model_list()], "version": __version__}

    @app.get("/", include_in_schema=False)
    @app.get("/playground", include_in_schema=False)
    async def playground() -> Response:
        """The playground page (``web/``): it calls /v1/decisions with the key the user types."""
        return Response(_web_file("index.html"), media_type="text/html; charset=utf-8")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in WEB_FILES:
            return JSONResponse({"error": {"message": "Not found.", "type": "not_found_error", "param": None,
                                           "code": "not_found"}}, status_code=404)
        return Response(_web_file(name), media_type=WEB_FILES[name],
                        headers={"cache-control": "no-cache"})

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        """Prometheus text; the master key when keys are configured (it shows every caller's traffic)."""
        try:
            caller = await _caller(request)
            if gateway.auth.enabled:
                gateway.auth.require_master(caller)
        except DecisionError as error:
            return _error_response(openai_dialect.render_error(error), error.headers)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(admin.router)
    app.include_router(chat.router)
    app.include_router(admin.self_service)
    app.router.routes.append(Route("/mcp", mcp_endpoint, methods=["GET", "POST", "DELETE"]))
    return app
