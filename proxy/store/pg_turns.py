"""The turn path on PostgreSQL: statements compiled once, run on asyncpg's own connections.

Through SQLAlchemy's async layer a turn's two reads and its commit cost more CPU than everything
else the proxy does for the turn (statement building, greenlet hops, the pool's bookkeeping). Here
a read is one prepared statement (asyncpg prepares each once per connection), and a turn's whole
write (its session's upsert, any new segment, its calls) is one statement of data-modifying CTEs:
one round trip, atomic on its own, committed (and, with fsync on, flushed) before it returns.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import orjson
from sqlalchemy import JSON, Boolean, DateTime, Float, Integer, LargeBinary, String, Table
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.types import TypeDecorator

from proxy.store.database import is_database_failure
from proxy.store.models import CallRow
from proxy.store.repository import utcnow
from proxy.store.turn_store import (
    NEW_CALL_FIELDS,
    Compiled,
    Query,
    TurnStore,
    TurnWrite,
    json_text,
    recording_error,
    refuse_finished,
)

# Connections per process: a turn holds one for a read or its write, a few milliseconds at most.
POOL_SIZE = 10
# What SQLAlchemy's asyncpg dialect reads from a URL that asyncpg.connect does not take.
_SQLALCHEMY_ONLY = ("prepared_statement_cache_size", "prepared_statement_name_func", "async_creator_fn")


def _json_value(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:  # what orjson refuses (an integer past 64 bits), the standard one reads
        return json.loads(text)


async def _codecs(connection: Any) -> None:
    # As SQLAlchemy's own engine writes and reads JSON columns: as text, decoded to Python values.
    await connection.set_type_codec(
        "json", encoder=json_text, decoder=_json_value, schema="pg_catalog", format="text"
    )


async def _keep(_connection: Any) -> None:
    """A connection goes back to the pool as it is: its statements leave no session state behind, and
    asyncpg's default reset would cost a round trip per use (an open transaction is rolled back all
    the same)."""


def _cast(column: Any) -> str:
    """The type a parameter is cast to where no target column gives it one (an INSERT ... SELECT).
    Base types only: an explicit cast to VARCHAR(n) would cut a long value instead of refusing it."""
    kind = column.type
    if isinstance(kind, TypeDecorator):  # PackedJSON: plain JSON on PostgreSQL
        kind = kind.impl_instance
    if isinstance(kind, DateTime):
        return "timestamptz" if kind.timezone else "timestamp"
    for base, name in ((JSON, "json"), (LargeBinary, "bytea"), (Boolean, "boolean"), (Integer, "bigint")):
        if isinstance(kind, base):
            return name
    if isinstance(kind, Float):
        return "double precision"
    assert isinstance(kind, String), f"no cast for {column.name}: {kind!r}"
    return "text"


_CALLS: Table = CallRow.__table__  # type: ignore[assignment]
_CALL_COLUMNS = ", ".join((*NEW_CALL_FIELDS, "created_at"))
_SESSION_UPSERT = (
    "s AS (INSERT INTO sessions (id, status, created_at, updated_at, template_now, metadata) "
    "VALUES ($1, 'active', $2, $2, $3, '{}') "
    "ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at "
    # A finished session's row is not returned: the calls below insert nothing, and the statement
    # reports it (the row stays locked until the statement ends, so a finish cannot slip between).
    "WHERE sessions.status <> 'finished' RETURNING id)"
)


def write_sql(opens: Sequence[bool]) -> str:
    """One statement writing a request's calls (call i opens a segment of its own if opens[i]).
    Parameters: $1 session id, $2 now, $3 the session's template date, then each call's fields."""
    ctes, number = [_SESSION_UPSERT], 4
    for index, opens_segment in enumerate(opens):
        values = []
        for name in NEW_CALL_FIELDS:
            if name == "session_id":
                values.append("s.id")
            elif name == "segment_id" and opens_segment:
                values.append(f"(SELECT id FROM seg_{index})")
            else:
                values.append(f"${number}::{_cast(_CALLS.c[name])}")
                number += 1
        if opens_segment:
            ctes.append(
                f"seg_{index} AS (INSERT INTO segments (session_id, created_at) "
                "SELECT id, $2::timestamptz FROM s RETURNING id)"
            )
        ctes.append(
            f"c_{index} AS (INSERT INTO calls ({_CALL_COLUMNS}) "
            f"SELECT {', '.join(values)}, $2::timestamptz FROM s RETURNING id)"
        )
    ids = [f"(SELECT id FROM c_{index})" for index in range(len(opens))]
    return f"WITH {', '.join(ctes)} SELECT {', '.join(['(SELECT count(*) FROM s)', *ids])}"


def write_parameters(write: TurnWrite) -> list[Any]:
    """write_sql's parameters for this write, in its order."""
    parameters: list[Any] = [write.session_id, utcnow(), write.template_now]
    for call in write.calls:
        for name in NEW_CALL_FIELDS:
            if name == "session_id" or (name == "segment_id" and call.segment_id is None):
                continue
            parameters.append(getattr(call, name))
    return parameters


class PostgresTurnStore(TurnStore):
    """The turn path on PostgreSQL, on a pool of asyncpg connections of its own."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._dialect = engine.dialect
        _, connect_args = engine.dialect.create_connect_args(engine.url)
        self._connect_args = {k: v for k, v in connect_args.items() if k not in _SQLALCHEMY_ONLY}
        self._pool: Any = None
        self._opening = asyncio.Lock()
        self._compiled: dict[int, Compiled] = {}
        self._writes: dict[tuple[bool, ...], str] = {}

    async def _connections(self) -> Any:
        """The pool, opened on first use (min_size 0: a server down at start is no start-up error)."""
        if self._pool is None:
            import asyncpg  # type: ignore[import-untyped]  # an optional dependency (the postgres extra)

            async with self._opening:
                if self._pool is None:
                    self._pool = await asyncpg.create_pool(
                        **self._connect_args, min_size=0, max_size=POOL_SIZE, init=_codecs, reset=_keep
                    )
        return self._pool

    async def _rows(self, query: Query, params: dict[str, Any]) -> Sequence[Any]:
        compiled = self._compiled.get(id(query))
        if compiled is None:
            compiled = self._compiled[id(query)] = Compiled(query, self._dialect)
        sql, parameters = compiled.bound(params)
        pool = await self._connections()
        async with pool.acquire() as connection:
            found = await connection.fetch(sql, *parameters)
        return compiled.converted(found)

    async def record(self, write: TurnWrite, *, alone: bool = False) -> list[int]:
        opens = tuple(call.segment_id is None for call in write.calls)
        sql = self._writes.get(opens)
        if sql is None:
            sql = self._writes[opens] = write_sql(opens)
        began = time.perf_counter()
        try:
            pool = await self._connections()
            async with pool.acquire() as connection:
                allowed, *call_ids = await connection.fetchrow(sql, *write_parameters(write))
        except Exception as exc:
            if is_database_failure(exc):
                raise recording_error(exc) from exc
            raise
        if not allowed:
            refuse_finished([(write.session_id, "finished")])
        if self.on_commit is not None:
            self.on_commit(1, time.perf_counter() - began)
        return [int(call_id) for call_id in call_ids]

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
