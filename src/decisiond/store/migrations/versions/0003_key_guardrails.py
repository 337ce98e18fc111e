"""guardrails on managed keys

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-17
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("guardrails", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("guardrails")
