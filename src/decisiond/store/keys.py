"""Managed API keys: ``dk-<id>-<secret>``. The id finds the row; only a salted SHA-256 of the secret is stored,
compared in constant time. The secret (256 random bits) is returned once, by ``create``."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select

from .db import Database, aware
from .tables import ApiKey

KEY_PREFIX = "dk-"


def hash_secret(salt: str, secret: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest()


def split_key(key: str) -> tuple[str, str] | None:
    """``dk-<id>-<secret>`` → (id, secret), or None when the key is not a managed key."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = key[len(KEY_PREFIX):].partition("-")
    if not sep or not key_id or not secret or len(key_id) > 32:
        return None
    return key_id, secret


@dataclass(frozen=True)
class KeyRecord:
    """What is known of a key, without its secret: safe to list."""

    id: str
    name: str
    user_path: str
    models: list[str] | None = None
    rate_limits: dict[str, Any] | None = None
    created_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    guardrails: list[str] = field(default_factory=list)

    def status(self, now: datetime | None = None) -> str:
        now = now or datetime.now(timezone.utc)
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"

    def public(self) -> dict[str, Any]:
        def iso(value: datetime | None) -> str | None:
            return value.isoformat().replace("+00:00", "Z") if value else None

        return {"id": self.id, "object": "api_key", "name": self.name, "prefix": f"{KEY_PREFIX}{self.id}",
                "user_path": self.user_path, "models": self.models, "rate_limits": self.rate_limits,
                "guardrails": self.guardrails, "created_at": iso(self.created_at), "expires_at": iso(self.expires_at),
                "revoked_at": iso(self.revoked_at), "status": self.status()}

    @classmethod
    def of(cls, row: ApiKey) -> "KeyRecord":
        return cls(row.id, row.name, row.user_path, row.models, row.rate_limits, aware(row.created_at) or
                   datetime.now(timezone.utc), aware(row.expires_at), aware(row.revoked_at),
                   list(row.guardrails or []))


class KeyStore:
    def __init__(self, db: Database):
        self.db = db

    async def create(self, name: str, user_path: str | None = None, models: list[str] | None = None,
                     rate_limits: dict[str, Any] | None = None,
                     expires_at: datetime | None = None,
                     guardrails: list[str] | None = None) -> tuple[KeyRecord, str]:
        """A new key: its record and the full key, which is not kept anywhere. ``guardrails``: names the caller
        has checked against the configured guardrails. A key created without a user path gets one of its own
        (``/keys/<id>``), never ``/``: a key at the root could name, and so charge, any team's path."""
        key_id, secret, salt = secrets.token_hex(8), secrets.token_urlsafe(32), secrets.token_hex(16)
        user_path = user_path if user_path is not None else f"/keys/{key_id}"
        row = ApiKey(id=key_id, name=name, salt=salt, secret_hash=hash_secret(salt, secret), user_path=user_path,
                     models=models, rate_limits=rate_limits, guardrails=guardrails or None,
                     created_at=datetime.now(timezone.utc), expires_at=expires_at)
        async with self.db.session() as session, session.begin():
            session.add(row)
        return KeyRecord.of(row), f"{KEY_PREFIX}{key_id}-{secret}"

    async def verify(self, key: str) -> KeyRecord | None:
        """The record of an existing key whose secret matches (revoked and expired ones included), else None."""
        parts = split_key(key)
        if parts is None:
            return None
        key_id, secret = parts
        async with self.db.session() as session:
            row = await session.get(ApiKey, key_id)
        if row is None or not hmac.compare_digest(row.secret_hash, hash_secret(row.salt, secret)):
            return None
        return KeyRecord.of(row)

    async def list(self) -> list[KeyRecord]:
        async with self.db.session() as session:
            rows = (await session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id))).all()
        return [KeyRecord.of(r) for r in rows]

    async def get(self, key_id: str) -> KeyRecord | None:
        async with self.db.session() as session:
            row = await session.get(ApiKey, key_id)
        return KeyRecord.of(row) if row is not None else None

    async def revoke(self, key_id: str) -> KeyRecord | None:
        async with self.db.session() as session, session.begin():
            row = await session.get(ApiKey, key_id)
            if row is None:
                return None
            if row.revoked_at is None:
                row.revoked_at = datetime.now(timezone.utc)
        return KeyRecord.of(row)
