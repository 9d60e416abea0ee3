"""An export's response sends every chunk in order, the last one with the end of the body (one socket
write fewer per export), and an empty export as an empty body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from proxy.api.export_stream import ExportStream


async def _chunks(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _messages(*chunks: bytes) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def run() -> None:
        await ExportStream(_chunks(*chunks), media_type="application/x-ndjson").stream_response(send)

    asyncio.run(run())
    return sent


def _body(messages: list[dict[str, Any]]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in messages if m["type"] == "http.response.body"]


def test_the_last_chunk_goes_out_with_the_end_of_the_body() -> None:
    messages = _messages(b"a", b"bb", b"ccc")
    assert messages[0]["type"] == "http.response.start"
    assert messages[0]["status"] == 200
    assert _body(messages) == [(b"a", True), (b"bb", True), (b"ccc", False)]


def test_empty_chunks_are_not_sent_and_an_empty_export_ends_its_body() -> None:
    assert _body(_messages(b"", b"x", b"")) == [(b"x", False)]
    assert _body(_messages()) == [(b"", False)]
