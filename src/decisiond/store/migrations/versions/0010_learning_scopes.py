"""learning stays in its tenant: each label keeps the user path it was posted under, each learned profile the user
path it serves

- ``decisions.label_scopes`` (JSON, {question name: user path}): the labels already there were posted before scopes
  existed and are given ``/``, the operator's (what they were: every label counted for everyone).
- ``profiles.scope`` (the user path whose requests a profile serves): the profiles already there get ``/``, serving
  everyone, as they did.
- At most one active profile per target, question **and scope**: the partial unique index is rebuilt on the three.

A downgrade deactivates the profiles of any scope but ``/`` (the old schema would serve them to everyone), then
drops the column and the label scopes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-20
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

PAGE = 500

decisions = sa.table("decisions", sa.column("request_id", sa.String(64)), sa.column("labels", sa.JSON),
                     sa.column("label_scopes", sa.JSON), sa.column("labelled_at", sa.DateTime(timezone=True)))
profiles = sa.table("profiles", sa.column("scope", sa.String(256)), sa.column("active", sa.Boolean))


def upgrade() -> None:
    op.add_column("decisions", sa.Column("label_scopes", sa.JSON, nullable=True))
    op.add_column("profiles", sa.Column("scope", sa.String(256), nullable=False, server_default="/"))
    op.drop_index("ux_profiles_one_active", "profiles")
    op.create_index("ux_profiles_one_active_scope", "profiles", ["target", "signature", "scope"], unique=True,
                    sqlite_where=sa.text("active"), postgresql_where=sa.text("active"))
    _operator_scopes()


def _operator_scopes() -> None:
    """Every label already posted: scope ``/``, a page of decisions at a time (by request id)."""
    bind = op.get_bind()
    after = ""
    while True:
        rows = bind.execute(sa.select(decisions.c.request_id, decisions.c.labels)
                            .where(decisions.c.labelled_at.is_not(None), decisions.c.request_id > after)
                            .order_by(decisions.c.request_id).limit(PAGE)).all()
        if not rows:
            return
        for request_id, labels in rows:
            if isinstance(labels, dict) and labels:
                bind.execute(sa.update(decisions).where(decisions.c.request_id == request_id).values(
                    label_scopes={name: "/" for name in labels}))
        after = rows[-1][0]


def downgrade() -> None:
    op.execute(sa.update(profiles).where(profiles.c.scope != "/", profiles.c.active.is_(True)).values(active=False))
    op.drop_index("ux_profiles_one_active_scope", "profiles")
    with op.batch_alter_table("profiles") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("scope")
    op.create_index("ux_profiles_one_active", "profiles", ["target", "signature"], unique=True,
                    sqlite_where=sa.text("active"), postgresql_where=sa.text("active"))
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("label_scopes")
