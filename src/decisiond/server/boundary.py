"""Where a refusal becomes an HTTP answer, for the surfaces that answer every error in one fixed shape (admin, the
console, chat, the Files and Batch APIs, labels, the small GET routes, the access guard, MCP's door). Their code
raises a ``DecisionError`` anywhere; one of two boundaries answers it:

- ``AnsweringRoute``: a FastAPI route (a router's ``route_class``) whose endpoint's ``DecisionError`` is answered by
  the route's ``answer`` — ``OpenAIRoute``: OpenAI's error shape (``openai_error``); a surface with a shape of its
  own subclasses it with its own ``answer``. Only the endpoint's errors: a response's body, once it streams, is the
  response's own.
- ``refusing``: for pure ASGI code before any route (``guard``, ``mcp``): a check's ``DecisionError`` answered in
  OpenAI's error shape, the request then done.

The decision routes answer in each caller's dialect, at their own boundary (``routes.serve``, ``routes.respond``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from ..dialects import openai as openai_dialect
from ..errors import DecisionError

T = TypeVar("T")


def error_response(rendered: tuple[int, dict[str, Any]], *header_sets: dict[str, str]) -> JSONResponse:
    """A rendered error (status, body) as a JSON response, with the headers of ``header_sets`` (later sets win)."""
    status, body = rendered
    headers = {k: v for h in header_sets for k, v in h.items()}
    return JSONResponse(body, status_code=status, headers=headers or None)


def openai_error(error: DecisionError, *header_sets: dict[str, str]) -> JSONResponse:
    """``error`` as the OpenAI-shaped routes answer it (admin, chat, files, batches, labels): its status and error
    object, with ``header_sets`` and then the error's own headers."""
    return error_response(openai_dialect.render_error(error), *header_sets, error.headers)


class AnsweringRoute(APIRoute):
    """A route whose endpoint may raise a ``DecisionError`` anywhere: ``answer(error, request)`` is its response.
    Subclasses name the answer; this class answers in OpenAI's error shape."""

    @staticmethod
    def answer(error: DecisionError, request: Request) -> Response:
        return openai_error(error)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        answer = self.answer

        async def answering(request: Request) -> Response:
            try:
                return await handler(request)
            except DecisionError as error:
                return answer(error, request)

        return answering


class OpenAIRoute(AnsweringRoute):
    """A route that answers its endpoint's ``DecisionError`` in OpenAI's error shape (``openai_error``)."""


class Refused:
    """What ``refusing`` returns when it answered the request itself."""


REFUSED = Refused()


async def refusing(check: Awaitable[T], scope: Scope, receive: Receive, send: Send) -> T | Refused:
    """``check``'s value; or, when it raises a ``DecisionError``, ``REFUSED`` once the error is answered in OpenAI's
    error shape (the request is then done: its app must not run)."""
    try:
        return await check
    except DecisionError as error:
        await openai_error(error)(scope, receive, send)
        return REFUSED
