"""Engine affinity: the engine each session's turns go to, so that every worker process sends a
session to the same engine (its prefix cache) and moves it off a lost engine only once; and the
engines registered or removed at run time, which every worker process follows.

Revision ID: 0008_engine_affinity
Revises: 0007_call_ids_never_reused
Create Date: 2026-11-24 00:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_engine_affinity"
down_revision: str | None = "0007_call_ids_never_reused"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "engine_affinity",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("engine_id", sa.String(length=64), nullable=False),
        sa.Column("assigned_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )
    op.create_table(
        "registered_engines",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("removed", sa.Boolean(), nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("registered_engines")
    op.drop_table("engine_affinity")
