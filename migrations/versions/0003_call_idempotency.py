"""Idempotent retries: the Idempotency-Key and the body hash a call was requested with.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 14:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("idempotency_key", sa.String(length=256), nullable=True))
        batch.add_column(sa.Column("request_hash", sa.String(length=64), nullable=True))
        batch.create_index("ix_calls_session_idempotency", ["session_id", "idempotency_key"])
        batch.create_index("ix_calls_session_request_hash", ["session_id", "request_hash"])


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_index("ix_calls_session_request_hash")
        batch.drop_index("ix_calls_session_idempotency")
        batch.drop_column("request_hash")
        batch.drop_column("idempotency_key")
