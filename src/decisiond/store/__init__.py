"""The SQL database: managed API keys today, usage and budgets later. SQLite by default, PostgreSQL to share it
between replicas; SQLAlchemy 2 (async) with Alembic migrations applied at start-up."""

from .db import Database, database_url, default_database_path
from .keys import KeyRecord, KeyStore, hash_secret

__all__ = ["Database", "KeyRecord", "KeyStore", "database_url", "default_database_path", "hash_secret"]
