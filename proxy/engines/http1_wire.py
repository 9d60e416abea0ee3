"""One HTTP/1.1 keep-alive connection to an engine: writes a request, parses its answer with httptools
(llhttp) in the protocol's callbacks, whole or as a stream of body blocks."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import cast

import httptools

# A stream's unread body above which the engine's socket is not read (the consumer is behind).
_HIGH_WATER = 4 << 20
_LOW_WATER = 1 << 20


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer: its status and body (decoded from chunks where it was chunked); for a
    stream, the body is empty and arrives through the connection's blocks."""

    status: int
    body: bytes
    content_type: str = ""


class Stale(Exception):
    """The connection closed before any byte of its answer."""


class AnswerCut(Exception):
    """The connection closed or broke after its answer began, or the answer was not HTTP."""


class Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer into a future (whole, or just
    its head for a stream, whose body is then read with next_block)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = loop.create_future()  # set when the socket is gone
        self.answers = 0  # answers read whole: a connection with none is fresh
        self.idle_since = 0.0
        self.keep_alive = False
        self.complete = False  # the current answer was read to its end
        self._parser = httptools.HttpResponseParser(self)
        self._busy = False  # a request is in flight and its answer not read to its end
        self._streaming = False
        self._answer: asyncio.Future[Answer] | None = None
        self._chunks: list[bytes] = []
        self._content_type = b""
        self._received = False  # a byte of the current answer arrived
        self._framed = False  # the answer has a Content-Length or is chunked
        self._headers_done = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        # A stream's body: blocks not yet read, and how it ended if it did not end well.
        self._blocks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._failure: BaseException | None = None
        self._wakeup: asyncio.Future[None] | None = None

    def send(self, request: bytes, timeout_s: float, *, stream: bool = False) -> asyncio.Future[Answer]:
        """Write the request; the future holds its answer (its head for a stream), or Stale,
        AnswerCut, TimeoutError."""
        assert self.transport is not None
        self._answer = answer = self._loop.create_future()
        self._busy, self._streaming = True, stream
        self._chunks = []
        self._content_type = b""
        self._received = self._framed = self._headers_done = self.complete = False
        self._failure = None
        # What the last stream's reader left unread once it had what it wanted (its end arrived).
        self._blocks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        self._timeout = timeout_s
        self._last_read = now = self._loop.time()
        self._timer = self._loop.call_at(now + timeout_s, self._check_silence)
        self.transport.write(request)
        return answer

    async def next_block(self) -> bytes | None:
        """A stream's next body block as it arrives; None at its end. Raises AnswerCut, TimeoutError."""
        while True:
            if self._blocks:
                block = self._blocks.popleft()
                self._buffered -= len(block)
                if self._paused and self._buffered < _LOW_WATER and self.transport is not None:
                    self._paused = False
                    self._last_read = self._loop.time()
                    self.transport.resume_reading()
                return block
            if self._failure is not None:
                raise self._failure
            if self.complete:
                return None
            self._wakeup = self._loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None

    def usable(self, now: float, idle_s: float) -> bool:
        transport = self.transport
        return transport is not None and not transport.is_closing() and now - self.idle_since < idle_s

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # nothing is left to flush; an engine reads a reset as the client gone

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport (the loop the proxy serves on) is no asyncio.Transport subclass.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        self._received = True
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(AnswerCut(f"malformed HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._busy:
            if self._headers_done and not self._framed:  # a body delimited by the connection's end
                self.keep_alive = False
                self.on_message_complete()
            elif not self._received:
                self._fail(Stale(f"the connection closed before the answer: {exc or 'end of stream'}"))
            else:
                self._fail(AnswerCut(f"the connection closed mid-answer: {exc or 'end of stream'}"))
        if not self.closed.done():
            self.closed.set_result(None)

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True
        elif len(name) == 12 and name.lower() == b"content-type":
            self._content_type = value

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self.keep_alive = self._parser.should_keep_alive()
        if self._streaming:
            self._settle(Answer(self._parser.get_status_code(), b"", self._content_type.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        if not self._streaming:
            self._chunks.append(body)
            return
        self._blocks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.answers += 1
        self._busy = False
        self.complete = True
        self._stop_timer()
        if self._streaming:
            self._wake()
        else:
            body = b"".join(self._chunks)
            self._chunks = []
            self._settle(Answer(self._parser.get_status_code(), body, self._content_type.decode("latin-1")))

    # --- internals ---

    def _settle(self, outcome: Answer | BaseException) -> None:
        answer, self._answer = self._answer, None
        if answer is None or answer.done():
            return
        if isinstance(outcome, Answer):
            answer.set_result(outcome)
        else:
            answer.set_exception(outcome)

    def _fail(self, exc: BaseException) -> None:
        """The answer ends badly: its future fails, or a stream's reader sees exc next."""
        self._busy = False
        self._stop_timer()
        if self._answer is not None:
            self._settle(exc)
        elif self._streaming:
            self._failure = exc
            self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_silence(self) -> None:
        deadline = self._last_read + self._timeout
        if self._paused:  # the reader is slow, not the engine
            deadline = self._loop.time() + self._timeout
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check_silence)
            return
        self._timer = None
        self._fail(TimeoutError())
        self.close()
