"""Initial schema: sessions, segments, calls.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 10:59:20.515101
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("template_now", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "segments",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("segments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_segments_session_id"), ["session_id"], unique=False)

    op.create_table(
        "calls",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("segment_id", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("history_key", sa.String(length=64), nullable=False),
        sa.Column("prompt_len", sa.Integer(), nullable=False),
        sa.Column("prompt_added", sa.LargeBinary(), nullable=False),
        sa.Column("output_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("finish_reason", sa.String(length=16), nullable=False),
        sa.Column("finish_detail", sa.JSON(), nullable=False),
        sa.Column("boundary_edits", sa.JSON(), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("response_message", sa.JSON(), nullable=False),
        sa.Column("sampling_params", sa.JSON(), nullable=False),
        sa.Column("weight_version", sa.String(length=128), nullable=True),
        sa.Column("engine_meta", sa.JSON(), nullable=False),
        sa.Column("timings", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["parent_id"], ["calls.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["segment_id"], ["segments.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_calls_segment_id"), ["segment_id"], unique=False)
        batch_op.create_index("ix_calls_session_history", ["session_id", "history_key"], unique=False)
        batch_op.create_index(batch_op.f("ix_calls_session_id"), ["session_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_calls_session_id"))
        batch_op.drop_index("ix_calls_session_history")
        batch_op.drop_index(batch_op.f("ix_calls_segment_id"))

    op.drop_table("calls")
    with op.batch_alter_table("segments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_segments_session_id"))

    op.drop_table("segments")
    op.drop_table("sessions")
