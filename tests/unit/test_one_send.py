"""A response's head goes out with its body in one write; bytes keep their order; nothing held is lost."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx

from proxy.api.one_send import HeadWithBody
from tests.support import serve


class _Recorder:
    """A transport that records each write call (a writelines is one call: one writev)."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        self.closed = self.aborted = False
        self.peer = ("127.0.0.1", 1)

    def write(self, data: bytes) -> None:
        self.calls.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.calls.append(b"".join(parts))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> Any:
        return self.peer if name == "peername" else None


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def _holder() -> tuple[HeadWithBody, _Recorder, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    recorder = _Recorder()
    return HeadWithBody(recorder, loop), recorder, loop  # type: ignore[arg-type]


def test_a_head_and_the_body_that_follows_it_are_one_write() -> None:
    holder, recorder, loop = _holder()
    try:
        holder.write(HEAD)
        assert recorder.calls == []
        assert holder.get_write_buffer_size() == len(HEAD)
        holder.write(b"{}")
        holder.write(b"more")  # not a head: straight through
        assert recorder.calls == [HEAD + b"{}", b"more"]
        loop.call_soon(loop.stop)
        loop.run_forever()  # the flush scheduled for the head finds nothing held
        assert recorder.calls == [HEAD + b"{}", b"more"]
    finally:
        loop.close()


def test_a_head_without_a_body_in_the_same_step_goes_out_on_the_next_pass() -> None:
    holder, recorder, loop = _holder()
    try:
        holder.write(HEAD)
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert recorder.calls == [HEAD]
        holder.write(b"data: 1\n\n")  # a stream's first event, later
        assert recorder.calls == [HEAD, b"data: 1\n\n"]
    finally:
        loop.close()


def test_closing_sends_what_is_held_first_and_an_abort_sends_nothing() -> None:
    holder, recorder, loop = _holder()
    try:
        holder.write(HEAD)
        holder.close()
        assert recorder.calls == [HEAD]
        assert recorder.closed
        other_recorder = _Recorder()
        other = HeadWithBody(other_recorder, loop)  # type: ignore[arg-type]
        other.write(HEAD)
        other.abort()
        assert other_recorder.calls == []
        assert other_recorder.aborted
        # Everything else is the transport's own.
        assert holder.get_extra_info("peername") == ("127.0.0.1", 1)
    finally:
        loop.close()


def test_writelines_and_write_eof_send_a_held_head_before_their_own_bytes() -> None:
    holder, recorder, loop = _holder()
    try:
        holder.write(HEAD)
        holder.writelines([b"a", b"b"])
        assert recorder.calls == [HEAD, b"ab"]
    finally:
        loop.close()


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/stream":
        for part in (b"one ", b"two"):
            await asyncio.sleep(0.01)  # the head goes out alone before the first part
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.body", "body": b"hello"})


def test_served_answers_plain_streamed_and_pipelined_keep_their_bytes() -> None:
    with serve(_ok) as url:
        with httpx.Client() as client:  # keep-alive: several answers on one connection
            for _ in range(3):
                assert client.get(f"{url}/").text == "hello"
                assert client.get(f"{url}/stream").text == "one two"
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:  # two requests sent at once
            raw.sendall(
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            received = b""
            while chunk := raw.recv(65536):
                received += chunk
        assert received.count(b"HTTP/1.1 200 OK") == 2
        assert received.count(b"hello") == 2
        assert received.index(b"hello") < received.rindex(b"HTTP/1.1 200 OK")
