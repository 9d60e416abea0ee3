"""What the proxy does differently behind sglang-router (one URL, many SGLang workers).

Read in sgl-project/sglang (the router's Rust code, sgl-router/ renamed sgl-model-gateway/):

- Routing key. `sgl-model-gateway/src/policies/consistent_hashing.rs` (commit 11658624): "`X-SMG-Routing-Key`:
  Consistent hash routing for session affinity": the key is hashed onto a ring of worker URLs and
  walks clockwise to the first healthy worker, so one key stays on one worker while it is healthy
  (and only the keys of a lost worker move). The `manual` policy (`policies/manual.rs`) reads the
  same header for sticky sessions; other policies (cache_aware, round_robin...) ignore it. The
  proxy sends the session id as that header on every /generate: sticky under `--policy
  consistent_hashing` or `manual`, harmless otherwise.
- Abort. `sgl-model-gateway/src/server.rs` (commits 6e97cb58 and 04902695) routes /generate,
  /v1/..., /workers, /get_model_info... and has no /abort_request: it falls to `sink_handler`,
  a 404. A later gateway test (`abort_request_tests::test_abort_request_fans_out_to_all_workers_
  with_body`) has the gateway send /abort_request to every worker, "the rid may live on either
  worker". The proxy does the same where the router answers 404: it lists the workers (GET
  /workers: `{"workers": [{"url": ...}, ...]}`; the older Python router's GET /list_workers:
  `{"urls": [...]}`) and posts the abort to each. Rids are unique (uuid4 hex), so only the worker
  running the request acts; the others answer without effect, as SGLang does for an unknown rid.

How the proxy knows: at start (proxy/engines/detect.py) a URL whose GET /workers or /list_workers
lists workers is a router.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import orjson

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
_QUICK = aiohttp.ClientTimeout(total=5.0)


def routing_headers(affinity: str) -> dict[str, str]:
    return {ROUTING_KEY_HEADER: affinity}


def worker_urls(path: str, body: object) -> list[str] | None:
    """The worker URLs a router lists at `path` (/workers or /list_workers); None when it lists none."""
    if not isinstance(body, dict):
        return None
    if path == "/workers" and isinstance(body.get("workers"), list):
        urls = [w.get("url") for w in body["workers"] if isinstance(w, dict)]
    elif path == "/list_workers" and isinstance(body.get("urls"), list):
        urls = body["urls"]
    else:
        return None
    found = [url for url in urls if isinstance(url, str) and url]
    return found or None


async def list_workers(session: aiohttp.ClientSession, base_url: str) -> list[str]:
    for path in ("/workers", "/list_workers"):
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
            async with session.get(base_url + path, timeout=_QUICK) as response:
                if response.status == 200:
                    urls = worker_urls(path, orjson.loads(await response.read()))
                    if urls:
                        return urls
    return []


async def abort_on_workers(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any]) -> None:
    """Send one /abort_request to every worker the router lists (best effort, all at once)."""

    async def one(worker: str) -> None:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with session.post(
                worker.rstrip("/") + "/abort_request",
                data=orjson.dumps(body),
                headers={"content-type": "application/json"},
                timeout=_QUICK,
            ) as response:
                await response.read()

    await asyncio.gather(*(one(worker) for worker in await list_workers(session, base_url)))
