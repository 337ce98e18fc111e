"""the Batch API: uploaded files, batches with their progress, the answered lines of unfinished batches, and the
batch a usage row's request was a line of

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None



def upgrade() -> None:
    op.add_column("usage", sa.Column("batch_id", sa.String(64), nullable=True))
    op.create_index("ix_usage_batch", "usage", ["batch_id"])
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(210), nullable=True),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("lines", sa.Integer, nullable=False),
        sa.Column("path", sa.String(256), nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_files_key_created", "files", ["key_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(210), nullable=True),
        sa.Column("user_path", sa.String(256), nullable=False),
        sa.Column("master", sa.Boolean, nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("batch_metadata", sa.JSON, nullable=True),
        sa.Column("errors", sa.JSON, nullable=True),
        *[sa.Column(name, sa.Integer, nullable=False) for name in ("total", "completed", "failed")],
        *[sa.Column(name, sa.BigInteger, nullable=False) for name in ("input_tokens", "cached_tokens",
                                                                       "output_tokens")],
        sa.Column("next_line", sa.Integer, nullable=False),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        *[sa.Column(name, sa.BigInteger, nullable=True) for name in (
            "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
            "cancelled_at")],
        sa.Column("runner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.Float, nullable=True),
    )
    op.create_index("ix_batches_key_created", "batches", ["key_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_results",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("line", sa.Integer, primary_key=True),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("batch_results")
    op.drop_index("ix_batches_status", "batches")
    op.drop_index("ix_batches_key_created", "batches")
    op.drop_table("batches")
    op.drop_index("ix_files_key_created", "files")
    op.drop_table("files")
    op.drop_index("ix_usage_batch", "usage")
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("batch_id")
