"""The schema comes only from migrations, and the ORM never drifts from it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from proxy.store.database import upgrade_blocking
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
