"""Sessions' engines in the database: the first process to assign a session wins, and a move off a
lost engine happens once (compare-and-set), so `--workers` processes keep a session on one engine."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.ext.asyncio import async_sessionmaker

from proxy.store.models import EngineAffinityRow
from proxy.store.repository import utcnow


class DatabaseAffinity:
    def __init__(self, db_sessions: async_sessionmaker[DbSession]) -> None:
        self._db_sessions = db_sessions

    async def get(self, session_id: str) -> str | None:
        async with self._db_sessions() as db:
            found: str | None = await db.scalar(
                select(EngineAffinityRow.engine_id).where(EngineAffinityRow.session_id == session_id)
            )
            return found

    async def assign(self, session_id: str, engine_id: str, *, replacing: str | None) -> str:
        if replacing is not None:
            async with self._db_sessions() as db, db.begin():
                await db.execute(
                    update(EngineAffinityRow)
                    .where(
                        EngineAffinityRow.session_id == session_id,
                        EngineAffinityRow.engine_id == replacing,
                    )
                    .values(engine_id=engine_id, assigned_at=utcnow())
                )
        # The IntegrityError is caught inside the session: leaving it, the error would become a 409.
        async with self._db_sessions() as db:
            try:
                async with db.begin():
                    db.add(
                        EngineAffinityRow(session_id=session_id, engine_id=engine_id, assigned_at=utcnow())
                    )
            except IntegrityError:
                pass  # assigned already: by this move, or by another process first
        return await self.get(session_id) or engine_id
