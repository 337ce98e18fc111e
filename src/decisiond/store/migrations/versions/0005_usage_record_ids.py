"""usage rows carry a unique record id: a journaled record replayed after a crash is inserted once

Several rows may share a request id (a decision_judge guardrail's calls, the request's own row), so the request id
cannot be the key of a replay; each record gets its own ``record_id`` when it is journaled. Rows written before
this migration have none (NULL: a unique index allows any number of them, on SQLite and PostgreSQL alike).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("usage", sa.Column("record_id", sa.String(32), nullable=True))
    op.create_index("ux_usage_record_id", "usage", ["record_id"], unique=True)


def downgrade() -> None:
    op.drop_index("ux_usage_record_id", "usage")
    with op.batch_alter_table("usage") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("record_id")
