"""Indexes over optional columns hold only the rows that have a value.

Most turns carry no Idempotency-Key and no retry identity, and most sessions are in no group: their
index entries were never looked up (every lookup names a value), yet each was one more b-tree page
written and synced on every commit. The group index is dropped: the unique (group_id, sample_index)
index answers every lookup by group. The request-hash index leads with the hash, so that an SDK
retry without a session (found by its hash alone) is an indexed lookup too.

Revision ID: 0011_partial_indexes
Revises: 0010_segment_summaries
Create Date: 2026-11-24 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_partial_indexes"
down_revision: str | None = "0010_segment_summaries"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _where(condition: str) -> dict[str, sa.TextClause]:
    return {"sqlite_where": sa.text(condition), "postgresql_where": sa.text(condition)}


def upgrade() -> None:
    op.drop_index("ix_sessions_group_id", table_name="sessions")
    op.drop_index("ux_sessions_group_sample", table_name="sessions")
    op.create_index(
        "ux_sessions_group_sample",
        "sessions",
        ["group_id", "sample_index"],
        unique=True,
        **_where("group_id IS NOT NULL"),
    )
    op.drop_index("ix_calls_session_idempotency", table_name="calls")
    op.create_index(
        "ix_calls_session_idempotency",
        "calls",
        ["session_id", "idempotency_key"],
        **_where("idempotency_key IS NOT NULL"),
    )
    op.drop_index("ix_calls_session_request_hash", table_name="calls")
    op.create_index(
        "ix_calls_request_hash_session",
        "calls",
        ["request_hash", "session_id"],
        **_where("request_hash IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_calls_request_hash_session", table_name="calls")
    op.create_index("ix_calls_session_request_hash", "calls", ["session_id", "request_hash"])
    op.drop_index("ix_calls_session_idempotency", table_name="calls")
    op.create_index("ix_calls_session_idempotency", "calls", ["session_id", "idempotency_key"])
    op.drop_index("ux_sessions_group_sample", table_name="sessions")
    op.create_index("ux_sessions_group_sample", "sessions", ["group_id", "sample_index"], unique=True)
    op.create_index("ix_sessions_group_id", "sessions", ["group_id"])
