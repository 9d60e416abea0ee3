"""The JSON of an engine call: the request body written, a plain (unstreamed) answer parsed with its
failures named as engine errors, and an engine's refusal named as the proxy's error."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import (
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    ProxyError,
)

# How engines word a refusal for length. SGLang: "... longer than the model's context length",
# "... exceeds the maximum allowed length"; vLLM: "Input length (P) exceeds model's maximum context
# length (M)", "The decoder prompt (length P) ... is longer than the maximum model length of M".
_LENGTH_PHRASES = ("context length", "maximum allowed length", "maximum model length")


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


def refusal(status: int, message: str) -> ProxyError:
    """The error for an engine's refusal, the same whether it came as an HTTP status, a streamed
    abort carrying a status_code, or a streamed error event carrying a code."""
    if status == 400:
        if any(phrase in message for phrase in _LENGTH_PHRASES):
            return ContextLengthExceeded(f"the engine refused the length: {message}", param="messages")
        return InvalidRequest(f"the engine rejected the request: {message}", code="engine_rejected")
    if status == 503:
        return EngineUnavailable(f"the engine is not ready: {message}")
    return EngineError(f"the engine answered HTTP {status}: {message}")
