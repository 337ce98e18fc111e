"""The admin API (master key only), in OpenAI's error shape:

- ``POST /admin/keys`` ``{name, user_path?, models?, rate_limits?, expires_at? | expires_in_seconds?}`` → 201 with
  the key's record and, this once, its secret ``key``;
- ``GET /admin/keys`` → the records, never a secret;
- ``DELETE /admin/keys/{id}`` → the revoked record;
- ``GET /admin/cache`` → the response cache's statistics (entries, bytes, hits, misses; Redis entries if shared);
- ``DELETE /admin/cache`` → empties this process's cache and the shared Redis entries (other replicas' in-process
  copies live until their TTL).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AwareDatetime, Field, field_validator, model_validator

from .dialects import openai as openai_dialect
from .dialects.common import StrictModel, validate_body
from .errors import DecisionError
from .gateway.auth import Authenticator
from .gateway.config import RateLimitConfig, check_user_path
from .gateway.service import Gateway
from .store.keys import KeyStore
from .transport import read_payload

__all__ = ["KeyCreate", "router"]

router = APIRouter(prefix="/admin")

ADMIN_BODY_LIMIT = 64 * 1024
MAX_MODEL_PATTERNS = 100


class KeyCreate(StrictModel):
    name: str = Field(min_length=1, max_length=200)
    user_path: str = "/"
    models: list[str] | None = Field(default=None, max_length=MAX_MODEL_PATTERNS)
    rate_limits: RateLimitConfig | None = None
    expires_at: AwareDatetime | None = None
    expires_in_seconds: int | None = Field(default=None, ge=1)

    @field_validator("user_path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_user_path(value)

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
    caller = await gateway.auth.authenticate(request.headers)
    Authenticator.require_master(caller)
    if gateway.keys is None:
        raise DecisionError("managed keys need a database; none is open", code="no_database", status=503,
                            type="server_error")
    return gateway.keys


def _error(error: DecisionError) -> JSONResponse:
    status, body = openai_dialect.render_error(error)
    return JSONResponse(body, status_code=status, headers=error.headers or None)


@router.post("/keys")
async def create_key(request: Request) -> JSONResponse:
    try:
        store = await _store(request)
        payload = await read_payload(request, ADMIN_BODY_LIMIT)
        body = validate_body(KeyCreate, payload.document)
    except DecisionError as error:
        return _error(error)
    record, key = await store.create(
        body.name, body.user_path, body.models,
        body.rate_limits.model_dump(exclude_none=True) if body.rate_limits is not None else None, body.expiry())
    return JSONResponse({**record.public(), "key": key}, status_code=201)


@router.get("/keys")
async def list_keys(request: Request) -> Any:
    try:
        store = await _store(request)
    except DecisionError as error:
        return _error(error)
    return {"object": "list", "data": [r.public() for r in await store.list()]}


@router.delete("/keys/{key_id}")
async def revoke_key(request: Request, key_id: str) -> Any:
    try:
        store = await _store(request)
        record = await store.revoke(key_id)
        if record is None:
            raise DecisionError(f"no API key with id {key_id[:40]!r}", ("id",), code="key_not_found", status=404)
    except DecisionError as error:
        return _error(error)
    gateway: Gateway = request.app.state.gateway
    gateway.auth.forget()
    return record.public()


async def _master(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    Authenticator.require_master(await gateway.auth.authenticate(request.headers))
    return gateway


@router.get("/cache")
async def cache_stats(request: Request) -> Any:
    try:
        gateway = await _master(request)
    except DecisionError as error:
        return _error(error)
    return await gateway.cache.stats()


@router.delete("/cache")
async def cache_clear(request: Request) -> Any:
    try:
        gateway = await _master(request)
    except DecisionError as error:
        return _error(error)
    return await gateway.cache.clear()
