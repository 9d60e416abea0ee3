"""An engine's plain (unstreamed) answer read whole as JSON, its failures named as engine errors."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from proxy.errors import EngineError, EngineTimeout, EngineUnavailable


async def json_body(response: aiohttp.ClientResponse, engine: str) -> Any:
    """The parsed body; `engine` names the engine in the errors ("vLLM", "the engine")."""
    try:
        content = await response.read()
    except TimeoutError as exc:
        raise EngineTimeout(f"{engine} did not answer in time") from exc
    except aiohttp.ClientError as exc:
        raise EngineUnavailable(f"{engine}'s answer was cut: {exc}") from exc
    finally:
        response.release()
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"{engine} answered with malformed JSON") from exc
