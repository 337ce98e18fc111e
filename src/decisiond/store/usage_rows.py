"""Inserting usage rows in bulk, each record once: the rows whose ``record_id`` is not in the table yet are inserted,
in the caller's transaction, and the ids inserted returned.

The rows are sent as the driver takes them, not through SQLAlchemy's per-row statement machinery (which cost a
fifth of a millisecond a row, on the event loop): each value goes through its column type's own bind processor (so
it is stored exactly as SQLAlchemy stores it and read back the same), then

- PostgreSQL: one ``INSERT … SELECT * FROM unnest($1::text[], …) ON CONFLICT (record_id) DO NOTHING RETURNING
  record_id``, one array a column;
- SQLite: the ids already there, then one ``executemany`` of the others.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Integer, String, text
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.asyncio import AsyncSession

from .tables import UsageRow

_COLUMNS = [c for c in UsageRow.__table__.columns if not c.primary_key]
_NAMES = ", ".join(c.name for c in _COLUMNS)
_ARRAYS = ((String, "text"), (DateTime, "timestamptz"), (BigInteger, "int8"), (Integer, "int4"), (Float, "float8"),
           (Boolean, "bool"), (JSON, "json"))


def _array_type(column: Any) -> str:
    return next(name for kind, name in _ARRAYS if isinstance(column.type, kind))


_POSTGRES = (f"INSERT INTO usage ({_NAMES}) SELECT * FROM unnest("
             + ", ".join(f"${i}::{_array_type(c)}[]" for i, c in enumerate(_COLUMNS, 1))
             + ") ON CONFLICT (record_id) DO NOTHING RETURNING record_id")
_SQLITE = f"INSERT INTO usage ({_NAMES}) VALUES ({', '.join('?' for _ in _COLUMNS)})"
_processors: dict[str, list[tuple[str, Any, Any]]] = {}


def _bound(dialect: Dialect) -> list[tuple[str, Any, Any]]:
    """Each column's (name, bind processor for ``dialect`` — None where the driver takes the value as it is —, and
    what the processor makes of None: computed once, as a JSON column's ``null``)."""
    found = _processors.get(dialect.name)
    if found is None:
        found = _processors[dialect.name] = []
        for c in _COLUMNS:
            processor = c.type.bind_processor(dialect)
            found.append((c.name, processor, processor(None) if processor is not None else None))
    return found


def values_of(rows: list[dict[str, Any]], dialect: Dialect) -> list[list[Any]]:
    """The rows (``usage_writer.fit`` made each fit its columns) as the driver takes them, column by column."""
    processors = _bound(dialect)
    return [[row[name] if p is None else null if row[name] is None and null is not None else p(row[name])
             for name, p, null in processors] for row in rows]


def insert_new_sqlite(connection: Connection, rows: list[dict[str, Any]], values: list[list[Any]]) -> set[str]:
    """SQLite, in ``connection``'s transaction: the ids already there, then one ``executemany`` of the others; the
    record ids inserted."""
    ids = [row["record_id"] for row in rows]
    marks = ", ".join("?" for _ in ids)
    there = {r[0] for r in connection.exec_driver_sql(
        f"SELECT record_id FROM usage WHERE record_id IN ({marks})", tuple(ids)).all()}
    fresh, taken = [], set(there)
    for v, ident in zip(values, ids):
        if ident not in taken:  # one record twice in a batch (a replay beside a new answer): the first goes in
            taken.add(ident)
            fresh.append(tuple(v))
    if fresh:
        connection.exec_driver_sql(_SQLITE, fresh)
    return {ident for ident in ids if ident not in there}


async def insert_new_postgres(session: AsyncSession, values: list[list[Any]]) -> set[str]:
    """PostgreSQL, in the session's transaction: one ``INSERT … SELECT * FROM unnest(…) ON CONFLICT DO NOTHING``;
    the record ids inserted."""
    connection = await session.connection()
    await session.execute(text("SELECT 1"))  # the transaction is begun on the driver's connection
    driver: Any = (await connection.get_raw_connection()).driver_connection
    records = await driver.fetch(_POSTGRES, *(list(column) for column in zip(*values)))
    return {r[0] for r in records}
