"""A turn's result as a Responses API `Response`: output items, status and usage.

Items come in the order the model produced them: reasoning (the sampled reasoning text, sealed in
`encrypted_content` when the client asked for it), the assistant message, then function calls.
Item ids derive from the response id, so a plain answer and its stream name items alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.chat.reasoning_tokens import ReasoningTokens
from proxy.dialects.seals import Sealer
from proxy.turns import TurnResult

# The turn core names request fields as chat does; a Responses client sent these under other names.
RESPONSES_FIELD_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def responses_param(param: str | None) -> str | None:
    """An error's `param` as the Responses request names that field."""
    return RESPONSES_FIELD_NAMES.get(param, param) if param is not None else None


@dataclass(frozen=True)
class ResponseShape:
    """What every Response of one request shares."""

    response_id: str
    body: dict[str, Any]  # the request, without input: echoed fields come from here
    model: str
    created_at: int
    sealer: Sealer | None  # set when the client included reasoning.encrypted_content
    reasoning_tokens: ReasoningTokens | None = None  # how many sampled tokens are reasoning

    @property
    def _suffix(self) -> str:
        return self.response_id.removeprefix("resp_")[:32]

    def reasoning_id(self) -> str:
        return f"rs_{self._suffix}"

    def message_id(self) -> str:
        return f"msg_{self._suffix}"

    def call_item_id(self, index: int) -> str:
        return f"fc_{self._suffix}_{index}"

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        # An item still in progress shows no text yet; a finished or cut one shows what was sampled.
        written = status != "in_progress"
        item: dict[str, Any] = {
            "id": self.reasoning_id(),
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if written else [],
            "status": status,
        }
        if self.sealer is not None and written:
            item["encrypted_content"] = self.sealer.envelope(text)
        return item

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "id": self.message_id(),
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [output_text(text)] if status != "in_progress" else [],
        }

    def call_item(
        self, index: int, call_id: str, name: str, arguments: str, status: str = "completed"
    ) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": self.call_item_id(index),
            "type": "function_call",
            "status": status,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
        }
        namespace, dot, short = name.partition(".")
        if dot and self._namespaced(namespace):
            item["namespace"], item["name"] = namespace, short
        return item

    def _namespaced(self, namespace: str) -> bool:
        return any(
            t.get("type") == "namespace" and t.get("name") == namespace for t in self.body.get("tools") or []
        )

    def output(self, result: TurnResult) -> list[dict[str, Any]]:
        parsed = result.output
        # max_output_tokens cut the last text item; a parsed function call is whole, so never cut.
        cut = status_of(result) == "incomplete" and not parsed.tool_calls
        items = []
        if parsed.reasoning_content:
            cut_here = cut and not parsed.content
            items.append(self.reasoning_item(parsed.reasoning_content, _item_status(cut_here)))
        # A turn that sampled no text and no call still answers a message (empty): echoed, it is the
        # assistant turn the record holds (chat's content ""), so the segment goes on. Not after
        # reasoning the budget cut, where no message began.
        if parsed.content or not (parsed.tool_calls or (cut and parsed.reasoning_content)):
            items.append(self.message_item(parsed.content or "", _item_status(cut)))
        for index, call in enumerate(parsed.tool_calls):
            function = call["function"]
            items.append(self.call_item(index, call["id"], function["name"], function["arguments"]))
        return items

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning"),
            "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation", "disabled"),
            "usage": usage,
            "metadata": body.get("metadata") or {},
        }

    def usage(self, result: TurnResult) -> dict[str, Any]:
        return usage_of(result, self._reasoning_tokens(result))

    def _reasoning_tokens(self, result: TurnResult) -> int:
        if self.reasoning_tokens is None:
            return 0
        return self.reasoning_tokens.count(result.generation.output_ids, result.output)

    def completed(self, result: TurnResult) -> dict[str, Any]:
        return self.response(status_of(result), self.output(result), self.usage(result))


def _item_status(cut: bool) -> str:
    return "incomplete" if cut else "completed"


def status_of(result: TurnResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_of(result: TurnResult, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        # Both required by the openai SDK's ResponseUsage (2.5x); the proxy counts no cache.
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
