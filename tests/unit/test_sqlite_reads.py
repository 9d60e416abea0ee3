"""Which databases an export reads through the stdlib sqlite3 driver: plain SQLite files only."""

from __future__ import annotations

import pytest

from proxy.export.sqlite_reads import sqlite_file


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///runs/proxy.db", "runs/proxy.db"),
        ("sqlite:////var/lib/tito/proxy.db", "/var/lib/tito/proxy.db"),
        ("sqlite+aiosqlite:///proxy.db", "proxy.db"),
        ("sqlite://", None),  # in memory
        ("sqlite:///:memory:", None),
        ("sqlite:///proxy.db?mode=ro", None),  # options only SQLAlchemy's path honours
        ("postgresql+asyncpg://tito@db/tito", None),
    ],
)
def test_only_a_plain_sqlite_file_is_read_directly(url: str, path: str | None) -> None:
    assert sqlite_file(url) == path
