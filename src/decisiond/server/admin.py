"""The admin API (the master key, or a console session: ``console_session.admin_caller``), in OpenAI's error shape:

- ``POST /admin/keys`` ``{name, user_path?, models?, rate_limits?, guardrails?, expires_at? | expires_in_seconds?}``
  → 201 with the key's record and, this once, its secret ``key`` (``guardrails``: names of configured guardrails,
  run on the key's requests on top of the model's; an unknown name → 400 naming it);
- ``GET /admin/keys`` → the records, never a secret;
- ``DELETE /admin/keys/{id}`` → the revoked record;
- ``GET /admin/usage/summary`` and ``GET /admin/usage/daily`` ``?group_by=key,user_path,model,provider,request_type
  &start=&end=`` (ISO dates or times, UTC; plus the audit filters) → totals of requests, tokens and cost;
- ``GET /admin/audit`` ``?request_type=&key=&user_path=&model=&provider=&status=&batch=&start=&end=&limit=
  &before_id=`` → usage rows newest first, a page at a time (``next_before_id``);
- ``GET /admin/budgets`` (with each one's spend this period), ``PUT /admin/budgets`` ``{key | user_path | model,
  limit_usd, period | period_seconds}`` (the same scope and period replace the limit), ``DELETE /admin/budgets/{id}``.

Any key: ``GET /v1/usage`` → its own spend, its budgets (``remaining_usd``, ``resets_in_seconds``) and its live
rate-limit counters.
- ``GET /admin/quality?model=&since=&user_path=`` → per question of a model with stored decisions: how many were
  stored and labelled (and the labels per scope), the accuracy, log loss, Brier score and ECE (15 bins) of what was
  served, its reliability bins, for a cascade the share that went on past the first step, the active learned
  profiles of every scope, and the one serving ``user_path`` (default ``/``) with its cross-validated metrics;
- ``POST /admin/learn`` ``{"model"}`` → per target, question and scope of a stored model, the learning's candidates
  (cross-validated metrics, the acceptance rule's verdict) and the profile accepted (``gateway.profiles``), and the
  counts per scope; ``GET /admin/profiles?model=&scope=`` → the learned profiles; ``PUT /admin/profiles/{id}``
  ``{"active": false}`` rolls one back within its scope, ``{"active": true}`` serves it again;
- ``GET /admin/cache`` → the response cache's statistics (entries, bytes, hits, misses; Redis entries if shared);
- ``DELETE /admin/cache`` → empties this process's cache and the shared Redis entries (other replicas' in-process
  copies live until their TTL).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import date, datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AwareDatetime, Field, field_validator, model_validator

from ..dialects.common import StrictModel, validate_body
from ..errors import DecisionError, InvalidRequest, NotFound, Unavailable
from ..gateway import decisions, profile_learning, profile_store, usage
from ..gateway.access_settings import BudgetConfig, RateLimitConfig, check_user_path
from ..gateway.service import Gateway
from ..gateway.stages.budget_ledger import BudgetView
from ..gateway.stages.budget_store import BudgetStore
from ..gateway.types import Caller
from ..limits import AUDIT_PAGE_MAX, QUALITY_DECISIONS_MAX
from ..store.db import Database
from ..store.keys import KeyStore
from .boundary import OpenAIRoute
from .console_session import admin_caller
from .payload import read_payload

router = APIRouter(prefix="/admin", route_class=OpenAIRoute)
self_service = APIRouter(route_class=OpenAIRoute)

ADMIN_BODY_LIMIT = 64 * 1024
MAX_MODEL_PATTERNS = 100
MAX_KEY_GUARDRAILS = 50


class KeyCreate(StrictModel):
    name: str = Field(min_length=1, max_length=200)
    # None: a path of the key's own (``/keys/<id>``), never ``/``.
    user_path: str | None = None
    models: list[str] | None = Field(default=None, max_length=MAX_MODEL_PATTERNS)
    rate_limits: RateLimitConfig | None = None
    guardrails: list[str] = Field(default_factory=list, max_length=MAX_KEY_GUARDRAILS)
    expires_at: AwareDatetime | None = None
    expires_in_seconds: int | None = Field(default=None, ge=1)

    @field_validator("user_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return check_user_path(value) if value is not None else None

    @field_validator("models")
    @classmethod
    def _patterns(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not 1 <= len(v) <= 200 for v in value):
            raise ValueError("each model pattern must be 1 to 200 characters")
        return value

    @model_validator(mode="after")
    def _one_expiry(self) -> "KeyCreate":
        if self.expires_at is not None and self.expires_in_seconds is not None:
            raise ValueError("send expires_at or expires_in_seconds, not both")
        return self

    def expiry(self) -> datetime | None:
        if self.expires_in_seconds is not None:
            return datetime.now(timezone.utc) + timedelta(seconds=self.expires_in_seconds)
        return self.expires_at.astimezone(timezone.utc) if self.expires_at is not None else None


async def _store(request: Request) -> KeyStore:
    gateway: Gateway = request.app.state.gateway
    await admin_caller(request)
    if gateway.keys is None:
        raise Unavailable("managed keys need a database; none is open", code="no_database")
    return gateway.keys


@router.post("/keys")
async def create_key(request: Request) -> JSONResponse:
    store = await _store(request)
    payload = await read_payload(request, ADMIN_BODY_LIMIT)
    body = validate_body(KeyCreate, payload.document)
    gateway: Gateway = request.app.state.gateway
    gateway.guardrails.check_names(body.guardrails)
    record, key = await store.create(
        body.name, body.user_path, body.models,
        body.rate_limits.model_dump(exclude_defaults=True) if body.rate_limits is not None else None, body.expiry(),
        list(dict.fromkeys(body.guardrails)))
    return JSONResponse({**record.public(), "key": key}, status_code=201)


@router.get("/keys")
async def list_keys(request: Request) -> Any:
    store = await _store(request)
    return {"object": "list", "data": [r.public() for r in await store.list()]}


@router.delete("/keys/{key_id}")
async def revoke_key(request: Request, key_id: str) -> Any:
    store = await _store(request)
    record = await store.revoke(key_id)
    if record is None:
        raise NotFound(f"no API key with id {key_id[:40]!r}", ("id",), code="key_not_found")
    gateway: Gateway = request.app.state.gateway
    gateway.auth.forget()
    return record.public()


# ------------------------------------------------------------------------------------- usage, audit, budgets


async def _master_db(request: Request) -> tuple[Database, BudgetStore]:
    """The database and its budgets, for the master key (or a console session) only."""
    gateway: Gateway = request.app.state.gateway
    await admin_caller(request)
    if gateway.db is None or gateway.budgets is None:
        raise Unavailable("usage, audit and budgets need the gateway's database; none is open", code="no_database")
    return gateway.db, gateway.budgets


async def _spend(request: Request, budgets: list[BudgetView]) -> list[dict[str, Any]]:
    """The budgets' spend as the database has it, the room this process holds unused in its leases not counted."""
    leases = request.app.state.gateway.leases
    store: BudgetStore = request.app.state.gateway.budgets
    return await (leases.spend_report(budgets) if leases is not None else store.spend_report(budgets))


