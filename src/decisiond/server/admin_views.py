"""The admin API's views over time and of every batch (the master key, or a console session), in OpenAI's error
shape:

- ``GET /admin/usage/series`` ``?bucket=minute|hour|day&group_by=key,model,user_path,…&start=&end=`` (plus the
  audit filters) → requests, tokens and cost per time bucket (its UTC start, ``bucket``) and group, oldest first;
  ``start`` defaults to 6 hours back for minutes, 7 days for hours, 90 days for days; at most ``SERIES_ROWS_MAX``
  rows (``truncated`` says when more matched);
- ``GET /admin/quality/series`` ``?model=&bucket=hour|day&since=`` → per question of a stored model, per bucket of
  the time its labelled decisions were asked: the labels, and the accuracy and ECE of what was served
  (``decisions.quality``), over its newest ``QUALITY_DECISIONS_MAX`` labelled decisions;
- ``GET /admin/batches`` ``?limit=&after=`` → every key's batches, newest first, as ``GET /v1/batches`` shows them,
  with the key and user path that made each; ``POST /admin/batches/{batch_id}/cancel`` → cancels one (409 once it
  has ended).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import NotFound, Unavailable
from ..gateway import decisions, usage
from ..gateway.service import Gateway
from ..limits import BATCH_LIST_MAX, QUALITY_DECISIONS_MAX
from .admin import _bad, _filter, _group_by, _master, _master_db, _time
from .batch_api import _limit, _page, _runner, batch_object, cancel
from .boundary import OpenAIRoute

router = APIRouter(prefix="/admin", route_class=OpenAIRoute)

SERIES_ROWS_MAX = 20_000
DEFAULT_SPAN = {"minute": timedelta(hours=6), "hour": timedelta(days=7), "day": timedelta(days=90)}
QUALITY_BUCKETS = {"hour": 3600, "day": 86400}


def _bucket(params: Any, allowed: tuple[str, ...], default: str) -> str:
    value = params.get("bucket", default)
    if value not in allowed:
        raise _bad("bucket", f"must be one of {', '.join(allowed)}, got {value[:40]!r}")
    return str(value)


@router.get("/usage/series")
async def usage_series(request: Request) -> Any:
    """Usage over time (module docstring)."""
    params = request.query_params
    db, _ = await _master_db(request)
    bucket = _bucket(params, tuple(usage.BUCKETS), "hour")
    groups, where = _group_by(params), _filter(params)
    if where.start is None:
        where.start = datetime.now(timezone.utc) - DEFAULT_SPAN[bucket]
    rows = await usage.series(db, bucket, groups, where, SERIES_ROWS_MAX + 1)
    return {"object": "list", "bucket": bucket, "bucket_seconds": usage.BUCKETS[bucket][0], "group_by": groups,
            "start": where.start.isoformat(), "data": rows[:SERIES_ROWS_MAX],
            "truncated": len(rows) > SERIES_ROWS_MAX}


@router.get("/quality/series")
async def quality_series(request: Request) -> Any:
    """A stored model's quality over time (module docstring)."""
    params = request.query_params
    gateway: Gateway = await _master(request)
    model = params.get("model")
    if not model or model not in gateway.stored_models:
        raise _bad("model", f"{(model or '')[:100]!r} keeps no decisions (models with store: true: "
                            f"{', '.join(sorted(gateway.stored_models)) or 'none'})")
    bucket = _bucket(params, tuple(QUALITY_BUCKETS), "day")
    since = _time(params, "since")
    if gateway.decisions is None:
        raise Unavailable("stored decisions need a database; none is open")
    rows = await gateway.decisions.timed(model, since, QUALITY_DECISIONS_MAX)
    return {"object": "decision.quality_series", "model": model, "bucket": bucket,
            "since": since.isoformat() if since else None, "questions": _per_bucket(rows, QUALITY_BUCKETS[bucket])}


def _per_bucket(rows: list[tuple[datetime, list[dict[str, Any]], list[Any], dict[str, Any]]],
                seconds: int) -> list[dict[str, Any]]:
    """Per question name, its points oldest first: ``{bucket, labels, accuracy, ece}`` of each bucket with labels."""
    buckets: dict[int, list[tuple[list[dict[str, Any]], list[Any], dict[str, Any]]]] = {}
    for moment, questions, answers, labels in rows:
        buckets.setdefault(int(moment.timestamp()) // seconds * seconds, []).append((questions, answers, labels))
    points: dict[str, list[dict[str, Any]]] = {}
    for start in sorted(buckets):
        when = datetime.fromtimestamp(start, timezone.utc).isoformat().replace("+00:00", "Z")
        for name, measured in decisions.quality(buckets[start]).items():
            points.setdefault(name, []).append({"bucket": when, "labels": measured.labels,
                                                "accuracy": measured.accuracy, "ece": measured.ece})
    return [{"question": name, "points": points[name]} for name in sorted(points)]


def _admin_batch(row: Any) -> dict[str, Any]:
    return {**batch_object(row), "key_id": row.key_id, "user_path": row.user_path}


@router.get("/batches")
async def list_batches(request: Request) -> Any:
    """Every key's batches, newest first, a page at a time (``limit``, ``after``)."""
    await _master(request)
    store = _runner(request).store
    limit = _limit(request.query_params.get("limit"), 20, BATCH_LIST_MAX)
    rows = await store.batches(None, True, request.query_params.get("after"), limit)
    return JSONResponse(_page(rows, limit, _admin_batch))


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Any:
    """Cancel any key's batch: ``cancelling`` at once, ``cancelled`` once its runner has stopped it."""
    await _master(request)
    runner = _runner(request)
    row = await runner.store.batch(batch_id)
    if row is None:
        raise NotFound(f"No such Batch object: {batch_id[:100]}", ("batch_id",), code="batch_not_found")
    row = await cancel(runner, row)
    return JSONResponse(_admin_batch(row))

