"""Incremental OpenAI deltas from a growing output text, always prefixes of the final parse.

Each update sees the whole text decoded so far and emits only what can no longer change: text that
could still turn into a marker (`<think>`, `</think>`, a tool-call opener), trailing whitespace
that a final parse may trim, and a half-decoded UTF-8 character are held back. Tool calls are sent
once the final parse has them. So the streamed message reassembles exactly to the recorded one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.chat.parsing import OutputParser, ParsedOutput

# Where a tool call (or something that may become one) begins, per output format.
_CALL_MARKERS = {
    "hermes": ("<tool_call>",),
    "qwen3_coder": ("<tool_call>",),
    "glm45": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>",),
    "kimi_k2": ("<|tool_calls_section_begin|>",),
    "llama3_json": (),
    "gpt_oss": (),
}


def _hold_marker_prefix(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a suffix that is the start of one of `markers`."""
    for cut in range(min(len(text), max((len(m) for m in markers), default=0)), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return text[:-cut]
    return text


@dataclass
class StreamedMessage:
    parser: OutputParser
    reasoning_open: bool = False
    stop_strings: tuple[str, ...] = ()  # the turn's text ends before any of these
    sent_reasoning: str = ""
    sent_content: str = ""
    diverged: bool = False
    _buffer_all: bool = field(init=False)

    def __post_init__(self) -> None:
        # gpt-oss harmony and Llama's bare JSON calls are only known whole: streamed at the end.
        self._buffer_all = self.parser.name == "gpt_oss" or (
            self.parser.name == "llama3_json" and self.parser.tool_calls
        )

    def _view(self, text: str) -> tuple[str, str]:
        """Reasoning and content that every continuation of `text` starts with."""
        text = text.removesuffix("\ufffd")  # half of a UTF-8 character
        # Nothing from a stop string on is the turn's text; neither is text that may start one, until
        # the engine says so.
        found = [at for stop in self.stop_strings if (at := text.find(stop)) >= 0]
        text = _hold_marker_prefix(text[: min(found)] if found else text, self.stop_strings)
        if self._buffer_all:
            return "", ""
        rest = text
        reasoning = ""
        if self.parser.parse_reasoning:
            stripped = text.lstrip()
            if not stripped or "<think>".startswith(stripped):
                return "", ""  # may still become `<think>` (a model may open it after the prompt did)
            if stripped.startswith("<think>") or self.reasoning_open:
                body = stripped.removeprefix("<think>") if stripped.startswith("<think>") else text
                inside, closed, after = body.partition("</think>")
                if not closed:
                    return _hold_marker_prefix(inside, ("</think>",)).strip("\n") if inside.strip(
                        "\n"
                    ) else "", ""
                reasoning, rest = inside.strip("\n"), after.lstrip("\n")
                if not rest:
                    return reasoning, ""
        markers = _CALL_MARKERS.get(self.parser.name, ()) if self.parser.tool_calls else ()
        found = [rest.index(m) for m in markers if m in rest]
        content = rest[: min(found)] if found else _hold_marker_prefix(rest, markers)
        return reasoning, content.rstrip()

    def update(self, text: str) -> dict[str, str]:
        reasoning, content = self._view(text)
        # Cleaned as the final parse cleans them, so that both agree.
        return self._deltas(self.parser.clean(reasoning) or "", self.parser.clean(content) or "")

    def _deltas(self, reasoning: str, content: str) -> dict[str, str]:
        delta: dict[str, str] = {}
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            delta["reasoning_content"] = reasoning[len(self.sent_reasoning) :]
            self.sent_reasoning = reasoning
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            delta["content"] = content[len(self.sent_content) :]
            self.sent_content = content
        return delta

    def finish(self, final: ParsedOutput) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """The last text deltas and the tool-call deltas, from the authoritative final parse."""
        reasoning, content = final.reasoning_content or "", final.content or ""
        if not reasoning.startswith(self.sent_reasoning) or not content.startswith(self.sent_content):
            self.diverged = True  # never expected; the record holds the final parse regardless
        delta = self._deltas(reasoning, content)
        calls: list[dict[str, Any]] = []
        for index, call in enumerate(final.tool_calls):
            calls.append(
                {
                    "index": index,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""},
                }
            )
            calls.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
        return delta, calls
