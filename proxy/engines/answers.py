"""An engine's plain (unstreamed) answer parsed as JSON, its failures named as engine errors."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import EngineError


def json_answer(content: bytes, engine: str) -> Any:
    """The parsed body; `engine` names the engine in the error ("vLLM", "the engine")."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"{engine} answered with malformed JSON") from exc
