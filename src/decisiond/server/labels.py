"""Labels for stored decisions (a model's ``store: true``; ``gateway.decisions``), in OpenAI's error shape:

- ``POST /v1/decisions/{request_id}/labels`` ``{"labels": {question name: value}}`` → 200
  ``{"request_id", "object": "decision.labels", "labels"}`` (every label the decision has now); 404 for a request
  that was not stored or that another key made; 400 naming the field for an unknown question or a value it does not
  allow;
- ``DELETE /v1/decisions/{request_id}`` → ``{"id", "object": "decision", "deleted": true}``.

A decision is written off the request path (with its usage record, through the journal): a label posted right after
its answer waits up to ``WRITE_WAIT_S`` for it to be written.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import InvalidRequest, NotFound
from ..gateway.decisions import DecisionStore, check_labels, label_scope
from ..gateway.service import Gateway
from ..gateway.types import Caller
from ..store.tables import StoredDecision
from .boundary import OpenAIRoute
from .payload import read_payload
from .routes import authenticate

router = APIRouter(prefix="/v1/decisions", route_class=OpenAIRoute)

LABELS_BODY_LIMIT = 64 * 1024
WRITE_WAIT_S = 3.0


def _store(gateway: Gateway) -> DecisionStore:
    if gateway.decisions is None:
        raise InvalidRequest("stored decisions need the gateway's database, which this app has not opened (its "
                             "lifespan opens it)", code="decisions_unavailable")
    return gateway.decisions


async def _decision(request: Request, request_id: str) -> tuple[DecisionStore, StoredDecision, Caller]:
    """The caller's stored decision, waited for while it may still be on its way to the database, and the caller."""
    gateway: Gateway = request.app.state.gateway
    caller = await authenticate(request)
    store = _store(gateway)
    deadline = time.monotonic() + WRITE_WAIT_S
    while True:
        try:
            return store, await store.get(request_id, caller), caller
        except NotFound:
            if time.monotonic() >= deadline or not gateway.stored_models:
                raise
            if gateway.usage is not None:
                gateway.usage.wake()
            await asyncio.sleep(0.1)


@router.post("/{request_id}/labels")
async def post_labels(request: Request, request_id: str) -> JSONResponse:
    store, row, caller = await _decision(request, request_id)
    payload = await read_payload(request, LABELS_BODY_LIMIT)
    labels = check_labels(row.questions, payload.document)
    merged = await store.label(row.request_id, labels, label_scope(caller))
    return JSONResponse({"request_id": row.request_id, "object": "decision.labels", "labels": merged})


@router.delete("/{request_id}")
async def delete_decision(request: Request, request_id: str) -> JSONResponse:
    store, row, _ = await _decision(request, request_id)
    await store.delete(row.request_id)
    return JSONResponse({"id": row.request_id, "object": "decision", "deleted": True})
