"""A lean HTTP/1.1 keep-alive client for an engine's plain answers: POST a JSON body, read the whole
answer, over a pool of asyncio connections to one engine URL.

Why not aiohttp here: a plain /generate is the hop every turn takes, and aiohttp's request machinery
(URL objects, header multidicts, a response object, a stream reader, timer contexts) cost ~11% of a
turn's CPU. This client writes the request in one buffer and lets httptools (llhttp) parse the answer
in the protocol's callbacks: one future per request, one timer. Streams and the rare calls (probes,
aborts, /v1/models) stay on aiohttp.

Rules kept from the aiohttp client (proxy/engines/keepalive.py):
- A pooled connection the engine closed while it sat idle (its keep-alive timeout, seen late by a
  busy loop) fails before any byte of the answer: the engine never read the request, so it is sent
  again, once, on a fresh connection. A fresh connection's failure is never retried, nor is an
  answer cut after its first byte (the engine may have sampled).
- A request cancelled mid-flight (the client left) closes its connection: the engine aborts the
  request, and a half-read connection never goes back to the pool.
- The timeout is on the wait for the engine's next bytes, not on the whole generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from proxy.errors import EngineTimeout, EngineUnavailable, InvalidRequest

# Below uvicorn's 5 s keep-alive (SGLang and vLLM serve with it): a pooled connection is not reused
# just as the engine closes it.
IDLE_S = 4.0
CONNECT_TIMEOUT_S = 10.0
POOL_LIMIT = 1024


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole HTTP answer: its status and body (the body decoded from chunks where it was chunked)."""

    status: int
    body: bytes


class _Stale(Exception):
    """The connection closed before any byte of its answer."""


class _Cut(Exception):
    """The connection closed or broke after its answer began, or the answer was not HTTP."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: answers one request at a time into a future."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = loop.create_future()  # set when the socket is gone
        self.answers = 0  # answers read whole: a connection with none is fresh
        self.idle_since = 0.0
        self.keep_alive = False
        self._parser = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[Answer] | None = None
        self._chunks: list[bytes] = []
        self._received = False  # a byte of the current answer arrived
        self._framed = False  # the answer has a Content-Length or is chunked
        self._headers_done = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0

    def usable(self, now: float) -> bool:
        transport = self.transport
        return transport is not None and not transport.is_closing() and now - self.idle_since < IDLE_S

    def send(self, request: bytes, timeout_s: float) -> asyncio.Future[Answer]:
        """Write the request; the future holds its answer, or _Stale, _Cut, TimeoutError."""
        assert self.transport is not None
        self._answer = answer = self._loop.create_future()
        self._chunks = []
        self._received = self._framed = self._headers_done = False
        self._timeout = timeout_s
        self._last_read = now = self._loop.time()
        self._timer = self._loop.call_at(now + timeout_s, self._check_silence)
        self.transport.write(request)
        return answer

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # nothing is left to flush; an engine reads a reset as the client gone

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport (the loop the proxy serves on) is no asyncio.Transport subclass.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._answer is None:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        self._received = True
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(_Cut(f"malformed HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._answer is not None:
            if self._headers_done and not self._framed:  # a body delimited by the connection's end
                self.keep_alive = False
                self._finish(Answer(self._parser.get_status_code(), b"".join(self._chunks)))
            elif not self._received:
                self._finish(_Stale(f"the connection closed before the answer: {exc or 'end of stream'}"))
            else:
                self._finish(_Cut(f"the connection closed mid-answer: {exc or 'end of stream'}"))
        if not self.closed.done():
            self.closed.set_result(None)

    # --- httptools callbacks ---

    def on_header(self, name: bytes, _value: bytes) -> None:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self.answers += 1
        self._finish(Answer(self._parser.get_status_code(), b"".join(self._chunks)))

    # --- internals ---

    def _finish(self, outcome: Answer | Exception) -> None:
        answer, self._answer = self._answer, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._chunks = []
        if answer is None or answer.done():
            return
        if isinstance(outcome, Answer):
            answer.set_result(outcome)
        else:
            answer.set_exception(outcome)

    def _check_silence(self) -> None:
        deadline = self._last_read + self._timeout
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check_silence)
            return
        self._timer = None
        self._finish(TimeoutError())
        self.close()


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
        self._idle: deque[_Connection] = deque()  # the most recently used last
        self._live: set[_Connection] = set()  # every connection open or being opened
        self._opening = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        """POST `body` to base URL + path; the whole answer, whatever its status."""
        request = self._request(path, body, headers)
        connection = await self._acquire(pooled=True)
        try:
            return await self._exchange(connection, request)
        except _Stale as exc:
            if connection.answers == 0:  # a fresh connection: the engine itself went away
                raise self._unreachable(exc) from exc
        connection = await self._acquire(pooled=False)
        try:
            return await self._exchange(connection, request)
        except _Stale as exc:
            raise self._unreachable(exc) from exc

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

    async def _exchange(self, connection: _Connection, request: bytes) -> Answer:
        answer = connection.send(request, self._timeout_s)
        try:
            result = await answer
        except BaseException as exc:
            self._discard(connection)  # cancelled, timed out or broken: never back to the pool
            if isinstance(exc, TimeoutError):
                raise EngineTimeout(f"{self._engine} did not answer in time") from exc
            if isinstance(exc, _Cut):
                raise EngineUnavailable(f"{self._engine}'s answer was cut: {exc}") from exc
            raise
        if connection.keep_alive and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
            self._wake()
        else:
            self._discard(connection)
        return result

    def _unreachable(self, exc: Exception) -> EngineUnavailable:
        return EngineUnavailable(f"cannot reach {self._engine} at {self._base_url}: {exc}")

    # --- the pool ---

    async def _acquire(self, *, pooled: bool) -> _Connection:
        """A pooled connection when `pooled` and one is usable, else a new one within the limit."""
        while True:
            if self._closed:
                raise EngineUnavailable(f"the client of {self._engine} is closed")
            if pooled:
                now = time.monotonic()
                while self._idle:
                    connection = self._idle.pop()
                    if connection.usable(now):
                        return connection
                    self._discard(connection)
            if len(self._live) + self._opening < self._limit:
                return await self._connect()
            if self._idle:  # full of idle connections while a fresh one is wanted
                self._discard(self._idle.popleft())
                continue
            await self._wait_for_room()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        self._opening += 1
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), self._host, self._port, ssl=self._ssl
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

    def _discard(self, connection: _Connection) -> None:
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
