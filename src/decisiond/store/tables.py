"""The tables, as SQLAlchemy declarative models. A change here is a new migration under ``migrations/versions``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["ApiKey", "Base"]


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    """A managed key. Only a salted SHA-256 of its secret is kept; the secret is shown once, at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    salt: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(64))
    user_path: Mapped[str] = mapped_column(String(256))
    models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    rate_limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
