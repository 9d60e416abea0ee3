"""Cross-process retry claims: the database's primary key decides which process answers a request
identity; the others wait until it has recorded its answer (and dropped the claim).

A claim is a lease: its process renews `claimed_at` every RENEW_S while it holds it, and a claim not
renewed for LEASE_S is a process that died while answering (kill -9, a crash, a lost host): a waiter
drops it and answers itself. Without leases such a claim held every retry of its request for the
whole wait (600 s), in every process, and after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.ext.asyncio import async_sessionmaker

from proxy.store.models import RetryClaimRow
from proxy.store.repository import utcnow

log = logging.getLogger("tito_proxy.retries")

# A live process renews its claims this often...
RENEW_S = 5.0
# ...so one not renewed for this long is a dead process's (room for a stalled loop and clock skew).
LEASE_S = 30.0


class RetryClaims:
    def __init__(
        self,
        db_sessions: async_sessionmaker[DbSession],
        poll_s: float = 0.02,
        *,
        renew_s: float = RENEW_S,
        lease_s: float = LEASE_S,
    ) -> None:
        self._db_sessions = db_sessions
        self.poll_s = poll_s
        self.renew_s = renew_s
        self.lease_s = lease_s
        # Every claim of this process is owned "<process>:<claim>": one statement renews them all.
        self._process = uuid.uuid4().hex[:16]
        self._held = 0
        self._renewing: asyncio.Task[None] | None = None

    async def _try_claim(self, session_id: str, name: str, owner: str) -> bool:
        # The IntegrityError is caught inside the session: leaving it, the error would become a 409.
        async with self._db_sessions() as db:
            try:
                async with db.begin():
                    db.add(RetryClaimRow(session_id=session_id, name=name, owner=owner, claimed_at=utcnow()))
                return True
            except IntegrityError:
                pass
        # A claim whose lease ran out is a process that died while answering: it is dropped.
        async with self._db_sessions() as db, db.begin():
            await db.execute(
                delete(RetryClaimRow).where(
                    RetryClaimRow.session_id == session_id,
                    RetryClaimRow.name == name,
                    RetryClaimRow.claimed_at < utcnow() - timedelta(seconds=self.lease_s),
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
        """Held while answering; waits up to `wait_s` for another live process's claim, then goes on."""
        owner = f"{self._process}:{uuid.uuid4().hex}"
        deadline = time.monotonic() + wait_s
        claimed = await self._try_claim(session_id, name, owner)
        while not claimed and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
            claimed = await self._try_claim(session_id, name, owner)
        if not claimed:
            log.warning(
                "session %s: retry waited %.0f s for another process; sampling anew", session_id, wait_s
            )
        if claimed:
            self._hold()
        try:
            yield
        finally:
            if claimed:
                self._held -= 1
                async with self._db_sessions() as db, db.begin():
                    await db.execute(
                        delete(RetryClaimRow).where(
                            RetryClaimRow.session_id == session_id,
                            RetryClaimRow.name == name,
                            RetryClaimRow.owner == owner,
                        )
                    )

    def _hold(self) -> None:
        self._held += 1
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.create_task(self._renew_while_held())

    async def _renew_while_held(self) -> None:
        """Renews this process's claims until it holds none; a failed renewal is tried again."""
        while self._held:
            await asyncio.sleep(self.renew_s)
            try:
                async with self._db_sessions() as db, db.begin():
                    await db.execute(
                        update(RetryClaimRow)
                        .where(RetryClaimRow.owner.startswith(f"{self._process}:"))
                        .values(claimed_at=utcnow())
                    )
            except Exception as exc:  # the database: the next renewal, well within the lease
                log.warning("renewing retry claims failed: %s", exc)
