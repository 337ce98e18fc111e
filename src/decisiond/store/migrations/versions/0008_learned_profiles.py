"""learned profiles (``POST /admin/learn``), and what a stored decision's answers were computed from

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("decisions", sa.Column("sources", sa.JSON, nullable=True))
    op.create_table(
        "profiles",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("target", sa.String(256), nullable=False),
        sa.Column("question", sa.String(256), nullable=False),
        sa.Column("signature", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("accepted", sa.Boolean, nullable=False),
        sa.Column("active", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_profiles_active", "profiles", ["active"])
    op.create_index("ix_profiles_question", "profiles", ["target", "signature"])
    # At most one active profile per target and question: two learnings that race cannot both activate one.
    op.create_index("ux_profiles_one_active", "profiles", ["target", "signature"], unique=True,
                    sqlite_where=sa.text("active"), postgresql_where=sa.text("active"))


def downgrade() -> None:
    op.drop_index("ux_profiles_one_active", "profiles")
    op.drop_index("ix_profiles_question", "profiles")
    op.drop_index("ix_profiles_active", "profiles")
    op.drop_table("profiles")
    op.drop_column("decisions", "sources")
