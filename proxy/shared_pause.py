"""The trainer's pause shared by every process on one database (`--workers`, replicas): stored as a
setting by the process that is told, and followed by the others within a poll interval.

A process that notices a pause late (at most POLL_S) may have admitted a turn meanwhile: that turn
counts as in flight at the pause, which it finishes or, with `abort_in_flight`, is aborted and
continued after the resume, as on the process that was told.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.ext.asyncio import async_sessionmaker

from proxy.engines.resuming import ResumingEngine
from proxy.errors import ProxyError
from proxy.store.database import is_database_failure
from proxy.store.models import PAUSE_KEY
from proxy.store.repository import Repository

log = logging.getLogger("tito_proxy.pause")

POLL_S = 0.2
_OPEN: dict[str, Any] = {"paused": False, "since": None, "abort_epoch": 0}


@dataclass
class SharedPause:
    db_sessions: async_sessionmaker[DbSession]
    engine: ResumingEngine

    def __post_init__(self) -> None:
        self.seen_abort_epoch = 0  # aborts ordered before this process followed the setting are past
        self._telling = 0  # pauses and resumes this process is applying and publishing now

    @contextlib.asynccontextmanager
    async def told(self) -> AsyncIterator[None]:
        """A pause or resume this process was told of, applied here and then published: a poll
        meanwhile may read the value before it, and is left to the next one."""
        self._telling += 1
        try:
            yield
        finally:
            self._telling -= 1

    async def _stored(self) -> dict[str, Any]:
        async with self.db_sessions() as db:
            value = await Repository(db).get_setting(PAUSE_KEY)
        return {**_OPEN, **json.loads(value)} if value else dict(_OPEN)

    async def start(self) -> None:
        """Take the stored pause as it is (a process started during a pause stays paused); aborts
        ordered earlier concern other processes' generations only."""
        stored = await self._stored()
        self.seen_abort_epoch = stored["abort_epoch"]
        if stored["paused"]:
            self.engine.gate.pause()
            self._stored_since(stored)

    async def publish(self, *, paused: bool, abort: bool = False) -> None:
        """Store the pause this process was told of (it applied the pause and the abort itself)."""
        async with self.db_sessions() as db, db.begin():
            repo = Repository(db)
            value = await repo.get_setting(PAUSE_KEY)
            stored = {**_OPEN, **json.loads(value)} if value else dict(_OPEN)
            epoch = stored["abort_epoch"] + (1 if abort else 0)
            since = (stored["since"] or time.time()) if paused else None
            await repo.set_setting(
                PAUSE_KEY, json.dumps({"paused": paused, "since": since, "abort_epoch": epoch})
            )
        self.seen_abort_epoch = max(self.seen_abort_epoch, epoch)
        if paused:
            self._stored_since({"since": since})

    async def follow_once(self) -> None:
        """Bring this process's gate to the stored pause: pause, abort what runs here, or resume. A
        read that a pause or resume told to this process overtook is stale (the stored value may
        predate its publishing): it is left to the next poll, lest it undo what the trainer just
        asked for."""
        gate = self.engine.gate
        changes = gate.changes
        if self._telling:
            return
        stored = await self._stored()
        if self._telling or gate.changes != changes:
            return
        if stored["paused"] and not gate.paused:
            gate.pause()
        if stored["paused"]:
            self._stored_since(stored)
        if stored["abort_epoch"] > self.seen_abort_epoch:
            self.seen_abort_epoch = stored["abort_epoch"]
            await self.engine.abort_in_flight()
        if not stored["paused"] and gate.paused:
            await self.engine.refresh_version()  # the version that samples next, as at a resume
            gate.resume()

    def _stored_since(self, stored: dict[str, Any]) -> None:
        """The pause began when the process first told of it stored it: every process reports that
        time (/admin/state), not when it noticed the pause or started during it."""
        if isinstance(stored.get("since"), int | float):
            self.engine.gate.paused_since = float(stored["since"])

    async def follow(self) -> None:
        """Run for the process's life; a database that fails a poll is tried again at the next."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.follow_once()
            except ProxyError as exc:
                log.warning("following the shared pause: %s", exc.message)
            except Exception as exc:
                if not is_database_failure(exc):
                    raise
                log.warning("following the shared pause: the database failed (%s)", exc)
