"""Retry claims are leases: a dead process's claim is taken over once its lease runs out, a live
process's claim is renewed and never taken while it answers."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

from proxy.store.claims import RetryClaims
from proxy.store.database import create_engine, session_factory, upgrade_blocking
from proxy.store.models import RetryClaimRow, SessionRow
from proxy.store.repository import utcnow


def _database(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    upgrade_blocking(url)
    return url


def test_a_claim_left_by_a_dead_process_is_taken_over_once_its_lease_runs_out(tmp_path: Path) -> None:
    """kill -9 while answering leaves the claim: a retry waits out the lease, not the whole wait."""
    url = _database(tmp_path)

    async def scenario() -> float:
        engine = create_engine(url)
        sessions = session_factory(engine)
        try:
            async with sessions() as db, db.begin():
                now = utcnow()
                db.add(SessionRow(id="s", created_at=now, updated_at=now, template_now=now, meta={}))
                db.add(
                    RetryClaimRow(
                        session_id="s", name="key:k", owner="dead:1", claimed_at=now - timedelta(seconds=3)
                    )
                )
            claims = RetryClaims(sessions, lease_s=2.0, renew_s=0.5)
            started = time.monotonic()
            async with claims.claim("s", "key:k", wait_s=600):
                return time.monotonic() - started
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) < 5


def test_a_live_claim_is_renewed_and_waited_for_past_its_lease(tmp_path: Path) -> None:
    url = _database(tmp_path)

    async def scenario() -> list[str]:
        engine = create_engine(url)
        sessions = session_factory(engine)
        order: list[str] = []
        try:
            async with sessions() as db, db.begin():
                now = utcnow()
                db.add(SessionRow(id="s", created_at=now, updated_at=now, template_now=now, meta={}))
            answering, waiting = (RetryClaims(sessions, lease_s=0.6, renew_s=0.1) for _ in range(2))
            held = asyncio.Event()

            async def original() -> None:
                async with answering.claim("s", "key:k", wait_s=600):
                    held.set()
                    await asyncio.sleep(2.0)  # more than three leases: renewed all along
                    order.append("original answered")

            async def retry() -> None:
                await held.wait()
                async with waiting.claim("s", "key:k", wait_s=600):
                    order.append("retry answered")

            await asyncio.gather(original(), retry())
            return order
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == ["original answered", "retry answered"]
