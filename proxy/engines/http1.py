"""A lean HTTP/1.1 keep-alive client for an engine's generations: POST a JSON body, read the answer
whole or as a stream, over a pool of asyncio connections to one engine URL.

Why not aiohttp here: a generation is the hop every turn takes, and aiohttp's request machinery
(URL objects, header multidicts, a response object, a stream reader, timer contexts) cost ~11% of a
turn's CPU. This client writes the request in one buffer and lets httptools (llhttp) parse the answer
in the protocol's callbacks (proxy/engines/http1_wire.py): one future per request, one timer. The
rare calls (probes, aborts, /v1/models, router workers) stay on aiohttp.

Rules kept from the aiohttp client:
- A pooled connection the engine closed while it sat idle (its keep-alive timeout, seen late by a
  busy loop) fails before any byte of the answer: the engine never read the request, so it is sent
  again, once, on a fresh connection. A fresh connection's failure is never retried, nor is an
  answer cut after its first byte (the engine may have sampled).
- A request cancelled mid-flight (the client left) and a stream left unfinished close their
  connection: the engine aborts the request, and a half-read connection never goes back to the pool.
- The timeout is on the wait for the engine's next bytes, not on the whole generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

from proxy.engines.http1_wire import Answer, AnswerCut, Connection, Stale
from proxy.errors import EngineTimeout, EngineUnavailable, InvalidRequest

__all__ = ["Answer", "AnswerCut", "EngineHTTP", "Stream"]

# Below uvicorn's 5 s keep-alive (SGLang and vLLM serve with it): a pooled connection is not reused
# just as the engine closes it.
IDLE_S = 4.0
CONNECT_TIMEOUT_S = 10.0
POOL_LIMIT = 1024


class Stream:
    """An answer whose body is read as it arrives. release() when done with it: the connection goes
    back to the pool only when the body was read to its end."""

    def __init__(self, client: EngineHTTP, connection: Connection, head: Answer) -> None:
        self.status = head.status
        self.content_type = head.content_type
        self._client = client
        self._connection = connection
        self._loop = asyncio.get_running_loop()
        self._open = True

    def __del__(self) -> None:
        # A stream dropped unreleased (its reader never started) must not hold a pool slot: closed
        # on the loop, as the collector may run in any thread.
        if self._open:
            with contextlib.suppress(RuntimeError):  # the loop is closed: so is the connection
                self._loop.call_soon_threadsafe(self.close)

    async def blocks(self) -> AsyncIterator[bytes]:
        """The body's blocks as they arrive; raises AnswerCut or TimeoutError."""
        while (block := await self._connection.next_block()) is not None:
            yield block

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        return b"".join([block async for block in self.blocks()])

    def release(self) -> None:
        if self._open:
            self._open = False
            self._client.give_back(self._connection)

    def close(self) -> None:
        """Drop the connection, whether or not the body was read (the engine aborts an unread stream)."""
        if self._open:
            self._open = False
            self._client.drop(self._connection)


