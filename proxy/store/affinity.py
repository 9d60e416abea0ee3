"""The engine pool's state that `--workers` processes share: sessions' engines, run-time engines.

A session's first assignment is won by one process (the primary key decides); a move off a lost
engine happens once (compare-and-set on the engine it leaves).
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.ext.asyncio import async_sessionmaker

from proxy.errors import Conflict
from proxy.store.models import EngineAffinityRow, RegisteredEngineRow
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
                return engine_id
            except IntegrityError:
                pass  # assigned already: by this move, or by another process first
        return await self.get(session_id) or engine_id


class DatabaseRegistry:
    """Engines added and removed at run time; ids are unique across processes and restarts."""

    def __init__(self, db_sessions: async_sessionmaker[DbSession]) -> None:
        self._db_sessions = db_sessions

    async def entries(self) -> list[tuple[str, str, bool]]:
        """(id, url, removed) of every engine changed at run time."""
        async with self._db_sessions() as db:
            rows = await db.execute(
                select(RegisteredEngineRow.id, RegisteredEngineRow.url, RegisteredEngineRow.removed)
            )
            return [(engine_id, url, removed) for engine_id, url, removed in rows]

    async def added(self, engine_id: str, url: str) -> None:
        """Record an added engine; Conflict when another process registered that id (a removed
        engine's id may be taken again)."""
        async with self._db_sessions() as db:
            try:
                async with db.begin():
                    db.add(RegisteredEngineRow(id=engine_id, url=url, removed=False, changed_at=utcnow()))
                return
            except IntegrityError:
                pass
        async with self._db_sessions() as db, db.begin():
            reused = await db.execute(
                update(RegisteredEngineRow)
                .where(RegisteredEngineRow.id == engine_id, RegisteredEngineRow.removed.is_(True))
                .values(url=url, removed=False, changed_at=utcnow())
            )
        if not getattr(reused, "rowcount", 0):
            raise Conflict(f"an engine with id {engine_id!r} is registered already", code="engine_exists")

    async def removed(self, engine_id: str, url: str) -> None:
        async with self._db_sessions() as db, db.begin():
            await db.merge(RegisteredEngineRow(id=engine_id, url=url, removed=True, changed_at=utcnow()))
