"""The request middleware (pure ASGI): a request id on every response, one JSON access line per request, a
last-resort 500 that never carries a traceback, and — when the gateway traces — the request's span."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import tracing
from ..dialects import detect
from ..errors import ServerError
from .metrics import route_label

log = logging.getLogger("decisiond.server")
access = logging.getLogger("decisiond.access")

INTERNAL_ERROR = ServerError("Internal server error.")


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


class RequestContext:
    """Pure-ASGI middleware: a request id on every response (``x-request-id``, ``x-typesafe-request-id``), one JSON
    access line per request, and a last-resort 500 that never carries a traceback. With a ``tracer``, the request is
    a span (OTel's HTTP server conventions), the child of the caller's ``traceparent`` and the parent of everything
    the request does; its trace id goes on the access line."""

    def __init__(self, app: ASGIApp, tracer: tracing.Tracer | None = None):
        self.app = app
        self.tracer = tracer

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
        status = 0
        span: tracing.Span | None = None
        if self.tracer is not None:
            span = self.tracer.start(scope["method"], {
                "http.request.method": scope["method"], "url.path": scope["path"],
                "url.scheme": scope.get("scheme", "http"), "network.protocol.version": scope.get("http_version", ""),
                tracing.REQUEST_ID: request_id}, tracing.SERVER, tracing.extract(scope["headers"]))
            token = tracing.attach(span)
            fields["trace_id"] = tracing.trace_id(span)

        def log_access(status: int) -> None:
            access.info("%s %s %d", scope["method"], scope["path"], status, extra={
                "request_id": request_id, "method": scope["method"], "path": scope["path"], "status": status,
                "duration_ms": round((time.perf_counter() - start) * 1000, 2), **fields})

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
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
        finally:
            if span is not None:
                tracing.detach(token)
                _ended(span, scope, status)


def _ended(span: tracing.Span, scope: Scope, status: int) -> None:
    """The request's span ends, named by its route (``POST /v1/decisions``, ``DELETE /admin/keys/{key_id}``; the
    method alone for a path no route serves), with its status: failed at 500 and over, or with no answer."""
    route = getattr(scope.get("route"), "path_format", None)
    if not isinstance(route, str):
        route = scope["path"] if route_label(scope["path"]) == scope["path"] else None
    if route is not None:
        span.update_name(f"{scope['method']} {route}")
        span.set_attribute("http.route", route)
    if status:
        span.set_attribute("http.response.status_code", status)
    if status >= 500 or not status:
        tracing.error(span, str(status) if status else "incomplete")
    span.end()
