"""The one place where an INSERT is chosen by the database's dialect: PostgreSQL's or SQLite's, the two that
decisiond runs on, whose ``ON CONFLICT`` clauses SQLAlchemy builds alike. ``dialect_name`` is the engine's
(``Database.dialect``, ``connection.dialect.name``); any name but ``postgresql`` gets SQLite's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite


def _insert(dialect_name: str, table: Any) -> Any:
    return (postgresql.insert if dialect_name == "postgresql" else sqlite.insert)(table)


def insert_ignoring_conflict(dialect_name: str, table: Any, values: Mapping[str, Any] | None = None,
                             index_elements: Sequence[str] | None = None) -> Any:
    """``INSERT … ON CONFLICT DO NOTHING`` into ``table`` (of ``values``, or of the rows given at execution): a row
    whose key (``index_elements``; unset: any unique constraint) is there already is left as it is."""
    statement = _insert(dialect_name, table)
    if values is not None:
        statement = statement.values(**values)
    return statement.on_conflict_do_nothing(index_elements=index_elements)


def upsert(dialect_name: str, table: Any, index_elements: Sequence[str], update: Sequence[str],
           values: Mapping[str, Any] | None = None) -> Any:
    """``INSERT … ON CONFLICT (index_elements) DO UPDATE`` into ``table`` (of ``values``, or of the rows given at
    execution): a row whose key is there already has its ``update`` columns set to the new row's."""
    statement = _insert(dialect_name, table)
    if values is not None:
        statement = statement.values(**values)
    return statement.on_conflict_do_update(index_elements=index_elements,
                                           set_={name: statement.excluded[name] for name in update})
