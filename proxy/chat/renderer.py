"""Token ids for prompts: a full render for a new segment, a fixed-base delta for appended messages.

The delta of messages appended after an assistant turn is computed in a constant synthetic context
(a fixed system + user base and an assistant stub), so it never depends on the real history, whose
earlier turns the template may rewrite (stripped reasoning, dates, tool lists). The delta is cut
after the stub's close token, and only after checking at token level that the cut is a true prefix,
or, where the tokenizer provably splits its input at that close token, by encoding from it.
What the served template allows is decided once by the start-up probe (proxy/chat/probe.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from proxy.chat.first_prompts import FirstPrompts
from proxy.chat.messages import CallsOnlyContent, Message, for_template
from proxy.chat.piece_cache import FAST_BPE_AFTER_TOKENS, PieceCache, PromptTooLong, encoding_of
from proxy.chat.probe import TemplateProbe, TemplateVerdict
from proxy.chat.short_context import ShortContext
from proxy.chat.template import ChatTemplate
from proxy.chat.tokenizer import TokenizerFiles
from proxy.errors import TemplateError

# PromptTooLong: raised by Renderer.encode, defined beside the chunk cache that also raises it.
__all__ = [
    "BASE_SYSTEM",
    "BASE_USER",
    "FIXED_BASE",
    "LARGE_TEXT_CHARS",
    "STUB_CONTENT",
    "STUB_REASONING",
    "Delta",
    "DeltaUnavailable",
    "PromptTooLong",
    "Renderer",
]

BASE_SYSTEM = "You are a helpful assistant."
BASE_USER = "Hello."
# Distinctive text so that the stub is found in a render; never sent to the engine.
STUB_CONTENT = "tito-proxy fixed-base stub reply"
# Non-empty: templates like Qwen3 render a reasoning-free assistant differently when it is last.
STUB_REASONING = "tito-proxy fixed-base stub reasoning"
# Texts around a close token on which encoding from the close is checked against a full encode.
_SPLIT_SAMPLES = (
    ("reply", "\n<|im_start|>user\nhi"),
    ("x ", " leading space"),
    ("end.", "\n\n  indented\n\tline"),
    ("données", "é 123 ünïcödé 漢字"),
    ("", "plain"),
    ("a\n", ""),
    ("  ", "  "),
)


# Texts at least this long have their length checked against the prompt limit before their ids are
# built (a refused 10 MB message would hold the GIL for seconds to build and free them). Every
# encode releases the GIL while it works (encode_batch_fast), so that a render on a worker thread
# leaves the event loop free; shorter texts, such as a typical appended tool result, go straight.
LARGE_TEXT_CHARS = 8192


# A text longer than this many characters per allowed token is first measured on such a prefix,
# and refused when the prefix alone has a quarter more tokens than allowed.
_PROBE_CHARS_PER_TOKEN = 6
_PROBE_MARGIN = 1.25


FIXED_BASE: tuple[Message, ...] = (
    {"role": "system", "content": BASE_SYSTEM},
    {"role": "user", "content": BASE_USER},
)

# The cache of encoded fixed bases: a base holds the tool list, which a request may make large.
_HEADS = 256
_HEAD_CHARS = 8 * 1024 * 1024


class DeltaUnavailable(Exception):
    """The template does not let us compute a delta we can prove; start a new segment instead."""


@dataclass(frozen=True)
class Delta:
    ids: list[int]
    close: str  # the close token that precedes the delta in a render


class Renderer:
    """Renders conversations to ids with the served tokenizer and chat template."""

    def __init__(self, files: TokenizerFiles, *, fast_bpe_after: int | None = FAST_BPE_AFTER_TOKENS) -> None:
        """`fast_bpe_after`: tokens to encode before tiktoken is tried (PieceCache)."""
        self.files = files
        self.tokenizer = files.tokenizer
        self.template = ChatTemplate(files.chat_template, files.special_tokens)
        # Decided from the tokenizer alone, so that the probe's encodes already take it.
        self.pieces = PieceCache(self.tokenizer, large_chars=LARGE_TEXT_CHARS, fast_bpe_after=fast_bpe_after)
        self.first_prompts = FirstPrompts(pure=self.template.pure, reads_date=self.template.reads_date)
        decoder = self.tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(int(i) for i, token in decoder.items() if token.special)
        self._special_texts = sorted(
            (str(t.content) for t in decoder.values() if t.special), key=len, reverse=True
        )
        # How tool-call arguments and a calls-only turn's content are passed: set by the probe.
        self.arguments_as: Literal["object", "string"] = "object"
        self.calls_only_content: CallsOnlyContent = "empty"
        self._heads: dict[str, list[int]] = {}
        self._head_chars = 0
        self._heads_lock = threading.Lock()
        self._closes_of: TemplateVerdict | None = None
        self._closes: tuple[str, ...] = ()
        # None while the probe runs: it checks the full fixed-base render.
        self.short_context: ShortContext | None = None
        # Empty while the probe runs: it checks templates on full encodes only.
        self._splitting_closes: dict[str, int] = {}
        self.verdict: TemplateVerdict = TemplateProbe(self).run()
        self._splitting_closes = self._closes_split_at()
        self.short_context = ShortContext(self, FIXED_BASE)
        self.verdict = replace(
            self.verdict, short_delta=self.short_context.as_json(), encode_cache=self.pieces.as_json()
        )
        # Fixed for the process: derived once, read on every turn.
        self.close_token_ids = self._ids_of(self.verdict.close_tokens)
        # What the engine must stop on: the tokens that end a sampled turn, and EOS.
        eos = files.special_tokens.get("eos_token")
        stops = self._ids_of(self.verdict.sampled_stop_tokens | ({eos} if eos else set()))
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    @property
    def vocab_size(self) -> int:
        return self.files.vocab_size

    def encode(self, text: str, *, at_most: int | None = None, special: bool = False) -> list[int]:
        """The ids of `text` (`special`: with the tokenizer's own BOS/EOS); PromptTooLong past `at_most`
        ids (checked on large texts, whose ids would hold the GIL long to build: a 10 MB message has
        ~5M). Without `special`, from the cache of chunks where proven exact (proxy/chat/piece_cache.py)."""
        by_pieces = self.pieces.proven and not special
        if len(text) < LARGE_TEXT_CHARS:
            if by_pieces:
                return self.pieces.encode(text)  # at_most is checked on large texts only, as below
            return list(self._encoding(text, special).ids)
        if at_most is not None and len(text) > _PROBE_CHARS_PER_TOKEN * at_most:
            # Freeing an encoding takes the GIL for ~0.5 us per token (~0.8 s for a 10 MB message), so
            # a text far too long is refused from a prefix: more text never has fewer tokens, and the
            # margin covers what the cut changes at its end.
            prefix = self._encoding(text[: _PROBE_CHARS_PER_TOKEN * at_most], special)
            if len(prefix) > _PROBE_MARGIN * at_most:
                raise PromptTooLong(len(prefix))
        if by_pieces:
            return self.pieces.encode(text, at_most=at_most)
        encoding = self._encoding(text, special)
        if at_most is not None and len(encoding) > at_most:
            raise PromptTooLong(len(encoding))
        return list(encoding.ids)

    def plain_encode(self, text: str) -> list[int]:
        """The tokenizer's own encode of `text`, without the chunk cache: what start-up proofs compare."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _encoding(self, text: str, special: bool) -> Any:
        return encoding_of(self.tokenizer, text, special=special)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def _ids_of(self, texts: Iterable[str]) -> frozenset[int]:
        return frozenset(i for text in texts if (i := self.token_id(text)) is not None)

    def token_id(self, text: str) -> int | None:
        found = self.tokenizer.token_to_id(text)
        return int(found) if found is not None else None

    @property
    def special_texts(self) -> tuple[str, ...]:
        return tuple(self._special_texts)

    def first_special_after(self, text: str, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for special in self._special_texts:
            at = text.find(special, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, special)
        return best

    def render_text(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ) -> str:
        return self.template.render(
            [
                for_template(m, arguments_as=self.arguments_as, calls_only_content=self.calls_only_content)
                for m in messages
            ],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
            now=now,
        )

    def render_prompt(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
    ) -> list[int]:
        """The full render of a conversation: a new segment's first prompt (at most `max_tokens`).
        The same first prompt (every rollout of a task) is rendered once (proxy/chat/first_prompts.py)."""
        key = self.first_prompts.key(
            messages,
            tools=tools,
            template_kwargs=template_kwargs,
            add_generation_prompt=add_generation_prompt,
            now=now,
            shape=(self.arguments_as, self.calls_only_content),
        )
        text = None if key is None else self.first_prompts.get(key)
        if text is None:
            text = self.render_text(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                template_kwargs=template_kwargs,
                now=now,
            )
            if key is not None:
                self.first_prompts.put(key, text)
        return self.encode(text, at_most=max_tokens)

    def _render_with_stub(
        self,
        previous_assistant: Message,
        appended: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
        *,
        base: Sequence[Message] = FIXED_BASE,
    ) -> str:
        stub: Message = {"role": "assistant", "content": STUB_CONTENT, "reasoning_content": STUB_REASONING}
        if previous_assistant.get("tool_calls"):
            # Tool results may be rendered with the calls' names and ids (gpt-oss, Kimi): keep those.
            # Arguments carry the marker; a turn that only called tools stays one (DeepSeek R1 renders
            # calls, and closes them, only then).
            if not previous_assistant.get("content"):
                stub["content"] = None
            stub["tool_calls"] = [
                {**call, "function": {"name": call["function"]["name"], "arguments": {"stub": STUB_CONTENT}}}
                for call in previous_assistant["tool_calls"]
            ]
        # gpt-oss refuses reasoning beside content on a tool-calling turn; such templates keep the
        # reasoning of tool turns anyway, so without it the stub's render still does not depend on
        # what follows.
        variants = [stub]
        if "tool_calls" in stub:
            variants.append({k: v for k, v in stub.items() if k != "reasoning_content"})
        for attempt, variant in enumerate(variants, start=1):
            try:
                return self.render_text(
                    [*base, variant, *appended],
                    tools=tools,
                    add_generation_prompt=True,
                    template_kwargs=template_kwargs,
                    now=now,
                )
            except TemplateError:
                if attempt == len(variants):
                    raise
        raise AssertionError("unreachable: the last variant returns or raises")

    def render_delta(
        self,
        previous_assistant: Message,
        appended: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
        max_tokens: int | None = None,
        tools_key: bytes | None = None,
    ) -> Delta:
        """Ids a render puts after an assistant turn's close for `appended`, and the generation prompt
        (PromptTooLong when they alone are more than `max_tokens`). Rendered from the stub alone where
        proven to give the same text (proxy/chat/short_context.py), else with the whole fixed base.
        `tools_key`: a digest of the tools' JSON, when the caller has one (else one is made)."""
        if not self._close_tokens():
            raise DeltaUnavailable("the template has no token that closes an assistant turn")
        short = self.short_context
        shape = (
            None
            if short is None
            else short.shape(previous_assistant, appended, tools, template_kwargs, tools_key)
        )
        proven = None if short is None or shape is None else short.verdict(shape)
        if proven and short is not None:
            found = self._short_delta(
                short,
                previous_assistant,
                appended,
                template_kwargs=template_kwargs,
                now=now,
                max_tokens=max_tokens,
            )
            if found is not None:
                return found
        text = self._render_with_stub(previous_assistant, appended, tools, template_kwargs, now)
        stub_at = text.rfind(STUB_CONTENT)
        if stub_at < 0:
            raise DeltaUnavailable("the assistant stub is missing from the fixed-base render")
        delta = self.cut_after_close(text, stub_at + len(STUB_CONTENT), max_tokens=max_tokens)
        if short is not None and shape is not None and proven is None:
            short.decide(
                shape,
                self._tail(text),
                functools.partial(
                    self.delta_text, previous_assistant, appended, template_kwargs, now, base=short.base
                ),
            )
        return delta

    def _short_delta(
        self,
        short: ShortContext,
        previous_assistant: Message,
        appended: Sequence[Message],
        *,
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
        max_tokens: int | None,
    ) -> Delta | None:
        """The delta from the short render, exactly the ids the full one gives; None to render in full."""
        try:
            tail = self.delta_text(previous_assistant, appended, template_kwargs, now, base=short.base)
        except TemplateError:
            return None
        if tail is None:
            return None
        close, text = tail
        # Encoded from the close as cut_after_close does for a close the tokenizer splits at.
        from_close = self.encode(text, at_most=_plus(max_tokens, 1))
        if from_close[:1] != [self._splitting_closes[close]]:
            return None
        return Delta(ids=from_close[1:], close=close)

    def delta_text(
        self,
        previous_assistant: Message,
        appended: Sequence[Message],
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
        *,
        base: Sequence[Message] = FIXED_BASE,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, str] | None:
        """The close token after the stub and the text from it on, in a render of `base`, the stub
        and `appended` with `tools`. None when that close is not one the tokenizer splits its input at."""
        return self._tail(
            self._render_with_stub(previous_assistant, appended, tools, template_kwargs, now, base=base)
        )

    def _tail(self, text: str) -> tuple[str, str] | None:
        """The first close after the stub and the text from it on, if the tokenizer splits at it."""
        stub_at = text.rfind(STUB_CONTENT)
        if stub_at < 0:
            return None
        found = self._first_close(text, stub_at + len(STUB_CONTENT))
        if found is None or found[1] not in self._splitting_closes:
            return None
        return found[1], text[found[0] :]

    def splitting_closes(self) -> frozenset[str]:
        """The close tokens ids may be encoded from (see _closes_split_at)."""
        return frozenset(self._splitting_closes)

    def render_after_empty_turn(
        self,
        empty_reply: Message,
        appended: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        now: datetime | None,
    ) -> list[int]:
        """Ids a render puts after the generation prompt for an assistant turn that said nothing,
        then `appended` and the next generation prompt, in the fixed-base context. A turn without
        text has no close of its own to cut after: only the template knows what it writes there."""
        base = list(FIXED_BASE)
        kwargs: dict[str, Any] = {"tools": tools, "template_kwargs": template_kwargs, "now": now}
        try:
            head = self.render_text(base, add_generation_prompt=True, **kwargs)
            full = self.render_text([*base, empty_reply, *appended], add_generation_prompt=True, **kwargs)
        except TemplateError as exc:
            raise DeltaUnavailable(f"the template does not render an empty assistant turn: {exc}") from exc
        head_ids, full_ids = self.encode(head), self.encode(full)
        if full_ids[: len(head_ids)] != head_ids:
            raise DeltaUnavailable(
                "an empty assistant turn does not follow the generation prompt in a render"
            )
        return full_ids[len(head_ids) :]

    def _head_ids(self, head: str) -> list[int]:
        """The fixed base up to the stub's close: the same few texts on every turn (one per tool list
        and kwargs), so encoded once; at most _HEADS entries and _HEAD_CHARS characters are kept."""
        found = self._heads.get(head)
        if found is not None:
            return found
        found = self.encode(head)
        if len(head) <= _HEAD_CHARS // 8:
            with self._heads_lock:  # large renders run on worker threads
                while self._heads and (
                    len(self._heads) >= _HEADS or self._head_chars + len(head) > _HEAD_CHARS
                ):
                    oldest = next(iter(self._heads))
                    del self._heads[oldest]
                    self._head_chars -= len(oldest)
                if head not in self._heads:
                    self._heads[head] = found
                    self._head_chars += len(head)
        return found

    def cached_heads(self) -> int:
        return len(self._heads)

    def cached_head_chars(self) -> int:
        return self._head_chars

    def _closes_split_at(self) -> dict[str, int]:
        """The close tokens the tokenizer cuts its input at before anything else runs, with their ids.

        A Hugging Face tokenizer first splits the text at added tokens that are not normalized, then
        normalizes and pre-tokenizes each piece on its own. After such a close the ids do not depend on
        what precedes it, so encoding may start at the close rather than re-encode the fixed base with
        its tool list. Options that look past the token (strip, single word) or a longer added token
        containing it rule that out; so does any sample where the two encodes differ.
        """
        added = {str(t.content): (int(i), t) for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        splitting: dict[str, int] = {}
        for close in self.verdict.close_tokens:
            if close not in added:
                continue
            token_id, token = added[close]
            plain = token.special and not (
                token.normalized or token.lstrip or token.rstrip or token.single_word
            )
            swallowed = any(close in other and other != close for other in added)
            if plain and not swallowed and all(self._same_after(close, token_id, *s) for s in _SPLIT_SAMPLES):
                splitting[close] = token_id
        return splitting

    def close_splits_input(self, close: str) -> bool:
        """Whether ids after `close` are encoded from the close, not from the whole render."""
        return close in self._splitting_closes

    def _same_after(self, close: str, close_id: int, before: str, after: str) -> bool:
        whole = self.plain_encode(before + close + after)
        head = self.plain_encode(before + close)
        from_close = self.plain_encode(close + after)
        return from_close[:1] == [close_id] and whole == head + from_close[1:]

    def _close_tokens(self) -> tuple[str, ...]:
        """verdict.close_tokens, derived once per verdict (the probe sets verdicts as it learns)."""
        if self._closes_of is not self.verdict:
            self._closes_of, self._closes = self.verdict, tuple(sorted(self.verdict.close_tokens))
        return self._closes

    def _first_close(self, text: str, start: int) -> tuple[int, str] | None:
        """Where the first close token at or past `start` is, and which it is."""
        return _first_close_in(text, start, self._close_tokens())

    def cut_after_close(self, text: str, start: int, *, max_tokens: int | None = None) -> Delta:
        """The ids of `text` after the first close token at or past `start`, trusted only when the
        text up to that close encodes to a token prefix of the whole (at most `max_tokens` of them)."""
        found = self._first_close(text, start)
        if found is None:
            raise DeltaUnavailable("no close token after the assistant turn in the render")
        close_at, close = found
        close_id = self._splitting_closes.get(close)
        if close_id is not None:
            # The tokenizer cuts at this close (see _closes_split_at): its ids are a prefix boundary.
            from_close = self.encode(text[close_at:], at_most=_plus(max_tokens, 1))
            if from_close[:1] == [close_id]:
                return Delta(ids=from_close[1:], close=close)
        head_ids = self._head_ids(text[: close_at + len(close)])
        full_ids = self.encode(text, at_most=_plus(max_tokens, len(head_ids)))
        if full_ids[: len(head_ids)] != head_ids:
            raise DeltaUnavailable("the render is not a token prefix at the assistant's close")
        return Delta(ids=full_ids[len(head_ids) :], close=close)


def _first_close_in(text: str, start: int, closes: Iterable[str]) -> tuple[int, str] | None:
    ends = [(at, close) for close in closes if (at := text.find(close, start)) >= 0]
    return min(ends) if ends else None


def _plus(limit: int | None, extra: int) -> int | None:
    return None if limit is None else limit + extra
