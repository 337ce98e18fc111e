"""The SQL database: managed API keys, usage rows, budgets and their windows. SQLite by default, PostgreSQL to share
it between replicas; SQLAlchemy 2 (async) with Alembic migrations applied at start-up (``db``)."""
