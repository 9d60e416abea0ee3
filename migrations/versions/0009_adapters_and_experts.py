"""Each call records the LoRA adapter it was sampled with and the MoE experts its positions were
routed to (both nullable: the base weights, or no routing asked for).

Revision ID: 0009_adapters_and_experts
Revises: 0008_engine_affinity
Create Date: 2026-11-24 00:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_adapters_and_experts"
down_revision: str | None = "0008_engine_affinity"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMNs (no table rebuild on SQLite): calls keep their AUTOINCREMENT.
    op.add_column("calls", sa.Column("adapter", sa.String(length=256), nullable=True))
    op.add_column("calls", sa.Column("routed_experts", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("routed_experts")
        batch.drop_column("adapter")
