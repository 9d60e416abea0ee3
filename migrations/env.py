"""Alembic environment: runs migrations on the async engine the proxy itself uses."""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from sqlalchemy import event, pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from proxy.store.database import async_url
from proxy.store.models import Base

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    # transactional_ddl: Alembic assumes SQLite cannot roll back DDL and commits after each migration;
    # with the driver's own transactions off (below) it can, so the whole upgrade is one commit.
    context.configure(
        connection=connection, target_metadata=target_metadata, render_as_batch=True, transactional_ddl=True
    )
    with context.begin_transaction():
        context.run_migrations()


def _transactional_ddl(sync_engine: Any) -> None:
    """SQLite's driver runs DDL outside any transaction unless told otherwise: then every statement
    commits alone (a crash between them leaves a half-migrated file, and each commit syncs the disk).
    Opening the transaction ourselves makes the whole upgrade one atomic commit."""

    @event.listens_for(sync_engine, "connect")
    def _no_driver_transactions(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(sync_engine, "begin")
    def _begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")


async def _run_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    assert url is not None
    engine = create_async_engine(async_url(url), poolclass=pool.NullPool)
    if engine.dialect.name == "sqlite":
        _transactional_ddl(engine.sync_engine)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=context.config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())
