"""The FastAPI app: ``create_app`` assembles the decision routes (``routes``), the small GET routes (``pages``),
admin (``admin``, ``admin_views``), the operator's console (``console``), chat, the Files and Batch APIs
(``batch_api``, run by ``batch_runner``) and MCP behind the request middleware (``middleware``), and owns the app's
lifespan; its ``Settings`` (``settings``) are the server's body limits."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..gateway.router import Router
from ..gateway.service import Gateway
from ..store.batches import BatchStore, default_folder
from ..version import __version__
from . import admin, admin_views, batch_api, chat, console, labels, pages
from . import mcp as mcp_server
from .batch_runner import BatchRunner
from .console_oidc import OidcClient
from .console_session import Sessions, SignInLimiter
from .guard import AccessGuard
from .metrics import Metrics, MetricsMiddleware
from .middleware import RequestContext
from .routes import ROUTES, decision_asgi, endpoint
from .settings import Settings


def create_app(router: Router, settings: Settings | None = None, gateway: Gateway | None = None) -> FastAPI:
    gateway = gateway or Gateway(router)
    settings = settings or Settings()
    mcp = mcp_server.build(gateway)
    mcp_endpoint = mcp_server.http_endpoint(mcp, gateway, settings.max_body_bytes, settings.body_read_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        runner = app.state.batches = _batch_runner(gateway)
        try:
            async with mcp.session_manager.run():
                yield
        finally:
            if runner is not None:
                await runner.aclose()  # lines in flight finish or stop; the batches' leases are given back
            if app.state.console_oidc is not None:
                await app.state.console_oidc.aclose()
            await gateway.aclose()  # upstream connection pools, Redis, the database

    app = App(title="decisiond", version=__version__, lifespan=lifespan)
    app.state.router = router
    app.state.gateway = gateway
    app.state.settings = settings
    app.state.batches = None  # the Batch API's runner, once the gateway's database is open
    app.state.metrics = metrics = Metrics(router, gateway)
    console_config = gateway.config.console
    app.state.console_sessions = Sessions.of(console_config, gateway.master_key)
    app.state.console_limiter = SignInLimiter(console_config.sign_in_failures_per_minute)
    app.state.console_oidc = OidcClient(console_config.oidc) if console_config.oidc is not None else None
    app.add_middleware(AccessGuard)  # innermost of the three: its refusals are counted and logged
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # inside RequestContext: it reads the access fields
    app.add_middleware(RequestContext, tracer=gateway.tracer)
    _add_decision_routes(app)
    app.direct = {route.path: RequestContext(MetricsMiddleware(AccessGuard(decision_asgi(route)), metrics=metrics),
                                             gateway.tracer) for route in ROUTES}
    app.include_router(pages.router)
    app.include_router(admin.router)
    app.include_router(admin_views.router)
    app.include_router(console.router)
    app.include_router(chat.router)
    app.include_router(admin.self_service)
    app.include_router(batch_api.router)
    app.include_router(labels.router)
    app.router.routes.append(Route("/mcp", mcp_endpoint, methods=["GET", "POST", "DELETE"]))
    return app


def _batch_runner(gateway: Gateway) -> BatchRunner | None:
    """The Batch API's runner, started, on the gateway's database (None without one)."""
    if gateway.db is None:
        return None
    config = gateway.config.batches
    folder = Path(config.files_path) if config.files_path else default_folder(gateway.database_url)
    runner = BatchRunner(gateway, BatchStore(gateway.db, folder), config)
    runner.start()
    return runner


class App(FastAPI):
    """The FastAPI app, with one shortcut: a ``POST`` to a decision route (``routes.ROUTES``) goes straight to its
    endpoint through decisiond's own three middlewares (request id and access line, metrics, access guard), not
    through FastAPI's routing and exception layers: its endpoint answers every error itself, in the caller's dialect
    (why: ``benchmarks/SERVER_NOTES.md``). Its OpenAPI schema is FastAPI's as for any route."""

    direct: dict[str, ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.direct.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _add_decision_routes(app: FastAPI) -> None:
    """The POST routes of ``ROUTES``, and an ``/openapi.json`` that carries the wire models their bodies follow."""
    components: dict[str, Any] = {}
    for route in ROUTES:
        extra = route.openapi()
        components.update(extra.pop("x-components"))
        app.add_api_route(route.path, endpoint(route), methods=["POST"], name=route.path.rsplit("/", 1)[-1],
                          summary=route.summary, openapi_extra=extra)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
