"""How many sampled tokens are reasoning (the Responses API's `reasoning_tokens`): those up to the
close of a `<think>` block, or gpt-oss's analysis messages, headers and ends included."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.chat.parsing import ParsedOutput
from proxy.chat.renderer import Renderer


@dataclass(frozen=True)
class ReasoningTokens:
    think_close: int | None  # `</think>`
    decode: Callable[[list[int]], str]  # the model's own, for a harmony message's header
    # gpt-oss (harmony): `<|start|>`, which opens each message after the first, and `<|channel|>`,
    # `<|message|>`, between which a message's header names its channel.
    harmony: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, renderer: Renderer, parser_name: str) -> ReasoningTokens:
        start, channel, message = (
            renderer.token_id(text) for text in ("<|start|>", "<|channel|>", "<|message|>")
        )
        harmony = None
        if parser_name == "gpt_oss" and start is not None and channel is not None and message is not None:
            harmony = (start, channel, message)
        return cls(renderer.token_id("</think>"), renderer.decode, harmony)

    def count(self, ids: Sequence[int], output: ParsedOutput) -> int:
        if not output.reasoning_content:
            return 0
        if self.harmony is not None:
            return self._analysis_tokens(list(ids))
        if self.think_close is not None and self.think_close in ids:
            return list(ids).index(self.think_close) + 1
        # Never closed: all of it is reasoning, unless something else was parsed out of it.
        return len(ids) if not (output.content or output.tool_calls) else 0

    def _analysis_tokens(self, ids: list[int]) -> int:
        """The tokens of the messages on the analysis channel (a message runs from its `<|start|>`,
        or the output's start, to the next one)."""
        assert self.harmony is not None
        start, channel, message = self.harmony
        starts = [0, *(i for i, token in enumerate(ids) if token == start and i > 0), len(ids)]
        counted = 0
        for begin, end in itertools.pairwise(starts):
            span = ids[begin:end]
            if channel not in span:
                continue
            header_from = span.index(channel) + 1
            header_to = span.index(message) if message in span else len(span)
            header = self.decode(span[header_from:header_to])
            if header.split(" ", 1)[0].strip() == "analysis" and "to=" not in header:
                counted += len(span)
        return counted
