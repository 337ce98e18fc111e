"""One async SQLAlchemy engine per process, migrated to the newest schema when it opens.

``database_url`` takes what users write — ``sqlite:///path``, ``postgresql://user@host/db`` — and picks the async
driver (aiosqlite, asyncpg). The default is a SQLite file in the user data dir, created on first start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from ..limits import DATABASE_CONNECT_TIMEOUT_S

MIGRATIONS = Path(__file__).with_name("migrations")
_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}


def data_directory() -> Path:
    """``$DECISIOND_DATA_DIR``, else ``$XDG_DATA_HOME/decisiond``, else ``~/.local/share/decisiond``."""
    return Path(os.environ.get("DECISIOND_DATA_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "decisiond"))


def default_database_path() -> Path:
    """The SQLite file used without a ``database_url``: ``decisiond.sqlite3`` in the data directory."""
    return data_directory() / "decisiond.sqlite3"


def sqlite_file(url: str | None) -> Path | None:
    """The file of a SQLite database (the default one without ``url``); None for PostgreSQL or ``:memory:``."""
    if not url:
        return default_database_path()
    parsed = make_url(url)
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).absolute()


def database_url(url: str | None) -> str:
    """The async SQLAlchemy URL for ``url`` (or the default SQLite file, its folder created)."""
    if not url:
        path = default_database_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite+aiosqlite:///{path}"
    parsed = make_url(url)
    driver = _DRIVERS.get(parsed.drivername)
    if driver is None and parsed.drivername not in _DRIVERS.values():
        raise ValueError(f"{parsed.drivername}:// is not supported: use a sqlite:// or postgresql:// URL")
    if driver is not None:
        parsed = parsed.set(drivername=driver)
    if parsed.drivername.startswith("sqlite") and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    return parsed.render_as_string(hide_password=False)


def _upgrade(connection: Connection) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


class Database:
    """The engine and a session factory. ``await Database.open(url)`` migrates before it returns."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.session = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)

    @classmethod
    async def open(cls, url: str | None) -> "Database":
        resolved = database_url(url)
        options: dict[str, Any] = {"pool_pre_ping": True}
        if resolved.startswith("postgresql"):  # a host that drops packets is refused in seconds, not asyncpg's 60
            options["connect_args"] = {"timeout": DATABASE_CONNECT_TIMEOUT_S}
        engine = create_async_engine(resolved, **options)
        db = cls(engine)
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade)
        return db

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def aclose(self) -> None:
        await self.engine.dispose()
