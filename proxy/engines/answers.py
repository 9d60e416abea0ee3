"""The JSON of an engine call: the request body written, a plain (unstreamed) answer parsed with its
failures named as engine errors."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import EngineError


def request_json(payload: dict[str, Any]) -> bytes:
    """A request's body; a 32k-token prompt array is written straight from numpy, without a Python
    list in between."""
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def json_answer(content: bytes, engine: str) -> Any:
    """The parsed body; `engine` names the engine in the error ("vLLM", "the engine")."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"{engine} answered with malformed JSON") from exc
