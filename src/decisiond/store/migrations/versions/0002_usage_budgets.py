"""usage, budgets and budget windows

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-10
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("day", sa.String(10), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(210), nullable=True),
        sa.Column("user_path", sa.String(256), nullable=False),
        sa.Column("request_type", sa.String(32), nullable=False),
        sa.Column("dialect", sa.String(32), nullable=True),
        sa.Column("requested_model", sa.String(256), nullable=True),
        sa.Column("resolved_model", sa.String(256), nullable=True),
        sa.Column("provider", sa.String(200), nullable=True),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("upstream_model", sa.String(256), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cost", sa.Float(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("cache_hit", sa.Boolean(), nullable=False),
        sa.Column("guardrail", sa.String(200), nullable=True),
        sa.Column("outcomes", sa.JSON(), nullable=True),
        sa.Column("request_body", sa.JSON(), nullable=True),
        sa.Column("response_body", sa.JSON(), nullable=True),
    )
    op.create_index("ix_usage_time", "usage", ["time"])
    op.create_index("ix_usage_key_time", "usage", ["key_id", "time"])
    op.create_index("ix_usage_type_time", "usage", ["request_type", "time"])
    op.create_index("ix_usage_request_id", "usage", ["request_id"])
    op.create_table(
        "budgets",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(210), nullable=True),
        sa.Column("user_path", sa.String(256), nullable=True),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("limit_nanousd", sa.BigInteger(), nullable=False),
        sa.Column("period", sa.String(16), nullable=True),
        sa.Column("period_seconds", sa.Integer(), nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "budget_windows",
        sa.Column("budget_id", sa.String(64), primary_key=True),
        sa.Column("window_start", sa.BigInteger(), primary_key=True),
        sa.Column("spent", sa.BigInteger(), nullable=False),
        sa.Column("reserved", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("budget_windows")
    op.drop_table("budgets")
    op.drop_table("usage")
