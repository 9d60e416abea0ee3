"""Session lifecycle, rewards, export cursors and acknowledgements, persisted settings.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 11:58:55.666398
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "settings",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_table(
        "export_acks",
        sa.Column("consumer", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("consumer", "session_id"),
    )
    op.create_table(
        "finished_sessions",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("session_id"),
    )
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reward", sa.Float(), nullable=True))

    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("metadata", sa.JSON(), server_default="{}", nullable=False))
        batch_op.add_column(sa.Column("reward", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index("ix_sessions_status_updated", ["status", "updated_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_sessions_status_updated")
        batch_op.drop_column("finished_at")
        batch_op.drop_column("reward")
        batch_op.drop_column("metadata")

    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("reward")

    op.drop_table("finished_sessions")
    op.drop_table("export_acks")
    op.drop_table("settings")
