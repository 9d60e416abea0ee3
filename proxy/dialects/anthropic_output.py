"""A turn's result as an Anthropic `Message`: content blocks, stop_reason and usage.

Blocks in the order the model produced them: thinking (the sampled reasoning, with our signature),
text, then tool_use blocks whose ids are the proxy's call ids, remembered for the echo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.dialects.seals import Sealer
from proxy.dialects.shared import arguments_object
from proxy.turns import TurnResult


@dataclass(frozen=True)
class MessageShape:
    message_id: str
    model: str
    sealer: Sealer
    stop_sequences: tuple[str, ...]
    # thinking.display "omitted": the reasoning is left out of the answer, and its signature
    # carries it (sealed) so that the echoed block continues the turn as the full one would.
    omit_thinking: bool = False

    def thinking_block(self, text: str) -> dict[str, Any]:
        return {
            "type": "thinking",
            "thinking": "" if self.omit_thinking else text,
            "signature": self.seal(text),
        }

    def seal(self, text: str) -> str:
        """A thinking block's signature: the seal of its text, or with the text omitted, the text
        and its seal in one opaque string."""
        return self.sealer.envelope(text) if self.omit_thinking else self.sealer.signature(text)

    def content(self, result: TurnResult) -> list[dict[str, Any]]:
        parsed = result.output
        blocks: list[dict[str, Any]] = []
        if parsed.reasoning_content:
            blocks.append(self.thinking_block(parsed.reasoning_content))
        if parsed.content:
            blocks.append({"type": "text", "text": parsed.content})
        for call in parsed.tool_calls:
            function = call["function"]
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": function["name"],
                    "input": arguments_object(function["arguments"]),
                }
            )
        return blocks

    def stop(self, result: TurnResult) -> tuple[str, str | None]:
        """stop_reason and stop_sequence."""
        if result.finish_reason == "length":
            return "max_tokens", None
        if result.finish_reason == "tool_calls":
            return "tool_use", None
        matched = result.generation.finish.matched_text
        if matched is not None and matched in self.stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None

    def start(self, input_tokens: int) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(input_tokens, 0),
        }

    def message(self, result: TurnResult) -> dict[str, Any]:
        reason, sequence = self.stop(result)
        return {
            **self.start(result.prompt_tokens),
            "content": self.content(result),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(result.prompt_tokens, result.completion_tokens),
        }


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
