"""The lean engine client (proxy/engines/http1.py) against real local HTTP servers: framings, keep-alive
reuse, the one resend after a stale pooled connection, cut answers, cancellation, timeouts, the pool
limit and a clean close."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

from proxy.engines import http1
from proxy.engines.http1 import AnswerCut, EngineHTTP
from proxy.errors import EngineTimeout, EngineUnavailable, InvalidRequest

JSON = {"content-type": "application/json"}


def answer(body: bytes = b"{}", status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status.encode(),
        len(body),
        extra,
        body,
    )


@contextlib.asynccontextmanager
async def _client(base_url: str, **options: Any) -> AsyncIterator[EngineHTTP]:
    """A client closed however the test ends."""
    client = EngineHTTP(base_url, **options)
    try:
        yield client
    finally:
        await client.aclose()


class Server:
    """A TCP server whose every connection runs `handler(server, connection)` on its own thread."""

    def __init__(self, handler: Callable[[Server, socket.socket], None]) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.requests: list[bytes] = []  # the body of each request read, in order
        self.heads: list[bytes] = []
        self.connections: list[socket.socket] = []
        self.closed_by_client = threading.Event()
        self.received = threading.Event()  # a request was read whole
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections.append(connection)
            threading.Thread(target=self._run, args=(connection,), daemon=True).start()

    def _run(self, connection: socket.socket) -> None:
        with connection, _quiet():
            self.handler(self, connection)

    def read_request(self, connection: socket.socket) -> bytes | None:
        """The next request's body; None when the client closed the connection."""
        data = b""
        while b"\r\n\r\n" not in data:
            try:
                chunk = connection.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed_by_client.set()
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        while len(body) < length:
            body += connection.recv(65536)
        with self.lock:
            self.heads.append(head)
            self.requests.append(body)
        self.received.set()
        return body

    def wait_for_close(self, connection: socket.socket) -> None:
        """Block until the client closes (or resets) the connection."""
        connection.settimeout(5.0)
        try:
            data = connection.recv(1)
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed_by_client.set()

    def close(self) -> None:
        self.listener.close()
        for connection in self.connections:
            with _quiet():
                connection.shutdown(socket.SHUT_RDWR)


class _quiet:
    """Ignore the socket errors of a connection the client dropped."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[Server, socket.socket], None]], Server]]:
    servers: list[Server] = []

    def start(handler: Callable[[Server, socket.socket], None]) -> Server:
        servers.append(Server(handler))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


Runner = Callable[[Callable[[], Coroutine[Any, Any, Any]]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Runs a coroutine function on asyncio's own loop, or on uvloop's (the loop the proxy serves on)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def run_main(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main())

    return run_main


def keep_alive(server: Server, connection: socket.socket) -> None:
    """Echo each request's body, keeping the connection open."""
    while (body := server.read_request(connection)) is not None:
        connection.sendall(answer(body))


