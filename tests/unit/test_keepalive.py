"""A pooled keep-alive connection the engine closed while this process was busy is not an engine
failure: the request is sent again on a new connection; a refused connection still fails at once."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import aiohttp
import pytest

from proxy.engines import keepalive

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@pytest.fixture
def closing_engine() -> Iterator[tuple[int, list[bytes]]]:
    """A server that answers one request per connection and closes it 50 ms later without saying
    so (no `Connection: close`), as an engine does when its keep-alive timeout passes."""
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += connection.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                while len(body) < length:
                    body += connection.recv(65536)
                served.append(body)
                connection.sendall(ANSWER)
                time.sleep(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], served
    listener.close()


def test_a_request_on_a_connection_the_engine_closed_is_sent_again(
    closing_engine: tuple[int, list[bytes]],
) -> None:
    port, served = closing_engine

    async def run() -> None:
        connector = aiohttp.TCPConnector(keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as session:
            for body in (b"{}", b'{"a":1}', b'{"b":22}'):
                response = await keepalive.post(session, f"http://127.0.0.1:{port}/generate", data=body)
                assert response.status == 200
                await response.read()
                # A busy event loop: the engine closes the pooled connection before the loop sees it.
                time.sleep(0.2)  # noqa: ASYNC251 (blocking the loop is the point)

    asyncio.run(run())
    assert served == [b"{}", b'{"a":1}', b'{"b":22}']  # each request reached the engine exactly once


def test_a_refused_connection_is_not_retried() -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await keepalive.post(session, "http://127.0.0.1:9/generate", data=b"{}")

    with pytest.raises(aiohttp.ClientConnectorError):
        asyncio.run(run())