def _bad(param: str, message: str) -> DecisionError:
    return InvalidRequest(f"{param}: {message}", (param,))


def _time(params: Any, name: str, end: bool = False) -> datetime | None:
    value = params.get(name)
    if value is None:
        return None
    try:
        if len(value) == 10:  # a date: the start of that UTC day; an end date includes the whole day
            day = date.fromisoformat(value)
            moment = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
            return moment + timedelta(days=1) if end else moment
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _bad(name, f"{value[:40]!r} is not an ISO date (2026-12-01) or time (2026-12-01T10:00:00Z)") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _filter(params: Any) -> usage.UsageFilter:
    request_type = params.get("request_type")
    if request_type is not None and request_type not in usage.REQUEST_TYPES:
        raise _bad("request_type", f"must be one of {', '.join(usage.REQUEST_TYPES)}, got {request_type[:40]!r}")
    status = params.get("status")
    if status is not None and not status.isdigit():
        raise _bad("status", f"must be an HTTP status such as 200 or 402, got {status[:40]!r}")
    user_path = params.get("user_path")
    if user_path is not None:
        try:
            check_user_path(user_path)
        except ValueError as e:
            raise _bad("user_path", str(e)) from None
    return usage.UsageFilter(start=_time(params, "start"), end=_time(params, "end", end=True),
                             request_type=request_type, key_id=params.get("key"), user_path=user_path,
                             model=params.get("model"), provider=params.get("provider"),
                             status=int(status) if status is not None else None, batch_id=params.get("batch"))


