"""The HTTP server: each route reads its dialect, asks the router, and answers in the same dialect."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import __version__
from .dialects import openai as openai_dialect
from .dialects import score as score_dialect
from .dialects import sglang as sglang_dialect
from .dialects import systemone as systemone_dialect
from .dialects.detect import decisions_dialect, mixed_error_body
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
    # (JSON document, multipart files) → canonical request
    parse: Callable[[Any, dict], Any]
    # (canonical result, canonical request) → JSON body
    render: Callable[[Any, Any], dict]
    # (error, JSON document or None) → (status, JSON body)
    error: Callable[[DecisionError, Any], tuple[int, dict]]
    # Whether an unknown model name is refused (OpenAI) or answered by the served model (System One, SGLang).
    strict_model: bool = True
    # "decide" (a decision request) or "score" (SGLang's /v1/score)
    operation: str = "decide"


def _questions(document: Any) -> Any:
    return document.get("questions") if isinstance(document, dict) else None


OPENAI = Dialect("openai", lambda body, files: openai_dialect.parse_request(body), openai_dialect.render_response,
                 lambda error, document: (error.status, openai_dialect.error_body(error)))
SGLANG = Dialect("sglang", sglang_dialect.parse_request, sglang_dialect.render_response,
                 lambda error, document: (error.status, sglang_dialect.error_body(error, _questions(document))),
                 strict_model=False)
SYSTEM_ONE = Dialect("system_one", systemone_dialect.parse_request, systemone_dialect.render_response,
                     systemone_dialect.error_response, strict_model=False)
SCORE = Dialect("sglang_score", score_dialect.parse_request, score_dialect.render_response,
                lambda error, document: (error.status, sglang_dialect.error_body(error)), strict_model=False,
                operation="score")


def choose_decisions_dialect(document: Any) -> Dialect:
    """``POST /v1/decisions`` serves OpenAI's and SGLang's shapes; the body's own keys tell which (see detect)."""
    return SGLANG if decisions_dialect(document) == "sglang" else OPENAI


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def create_app(router: Router, settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await router.aclose()  # upstream connection pools

    app = FastAPI(title="decisiond", version=__version__, lifespan=lifespan)
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

    async def serve(request: Request, choose: Callable[[Any], Dialect], fallback: Dialect) -> JSONResponse:
        """Read the body, pick the dialect, parse, ask the router, render — errors in the caller's dialect."""
        state = request.state.log
        dialect, document = fallback, None
        try:
            payload = await read_payload(request, settings.max_body_bytes)
            document = payload.document
            if payload.content_encoding != "identity" or payload.multipart:
                state.update(content_encoding=payload.content_encoding, multipart=payload.multipart)
            try:
                dialect = choose(document)
            except DecisionError as error:
                state.update(error_code=error.code)
                return JSONResponse(mixed_error_body(error), status_code=error.status)
            state["dialect"] = dialect.name
            parsed = dialect.parse(document, payload.files)
            state["model"] = parsed.model
            headers = {}
            if dialect.operation == "score":
                state["items"] = len(parsed.prompts)
                result = await router.score(parsed)
                state["input_tokens"] = result.prompt_tokens
            else:
                state["questions"] = len(parsed.questions)
                result = await router.decide(parsed, strict=dialect.strict_model)
                state.update(served_model=result.model, input_tokens=result.usage.input_tokens,
                             provider_format=result.provider_format)
                headers["x-decisiond-provider-format"] = result.provider_format
            return JSONResponse(dialect.render(result, parsed), headers=headers)
        except DecisionError as error:
            state.update(error_code=error.code)
            status, body = dialect.error(error, document)
            return JSONResponse(body, status_code=status, headers=error.headers or None)

    @app.post("/v1/decisions")
    async def decisions(request: Request):
        return await serve(request, choose_decisions_dialect, OPENAI)

    @app.post("/v1/systemone")
    async def systemone(request: Request):
        return await serve(request, lambda document: SYSTEM_ONE, SYSTEM_ONE)

    @app.post("/v1/score")
    async def score(request: Request):
        return await serve(request, lambda document: SCORE, SCORE)

    @app.get("/v1/models")
    async def models(request: Request, capability: str | None = None):
        listed = router.model_list(capability)
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
    async def health():
        return {"status": "ok", "models": [m.name for m in router.model_list()], "version": __version__}

    return app
