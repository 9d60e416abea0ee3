"""A throwaway PostgreSQL server for the tests: the machine's own binaries, a fresh cluster in a
temporary directory, on a free loopback port, with a new database per test."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from proxy.store.database import async_url
from tests.support import free_port

# Debian installs the server programs outside PATH.
_BIN_DIRS = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)


def _program(name: str) -> str | None:
    found = shutil.which(name)
    if found is None:
        candidates = [f"{d}/{name}" for d in _BIN_DIRS if Path(d, name).is_file()]
        found = candidates[0] if candidates else None
    return found


def available() -> bool:
    return all(_program(name) for name in ("initdb", "pg_ctl"))


def _run_as_server_user(command: list[str]) -> None:
    # initdb and postgres refuse to run as root; Debian's package leaves a `postgres` user for that.
    full = ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command
    done = subprocess.run(full, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"


@contextmanager
def postgres_server(root: Path, *, durable: bool = False) -> Iterator[str]:
    """Start a cluster under `root`; yields the URL of its `postgres` database (trust auth).
    `durable`: every commit flushed to disk (the benchmarks), else fsync is off (the tests)."""
    data, sockets = root / "data", root / "sockets"
    for folder in (data, sockets):
        folder.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres", "postgres")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    initdb = _program("initdb")
    assert initdb is not None, "PostgreSQL's initdb is not installed"
    _run_as_server_user([initdb, "-D", str(data), "-U", "postgres", "--auth=trust"])
    port = free_port()
    start(root, port, durable=durable)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        stop(root)


def _pg_ctl() -> str:
    pg_ctl = _program("pg_ctl")
    assert pg_ctl is not None, "PostgreSQL's pg_ctl is not installed"
    return pg_ctl


def start(root: Path, port: int, *, durable: bool = False) -> None:
    """Start (or start again) the cluster under `root` on `port`."""
    # fsync off: the tests check behaviour, not power-loss durability, and run faster without it.
    options = f"-p {port} -k {root / 'sockets'} -c listen_addresses=127.0.0.1" + ("" if durable else " -F")
    log = root / "server.log"
    _run_as_server_user([_pg_ctl(), "-D", str(root / "data"), "-l", str(log), "-o", options, "-w", "start"])


def server_pid(root: Path) -> int:
    """The postmaster's pid (its backends are its children)."""
    return int((root / "data" / "postmaster.pid").read_text().split()[0])


def stop(root: Path) -> None:
    """Stop the cluster under `root` at once (a crash, as far as its clients can tell); no-op if stopped."""
    data = root / "data"
    if (data / "postmaster.pid").exists():
        _run_as_server_user([_pg_ctl(), "-D", str(data), "-m", "immediate", "stop"])


def new_database(server_url: str) -> str:
    """A fresh, empty database on the server; returns its URL."""
    name = f"tito_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        # CREATE DATABASE cannot run inside a transaction.
        engine = create_async_engine(async_url(server_url), isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as connection:
                await connection.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            await engine.dispose()

    asyncio.run(create())
    return server_url.rsplit("/", 1)[0] + f"/{name}"
