"""The HTTP server: each route reads its dialect, asks the router, and answers in the same dialect."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import __version__
from .canonical import DecisionRequest, DecisionResult
from .dialects import openai as openai_dialect
from .dialects import systemone as systemone_dialect
from .errors import DecisionError
from .gateway.router import Router
from .transport import read_payload

log = logging.getLogger("decisiond.server")
access = logging.getLogger("decisiond.access")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class Settings:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass
class Dialect:
    """How one wire format enters and leaves: pure functions from ``decisiond.dialects``."""

    name: str
    parse: Callable[[Any, dict], DecisionRequest]
    render: Callable[[DecisionResult, DecisionRequest], dict]
    error: Callable[[DecisionError], tuple[int, dict]]
    # Whether an unknown model name is refused (OpenAI) or answered by the served model (System One, SGLang).
    strict_model: bool = True


def _openai_error(error: DecisionError) -> tuple[int, dict]:
    return error.status, openai_dialect.error_body(error)


OPENAI = Dialect("openai", lambda body, files: openai_dialect.parse_request(body), openai_dialect.render_response,
                 _openai_error)
SYSTEM_ONE = Dialect("system_one", systemone_dialect.parse_request, systemone_dialect.render_response,
                     systemone_dialect.error_response, strict_model=False)


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def create_app(router: Router, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="decisiond", version=__version__)
    app.state.router = router
    app.state.settings = settings

    @app.middleware("http")
    async def request_context(request: Request, call_next):
        request.state.request_id = new_request_id()
        request.state.log = {}
        start = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception:  # a bug: never leak a traceback to the client
            log.exception("unhandled error", extra={"request_id": request.state.request_id})
            response = JSONResponse(
                {"error": {"message": "Internal server error.", "type": "server_error", "param": None, "code": None}},
                status_code=500,
            )
        response.headers["x-request-id"] = request.state.request_id
        response.headers["x-typesafe-request-id"] = request.state.request_id
        access.info(
            "%s %s %d",
            request.method,
            request.url.path,
            response.status_code,
            extra={
                "request_id": request.state.request_id,
                "method": request.method,
                "path": request.url.path,
                "status": response.status_code,
                "duration_ms": round((time.perf_counter() - start) * 1000, 2),
                **request.state.log,
            },
        )
        return response

    async def serve_decision(request: Request, dialect: Dialect) -> JSONResponse:
        state = request.state.log
        state["dialect"] = dialect.name
        try:
            payload = await read_payload(request, settings.max_body_bytes)
            if payload.content_encoding != "identity" or payload.multipart:
                state.update(content_encoding=payload.content_encoding, multipart=payload.multipart)
            decision = dialect.parse(payload.document, payload.files)
            state.update(model=decision.model, questions=len(decision.questions))
            result = await router.decide(decision, strict=dialect.strict_model)
            state.update(served_model=result.model, input_tokens=result.usage.input_tokens)
            return JSONResponse(dialect.render(result, decision))
        except DecisionError as error:
            state.update(error_code=error.code)
            status, body = dialect.error(error)
            return JSONResponse(body, status_code=status, headers=error.headers or None)

    @app.post("/v1/decisions")
    async def decisions(request: Request):
        return await serve_decision(request, OPENAI)

    @app.post("/v1/systemone")
    async def systemone(request: Request):
        return await serve_decision(request, SYSTEM_ONE)

    @app.get("/v1/models")
    async def models(request: Request):
        if request.headers.get("x-typesafe-sdk"):
            # The TypeSafe SDK reads {"models": [{name, description, release_date}]}.
            return systemone_dialect.models_body(router.models())
        return {
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owned_by,
                 "capabilities": list(m.capabilities)}
                for m in router.models()
            ],
        }

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": [m.name for m in router.models()], "version": __version__}

    return app
