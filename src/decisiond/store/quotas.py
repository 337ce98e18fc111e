"""What one key may hold in the files folder (``batches.max_bytes_per_key``, ``batches.max_files_per_key``), counted
from the ``files`` table: the bytes and the number of the files whose ``key_id`` is the key's — its uploads and
its batches' output and error files, until they are deleted or expire. The master key has no quota; on a server
without keys every caller is one holder (``key_id`` NULL).

An upload is recorded only within its key's quota (``add_within``): the key's files are counted and the row inserted
in one transaction that holds a lock of the key's own, so that uploads made at once — on one process or on replicas
sharing the database — never pass the quota together (SQLite: the file's write lock, ``BEGIN IMMEDIATE``;
PostgreSQL: a transaction-level advisory lock on the key). A batch's output is recorded without a check (its lines
were answered and charged): it may take its key past the quota, and the key's next upload is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from sqlalchemy import func, insert, select, text
from sqlalchemy.engine import Connection

from ..errors import InvalidRequest
from .batches import file_columns
from .db import Database
from .tables import StoredFile


@dataclass(frozen=True)
class Quota:
    """The most one key may hold: bytes, and files."""

    max_bytes: int
    max_files: int


def _held(connection: Connection, key_id: str | None) -> tuple[int, int]:
    """(bytes, files) the key holds."""
    owner = StoredFile.key_id.is_(None) if key_id is None else StoredFile.key_id == key_id
    size, count = connection.execute(select(func.coalesce(func.sum(StoredFile.bytes), 0), func.count())
                                     .where(owner)).one()
    return int(size), int(count)


def check(held: tuple[int, int], size: int, quota: Quota) -> None:
    """The one rule: a new file of ``size`` bytes fits when the key's files with it stay within both limits; else
    400 ``file_quota_exceeded``, naming the limit."""
    held_bytes, held_files = held
    if held_files + 1 > quota.max_files:
        raise _over(f"the key holds {held_files} files, the most batches.max_files_per_key ({quota.max_files}) "
                    "allows")
    if held_bytes + size > quota.max_bytes:
        raise _over(f"the key holds {held_bytes} bytes of files, and this one's {size} would take it past "
                    f"batches.max_bytes_per_key ({quota.max_bytes})")


def _over(reason: str) -> InvalidRequest:
    return InvalidRequest(f"file quota exceeded: {reason}. Delete files it no longer needs (DELETE /v1/files/"
                          "{file_id}), or ask the operator for a larger quota", ("file",), code="file_quota_exceeded")


async def check_room(db: Database, key_id: str | None, size: int, quota: Quota | None) -> None:
    """Refuse early, before an upload is written, one that would not fit (``add_within`` decides)."""
    if quota is None:
        return
    async with db.engine.connect() as connection:
        held = await connection.run_sync(_held, key_id)
    check(held, size, quota)


async def add_within(db: Database, row: StoredFile, quota: Quota | None) -> None:
    """Record ``row`` if its key's files with it stay within ``quota`` (None: no quota), else refuse it
    (``file_quota_exceeded``; nothing recorded): the count and the insert in one transaction under the key's lock."""
    def run(connection: Connection) -> None:
        if quota is not None:
            if connection.dialect.name == "postgresql":
                digest = hashlib.sha256(f"decisiond files quota:{row.key_id}".encode()).digest()
                connection.execute(text("SELECT pg_advisory_xact_lock(:lock)"),
                                   {"lock": int.from_bytes(digest[:8], "big", signed=True)})
            check(_held(connection, row.key_id), row.bytes, quota)
        connection.execute(insert(StoredFile), [file_columns(row)])

    await db.write(run)
