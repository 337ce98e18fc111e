"""Pure-ASGI middleware: what a request may reach before any route runs.

- **Docs.** ``/openapi.json``, ``/docs`` and ``/redoc`` need a key (any valid one) once keys are configured, unless
  the config says ``public_docs: true``: the schema names every route and model option.
- **A server without keys is not a web page's to spend.** With no key configured (the out-of-the-box local server),
  every request's ``Host`` must name the server — a loopback name (``localhost``, ``127.0.0.1``, ``[::1]``), the
  address it serves on, or a configured ``allowed_hosts`` entry (``"*"``: any, for an operator who opened a
  keyless server to a network on purpose) — so that a page whose DNS name was rebound to this machine cannot reach
  it; and a request that carries an ``Origin`` must come from this same host (the playground
  does), so that a page on another origin cannot POST to it (not even a multipart form, which needs no preflight).
  Bodies of other types (``text/plain``, URL-encoded forms) are refused by their Content-Type (``payload``).

Refusals are OpenAI-shaped JSON errors: 401 (docs without a key), 403 (a foreign Host or Origin).
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import PermissionDenied
from .boundary import REFUSED, refusing

DOCS_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str:
    """``[::1]:8000`` → ``::1``; ``Example.COM:80`` → ``example.com``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _loopback(name: str) -> bool:
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class AccessGuard:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await refusing(self._check(scope), scope, receive, send) is not REFUSED:
            await self.app(scope, receive, send)

    async def _check(self, scope: Scope) -> None:
        state: Any = scope["app"].state
        gateway, settings = state.gateway, state.settings
        headers = Headers(scope=scope)
        if not gateway.auth.enabled:
            self._same_site(headers, gateway.config.allowed_hosts, settings.host)
        elif scope["path"] in DOCS_PATHS and not gateway.config.public_docs:
            await gateway.auth.authenticate(headers)

    @staticmethod
    def _same_site(headers: Headers, allowed: list[str], served: str | None) -> None:
        host = host_name(headers.get("host", ""))
        known = {h.lower() for h in allowed} | ({served.lower()} if served else set())
        if not (_loopback(host) or host in known or "*" in known):
            raise PermissionDenied(f"this server answers to its own host names, not {host[:100]!r} (add it to "
                                   "allowed_hosts, or configure keys)", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and origin != "null":
            parts = urlsplit(origin)
            if (parts.netloc or "").lower() != headers.get("host", "").strip().lower():
                raise PermissionDenied(f"requests from the page {origin[:100]!r} are refused: this server has no "
                                       "keys, so only its own pages may call it", code="cross_origin_refused")
        elif origin == "null":
            raise PermissionDenied("requests from an opaque origin are refused: this server has no keys",
                                   code="cross_origin_refused")
