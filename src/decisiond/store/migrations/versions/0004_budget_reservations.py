"""budget reservations one row each (so that they can expire); usage rows say when their tokens were estimated

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "budget_reservations",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("budget_id", sa.String(64), nullable=False),
        sa.Column("window_start", sa.BigInteger(), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_budget_reservations_budget_created", "budget_reservations", ["budget_id", "created_ms"])
    op.add_column("usage", sa.Column("estimated", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("estimated")
    op.drop_index("ix_budget_reservations_budget_created", "budget_reservations")
    op.drop_table("budget_reservations")
