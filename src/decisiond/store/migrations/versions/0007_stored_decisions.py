"""stored decisions (a model's ``store: true``) and the labels posted for them

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "decisions",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(210), nullable=True),
        sa.Column("user_path", sa.String(256), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("questions", sa.JSON, nullable=False),
        sa.Column("answers", sa.JSON, nullable=False),
        sa.Column("steps", sa.JSON, nullable=True),
        sa.Column("teacher", sa.JSON, nullable=True),
        sa.Column("labels", sa.JSON, nullable=True),
        sa.Column("labelled_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_decisions_model_labelled", "decisions", ["model", "labelled_at"])
    op.create_index("ix_decisions_expires", "decisions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_decisions_expires", "decisions")
    op.drop_index("ix_decisions_model_labelled", "decisions")
    op.drop_table("decisions")