def test_keep_alive_answers_reuse_one_connection(serve: Callable[..., Server], run: Runner) -> None:
    server = serve(keep_alive)

    async def main() -> list[bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            return [(await client.post("/generate", b'{"n":%d}' % n, JSON)).body for n in range(3)]

    assert run(main) == [b'{"n":0}', b'{"n":1}', b'{"n":2}']
    assert len(server.connections) == 1
    assert server.heads[0].startswith(b"POST /generate HTTP/1.1\r\n")
    assert b"content-type: application/json" in server.heads[0]


def test_a_chunked_answer_is_read_whole(serve: Callable[..., Server], run: Runner) -> None:
    def chunked(server: Server, connection: socket.socket) -> None:
        while server.read_request(connection) is not None:
            connection.sendall(b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{"a":\r\n')
            time.sleep(0.02)
            connection.sendall(b"3\r\n12}\r\n0\r\n\r\n")

    server = serve(chunked)

    async def main() -> list[bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            return [(await client.post("/generate", b"{}", JSON)).body for _ in range(2)]

    assert run(main) == [b'{"a":12}', b'{"a":12}']
    assert len(server.connections) == 1


def test_an_answer_ended_by_the_connection_closing_is_read_whole_and_not_pooled(
    serve: Callable[..., Server],
    run: Runner,
) -> None:
    def until_close(server: Server, connection: socket.socket) -> None:
        server.read_request(connection)
        connection.sendall(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n[1,2,3]")

    server = serve(until_close)

    async def main() -> list[bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            return [(await client.post("/generate", b"{}", JSON)).body for _ in range(2)]

    assert run(main) == [b"[1,2,3]", b"[1,2,3]"]
    assert len(server.connections) == 2


def test_an_error_status_is_an_answer_with_its_body(serve: Callable[..., Server], run: Runner) -> None:
    def refusing(server: Server, connection: socket.socket) -> None:
        while server.read_request(connection) is not None:
            connection.sendall(answer(b'{"error":"context length"}', "400 Bad Request"))

    server = serve(refusing)

    async def main() -> tuple[int, bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            got = await client.post("/generate", b"{}", JSON)
            return got.status, got.body

    assert run(main) == (400, b'{"error":"context length"}')


def test_extra_headers_reach_the_engine_and_a_line_break_in_one_is_refused(
    serve: Callable[..., Server],
    run: Runner,
) -> None:
    server = serve(keep_alive)

    async def main() -> None:
        async with _client(server.url + "/prefix/", engine="the engine", timeout_s=5.0) as client:
            await client.post("/generate", b"{}", {**JSON, "X-SMG-Routing-Key": "session-1"})
            with pytest.raises(InvalidRequest):
                await client.post("/generate", b"{}", {"X-SMG-Routing-Key": "a\r\nX-Evil: 1"})

    run(main)
    assert len(server.heads) == 1
    assert server.heads[0].startswith(b"POST /prefix/generate HTTP/1.1\r\n")
    assert b"\r\nX-SMG-Routing-Key: session-1" in server.heads[0]


def test_a_pooled_connection_the_engine_closed_while_idle_is_sent_again_once(
    serve: Callable[..., Server],
    run: Runner,
) -> None:
    def closing(server: Server, connection: socket.socket) -> None:
        body = server.read_request(connection)
        connection.sendall(answer(body or b""))
        time.sleep(0.05)  # then close without saying so, as an engine's keep-alive timeout does

    server = serve(closing)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            for body in (b"{}", b'{"a":1}', b'{"b":22}'):
                assert (await client.post("/generate", body, JSON)).body == body
                # A busy event loop: the engine closes the pooled connection before the loop sees it.
                time.sleep(0.2)  # noqa: ASYNC251 (blocking the loop is the point)

    run(main)
    assert server.requests == [b"{}", b'{"a":1}', b'{"b":22}']  # each reached the engine exactly once
    assert len(server.connections) == 3  # the second and third each found theirs stale, then a new one


def test_a_fresh_connection_closed_before_the_answer_is_not_retried(
    serve: Callable[..., Server], run: Runner
) -> None:
    def dying(server: Server, connection: socket.socket) -> None:
        server.read_request(connection)  # read, then go away without answering (a crash)

    server = serve(dying)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            with pytest.raises(EngineUnavailable, match="cannot reach the engine"):
                await client.post("/generate", b"{}", JSON)

    run(main)
    assert server.requests == [b"{}"]


def test_an_answer_cut_after_its_first_byte_is_an_error_and_not_resent(
    serve: Callable[..., Server], run: Runner
) -> None:
    def cutting(server: Server, connection: socket.socket) -> None:
        server.read_request(connection)
        connection.sendall(answer(b'{"n":1}'))
        server.read_request(connection)  # the second request, on the pooled connection
        connection.sendall(answer(b'{"output_ids": [1, 2, 3]}')[:60])

    server = serve(cutting)

    async def main() -> None:
        async with _client(server.url, engine="vLLM", timeout_s=5.0) as client:
            await client.post("/generate", b"1", JSON)
            with pytest.raises(EngineUnavailable, match="vLLM's answer was cut"):
                await client.post("/generate", b"2", JSON)

    run(main)
    assert server.requests == [b"1", b"2"]
    assert len(server.connections) == 1


def test_a_malformed_answer_is_an_error(serve: Callable[..., Server], run: Runner) -> None:
    def garbage(server: Server, connection: socket.socket) -> None:
        server.read_request(connection)
        connection.sendall(b"SPDY/9 nonsense\r\n\r\n")
        server.wait_for_close(connection)

    server = serve(garbage)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            with pytest.raises(EngineUnavailable, match="malformed HTTP answer"):
                await client.post("/generate", b"{}", JSON)

    run(main)
    assert server.closed_by_client.wait(5.0)


def test_a_cancelled_request_closes_its_connection_and_the_next_opens_a_new_one(
    serve: Callable[..., Server],
    run: Runner,
) -> None:
    def slow_first(server: Server, connection: socket.socket) -> None:
        if len(server.connections) == 1:
            server.read_request(connection)
            server.wait_for_close(connection)  # a long generation: the client leaves first
        else:
            keep_alive(server, connection)

    server = serve(slow_first)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            task = asyncio.create_task(client.post("/generate", b"first", JSON))
            assert await asyncio.to_thread(server.received.wait, 5.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(server.closed_by_client.wait, 5.0)  # the engine sees it leave
            assert (await client.post("/generate", b"second", JSON)).body == b"second"

    run(main)
    assert len(server.connections) == 2


def test_silence_past_the_timeout_is_an_engine_timeout_but_a_slow_steady_answer_is_not(
    serve: Callable[..., Server],
    run: Runner,
) -> None:
    def trickling(server: Server, connection: socket.socket) -> None:
        body = server.read_request(connection)
        if body == b"silent":
            server.wait_for_close(connection)
            return
        whole = answer(b'{"ok": true}')
        for index in range(len(whole)):  # 0.6 s in all, never 0.3 s without a byte
            connection.sendall(whole[index : index + 1])
            time.sleep(0.6 / len(whole))

    server = serve(trickling)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=0.3) as client:
            assert (await client.post("/generate", b"steady", JSON)).body == b'{"ok": true}'
            with pytest.raises(EngineTimeout, match="did not answer in time"):
                await client.post("/generate", b"silent", JSON)

    run(main)
    assert server.closed_by_client.wait(5.0)  # the timed-out connection was dropped


def test_a_refused_connection_is_engine_unavailable_at_once(run: Runner) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now

    async def main() -> None:
        async with _client(f"http://127.0.0.1:{port}", engine="the engine", timeout_s=5.0) as client:
            with pytest.raises(EngineUnavailable, match="cannot reach the engine"):
                await client.post("/generate", b"{}", JSON)

    run(main)


def test_the_pool_limit_bounds_the_connections_and_every_request_is_answered(
    serve: Callable[..., Server],
    run: Runner,
) -> None:
    def slow(server: Server, connection: socket.socket) -> None:
        while (body := server.read_request(connection)) is not None:
            time.sleep(0.05)
            connection.sendall(answer(body))

    server = serve(slow)

    async def main() -> list[bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0, limit=2) as client:
            answers = await asyncio.gather(*(client.post("/generate", b"%d" % n, JSON) for n in range(6)))
            return [got.body for got in answers]

    assert run(main) == [b"%d" % n for n in range(6)]
    assert len(server.connections) == 2


def test_closing_with_requests_in_flight_and_idle_connections_leaves_no_open_socket(
    serve: Callable[..., Server],
    run: Runner,
) -> None:
    def mixed(server: Server, connection: socket.socket) -> None:
        while (body := server.read_request(connection)) is not None:
            if body == b"hang":
                server.wait_for_close(connection)
                return
            connection.sendall(answer(body))

    server = serve(mixed)

    async def main() -> None:
        client = EngineHTTP(server.url, engine="the engine", timeout_s=5.0)
        await asyncio.gather(*(client.post("/generate", b"idle", JSON) for _ in range(3)))
        hanging = asyncio.create_task(client.post("/generate", b"hang", JSON))
        while b"hang" not in server.requests:
            server.received.clear()
            await asyncio.to_thread(server.received.wait, 1.0)
        await client.aclose()
        with pytest.raises(EngineUnavailable):
            await hanging
        with pytest.raises(EngineUnavailable, match="closed"):
            await client.post("/generate", b"after", JSON)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(main)
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert server.closed_by_client.wait(5.0)


def sse(server: Server, connection: socket.socket) -> None:
    """Stream three events in chunks, then end; "hang" streams one event and goes silent, "cut" one
    event and closes the connection mid-body."""
    while (body := server.read_request(connection)) is not None:
        connection.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
        for event in events[: 1 if body in (b"hang", b"cut") else 3]:
            connection.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            time.sleep(0.01)
        if body == b"hang":
            server.wait_for_close(connection)
            return
        if body == b"cut":
            return
        connection.sendall(b"0\r\n\r\n")


def test_a_stream_read_to_its_end_gives_its_connection_back(
    serve: Callable[..., Server], run: Runner
) -> None:
    server = serve(sse)

    async def main() -> list[bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            read = []
            for _ in range(2):
                stream = await client.open("/generate", b"{}", JSON)
                assert (stream.status, stream.content_type) == (200, "text/event-stream")
                read.append(b"".join([block async for block in stream.blocks()]))
                stream.release()
            return read

    assert run(main) == [b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"] * 2
    assert len(server.connections) == 1


def test_a_stream_left_unfinished_closes_its_connection(serve: Callable[..., Server], run: Runner) -> None:
    server = serve(sse)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            stream = await client.open("/generate", b"hang", JSON)
            assert await anext(stream.blocks()) == b"data: 1\n\n"
            stream.release()  # not read to its end: the engine must see the client leave
            assert await asyncio.to_thread(server.closed_by_client.wait, 5.0)
            stream = await client.open("/generate", b"{}", JSON)
            assert await stream.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            stream.release()

    run(main)
    assert len(server.connections) == 2


def test_a_stream_cut_or_silent_mid_body_raises_to_its_reader(
    serve: Callable[..., Server], run: Runner
) -> None:
    server = serve(sse)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=0.3) as client:
            for body, error in ((b"cut", AnswerCut), (b"hang", TimeoutError)):
                stream = await client.open("/generate", body, JSON)
                blocks = stream.blocks()
                assert await anext(blocks) == b"data: 1\n\n"
                with pytest.raises(error):
                    await anext(blocks)
                stream.close()

    run(main)
    assert server.closed_by_client.wait(5.0)


def test_a_stream_answered_with_an_error_status_reads_its_body(
    serve: Callable[..., Server], run: Runner
) -> None:
    def refusing(server: Server, connection: socket.socket) -> None:
        while server.read_request(connection) is not None:
            connection.sendall(answer(b'{"error":"no"}', "503 Service Unavailable"))

    server = serve(refusing)

    async def main() -> tuple[int, bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            stream = await client.open("/generate", b"{}", JSON)
            try:
                return stream.status, await stream.read()
            finally:
                stream.release()

    assert run(main) == (503, b'{"error":"no"}')


def test_a_slow_reader_of_a_large_stream_is_not_timed_out_and_reads_it_whole(
    serve: Callable[..., Server], run: Runner
) -> None:
    block = b"x" * 65536

    def large(server: Server, connection: socket.socket) -> None:
        server.read_request(connection)
        connection.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for _ in range(160):  # 10 MiB: past the point where the client stops reading the socket
            connection.sendall(b"%x\r\n%s\r\n" % (len(block), block))
        connection.sendall(b"0\r\n\r\n")

    server = serve(large)

    async def main() -> int:
        async with _client(server.url, engine="the engine", timeout_s=0.3) as client:
            stream = await client.open("/generate", b"{}", JSON)
            await asyncio.sleep(1.0)  # the reader is behind: the engine waits, nobody times out
            size = len(await stream.read())
            stream.release()
            return size

    assert run(main) == 160 * len(block)


def test_what_a_stream_reader_left_unread_never_reaches_the_next_stream(
    serve: Callable[..., Server], run: Runner
) -> None:
    server = serve(sse)

    async def main() -> list[bytes]:
        async with _client(server.url, engine="the engine", timeout_s=5.0) as client:
            stream = await client.open("/generate", b"{}", JSON)
            first = await anext(stream.blocks())  # what the reader wanted (a finish reason, say)
            await asyncio.sleep(0.2)  # the rest of the answer arrives unread
            stream.release()
            stream = await client.open("/generate", b"{}", JSON)
            second = await stream.read()
            stream.release()
            return [first, second]

    assert run(main) == [b"data: 1\n\n", b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"]
    assert len(server.connections) == 1  # the first answer had ended: its connection was reused


def test_a_stream_dropped_unreleased_gives_up_its_connection(
    serve: Callable[..., Server], run: Runner
) -> None:
    server = serve(sse)

    async def main() -> None:
        async with _client(server.url, engine="the engine", timeout_s=5.0, limit=1) as client:
            await client.open("/generate", b"hang", JSON)  # dropped: never read, never released
            gc.collect()
            await asyncio.sleep(0)
            assert await asyncio.to_thread(server.closed_by_client.wait, 5.0)
            async with asyncio.timeout(5.0):  # the only slot of the pool is free again
                stream = await client.open("/generate", b"{}", JSON)
            await stream.read()
            stream.release()

    run(main)


def test_a_connection_the_engine_never_accepts_is_an_engine_timeout(
    monkeypatch: pytest.MonkeyPatch, run: Runner
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    # The accept queue full (never accepted): further handshakes get no answer.
    fillers = [socket.create_connection(("127.0.0.1", port), timeout=1.0)]
    monkeypatch.setattr(http1, "CONNECT_TIMEOUT_S", 0.3)

    async def main() -> None:
        async with _client(f"http://127.0.0.1:{port}", engine="the engine", timeout_s=5.0) as client:
            with pytest.raises(EngineTimeout, match="did not accept a connection in time"):
                await client.post("/generate", b"{}", JSON)

    try:
        run(main)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
