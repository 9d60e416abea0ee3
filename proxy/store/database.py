"""Database URLs, the async engine with its SQLite pragmas, and applying Alembic migrations."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import TracebackType
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

from proxy.errors import ConcurrentChange, DatabaseUnavailable, ProxyError

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


def is_database_failure(error: BaseException) -> bool:
    """Whether an exception is the database failing, whichever layer raised it: SQLAlchemy wraps the
    driver's errors once connected, but a refused connection surfaces as the driver's own (asyncpg
    raises OSError, or its PostgresError while the server starts or stops)."""
    if isinstance(error, ProxyError):
        return False
    return isinstance(error, SQLAlchemyError | OSError) or type(error).__module__.startswith(
        ("asyncpg", "aiosqlite", "sqlite3")
    )


def database_error(error: BaseException) -> ProxyError:
    """The one mapping of a database failure to what the client is told: a 409 for a write that a
    concurrent one made impossible, else a 503 (nothing was written: the transaction rolled back)."""
    if isinstance(error, IntegrityError):
        return ConcurrentChange("the record changed while this request ran; nothing was written, retry it")
    reason = error.orig if isinstance(error, DBAPIError) else error  # the driver's words, not the SQL
    return DatabaseUnavailable(f"the database failed, nothing was written: {reason or type(reason).__name__}")


class GuardedSession(DbSession):
    """A database session whose failures leave its `async with` block as a DatabaseUnavailable (503
    in the envelope), however they arise: a query, the commit, the connection, closing."""

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            await super().__aexit__(kind, error, traceback)
        except Exception as closing:
            if not is_database_failure(closing):
                raise
            raise database_error(error if error is not None else closing) from closing
        if error is not None and is_database_failure(error):
            raise database_error(error) from error


def session_factory(engine: AsyncEngine) -> async_sessionmaker[DbSession]:
    return async_sessionmaker(engine, expire_on_commit=False, class_=GuardedSession)
