"""Sampled ids to answer text: the stop token and stop string cut, parsed output, finish reasons."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from proxy.chat.parsing import XML_FORMATS, OutputParser, ParsedOutput, TextArguments, text_arguments
from proxy.chat.renderer import Renderer
from proxy.engines.base import FinishReason, Generation
from proxy.store.codec import IdArray
from proxy.turns.request import TurnRequest

# Prompt tails whose reasoning_open is remembered (a template has a handful).
_KNOWN_TAILS = 256
# Tool lists whose string-typed arguments are remembered (an agent run has a few).
_KNOWN_TOOL_LISTS = 256


class AnswerText:
    """Reads sampled ids as the client's answer, with the renderer's vocabulary and the model's parser."""

    def __init__(self, renderer: Renderer, parser: OutputParser) -> None:
        self.renderer = renderer
        self.parser = parser
        # reasoning_open by the prompt's last ids: a template ends every prompt with one of a few
        # generation prompts, and decoding them cost more than the rest of the check.
        self._opens: dict[tuple[int, ...], bool] = {}
        self._text_arguments: dict[bytes, TextArguments] = {}

    def parser_for(self, request: TurnRequest) -> OutputParser:
        if request.is_completion:
            return replace(self.parser, parse_reasoning=False, tool_calls=False)  # raw text
        if not request.parse_tools:
            return replace(self.parser, tool_calls=False)
        if self.parser.name in XML_FORMATS and request.tools:
            return replace(self.parser, strings=self._strings(request))
        return self.parser

    def _strings(self, request: TurnRequest) -> TextArguments:
        """The tools' string-typed arguments, read once per tool list (a session resends its own)."""
        key = request.tools_key
        if key is None:  # a list orjson cannot write has no key: read it each time
            return text_arguments(request.tools)
        found = self._text_arguments.get(key)
        if found is None:
            if len(self._text_arguments) >= _KNOWN_TOOL_LISTS:
                self._text_arguments.clear()
            found = self._text_arguments[key] = text_arguments(request.tools)
        return found

    def reasoning_open(self, prompt: IdArray) -> bool:
        """Whether the generation prompt itself opened reasoning (DeepSeek R1's `<think>\\n`)."""
        if not self.parser.parse_reasoning:
            return False
        last = tuple(prompt[-4:].tolist())
        opens = self._opens.get(last)
        if opens is None:
            opens = self.renderer.decode(list(last)).rstrip("\n").endswith("<think>")
            if len(self._opens) >= _KNOWN_TAILS:
                self._opens.clear()
            self._opens[last] = opens
        return opens

    def output_text(self, output_ids: Sequence[int], finish: FinishReason | None) -> str:
        """The text of sampled ids as parsers see it: special tokens kept, the stop token and a matched
        stop string removed (they end the turn; they are not text)."""
        ids = list(output_ids)
        if (
            finish is not None
            and finish.matched_token is not None
            and ids
            and ids[-1] == finish.matched_token
        ):
            ids = ids[:-1]
        text = self.renderer.decode(ids)
        matched = finish.matched_text if finish is not None else None
        if matched and matched in text:
            text = text[: self._stop_string_at(ids, text, matched)]
        return text

    def _stop_string_at(self, ids: list[int], text: str, matched: str) -> int:
        """Where the engine's match of `matched` starts. The engine checks the decoded tail after each
        token, so its match is the first occurrence that ends inside the last token: the last token
        may hold the string twice, and the match may start in an earlier token."""
        before = self.renderer.decode(ids[:-1])
        # Characters of `text` decoded before the last token (a split UTF-8 character may differ).
        pairs = zip(before, text, strict=False)
        boundary = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(before), len(text)))
        found = text.find(matched, max(0, boundary - len(matched) + 1))
        return found if found >= 0 else text.find(matched)

    def parse(
        self, generation: Generation, *, reasoning_open: bool = False, parser: OutputParser | None = None
    ) -> ParsedOutput:
        return (parser or self.parser).parse(
            self.output_text(generation.output_ids, generation.finish), reasoning_open=reasoning_open
        )


def finish_for_openai(generation: Generation, output: ParsedOutput) -> str | None:
    """The finish_reason the client is answered with; None for an aborted generation, whose client
    got an error and no finish reason."""
    if generation.finish.kind == "abort":
        return None
    if generation.finish.kind == "length":
        return "length"
    return "tool_calls" if output.tool_calls else "stop"


def status_of(generation: Generation) -> str:
    return "aborted" if generation.finish.kind == "abort" else "ok"
