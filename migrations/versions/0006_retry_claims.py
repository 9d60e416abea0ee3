"""Retry claims: which request identity a process is answering, so that duplicates sent to other
worker processes wait for it and replay its answer instead of sampling again.

Revision ID: 0006_retry_claims
Revises: 0004_session_groups
Create Date: 2026-11-23 22:25:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_retry_claims"
down_revision: str | None = "0004_session_groups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "retry_claims",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=300), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "name"),
    )


def downgrade() -> None:
    op.drop_table("retry_claims")