class EngineHTTP:
    """POSTs to one engine URL over pooled keep-alive connections; errors raised as proxy errors
    naming `engine` ("the engine", "vLLM"). Open it inside the event loop that uses it."""

    def __init__(self, base_url: str, *, engine: str, timeout_s: float, limit: int = POOL_LIMIT) -> None:
        parts = urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._base_url = base_url.rstrip("/")
        self._engine = engine
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path
        self._host_header = parts.netloc.rpartition("@")[2].encode("idna")
        self._timeout_s = timeout_s
        self._limit = limit
        self._idle: deque[Connection] = deque()  # the most recently used last
        self._live: set[Connection] = set()  # every connection open, idle or not
        self._opening = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        """POST `body` to base URL + path; the whole answer, whatever its status."""
        connection, answer = await self._send(path, body, headers, stream=False)
        self.give_back(connection)
        return answer

    async def open(self, path: str, body: bytes, headers: Mapping[str, str]) -> Stream:
        """POST `body` to base URL + path; the answer once its head arrived, its body to stream."""
        connection, head = await self._send(path, body, headers, stream=True)
        return Stream(self, connection, head)

    async def aclose(self) -> None:
        """Close every connection, in flight or idle, and wait until their sockets are closed."""
        self._closed = True
        self._idle.clear()
        live = list(self._live)
        for connection in live:
            connection.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await asyncio.gather(*(c.closed for c in live))
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    # --- one exchange ---

    async def _send(
        self, path: str, body: bytes, headers: Mapping[str, str], *, stream: bool
    ) -> tuple[Connection, Answer]:
        """The connection and its answer (its head for a stream); a pooled connection found stale
        sends the request again, once, on a fresh one."""
        request = self._request(path, body, headers)
        connection = await self._acquire(pooled=True)
        try:
            return connection, await self._exchange(connection, request, stream)
        except Stale as exc:
            if connection.answers == 0:  # a fresh connection: the engine itself went away
                raise self._unreachable(exc) from exc
        connection = await self._acquire(pooled=False)
        try:
            return connection, await self._exchange(connection, request, stream)
        except Stale as exc:
            raise self._unreachable(exc) from exc

    def _request(self, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        lines = [
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n"
            % ((self._prefix + path).encode(), self._host_header, len(body))
        ]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise InvalidRequest(f"a header for the engine holds a line break: {name!r}")
            lines.append(b"%s: %s\r\n" % (name.encode(), value.encode()))
        lines.append(b"\r\n")
        lines.append(body)
        return b"".join(lines)

    async def _exchange(self, connection: Connection, request: bytes, stream: bool) -> Answer:
        try:
            return await connection.send(request, self._timeout_s, stream=stream)
        except BaseException as exc:
            self.drop(connection)  # cancelled, timed out or broken: never back to the pool
            if isinstance(exc, TimeoutError):
                raise EngineTimeout(f"{self._engine} did not answer in time") from exc
            if isinstance(exc, AnswerCut):
                raise EngineUnavailable(f"{self._engine}'s answer was cut: {exc}") from exc
            raise

    def _unreachable(self, exc: Exception) -> EngineUnavailable:
        return EngineUnavailable(f"cannot reach {self._engine} at {self._base_url}: {exc}")

    # --- the pool ---

    def give_back(self, connection: Connection) -> None:
        """Back to the pool when its answer was read whole and the engine keeps it open."""
        if connection.complete and connection.keep_alive and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
            self._wake()
        else:
            self.drop(connection)

    async def _acquire(self, *, pooled: bool) -> Connection:
        """A pooled connection when `pooled` and one is usable, else a new one within the limit."""
        while True:
            if self._closed:
                raise EngineUnavailable(f"the client of {self._engine} is closed")
            if pooled:
                now = time.monotonic()
                while self._idle:
                    connection = self._idle.pop()
                    if connection.usable(now, IDLE_S):
                        return connection
                    self.drop(connection)
            if len(self._live) + self._opening < self._limit:
                return await self._connect()
            if self._idle:  # full of idle connections while a fresh one is wanted
                self.drop(self._idle.popleft())
                continue
            await self._wait_for_room()

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        self._opening += 1
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, connection = await loop.create_connection(
                    lambda: Connection(loop), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError as exc:
            raise EngineTimeout(
                f"{self._engine} at {self._base_url} did not accept a connection in time"
            ) from exc
        except OSError as exc:
            raise self._unreachable(exc) from exc
        finally:
            self._opening -= 1
            self._wake()
        if self._closed:
            connection.close()
            raise EngineUnavailable(f"the client of {self._engine} is closed")
        self._live.add(connection)
        return connection

    def drop(self, connection: Connection) -> None:
        connection.close()
        self._live.discard(connection)
        with contextlib.suppress(ValueError):
            self._idle.remove(connection)
        self._wake()

    async def _wait_for_room(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._wake()  # the room it was woken for goes to the next in line
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
