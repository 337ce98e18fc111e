"""Alembic environment: migrations run on the connection decisiond hands over (``config.attributes``), inside
the async engine's ``run_sync``; on PostgreSQL an advisory lock keeps replicas that start together in line."""

from alembic import context
from sqlalchemy import text

from decisiond.store.tables import Base

MIGRATION_LOCK = 0x6465636973696F6E  # "decision"

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
    context.run_migrations()
