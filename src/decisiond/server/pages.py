"""The small GET routes: the model list (``/v1/models``), ``/health``, Prometheus ``/metrics``, and the playground
(``/``, ``/playground``, ``/static/{name}``), whose files ship in the package (``web/``): no build step, no CDN.
``/static/`` serves the console's files too (``console``), and uPlot, vendored with its licence
(``web/uplot.LICENSE``)."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..dialects import systemone as systemone_dialect
from ..gateway.router import Router
from ..gateway.service import Gateway
from ..gateway.stages.allowlist import allowed
from ..version import __version__
from .boundary import OpenAIRoute
from .metrics import CONTENT_TYPE, Metrics
from .routes import authenticate, caller_or_none

router = APIRouter(route_class=OpenAIRoute)

# The playground's files, shipped in the package (web/).
WEB_FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
             "playground.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8",
             "console.css": "text/css; charset=utf-8", "uplot.iife.min.js": "text/javascript; charset=utf-8",
             "uplot.min.css": "text/css; charset=utf-8"}


def web_file(name: str) -> bytes:
    """A file of the package's ``web/`` folder."""
    return files("decisiond").joinpath("web", name).read_bytes()


@router.get("/v1/models")
async def models(request: Request, capability: str | None = None) -> Any:
    served: Router = request.app.state.router
    caller = await authenticate(request)
    listed = [m for m in served.catalog.model_list(capability) if allowed(served.catalog, caller, m.name)]
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


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """Liveness for anyone; the models and version only for a caller with a key (or when no keys are configured)."""
    served: Router = request.app.state.router
    gateway: Gateway = request.app.state.gateway
    if gateway.auth.enabled and await caller_or_none(gateway, request.headers) is None:
        return {"status": "ok"}
    return {"status": "ok", "models": [m.name for m in served.catalog.model_list()], "version": __version__}


@router.get("/", include_in_schema=False)
@router.get("/playground", include_in_schema=False)
async def playground() -> Response:
    """The playground page (``web/``): it calls /v1/decisions with the key the user types."""
    return Response(web_file("index.html"), media_type="text/html; charset=utf-8")


@router.get("/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    if name not in WEB_FILES:
        return JSONResponse({"error": {"message": "Not found.", "type": "not_found_error", "param": None,
                                       "code": "not_found"}}, status_code=404)
    return Response(web_file(name), media_type=WEB_FILES[name],
                    headers={"cache-control": "no-cache", "x-content-type-options": "nosniff"})


@router.get("/metrics")
async def metrics_route(request: Request) -> Response:
    """Prometheus text; the master key when keys are configured (it shows every caller's traffic)."""
    gateway: Gateway = request.app.state.gateway
    metrics: Metrics = request.app.state.metrics
    caller = await authenticate(request)
    if gateway.auth.enabled:
        gateway.auth.require_master(caller)
    if metrics.label_quality is not None:
        await metrics.label_quality.refresh()
    return Response(metrics.render(), media_type=CONTENT_TYPE)
