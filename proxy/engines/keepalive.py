"""A POST to an engine over a pooled keep-alive connection, sent again on another connection when the
engine had already closed the pooled one.

An engine closes an idle keep-alive connection after its own timeout (uvicorn's 5 s under SGLang and
vLLM). The client pool drops connections idle past a shorter timeout, but it counts from when this
process read the last answer: a busy event loop reads late, the pooled connection looks fresh, and
the write meets a socket the engine closed ("Can not write request body", "Server disconnected").
The engine never read such a request, so sending it again is safe; a refused connection is not
retried (nothing is listening).
"""

from __future__ import annotations

from typing import Any

import aiohttp
from yarl import URL

# Pooled connections that may all have gone stale at once: one more than a busy pool is likely to hold.
STALE_RETRIES = 3


async def post(session: aiohttp.ClientSession, url: str | URL, **kwargs: Any) -> aiohttp.ClientResponse:
    """session.post(url, **kwargs); the response is open, its body unread. Raises as aiohttp does."""
    for attempt in range(STALE_RETRIES + 1):
        try:
            return await session.post(url, **kwargs)
        except aiohttp.ClientConnectorError:
            raise  # a new connection failed: nothing listens there
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if attempt == STALE_RETRIES:
                raise
    raise AssertionError("unreachable")
