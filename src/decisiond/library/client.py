"""``Client``, a remote decisiond (``POST /v1/decisions``, ``GET /v1/models``) answering with the library's types.
Its boundary is the exception tree: a server's error response, a body that is not JSON, a timeout or a connection
that fails is raised as the ``DecisionError`` it stands for (``error_from``), never as an httpx exception."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any

import httpx

from ..errors import (
    AuthenticationFailed,
    BudgetExceeded,
    ConnectionFailed,
    DecisionError,
    GuardrailBlocked,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    ServerError,
    Timeout,
    Unavailable,
    retry_headers,
)
from .decider import Decider, LoopThread, T

# A server's refusal → its class: by its code where the code says more than the status (a limit, a guardrail, a
# provider's failure relayed with the provider's status), else by its status. A code ``upstream_<status>`` (what
# ``errors.provider_error`` names a provider's error) is a provider's failure; any other 5xx is too, and any other
# 4xx an invalid request. decisiond's own 500s carry ``internal_error`` or a code of their own.
_CLASSES: dict[str | int, type[DecisionError]] = {
    "limit_exceeded": LimitExceeded, "request_too_large": LimitExceeded, "context_length_exceeded": LimitExceeded,
    "template_limit": LimitExceeded, "guardrail_blocked": GuardrailBlocked, "upstream_timeout": ProviderTimeout,
    "provider_error": ProviderError, "internal_error": ServerError,
    400: InvalidRequest, 401: AuthenticationFailed, 402: BudgetExceeded, 403: PermissionDenied, 404: NotFound,
    413: LimitExceeded, 422: InvalidRequest, 429: RateLimited, 500: ServerError, 503: Unavailable, 504: Timeout,
}


def error_from(status: int, body: Any, text: str, headers: Mapping[str, str]) -> DecisionError:
    """The exception an error response stands for, with its message, ``param`` (as ``path``), code, status, type and
    retry headers. A response that is not an OpenAI error object (not JSON: a proxy's page, a broken body), or a
    success whose body is not the answer asked for, is a ``ProviderError`` (``invalid_response``) naming the status."""
    kept = retry_headers(headers)
    error = body.get("error") if isinstance(body, dict) and status >= 400 else None
    if not isinstance(error, dict):
        if body is None:
            shape = "a body that is not JSON"
        else:
            shape = "JSON that is not an OpenAI error object" if status >= 400 else "JSON that is not its answer"
        excerpt = f": {text[:200]!r}" if text else ""
        return ProviderError(f"the server answered HTTP {status} with {shape}{excerpt}", code="invalid_response",
                             status=status if status >= 400 else 502, headers=kept)
    code = str(error["code"]) if error.get("code") else None
    if code is not None and code in _CLASSES:
        cls = _CLASSES[code]
    elif code is not None and code.startswith("upstream_"):
        cls = ProviderError
    else:
        cls = _CLASSES.get(status) or (ProviderError if status >= 500 else InvalidRequest)
    param = error.get("param")
    return cls(str(error.get("message") or f"HTTP {status}"), path=(param,) if isinstance(param, str) else (),
               code=code, status=status, type=str(error["type"]) if error.get("type") else None, headers=kept)


class Client(Decider):
    """A remote decisiond (``POST /v1/decisions``), answering with the same types as ``Engine``.

    Every failure is a ``DecisionError``: the server's refusals as their class (``RateLimited`` with its
    ``retry-after`` headers in ``.headers``, …), no answer within ``timeout`` seconds as ``Timeout``
    (``client_timeout``), a refused or broken connection as ``ConnectionFailed``.

    Examples:
        >>> client = decisiond.Client("http://127.0.0.1:8000", api_key="sk-…")  # doctest: +SKIP
        >>> client.decide("I was charged twice.", [Predicate("billing", "About billing?")])["billing"].value
        True
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, model: str = "default", timeout: float = 60.0):
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        self.model = model
        self.timeout = timeout
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: dict[int, httpx.AsyncClient] = {}
        self._loop = LoopThread()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coroutine)

    def _client(self) -> httpx.AsyncClient:
        key = id(asyncio.get_running_loop())  # an httpx pool belongs to the loop that made it
        if key not in self._clients:
            self._clients[key] = httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                                   timeout=self.timeout)
        return self._clients[key]

    async def _request(self, method: str, path: str, listing: str, **kwargs: Any) -> dict[str, Any]:
        """One exchange with the server: its answer, a JSON object with a list ``listing``, or the
        ``DecisionError`` it stands for."""
        try:
            response = await self._client().request(method, path, **kwargs)
        except httpx.TimeoutException as e:
            raise Timeout(f"no answer from {self.base_url} within {self.timeout:g} s ({type(e).__name__})",
                          code="client_timeout") from e
        except (httpx.TransportError, httpx.InvalidURL) as e:
            raise ConnectionFailed(f"could not reach {self.base_url}: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:  # an answer httpx could not read (a broken content encoding)
            raise ProviderError(f"the server's answer could not be read: {type(e).__name__}: {e}",
                                code="invalid_response") from e
        try:
            data: Any = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400 or not (isinstance(data, dict) and isinstance(data.get(listing), list)):
            raise error_from(response.status_code, data, response.text, response.headers)
        return data

    async def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", "/v1/decisions", "answers", json=body)

    async def amodels(self) -> list[str]:
        """The models the server (and this key) may use, as ``GET /v1/models`` lists them."""
        data = await self._request("GET", "/v1/models", "data")
        try:
            return [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError) as e:
            raise ProviderError(f"GET /v1/models listed a model without an id ({type(e).__name__}: {e})",
                                code="invalid_response") from e

    def models(self) -> list[str]:
        return self._run(self.amodels())

    def close(self) -> None:
        for client in self._clients.values():
            try:
                self._loop.run(client.aclose())
            except RuntimeError:
                pass
        self._clients.clear()
        self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
