"""A real HTTP server that stands in for sglang-router (sgl-model-gateway) in front of SGLang workers.

As read in sgl-project/sglang:
- `sgl-model-gateway/src/policies/consistent_hashing.rs` (commit 11658624): with `--policy
  consistent_hashing`, a request's `X-SMG-Routing-Key` header is hashed onto a ring of worker URLs
  (blake3) and goes to the first healthy worker clockwise: one key, one worker. Without the header
  (and without authorization / x-forwarded-for / cookie headers) a worker is picked at random.
  Here: sha256 of the key modulo the workers, the same stickiness; random without a key.
- `sgl-model-gateway/src/server.rs` (commits 6e97cb58, 04902695): /generate, /v1/models,
  /get_model_info (and /model_info), /health, /readiness, GET /workers (`{"workers": [{"url": ...,
  "is_healthy": ...}], "total": N}`) are routed; /abort_request is not, so it falls to the
  `sink_handler` fallback: 404. So does GET /ready.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ROUTING_KEY = "x-smg-routing-key"


@dataclass
class FakeRouter:
    workers: list[str]  # worker base URLs (FakeSGLang servers)
    routed: list[tuple[str | None, str]] = field(default_factory=list)  # (routing key, worker)
    _client: httpx.AsyncClient | None = None  # opened in the server's event loop

    def pick(self, key: str | None) -> str:
        if key is None:
            return random.choice(self.workers)
        digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
        return self.workers[digest % len(self.workers)]

    async def generate(self, request: Request) -> Response:
        key = request.headers.get(ROUTING_KEY)
        worker = self.pick(key)
        self.routed.append((key, worker))
        body = await request.body()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=60)
        client = self._client
        upstream = await client.send(
            client.build_request(
                "POST", f"{worker}/generate", content=body, headers={"content-type": "application/json"}
            ),
            stream=True,
        )

        async def relay() -> Any:
            try:
                async for block in upstream.aiter_raw():
                    yield block
            finally:
                await upstream.aclose()

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    async def _first_worker(self, path: str) -> Response:
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.get(f"{self.workers[0]}{path}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def models(self, _: Request) -> Response:
        return await self._first_worker("/v1/models")

    async def model_info(self, _: Request) -> Response:
        return await self._first_worker("/model_info")

    async def health(self, _: Request) -> Response:
        return Response("OK")

    async def list_workers(self, _: Request) -> JSONResponse:
        workers = [{"id": url, "url": url, "is_healthy": True, "load": 0} for url in self.workers]
        return JSONResponse({"workers": workers, "total": len(workers), "stats": {}})

    async def not_found(self, _: Request) -> Response:
        return Response(status_code=404)  # the gateway's sink_handler: an empty 404

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Starlette) -> AsyncIterator[None]:
        yield
        if self._client is not None:
            await self._client.aclose()

    def app(self) -> Starlette:
        return Starlette(
            lifespan=self._lifespan,
            routes=[
                Route("/generate", self.generate, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/get_model_info", self.model_info),
                Route("/model_info", self.model_info),
                Route("/health", self.health),
                Route("/readiness", self.health),
                Route("/workers", self.list_workers),
                Route("/abort_request", self.not_found, methods=["POST"]),
            ],
        )
