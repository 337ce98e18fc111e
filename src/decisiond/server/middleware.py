"""The request middleware (pure ASGI): a request id on every response, one JSON access line per request, and a
last-resort 500 that never carries a traceback."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..dialects import detect
from ..errors import ServerError

log = logging.getLogger("decisiond.server")
access = logging.getLogger("decisiond.access")

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
