"""uvicorn's HTTP protocol with each response's head sent together with its body: one send, not two.

uvicorn writes a response's status line and headers as soon as the app starts the response, then
each body part as it comes: a plain JSON answer costs two socket writes, each a system call that on
loopback also runs the receiving side's TCP work in this process. Here the head is held until the
next write on the connection (the answer's body, normally in the same step of the event loop) and
both go out in one write; a head whose body is not written in that step (a stream waiting for its
first event) goes out alone on the loop's next pass. Every write on the connection passes through the
same holder, so the bytes keep their order, and closing the connection sends what is held first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# How uvicorn's status lines start (h11 and httptools alike): what is held.
_HEAD = b"HTTP/1.1 "


class HeadWithBody:
    """A transport that holds a response head until the next write and sends both in one."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush_later: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._release()
            self._transport.writelines((held, data))  # one writev
        elif bytes(data[: len(_HEAD)]) == _HEAD:
            self._held = bytes(data)
            self._flush_later = self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def writelines(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        self.flush()
        self._transport.writelines(parts)

    def flush(self) -> None:
        """Send a held head now (on the loop's next pass, or before anything else happens)."""
        held = self._held
        if held is None:
            return
        self._release()
        if not self._transport.is_closing():
            self._transport.write(held)

    def _release(self) -> None:
        self._held = None
        if self._flush_later is not None:
            self._flush_later.cancel()
            self._flush_later = None

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._release()  # nothing is sent on an abort
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def __getattr__(self, name: str) -> Any:
        # Everything else (is_closing, get_extra_info, pause_reading, set_protocol, ...) is the
        # transport's own.
        return getattr(self._transport, name)


class OneSendHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, writing through HeadWithBody (`uvicorn.run(..., http=...)`)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport is no asyncio.Transport subclass, but has its methods.
        holder = HeadWithBody(cast(asyncio.Transport, transport), self.loop)
        super().connection_made(cast(asyncio.Transport, holder))  # it answers what uvicorn asks of one
