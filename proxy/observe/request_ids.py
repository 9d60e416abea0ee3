"""ASGI middleware: accept or generate `x-request-id`, return it, and expose it to logs and errors."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.ids import random_hex
from proxy.observe import context

HEADER = b"x-request-id"
MAX_LENGTH = 128
# Printable ASCII without spaces: the id goes verbatim into headers and log lines.
_VALID = re.compile(rf"^[\x21-\x7e]{{1,{MAX_LENGTH}}}$")
_SESSION_PATH = re.compile(r"^/(?:sessions|ui/api/sessions)/([^/]+)")


def accepted_id(presented: bytes | None) -> str:
    """The client's id when it is a sane token, else a fresh one (a bad id is replaced, not refused:
    a tracing header must never fail a turn)."""
    if presented is not None:
        text = presented.decode("latin-1")
        if _VALID.match(text):
            return text
    return random_hex()


def session_of(path: str, headers: dict[bytes, bytes]) -> str | None:
    found = _SESSION_PATH.match(path)
    if found:
        return found.group(1)[:MAX_LENGTH]
    header = headers.get(b"x-session-id")
    return header.decode("latin-1")[:MAX_LENGTH] if header else None


class RequestIdMiddleware:
    """Outermost layer, so that every answer carries the id, even a 500 answered by Starlette or a
    413 from the body cap. `also_named`: the other header a path's clients read the id from, if any
    (Anthropic's SDKs read `request-id`)."""

    def __init__(self, app: ASGIApp, also_named: Callable[[str], bytes | None] = lambda _: None) -> None:
        self.app = app
        self.also_named = also_named

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        rid = accepted_id(headers.get(HEADER))
        context.request_id.set(rid)
        context.session_id.set(session_of(scope["path"], headers))
        context.calls_recorded.set(False)
        raw = rid.encode()
        names = (HEADER,) if (other := self.also_named(scope["path"])) is None else (HEADER, other)

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *(h for h in message.get("headers", []) if h[0].lower() not in names),
                    *((name, raw) for name in names),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)
