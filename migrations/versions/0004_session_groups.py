"""Groups (GRPO): a session's group id, its sample index in the group, and the group's size.

Revision ID: 0004_session_groups
Revises: 0003
Create Date: 2026-11-23 21:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_session_groups"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("group_id", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("sample_index", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("group_size", sa.Integer(), nullable=True))
        batch.create_index("ix_sessions_group_id", ["group_id"])
        batch.create_index("ux_sessions_group_sample", ["group_id", "sample_index"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index("ux_sessions_group_sample")
        batch.drop_index("ix_sessions_group_id")
        batch.drop_column("group_size")
        batch.drop_column("sample_index")
        batch.drop_column("group_id")
