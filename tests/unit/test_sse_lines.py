"""Splitting the engine's event stream into lines, whatever the block boundaries and line lengths."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.engines.sglang import lines_of
from proxy.errors import EngineError


async def _blocks(body: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    start = 0
    for cut in sorted({c % (len(body) + 1) for c in cuts}):
        yield body[start:cut]
        start = cut
    yield body[start:]


def _split(body: bytes, cuts: list[int]) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [line async for line in lines_of(_blocks(body, cuts))]

    return asyncio.run(collect())


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20),
    trailing_newline=st.booleans(),
)
def test_lines_survive_any_block_boundaries(
    lines: list[bytes], cuts: list[int], trailing_newline: bool
) -> None:
    body = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    expected = body.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()  # a final newline ends the last line; it opens none
    assert _split(body, cuts) == expected


def test_a_line_past_aiohttps_own_limit_arrives_whole() -> None:
    long_line = b"data: " + b"[1, -0.5]," * 200_000  # about 2 MiB: a long cumulative chunk
    body = long_line + b"\n\ndata: [DONE]\n"
    cuts = list(range(0, len(body), 65_536))
    assert _split(body, cuts) == [long_line, b"", b"data: [DONE]"]


def test_a_line_without_end_past_the_bound_is_an_engine_error() -> None:
    async def endless() -> AsyncIterator[bytes]:
        block = b"x" * (1 << 20)
        for _ in range(80):
            yield block

    async def drain() -> None:
        async for _ in lines_of(endless()):
            pass

    with pytest.raises(EngineError, match="longer than"):
        asyncio.run(drain())
