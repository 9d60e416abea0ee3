"""Call ids are never reused on SQLite (AUTOINCREMENT): worker processes cache contexts by call id,
and without it a deleted session's newest ids came back for new calls.

Revision ID: 0007_call_ids_never_reused
Revises: 0006_retry_claims
Create Date: 2026-11-23 22:40:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007_call_ids_never_reused"
down_revision: str | None = "0006_retry_claims"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return  # PostgreSQL's sequences never hand out an id twice
    with op.batch_alter_table("calls", recreate="always", table_kwargs={"sqlite_autoincrement": True}):
        pass


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("calls", recreate="always", table_kwargs={"sqlite_autoincrement": False}):
        pass
