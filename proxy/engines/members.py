"""Each engine of a pool (Member) and what the pool's processes share: affinity, registrations."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.engines.base import Engine


class AffinityStore(Protocol):
    """Where sessions' engines are kept, shared by every process of one proxy."""

    async def get(self, session_id: str) -> str | None: ...

    async def assign(self, session_id: str, engine_id: str, *, replacing: str | None) -> str:
        """Assign unless another process assigned it first (or moved it off `replacing`): the winner."""
        ...


class EngineRegistry(Protocol):
    """Engines added and removed at run time, shared by every process of one proxy."""

    async def entries(self) -> list[tuple[str, str, bool]]: ...

    async def added(self, engine_id: str, url: str) -> None: ...

    async def removed(self, engine_id: str, url: str) -> None: ...


class MemoryAffinity:
    """Assignments of one process (tests, and apps built without a database)."""

    def __init__(self) -> None:
        self._engines: dict[str, str] = {}

    async def get(self, session_id: str) -> str | None:
        return self._engines.get(session_id)

    async def assign(self, session_id: str, engine_id: str, *, replacing: str | None) -> str:
        if self._engines.get(session_id) == replacing:
            self._engines[session_id] = engine_id
        return self._engines[session_id]


@dataclass
class Member:
    """One engine of the pool and what the proxy knows of it."""

    id: str
    url: str
    kind: str
    engine: Engine
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    last_error: str | None = None
    sessions: int = 0  # sessions this process assigned to it
    # False for an engine that could not tell its model yet (down at start): it takes no call until
    # a health check finds it serving the pool's model.
    model_known: bool = True
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no call is in flight

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining and self.model_known

    def report(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.kind,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "sessions": self.sessions,
            "last_error": self.last_error,
        }


# Builds a checked engine for a URL (protocol identified, vLLM probed); raises ProxyError when it
# speaks the wrong protocol.
Connect = Callable[[str], Awaitable[tuple[Engine, str]]]
