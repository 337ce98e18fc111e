"""One async SQLAlchemy engine per process, migrated to the newest schema when it opens.

``database_url`` takes what users write — ``sqlite:///path``, ``postgresql://user@host/db`` — and picks the async
driver (aiosqlite, asyncpg). The default is a SQLite file in the user data dir, created on first start.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine, create_engine, make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from ..limits import DATABASE_CONNECT_TIMEOUT_S, DATABASE_IDLE_TRANSACTION_S, SQLITE_LOCK_POLL_S, SQLITE_LOCK_WAIT_S

MIGRATIONS = Path(__file__).with_name("migrations")
T = TypeVar("T")
_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}


def aware(value: datetime | None) -> datetime | None:
    """A stored time as an aware one: SQLite hands timestamps back naive; they were stored in UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


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


def private_sqlite_file(path: Path) -> None:
    """Make a SQLite file's folder (0700, where it is made here) and the file itself, empty and 0600, before SQLite
    opens it (an empty file is an empty database; SQLite gives its ``-wal`` and ``-shm`` files the database file's
    mode), whatever the umask. An existing file is left as it is."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o600))
    except FileExistsError:  # a database already (or a folder, which SQLite then refuses in its own words)
        pass


def database_url(url: str | None) -> str:
    """The async SQLAlchemy URL for ``url`` (or the default SQLite file); a SQLite file is made private first
    (``private_sqlite_file``)."""
    if not url:
        path = default_database_path()
        private_sqlite_file(path)
        return f"sqlite+aiosqlite:///{path}"
    parsed = make_url(url)
    driver = _DRIVERS.get(parsed.drivername)
    if driver is None and parsed.drivername not in _DRIVERS.values():
        raise ValueError(f"{parsed.drivername}:// is not supported: use a sqlite:// or postgresql:// URL")
    if driver is not None:
        parsed = parsed.set(drivername=driver)
    if parsed.drivername.startswith("sqlite") and parsed.database not in (None, "", ":memory:"):
        private_sqlite_file(Path(parsed.database))
    return parsed.render_as_string(hide_password=False)


# SQLSTATE classes of a database's state rather than of a statement: connection exceptions (08), transaction
# rollbacks (40: serialization failures, deadlocks), insufficient resources (53), operator intervention (57:
# statement timeouts, shutdowns), system errors (58); and lock_not_available (55P03), object_in_use (55006).
_TRANSIENT_CLASSES = frozenset({"08", "40", "53", "57", "58"})
_TRANSIENT_STATES = frozenset({"55P03", "55006"})


def transient(error: BaseException) -> bool:
    """Whether ``error`` comes from the database's state (unreachable, busy, locked, a lock or statement timeout, a
    serialization failure, a dropped connection) and the same statement may well succeed when retried — as
    opposed to an error of the statement or its data (a constraint, a value out of range), which will fail again.
    """
    if isinstance(error, (TimeoutError, asyncio.TimeoutError, ConnectionError, OSError)):
        return True
    if not isinstance(error, DBAPIError):
        return False
    if error.connection_invalidated:
        return True
    state = getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None)
    if isinstance(state, str) and state:
        return state[:2] in _TRANSIENT_CLASSES or state in _TRANSIENT_STATES
    # SQLite (no SQLSTATE): OperationalError is "database is locked", "database table is locked", "disk I/O error",
    # "unable to open database file"; an InterfaceError a closed connection.
    return isinstance(error, (OperationalError, InterfaceError))


def _sqlite_pragmas(connection: Any, record: Any) -> None:
    """SQLite in WAL mode (readers never wait for a writer, nor a writer for readers; processes on one host share
    the file) with ``synchronous=NORMAL``: a commit is not fsynced until the next checkpoint, so it survives the
    process but not a power loss — the durability of the usage journal, which every write goes through."""
    cursor = connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def _begin_immediate(connection: Connection) -> None:
    """A write transaction takes SQLite's write lock as it begins (a deferred one that reads first could find, when
    it comes to write, that another wrote meanwhile, and fail at once)."""
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def _upgrade(connection: Connection) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


class Database:
    """The engine and a session factory. ``await Database.open(url)`` migrates before it returns. ``write(fn)`` runs
    a short write transaction (the budget ledger, usage rows)."""

    def __init__(self, engine: AsyncEngine, writer: Engine | None = None):
        self.engine = engine
        self.session = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
        # SQLite: a plain engine whose transactions run whole in a thread (``write``).
        self.writer = writer

    @classmethod
    async def open(cls, url: str | None) -> "Database":
        resolved = database_url(url)
        options: dict[str, Any] = {}
        if resolved.startswith("postgresql"):
            # A pooled connection is checked before use (a server restarted, a connection cut); a host that drops
            # packets is refused in seconds, not asyncpg's 60. A SQLite file has no connection to lose.
            options["pool_pre_ping"] = True
            # A transaction left open by a stalled process is ended by the server, its locks with it.
            options["connect_args"] = {"timeout": DATABASE_CONNECT_TIMEOUT_S, "server_settings": {
                "idle_in_transaction_session_timeout": str(int(DATABASE_IDLE_TRANSACTION_S * 1000))}}
        engine = create_async_engine(resolved, **options)
        writer = None
        if resolved.startswith("sqlite"):
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        if resolved.startswith("sqlite") and make_url(resolved).database not in (None, "", ":memory:"):  # a file
            writer = create_engine(resolved.replace("sqlite+aiosqlite", "sqlite+pysqlite", 1),
                                   connect_args={"isolation_level": None, "check_same_thread": False,
                                                 "timeout": SQLITE_LOCK_POLL_S})
            event.listen(writer, "connect", _sqlite_pragmas)
            event.listen(writer, "begin", _begin_immediate)
        db = cls(engine, writer)
        try:
            if writer is not None:
                # A file that cannot be opened fails here, in the plain driver, before any aiosqlite connection: a
                # failed aiosqlite connect leaves its worker thread to answer on the event loop later, which a
                # command line has closed by then ("Event loop is closed"; aiosqlite 0.22, omnilib/aiosqlite#389).
                await asyncio.to_thread(lambda: writer.connect().close())
            async with engine.begin() as conn:
                await conn.run_sync(_upgrade)
        except BaseException:  # not opened: its connections are closed before the error goes on
            await db.aclose()
            raise
        return db

    async def reachable(self, timeout: float) -> bool:
        """Whether the database answers ``SELECT 1`` within ``timeout`` seconds (a locked SQLite file or a busy
        table still answers it: that database is up)."""
        async def ping() -> None:
            async with self.session() as session:
                await session.execute(text("SELECT 1"))

        try:
            await asyncio.wait_for(ping(), timeout)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """``fn(connection)`` in one transaction, committed when it returns. SQLite: run whole in a thread on a
        plain connection that begins with ``BEGIN IMMEDIATE``, so that the file's one write lock is held only while
        ``fn`` runs — never across turns of a busy event loop, where another process's writes would wait on it.
        PostgreSQL (row locks): on the async connection (``run_sync``). ``fn`` may be run again after a lock it
        waited for too long (its transaction rolled back): it only reads and writes the database."""
        writer = self.writer
        if writer is not None:
            def run() -> T:
                # SQLite's own wait for a lock sleeps in steps of up to 100 ms, and another process may take the
                # lock back meanwhile: it is asked again every few milliseconds here instead, up to the same wait.
                deadline = time.monotonic() + SQLITE_LOCK_WAIT_S
                while True:
                    try:
                        with writer.begin() as connection:
                            return fn(connection)
                    except OperationalError as error:
                        if "locked" not in str(error.orig) or time.monotonic() > deadline:
                            raise
                    time.sleep(SQLITE_LOCK_POLL_S)

            return await asyncio.to_thread(run)
        async with self.engine.begin() as connection:
            return await connection.run_sync(fn)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def aclose(self) -> None:
        await self.engine.dispose()
        if self.writer is not None:
            self.writer.dispose()
