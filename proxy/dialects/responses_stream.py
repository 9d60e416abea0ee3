"""The turn's events as Responses API server-sent events, numbered by `sequence_number`.

response.created, response.in_progress; per output item: output_item.added, content_part.added,
the deltas (reasoning_text / output_text / function_call_arguments), their .done events,
output_item.done; then response.completed (or response.incomplete when max_output_tokens cut the
turn). The turn is committed before response.completed; a fault after the start is an `error`
event followed by response.failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson

from proxy.dialects.responses_output import ResponseShape, output_text, responses_param, status_of
from proxy.dialects.turn_events import (
    Answer,
    Failed,
    Finished,
    Keepalive,
    TextDelta,
    ToolCallDelta,
)


class _Writer:
    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items done so far
        self.open_kind: str | None = None  # "reasoning" or "message"
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {orjson.dumps(payload).decode()}\n\n".encode()

    def _item_fields(self) -> dict[str, Any]:
        return {"item_id": self._open_id(), "output_index": len(self.output)}

    def _open_id(self) -> str:
        return self.shape.reasoning_id() if self.open_kind == "reasoning" else self.shape.message_id()

    def _open(self, kind: str) -> list[bytes]:
        events = self.close()
        self.open_kind, self.text = kind, ""
        item = (
            self.shape.reasoning_item("", status="in_progress")
            if kind == "reasoning"
            else self.shape.message_item("", status="in_progress")
        )
        events.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("")
        events.append(
            self.event("response.content_part.added", **self._item_fields(), content_index=0, part=part)
        )
        return events

    def text_delta(self, kind: str, delta: str) -> list[bytes]:
        events = self._open(kind) if self.open_kind != kind else []
        self.text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, **self._item_fields(), content_index=0, delta=delta, **extra))
        return events

    def open_item(self, status: str) -> dict[str, Any]:
        if self.open_kind == "reasoning":
            return self.shape.reasoning_item(self.text, status)
        return self.shape.message_item(self.text, status)

    def produced(self) -> list[dict[str, Any]]:
        """The items so far, the open one as cut (`incomplete`): what a failed response carries."""
        return self.output if self.open_kind is None else [*self.output, self.open_item("incomplete")]

    def close(self, status: str = "completed") -> list[bytes]:
        """Finish the open reasoning or message item (`incomplete` when max_output_tokens cut it)."""
        if self.open_kind is None:
            return []
        fields = {**self._item_fields(), "content_index": 0}
        item = self.open_item(status)
        if self.open_kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": self.text}
            events = [self.event("response.reasoning_text.done", **fields, text=self.text)]
        else:
            part = output_text(self.text)
            events = [self.event("response.output_text.done", **fields, text=self.text, logprobs=[])]
        events.append(self.event("response.content_part.done", **fields, part=part))
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.open_kind = None
        return events

    def missing_message(self, final: list[dict[str, Any]], status: str) -> list[bytes]:
        """The empty message item of a turn that sampled no text and no call (the final output holds
        one, so that the echoed turn continues its segment): its events, without a delta."""
        if any(item["type"] == "message" for item in self.output) or not any(
            item["type"] == "message" for item in final
        ):
            return []
        return [*self._open("message"), *self.close(status)]

    def call(self, call: ToolCallDelta) -> list[bytes]:
        events = self.close()
        index = len(self.output)
        added = self.shape.call_item(call.index, call.call_id, call.name, "", status="in_progress")
        done = self.shape.call_item(call.index, call.call_id, call.name, call.arguments)
        fields = {"item_id": done["id"], "output_index": index}
        events.append(self.event("response.output_item.added", output_index=index, item=added))
        events.append(self.event("response.function_call_arguments.delta", **fields, delta=call.arguments))
        events.append(
            self.event(
                "response.function_call_arguments.done", **fields, arguments=call.arguments, name=done["name"]
            )
        )
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        return events


async def response_events(
    shape: ResponseShape, answer: Answer, held: contextlib.AsyncExitStack
) -> AsyncIterator[bytes]:
    """The whole stream of one response; `held` (the retry lock) is released after the last event."""
    assert answer.events is not None
    writer = _Writer(shape)
    async with held, contextlib.aclosing(answer.events):
        started = shape.response("in_progress", [])
        yield writer.event("response.created", response=started)
        yield writer.event("response.in_progress", response=started)
        async for event in answer.events:
            if isinstance(event, Keepalive):
                yield b": keepalive\n\n"
            elif isinstance(event, TextDelta):
                for kind, delta in (("reasoning", event.reasoning), ("message", event.content)):
                    if delta:
                        for chunk in writer.text_delta(kind, delta):
                            yield chunk
            elif isinstance(event, ToolCallDelta):
                for chunk in writer.call(event):
                    yield chunk
            elif isinstance(event, Failed):
                error = event.error
                yield writer.event(
                    "error",
                    code=error.get("code"),
                    message=error.get("message"),
                    param=responses_param(error.get("param")),
                    request_id=error.get("request_id"),
                )
                failed = shape.response(
                    "failed",
                    writer.produced(),
                    error={"code": error.get("code") or "server_error", "message": error.get("message")},
                )
                yield writer.event("response.failed", response=failed)
                # No return: the core ends its stream by recording the partial turn as aborted.
            elif isinstance(event, Finished):
                result = event.result
                status = status_of(result)
                for chunk in writer.close(status):
                    yield chunk
                # The items as recorded: the final parse decides, the streamed pieces only preview it.
                output = shape.output(result)
                for chunk in writer.missing_message(output, status):
                    yield chunk
                final = shape.response(status, output, shape.usage(result))
                yield writer.event(f"response.{status}", response=final)
                return
