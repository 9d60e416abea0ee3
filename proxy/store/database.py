"""Database URLs, the async engine with its SQLite pragmas, and applying Alembic migrations."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
}


def async_url(url: str) -> str:
    """The URL with an async driver: `sqlite:///x.db` becomes `sqlite+aiosqlite:///x.db`."""
    parsed = make_url(url)
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    if driver is not None:
        parsed = parsed.set(drivername=driver)
    return parsed.render_as_string(hide_password=False)


def migrations_dir() -> Path:
    """migrations/ in a source checkout, or the copy packed into the wheel."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "migrations", package / "_migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise RuntimeError("the Alembic migrations directory is missing from this install")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    return config


def upgrade_blocking(url: str) -> None:
    command.upgrade(alembic_config(url), "head")


async def upgrade_to_head(url: str) -> None:
    """Apply every migration; run in a thread because env.py drives its own event loop."""
    await asyncio.to_thread(upgrade_blocking, url)


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL: readers never block the writer. synchronous=FULL: a commit survives power loss, not only a
    # crash of the proxy, and a turn is committed before it is answered.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def create_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(async_url(url))
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
    return engine


def session_factory(engine: AsyncEngine) -> async_sessionmaker[DbSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
