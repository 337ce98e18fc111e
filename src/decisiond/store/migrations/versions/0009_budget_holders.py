"""budget holds name the process that holds them, so that a process that died on this host gives its room back at
once

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("budget_reservations", sa.Column("holder", sa.String(200), nullable=True))
    op.create_index("ix_budget_reservations_holder", "budget_reservations", ["holder"])


def downgrade() -> None:
    op.drop_index("ix_budget_reservations_holder", "budget_reservations")
    with op.batch_alter_table("budget_reservations") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("holder")