def _group_by(params: Any) -> list[str]:
    raw = params.get("group_by")
    groups = [g.strip() for g in raw.split(",") if g.strip()] if raw else []
    unknown = [g for g in groups if g not in usage.GROUPS]
    if unknown:
        raise _bad("group_by", f"unknown group {unknown[0][:40]!r}; use {', '.join(usage.GROUPS)}")
    return list(dict.fromkeys(groups))


async def _grouped(request: Request, query: Callable[..., Awaitable[Any]]) -> Any:
    """A usage report (``usage.summary`` or ``usage.daily``) grouped and filtered as the query string says."""
    db, budgets = await _master_db(request)
    groups, where = _group_by(request.query_params), _filter(request.query_params)
    return {"object": "list", "group_by": groups, "data": await query(db, groups, where)}


@router.get("/usage/summary")
async def usage_summary(request: Request) -> Any:
    return await _grouped(request, usage.summary)


@router.get("/usage/daily")
async def usage_daily(request: Request) -> Any:
    return await _grouped(request, usage.daily)


@router.get("/audit")
async def audit_log(request: Request) -> Any:
    params = request.query_params
    db, budgets = await _master_db(request)
    where = _filter(params)
    limit, before = params.get("limit", "100"), params.get("before_id")
    if not limit.isdigit() or not 1 <= int(limit) <= AUDIT_PAGE_MAX:
        raise _bad("limit", f"must be an integer from 1 to {AUDIT_PAGE_MAX}")
    if before is not None and not before.isdigit():
        raise _bad("before_id", "must be a row id from next_before_id")
    rows, following = await usage.audit(db, where, int(limit), int(before) if before else None)
    return {"object": "list", "data": rows, "next_before_id": following}


@router.get("/budgets")
async def list_budgets(request: Request) -> Any:
    db, budgets = await _master_db(request)
    budgets.forget()
    return {"object": "list", "data": await _spend(request, await budgets.budgets())}


@router.put("/budgets")
async def put_budget(request: Request) -> Any:
    db, budgets = await _master_db(request)
    payload = await read_payload(request, ADMIN_BODY_LIMIT)
    body = validate_body(BudgetConfig, payload.document)
    view = await budgets.put(body, "admin")
    return (await _spend(request, [view]))[0]


@router.delete("/budgets/{budget_id}")
async def delete_budget(request: Request, budget_id: str) -> Any:
    db, budgets = await _master_db(request)
    if not await budgets.delete(budget_id):
        raise NotFound(f"no budget with id {budget_id[:40]!r}", ("id",), code="budget_not_found")
    return {"id": budget_id, "deleted": True}


@self_service.get("/v1/usage")
async def own_usage(request: Request) -> Any:
    """The caller's own spend, budgets and rate-limit counters (any key)."""
    gateway: Gateway = request.app.state.gateway
    caller: Caller = await gateway.auth.authenticate(request.headers)
    out: dict[str, Any] = {"object": "usage", "key": caller.key_id, "user_path": caller.user_path,
                           "rate_limits": await gateway.limiter.counters(caller)}
    db, budgets = gateway.db, gateway.budgets
    if db is None or budgets is None:
        out.update(spend=None, budgets=[])
        return out
    try:
        out["spend"] = await usage.key_spend(db, caller.key_id, caller.user_path)
        mine = [b for b in await budgets.budgets() if b.model is None and b.applies(caller, ())]
        out["budgets"] = await _spend(request, mine)
    except Exception:
        raise Unavailable("usage is unavailable: the database cannot be reached", code="no_database") from None
    return out
async def _master(request: Request) -> Gateway:
    """The gateway, for the master key (or a console session) only."""
    await admin_caller(request)
    gateway: Gateway = request.app.state.gateway
    return gateway


