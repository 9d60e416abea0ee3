"""The turn's events as Anthropic server-sent events.

message_start, ping, then per block content_block_start / content_block_delta (thinking_delta and
a final signature_delta, text_delta, input_json_delta) / content_block_stop, then message_delta
(stop_reason, usage) and message_stop. The turn is committed before message_delta; a quiet stream
gets pings; a fault after the start is an `error` event.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson

from proxy.dialects.anthropic_errors import error_payload
from proxy.dialects.anthropic_output import MessageShape
from proxy.dialects.turn_events import Answer, Failed, Finished, Keepalive, TextDelta, ToolCallDelta


def _event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {orjson.dumps({'type': kind, **fields}).decode()}\n\n".encode()


# A streamed fault's kind in Anthropic's terms, from the type (and code) of the proxy's envelope.
_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "conflict_error": "invalid_request_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
}
_OVERLOADED = frozenset({"engine_unavailable", "database_unavailable", "record_failed"})


def _error_event(error: dict[str, Any]) -> bytes:
    """An `error` event from the proxy's envelope of a streamed fault."""
    kind = "overloaded_error" if error.get("code") in _OVERLOADED else "api_error"
    kind = _ERROR_TYPES.get(error.get("type", ""), kind)
    payload = error_payload(kind, error.get("message", ""), error.get("request_id"))
    return f"event: error\ndata: {orjson.dumps(payload).decode()}\n\n".encode()


class _Blocks:
    def __init__(self, shape: MessageShape) -> None:
        self.shape = shape
        self.index = -1
        self.open_kind: str | None = None
        self.text = ""

    def delta(self, kind: str, text: str) -> list[bytes]:
        events = []
        if self.open_kind != kind:
            events += self.close()
            self.index += 1
            self.open_kind, self.text = kind, ""
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {
                    "type": "text",
                    "text": "",
                }
            )
            events.append(_event("content_block_start", index=self.index, content_block=block))
        self.text += text
        if kind == "thinking" and self.shape.omit_thinking:
            return events  # only its signature goes out, at the block's end
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {
                "type": "text_delta",
                "text": text,
            }
        )
        events.append(_event("content_block_delta", index=self.index, delta=delta))
        return events

    def close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        events = []
        if self.open_kind == "thinking":
            signature = self.shape.seal(self.text)
            delta = {"type": "signature_delta", "signature": signature}
            events.append(_event("content_block_delta", index=self.index, delta=delta))
        events.append(_event("content_block_stop", index=self.index))
        self.open_kind = None
        return events

    def tool_use(self, call: ToolCallDelta) -> list[bytes]:
        events = self.close()
        self.index += 1
        block = {"type": "tool_use", "id": call.call_id, "name": call.name, "input": {}}
        events.append(_event("content_block_start", index=self.index, content_block=block))
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        events.append(_event("content_block_delta", index=self.index, delta=delta))
        events.append(_event("content_block_stop", index=self.index))
        return events


async def message_events(
    shape: MessageShape, answer: Answer, held: contextlib.AsyncExitStack
) -> AsyncIterator[bytes]:
    """The whole stream of one message; `held` (the retry lock) is released after the last event."""
    assert answer.events is not None
    blocks = _Blocks(shape)
    async with held, contextlib.aclosing(answer.events):
        yield _event("message_start", message=shape.start(answer.prompt_tokens))
        yield _event("ping")
        async for event in answer.events:
            if isinstance(event, Keepalive):
                yield _event("ping")
            elif isinstance(event, TextDelta):
                for kind, text in (("thinking", event.reasoning), ("text", event.content)):
                    if text:
                        for chunk in blocks.delta(kind, text):
                            yield chunk
            elif isinstance(event, ToolCallDelta):
                for chunk in blocks.tool_use(event):
                    yield chunk
            elif isinstance(event, Failed):
                yield _error_event(event.error)
                # No return: the core ends its stream by recording the partial turn as aborted.
            elif isinstance(event, Finished):
                for chunk in blocks.close():
                    yield chunk
                reason, sequence = shape.stop(event.result)
                yield _event(
                    "message_delta",
                    delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage={"output_tokens": event.result.completion_tokens},
                )
                yield _event("message_stop")
                return
