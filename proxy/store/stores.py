"""Which turn store a database gets: SQLite's writer thread, PostgreSQL's asyncpg pool, or the
async engine (in-memory SQLite)."""

from __future__ import annotations

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.store.pg_turns import PostgresTurnStore
from proxy.store.turn_store import AsyncTurnStore, SqliteTurnStore, TurnStore


def open_turn_store(url: str, engine: AsyncEngine) -> TurnStore:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        return SqliteTurnStore(url)
    if engine.dialect.driver == "asyncpg":
        return PostgresTurnStore(engine)
    return AsyncTurnStore(engine)