@router.get("/quality")
async def quality(request: Request) -> Any:
    """The quality of a stored model's answers against their labels, per question (``gateway.decisions.report``),
    over its newest ``QUALITY_DECISIONS_MAX`` stored decisions since ``since``."""
    gateway = await _master(request)
    model = request.query_params.get("model")
    if not model:
        raise _bad("model", "name the model: ?model=<a model or virtual model with store: true>")
    if model not in gateway.stored_models:
        raise _bad("model", f"{model[:100]!r} keeps no decisions (models with store: true: "
                            f"{', '.join(sorted(gateway.stored_models)) or 'none'})")
    if gateway.decisions is None:
        raise Unavailable("stored decisions need a database; none is open")
    since = _time(request.query_params, "since")
    user_path = _user_path(request.query_params, "user_path") or "/"
    rows = await gateway.decisions.since(model, since, QUALITY_DECISIONS_MAX)
    learned = await _profiles(gateway).listing(model)
    report = decisions.report(model, rows)
    active = [row for row in learned if row.active and row.model == model]
    for question in report["questions"]:
        mine = [row for row in active if row.question == question["question"]]
        found = (profile_learning.serving_profile(mine, target, sig, user_path)
                 for target, sig in sorted({(row.target, row.signature) for row in mine}))
        serving = next((row for row in found if row is not None), None)
        question["profile"] = None if serving is None else _shown(serving)
        question["profiles"] = [_shown(row) for row in sorted(mine, key=lambda r: (r.scope, r.target))]
    return {**report, "since": since.isoformat() if since else None, "user_path": user_path}


def _shown(row: Any) -> dict[str, Any]:
    """An active profile as the quality report shows it."""
    profile = profile_store.describe(row)
    return {k: profile[k] for k in ("id", "kind", "version", "target", "scope", "labels", "cv", "served_before")}


def _user_path(params: Any, name: str) -> str | None:
    """A user path given as ``?name=``, or None; 400 naming it where it is not one."""
    value = params.get(name)
    if value is None:
        return None
    try:
        return check_user_path(value)
    except ValueError as error:
        raise _bad(name, str(error)) from None


def _profiles(gateway: Gateway) -> profile_store.ProfileStore:
    if gateway.profiles is None:
        raise Unavailable("learned profiles need a database; none is open")
    return gateway.profiles


class LearnBody(StrictModel):
    model: str = Field(min_length=1, max_length=256)


class ProfileUpdate(StrictModel):
    active: bool


@router.post("/learn")
async def learn(request: Request) -> Any:
    """Learn from a stored model's labels (``gateway.profile_learning.learn_model``): per target, question and scope,
    the candidates' cross-validated metrics and the profile accepted, if any; this process serves it at once, the
    other replicas within ``learning.refresh_s``."""
    gateway = await _master(request)
    body = validate_body(LearnBody, (await read_payload(request, ADMIN_BODY_LIMIT)).document)
    model = profile_store.check_model(body.model, gateway.stored_models)
    report = await profile_learning.learn_model(_profiles(gateway), model)
    await gateway.read_profiles()
    return report


@router.get("/profiles")
async def list_profiles(request: Request) -> Any:
    """The learned profiles, newest first (``?model=``: those learned from, or serving, that name; ``?scope=``: those
    of that scope)."""
    gateway = await _master(request)
    scope = _user_path(request.query_params, "scope")
    rows = await _profiles(gateway).listing(request.query_params.get("model"), scope)
    return {"object": "list", "data": [profile_store.describe(row) for row in rows]}


@router.put("/profiles/{profile_id}")
async def put_profile(request: Request, profile_id: str) -> Any:
    """``{"active": false}`` rolls a profile back within its scope (the one it replaced there is served again, else
    what serves the scope above it); ``{"active": true}`` serves an accepted profile again in its scope.
    ``active_for_question``: the profile of that scope active now (None: none)."""
    gateway = await _master(request)
    body = validate_body(ProfileUpdate, (await read_payload(request, ADMIN_BODY_LIMIT)).document)
    store = _profiles(gateway)
    now_active = await store.set_active(profile_id, body.active)
    await gateway.read_profiles()
    row = await store.get(profile_id)
    return {**profile_store.describe(row), "active_for_question": now_active}


@router.get("/cache")
async def cache_stats(request: Request) -> Any:
    gateway = await _master(request)
    return await gateway.cache.stats()


@router.delete("/cache")
async def cache_clear(request: Request) -> Any:
    gateway = await _master(request)
    return await gateway.cache.clear()
