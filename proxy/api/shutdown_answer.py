"""ASGI middleware: a request the server cancels at shutdown gets a 503 in its dialect's envelope.

uvicorn cancels the requests still running once `--shutdown-grace-s` has passed; without this
layer, one whose answer had not begun got uvicorn's own plain-text 500. A turn cancelled there was
not answered, so the client may retry it (its retry identity finds the record if it was committed).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.dialects.anthropic_errors import error_body as anthropic_error_body
from proxy.dialects.anthropic_errors import is_anthropic_path
from proxy.errors import ShuttingDown
from proxy.observe import context

log = logging.getLogger("tito_proxy")

_MESSAGE = "tito-proxy is shutting down and stopped this request; retry it"


def _body(path: str) -> bytes:
    if is_anthropic_path(path):
        return orjson.dumps(anthropic_error_body(503, _MESSAGE, context.request_id.get()))
    return orjson.dumps(ShuttingDown(_MESSAGE).envelope())


class ShutdownAnswer:
    """Answers a request cancelled before its answer began; one cancelled later has its status
    line out already, and its stream ends as uvicorn ends it (a streamed turn's partial output is
    recorded as aborted by the turn core)."""

    def __init__(self, app: ASGIApp, retry_after_s: float) -> None:
        self.app = app
        # As every other 503's Retry-After (--retry-after-s), in whole seconds as HTTP writes them.
        self.retry_after = str(max(1, math.ceil(retry_after_s))).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if started:
                raise
            log.warning("%s %s cancelled at shutdown: answered 503", scope.get("method"), scope["path"])
            headers = [(b"content-type", b"application/json"), (b"retry-after", self.retry_after)]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": _body(scope["path"])})
            # The request is over, answered: the task ends here rather than as uvicorn's error.
