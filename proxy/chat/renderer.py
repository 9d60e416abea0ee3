"""Token ids for prompts: a full render for a new segment, a fixed-base delta for appended messages.

The delta of messages appended after an assistant turn is computed in a constant synthetic context
(a fixed system + user base and an assistant stub), so it never depends on the real history, whose
earlier turns the template may rewrite (stripped reasoning, dates, tool lists). The delta is cut
after the stub's close token, and only after checking at token level that the cut is a true prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from proxy.chat.messages import Message, for_template
from proxy.chat.template import ChatTemplate
from proxy.chat.tokenizer import TokenizerFiles

BASE_SYSTEM = "You are a helpful assistant."
BASE_USER = "Hello."
# Distinctive text so that the stub is found in a render; never sent to the engine.
STUB_CONTENT = "tito-proxy fixed-base stub reply"
# Non-empty: templates like Qwen3 render a reasoning-free last assistant differently from an earlier one.
STUB_REASONING = "tito-proxy fixed-base stub reasoning"


class DeltaUnavailable(Exception):
    """The template does not let us compute a delta we can prove; start a new segment instead."""


@dataclass(frozen=True)
class TemplateProfile:
    """What a probe of the served template found out, once, at start-up."""

    close_token_id: int | None
    close_token: str | None


class Renderer:
    """Renders conversations to ids with the served tokenizer and chat template."""

    def __init__(self, files: TokenizerFiles) -> None:
        self.files = files
        self.tokenizer = files.tokenizer
        self.template = ChatTemplate(files.chat_template, files.special_tokens)
        self._added_ids = {int(i) for i in self.tokenizer.get_added_tokens_decoder()}
        self.profile = self._probe()

    @property
    def vocab_size(self) -> int:
        return self.files.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def token_text(self, token_id: int) -> str | None:
        text = self.tokenizer.id_to_token(token_id)
        return str(text) if text is not None else None

    def token_id(self, text: str) -> int | None:
        found = self.tokenizer.token_to_id(text)
        return int(found) if found is not None else None

    def _probe(self) -> TemplateProfile:
        messages: list[Message] = [
            {"role": "system", "content": BASE_SYSTEM},
            {"role": "user", "content": BASE_USER},
            {"role": "assistant", "content": STUB_CONTENT},
        ]
        text = self.template.render(messages)
        stub_at = text.rfind(STUB_CONTENT)
        ids = self.encode(text[stub_at + len(STUB_CONTENT) :]) if stub_at >= 0 else []
        close = next((t for t in ids if t in self._added_ids), None)
        return TemplateProfile(
            close_token_id=close, close_token=self.token_text(close) if close is not None else None
        )

    def render_prompt(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
    ) -> list[int]:
        """The full render of a conversation with the generation prompt: a new segment's first prompt."""
        text = self.template.render(
            [for_template(m) for m in messages],
            tools=tools,
            add_generation_prompt=True,
            template_kwargs=template_kwargs,
            now=now,
        )
        return self.encode(text)

    def render_delta(
        self,
        previous_assistant: Message,
        appended: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
    ) -> list[int]:
        """Ids the template puts after an assistant turn's close for `appended`, plus the generation
        prompt."""
        close = self.profile.close_token
        if close is None:
            raise DeltaUnavailable("the template has no assistant close token")
        stub: Message = {"role": "assistant", "content": STUB_CONTENT, "reasoning_content": STUB_REASONING}
        if previous_assistant.get("tool_calls"):
            # Tool results may be rendered with the calls' names (gpt-oss, Llama): keep the real calls.
            stub["tool_calls"] = previous_assistant["tool_calls"]
        context: list[Message] = [
            {"role": "system", "content": BASE_SYSTEM},
            {"role": "user", "content": BASE_USER},
            stub,
            *appended,
        ]
        text = self.template.render(
            [for_template(m) for m in context],
            tools=tools,
            add_generation_prompt=True,
            template_kwargs=template_kwargs,
            now=now,
        )
        stub_at = text.find(STUB_CONTENT)
        close_at = text.find(close, stub_at) if stub_at >= 0 else -1
        if close_at < 0:
            raise DeltaUnavailable("the assistant stub or its close is missing from the fixed-base render")
        head_ids = self.encode(text[: close_at + len(close)])
        full_ids = self.encode(text)
        if full_ids[: len(head_ids)] != head_ids or head_ids[-1:] != [self.profile.close_token_id]:
            raise DeltaUnavailable("the fixed-base render is not a token prefix at the stub's close")
        return full_ids[len(head_ids) :]
