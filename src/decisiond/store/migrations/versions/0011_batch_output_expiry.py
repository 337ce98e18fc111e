"""a batch's output_expires_after: the seconds its output and error files live from their creation

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-09
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("output_expires_s", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("output_expires_s")
