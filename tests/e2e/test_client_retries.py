"""Both trainer clients retry 429 and 503 answers, waiting what Retry-After says, a bounded number
of times; against a real HTTP server that answers busy first."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import orjson
import pytest
from fastapi import FastAPI, Request, Response

from proxy.client import AsyncTitoClient, RetryPolicy, TitoClient, TitoError
from proxy.client_protocol import retry_after_s
from tests.support import serve


@dataclass
class BusyServer:
    """Answers `busy` times with `status` and Retry-After, then as the proxy would."""

    busy: int
    status: int = 503
    retry_after: str | None = "1"
    seen: list[tuple[str, float]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def any_route(path: str, request: Request) -> Response:
            self.seen.append((f"{request.method} /{path}", time.monotonic()))
            if len(self.seen) <= self.busy:
                headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
                body = {"error": {"message": "busy", "type": "engine_error", "param": None, "code": None}}
                return Response(orjson.dumps(body), status_code=self.status, headers=headers)
            if path == "sessions":
                return Response(orjson.dumps({"id": "s1"}), status_code=201)
            if path == "export":
                rows = b"".join(orjson.dumps({"session_id": f"s{k}", "cursor": k}) + b"\n" for k in (1, 2))
                return Response(rows, media_type="application/x-ndjson")
            if path == "export/ack":
                return Response(orjson.dumps({"consumer": "t", "acked": 1}))
            return Response(orjson.dumps({"ok": True}))

        return app


@pytest.fixture
def busy() -> Iterator[tuple[BusyServer, str]]:
    server = BusyServer(busy=1)
    with serve(server.app()) as url:
        yield server, url


def _gaps(server: BusyServer) -> list[float]:
    times = [t for _, t in server.seen]
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.mark.parametrize("status", [503, 429])
def test_sync_client_waits_retry_after_then_succeeds(busy: tuple[BusyServer, str], status: int) -> None:
    server, url = busy
    server.status = status
    with TitoClient(url) as client:
        assert client.create_session() == "s1"
    assert [what for what, _ in server.seen] == ["POST /sessions", "POST /sessions"]
    assert _gaps(server)[0] >= 0.95  # Retry-After: 1


def test_async_client_waits_retry_after_then_succeeds(busy: tuple[BusyServer, str]) -> None:
    server, url = busy

    async def run() -> str:
        async with AsyncTitoClient(url) as client:
            return await client.create_session()

    assert asyncio.run(run()) == "s1"
    assert len(server.seen) == 2
    assert _gaps(server)[0] >= 0.95


def test_export_stream_is_retried_by_both_clients(busy: tuple[BusyServer, str]) -> None:
    server, url = busy
    with TitoClient(url) as client:
        assert [r["session_id"] for r in client.iter_samples()] == ["s1", "s2"]
    server.seen.clear()

    async def run() -> list[str]:
        async with AsyncTitoClient(url) as client:
            return [r["session_id"] async for r in client.iter_samples(consumer="t", ack=True)]

    assert asyncio.run(run()) == ["s1", "s2"]
    assert [what for what, _ in server.seen] == [
        "GET /export",
        "GET /export",
        "POST /export/ack",
        "POST /export/ack",
    ]


def test_attempts_are_bounded_and_the_error_is_raised() -> None:
    server = BusyServer(busy=100, retry_after="0")
    with serve(server.app()) as url:
        with TitoClient(url, retry=RetryPolicy(max_attempts=3)) as client, pytest.raises(TitoError) as caught:
            client.finish("s1")
        assert caught.value.status_code == 503
        assert len(server.seen) == 3

        async def run() -> None:
            async with AsyncTitoClient(url, retry=RetryPolicy(max_attempts=2)) as client:
                await client.finish("s1")

        with pytest.raises(TitoError):
            asyncio.run(run())
        assert len(server.seen) == 5


def test_without_retry_after_the_client_backs_off() -> None:
    server = BusyServer(busy=2, retry_after=None)
    with serve(server.app()) as url, TitoClient(url, retry=RetryPolicy(backoff_s=0.2)) as client:
        client.finish("s1")
    gaps = _gaps(server)
    assert gaps[0] >= 0.19
    assert gaps[1] >= 0.39


def test_retry_after_forms() -> None:
    assert retry_after_s("3") == 3.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_s("soon") is None
    assert retry_after_s(None) is None
