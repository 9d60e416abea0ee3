"""Cross-process retry claims: the database's primary key decides which process answers a request
identity; the others wait until it has recorded its answer (and dropped the claim)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.ext.asyncio import async_sessionmaker

from proxy.store.models import RetryClaimRow
from proxy.store.repository import utcnow

log = logging.getLogger("tito_proxy.retries")


class RetryClaims:
    def __init__(self, db_sessions: async_sessionmaker[DbSession], poll_s: float = 0.02) -> None:
        self._db_sessions = db_sessions
        self.poll_s = poll_s

    async def _try_claim(self, session_id: str, name: str, owner: str, stale_s: float) -> bool:
        # The IntegrityError is caught inside the session: leaving it, the error would become a 409.
        async with self._db_sessions() as db:
            try:
                async with db.begin():
                    db.add(RetryClaimRow(session_id=session_id, name=name, owner=owner, claimed_at=utcnow()))
                return True
            except IntegrityError:
                pass
        # A claim older than the wait is a process that died while answering: it is dropped.
        async with self._db_sessions() as db, db.begin():
            await db.execute(
                delete(RetryClaimRow).where(
                    RetryClaimRow.session_id == session_id,
                    RetryClaimRow.name == name,
                    RetryClaimRow.claimed_at < utcnow() - timedelta(seconds=stale_s),
                )
            )
        return False

    async def claimed_session(self, name: str) -> str | None:
        """The session of the newest claim on this identity name (a request under way in some
        process), if any: where a retry that names no session finds its running original."""
        query = (
            select(RetryClaimRow.session_id)
            .where(RetryClaimRow.name == name)
            .order_by(RetryClaimRow.claimed_at.desc())
            .limit(1)
        )
        async with self._db_sessions() as db:
            found: str | None = await db.scalar(query)
        return found

    @asynccontextmanager
    async def claim(self, session_id: str, name: str, wait_s: float) -> AsyncIterator[None]:
        """Held while answering; waits up to `wait_s` for another process's claim, then goes on."""
        owner = uuid.uuid4().hex
        deadline = time.monotonic() + wait_s
        claimed = await self._try_claim(session_id, name, owner, wait_s)
        while not claimed and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
            claimed = await self._try_claim(session_id, name, owner, wait_s)
        if not claimed:
            log.warning(
                "session %s: retry waited %.0f s for another process; sampling anew", session_id, wait_s
            )
        try:
            yield
        finally:
            if claimed:
                async with self._db_sessions() as db, db.begin():
                    await db.execute(
                        delete(RetryClaimRow).where(
                            RetryClaimRow.session_id == session_id,
                            RetryClaimRow.name == name,
                            RetryClaimRow.owner == owner,
                        )
                    )
