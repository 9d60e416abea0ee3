"""The schema comes only from migrations, and the ORM never drifts from it."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

from proxy.store.database import alembic_config, upgrade_blocking
from proxy.store.models import Base


def test_migrations_build_the_schema_from_empty_without_drift(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    upgrade_blocking(f"sqlite:///{db}")
    tables = {
        row[0] for row in sqlite3.connect(db).execute("select name from sqlite_master where type='table'")
    }
    assert {"sessions", "segments", "calls", "alembic_version"} <= tables
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    engine.dispose()
    assert diff == []


def test_upgrade_is_idempotent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'twice.db'}"
    upgrade_blocking(url)
    upgrade_blocking(url)


def test_an_upgrade_that_fails_midway_leaves_the_database_as_it_was(tmp_path: Path) -> None:
    """On SQLite the whole upgrade is one transaction: a later migration failing undoes the earlier
    ones too, instead of leaving a half-migrated file behind."""
    db = tmp_path / "half.db"
    command.upgrade(alembic_config(f"sqlite:///{db}"), "0004_session_groups")
    with closing(sqlite3.connect(db)) as connection, connection:
        # The name the batch rebuild of `calls` (0007) needs, taken: 0007 fails after 0006 ran.
        connection.execute("create table _alembic_tmp_calls (id integer)")
    with pytest.raises(OperationalError):
        upgrade_blocking(f"sqlite:///{db}")
    with closing(sqlite3.connect(db)) as connection:
        [(version,)] = connection.execute("select version_num from alembic_version").fetchall()
        tables = {row[0] for row in connection.execute("select name from sqlite_master where type='table'")}
    assert version == "0004_session_groups"
    assert "retry_claims" not in tables
