"""The request body cap, as ASGI middleware in front of every route: a body past the limit is a 413
in OpenAI's envelope, refused from its Content-Length or, for a chunked body, as soon as the bytes
read pass the limit, so no route ever holds it."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy import native_memory
from proxy.dialects.anthropic_errors import error_body, is_anthropic_path
from proxy.errors import PayloadTooLarge
from proxy.observe.metrics import Metrics

_LARGE_BODY = 256 * 1024


class BodyLimit:
    """Reads the body before the app does and replays it in one piece (Starlette joins it anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Metrics | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_bytes:
            await self._refuse(scope, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, replaying(message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        del chunks
        await self.app(scope, replaying(whole, receive), send)
        if size >= _LARGE_BODY:
            # What the large body made the proxy allocate (and free) goes back to the OS; after the
            # answer is sent, and off the loop.
            await asyncio.to_thread(native_memory.trim)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        error = PayloadTooLarge(
            f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)", param=None
        )
        path = str(scope.get("path", ""))
        if self.metrics is not None:  # answered here, before any route: counted as the handlers count
            self.metrics.refused(path, error.status_code, error.code)
        envelope = error.envelope()
        if is_anthropic_path(path):
            envelope = error_body(error.status_code, error.message, envelope["error"].get("request_id"))
        body = orjson.dumps(envelope)
        await send(
            {
                "type": "http.response.start",
                "status": error.status_code,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),  # the rest of the body is never read
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # the server refuses a malformed length before we see it
    return 0


def replaying(first: Message, receive: Receive) -> Receive:
    """`receive` that answers `first` once, then the server's messages (a disconnect, for streams)."""
    pending: list[Message] = [first]

    async def replay() -> Any:
        if pending:
            return pending.pop()
        return await receive()

    return replay
