"""A call's request on SQLite: deflated once long, kept as text otherwise, read back the same by every
path (the turn store's own reads, SQLAlchemy's), rows written as text before included."""

from __future__ import annotations

import asyncio
import base64
import os
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import create_engine, select

from proxy.store.database import upgrade_blocking
from proxy.store.models import CallRow
from proxy.store.packed_json import PACK_FROM_BYTES, pack_json, unpack_json
from tests.turn_writes import turn_write
from tests.unit.test_turn_store import STORES

LONG_TEXT = "def f(x):\n    return compute(x) + offset  # a line repeated, as code and logs are\n" * 40
RANDOM_TEXT = base64.b64encode(os.urandom(3000)).decode()  # deflate saves a quarter of it, no more


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "packed.db"
    upgrade_blocking(f"sqlite:///{path}")
    return path


def _record_and_read(db: Path, kind: str, contents: list[str]) -> list[dict[str, Any]]:
    """Each content as a session's one call (none: record nothing); then every call's request, one
    per segment, as the turn store reads a segment."""

    async def scenario() -> list[dict[str, Any]]:
        store = STORES[kind](f"sqlite:///{db}")
        try:
            for n, content in enumerate(contents):
                await store.record(turn_write(f"s{n}", content=content))
            with sqlite3.connect(db) as connection:
                segments = [row[0] for row in connection.execute("select segment_id from calls order by id")]
            return [row.request for segment in segments for row in await store.segment_rows(segment)]
        finally:
            await store.close()

    return asyncio.run(scenario())


def _stored(db: Path) -> list[tuple[str, int]]:
    """Each call's request as SQLite holds it: its storage class and length."""
    with sqlite3.connect(db) as connection:
        return connection.execute("select typeof(request), length(request) from calls order by id").fetchall()


@pytest.mark.parametrize("kind", STORES)
def test_a_long_request_is_stored_deflated_and_read_back_whole(db: Path, kind: str) -> None:
    contents = ["hi", LONG_TEXT, RANDOM_TEXT]
    read = _record_and_read(db, kind, contents)
    assert read == [{"messages": [{"role": "user", "content": content}]} for content in contents]
    (short, _), (long_kind, long_size), (random_kind, random_size) = _stored(db)
    assert (short, long_kind, random_kind) == ("text", "blob", "blob")
    assert long_size < len(LONG_TEXT) / 10
    assert random_size < len(RANDOM_TEXT)
    engine = create_engine(f"sqlite:///{db}")  # SQLAlchemy's own reads (the exports, the viewer)
    with engine.connect() as connection:
        requests = connection.execute(select(CallRow.request).order_by(CallRow.id)).scalars().all()
    engine.dispose()
    assert [r["messages"][0]["content"] for r in requests] == contents


def test_rows_written_as_text_by_an_earlier_version_read_as_before(db: Path) -> None:
    _record_and_read(db, "sqlite-writer-thread", [LONG_TEXT])
    earlier = orjson.dumps({"messages": [{"role": "user", "content": LONG_TEXT}], "kind": "earlier"})
    with sqlite3.connect(db) as connection:
        connection.execute("update calls set request = ?", (earlier.decode(),))
    assert _stored(db)[0][0] == "text"
    for kind in STORES:
        assert _record_and_read(db, kind, []) == [orjson.loads(earlier)]


def test_packing_keeps_short_values_as_text_and_every_value_round_trips() -> None:
    short = {"a": "x" * (PACK_FROM_BYTES - 20)}
    assert isinstance(pack_json(short), str)
    # Past orjson's 64 bits the standard library writes it (read back as orjson reads any JSON: a
    # float; the turn routes parse bodies with orjson, so no recorded request holds one).
    assert unpack_json(pack_json({"n": 2**70 + 1})) == {"n": float(2**70 + 1)}
    long_values = [{"messages": [{"content": LONG_TEXT}]}, {"t": RANDOM_TEXT}, {"u": "é☃" * 400}]
    values = [short, *long_values]
    for value in values:
        assert unpack_json(pack_json(value)) == value
    assert all(isinstance(pack_json(value), bytes) for value in long_values)
