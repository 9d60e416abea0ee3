"""Segment summaries: what exporting a branch needs beyond its calls' token blobs (labels, per-call
lists, boundary edits, the drift report), computed once when its session finishes and stored.

Nothing is backfilled here (a drift report needs the served tokenizer and chat template, which a
migration does not have): a finished session without summaries gets them on its first export.

Revision ID: 0010_segment_summaries
Revises: 0009_adapters_and_experts
Create Date: 2026-11-24 00:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_segment_summaries"
down_revision: str | None = "0009_adapters_and_experts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "segment_summaries",
        sa.Column("leaf_call_id", sa.Integer(), nullable=False),
        sa.Column("drift_mode", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("summary", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["leaf_call_id"], ["calls.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("leaf_call_id", "drift_mode"),
    )
    op.create_index("ix_segment_summaries_session_id", "segment_summaries", ["session_id"])


def downgrade() -> None:
    op.drop_index("ix_segment_summaries_session_id", table_name="segment_summaries")
    op.drop_table("segment_summaries")
