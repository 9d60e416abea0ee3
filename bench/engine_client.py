"""The engine client alone: CPU per /generate, plain or streamed, of aiohttp (the old hot path) and
of the lean HTTP/1.1 client (proxy/engines/http1.py), against one engine stand-in in another process.

The stand-in (an aiohttp server answering a canned SGLang answer) runs in its own process, so the
CPU read here (time.process_time of this process) is the client's alone: building and writing the
request, reading and parsing the HTTP answer, the pool, the event loop (uvloop, as the proxy serves
on). Rounds alternate between the two clients; the medians are the figures to read.

Run: .venv/bin/python -m bench.engine_client [--requests 4000] [--concurrency 32] [--rounds 5] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import uvloop
from aiohttp import web

from bench.harness import free_port, wait_healthy
from proxy.engines.http1 import EngineHTTP

PROMPT_TOKENS = 2000
OUTPUT_TOKENS = 40
HEADERS = {"content-type": "application/json"}


def _answer() -> bytes:
    ids = list(range(1000, 1000 + OUTPUT_TOKENS))
    return orjson.dumps(
        {
            "text": "x" * OUTPUT_TOKENS,
            "output_ids": ids,
            "meta_info": {
                "id": "0" * 32,
                "finish_reason": {"type": "stop", "matched": 151645},
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": OUTPUT_TOKENS,
                "cached_tokens": PROMPT_TOKENS - 1,
                "output_token_logprobs": [[-0.25, i, None] for i in ids],
                "weight_version": "default",
                "e2e_latency": 0.001,
            },
        }
    )


def engine_app() -> web.Application:
    body = _answer()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def generate_stream(request: web.Request) -> web.StreamResponse:
        """SGLang's stream: an SSE event per token (cumulative output in SGLang; one id each here)."""
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in _EVENTS:
            await response.write(event)
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_get("/health", health)
    return app


_EVENTS = [
    b"data: %s\n\n" % orjson.dumps({"output_ids": [1000 + n], "meta_info": {"completion_tokens": n + 1}})
    for n in range(OUTPUT_TOKENS)
] + [b"data: [DONE]\n\n"]


def _payload() -> bytes:
    return orjson.dumps({"input_ids": list(range(PROMPT_TOKENS)), "sampling_params": {}, "rid": "0" * 32})


async def _with_aiohttp(url: str, body: bytes, stream: bool) -> Callable[[], Awaitable[bytes]]:
    """The old path: a POST on an aiohttp session (the retry of a stale connection around it cost
    nothing when none is stale), then read and release."""
    connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=600.0)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout)
    _sessions.append(session)

    async def one() -> bytes:
        response = await session.post(url + "/generate", data=body, headers=HEADERS)
        try:
            return await response.read()
        finally:
            response.release()

    async def streamed() -> bytes:
        response = await session.post(url + "/generate_stream", data=body, headers=HEADERS)
        try:
            return b"".join([block async for block in response.content.iter_any()])
        finally:
            response.release()

    return streamed if stream else one


async def _with_lean(url: str, body: bytes, stream: bool) -> Callable[[], Awaitable[bytes]]:
    client = EngineHTTP(url, engine="the engine", timeout_s=600.0)
    _lean.append(client)

    async def one() -> bytes:
        return (await client.post("/generate", body, HEADERS)).body

    async def streamed() -> bytes:
        response = await client.open("/generate_stream", body, HEADERS)
        try:
            return b"".join([block async for block in response.blocks()])
        finally:
            response.release()

    return streamed if stream else one


_sessions: list[aiohttp.ClientSession] = []
_lean: list[EngineHTTP] = []


async def _cpu_per_request(one: Callable[[], Awaitable[bytes]], requests: int, concurrency: int) -> float:
    """Milliseconds of this process's CPU per request, `concurrency` requests in flight."""
    await asyncio.gather(*(one() for _ in range(concurrency)))  # warm the pool
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - start) * 1000 / requests


async def measure(
    url: str, requests: int, concurrency: int, rounds: int, stream: bool
) -> dict[str, list[float]]:
    body = _payload()
    clients = {"aiohttp": await _with_aiohttp(url, body, stream), "lean": await _with_lean(url, body, stream)}
    figures: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for _ in range(rounds):
            for name, one in clients.items():
                figures[name].append(await _cpu_per_request(one, requests, concurrency))
    finally:
        for session in _sessions:
            await session.close()
        for client in _lean:
            await client.aclose()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=("measure", "engine"), default="measure")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stream", action="store_true", help=f"streamed: {OUTPUT_TOKENS} SSE events each")
    args = parser.parse_args()
    if args.role == "engine":
        web.run_app(engine_app(), host="127.0.0.1", port=args.port, print=None, access_log=None)
        return
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "bench.engine_client", "engine", "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, engine)
        figures = uvloop.run(measure(url, args.requests, args.concurrency, args.rounds, args.stream))
    finally:
        engine.terminate()
        engine.wait()
    kind = "streamed" if args.stream else "plain"
    print(
        f"client CPU per {kind} /generate, ms ({args.requests} requests x {args.rounds} rounds, "
        f"{args.concurrency} in flight, {PROMPT_TOKENS}-token prompt):"
    )
    for name, values in figures.items():
        rounds = " ".join(f"{value:.4f}" for value in values)
        print(f"  {name:8s} median {statistics.median(values):.4f}  rounds {rounds}")
    ratio = statistics.median(figures["lean"]) / statistics.median(figures["aiohttp"])
    print(f"  lean / aiohttp: {ratio:.2f}")


if __name__ == "__main__":
    main()
