"""Where a recorded token stream differs from a fresh chat-template render of the same messages.

Both sequences are cut at special tokens and aligned piece by piece; every differing region is
classified with a kind of chat-templates.md section 5 (or `system_relocated`) and the stream
position where it starts. A region is classified by what differs in it, not by what it touches:
only the assistant's own sampled text, whitespace and BPE splits may be canonicalized; a missing,
extra or changed marker token (role, tool call, any added token) or non-assistant token is a bug,
reported as `unclassified` at the position of the first such token.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

DriftMode = Literal["strict", "ignore_strippable", "disable"]

ALLOWED_KINDS = frozenset(
    {
        "separator_inserted",
        "final_separator_absent",
        "assistant_bpe",
        "gen_prompt_merge",
        "assistant_canonicalization",
        "history_reasoning_stripped",
        "think_wrapper",
        "stop_token_rewrite",
        "truncation_close_synthesized",
        "date_changed",
        "system_relocated",
    }
)
_DATE = re.compile(r"\d{1,4}[-/ ]\w{2,9}[-/ ]\d{2,4}")
_THINK_TAGS = re.compile(r"</?think>")
_EMPTY_THINK = re.compile(r"^\s*<think>\s*</think>\s*")
_OPEN_REASONING_CLOSED = re.compile(r"\s*</think>\s*$")
_UNCLOSED_THINK = re.compile(r"\s*<think>(?:(?!</think>).)*", re.DOTALL)
_OPENS_THINK = re.compile(r"<think>\s*$")
_CLOSES_THINK = re.compile(r"\s*</think>")
# A reasoning block as the stream holds it: `<think>...</think>`, or a harmony analysis message up to
# the next assistant header (the token alignment may leave its one `<|channel|>` on either side).
_REASONING_BLOCKS = (
    re.compile(r"<think>.*?</think>", re.DOTALL),
    re.compile(
        r"<\|channel\|>analysis<\|message\|>.*?<\|end\|><\|start\|>assistant(?!<\|channel\|>)", re.DOTALL
    ),
    re.compile(
        r"(?<!<\|channel\|>)analysis<\|message\|>.*?<\|end\|><\|start\|>assistant<\|channel\|>", re.DOTALL
    ),
)


@dataclass(frozen=True)
class Difference:
    kind: str
    position: int  # index in the stream (prompt + response) where the difference starts
    stream_text: str
    render_text: str
    whitespace_only: bool

    @property
    def allowed(self) -> bool:
        return self.kind in ALLOWED_KINDS

    def as_json(self, prompt_len: int) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "allowed": self.allowed,
            "position": self.position,
            "response_position": self.position - prompt_len,
            "stream_text": self.stream_text[:200],
            "render_text": self.render_text[:200],
            "whitespace_only": self.whitespace_only,
        }


@dataclass(frozen=True)
class StreamFacts:
    """What the recorder knows about each stream position."""

    ids: Sequence[int]
    sampled: Sequence[bool]  # True where the engine produced the token (loss mask 1)
    synthesized: frozenset[int]  # positions of synthesized closes
    close_ids: frozenset[int]
    # The conversation's system prompts: Mistral templates write them into the last user message only.
    system_texts: tuple[str, ...] = ()


def _pieces(ids: Sequence[int], specials: frozenset[int]) -> list[tuple[int, int]]:
    """(start, end) spans: each special token alone, each run of ordinary tokens together."""
    spans: list[tuple[int, int]] = []
    start = 0
    for index, token in enumerate(ids):
        if token in specials:
            if start < index:
                spans.append((start, index))
            spans.append((index, index + 1))
            start = index + 1
    if start < len(ids):
        spans.append((start, len(ids)))
    return spans


def _whitespace_only(a: str, b: str) -> bool:
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op != "equal" and (a[a0:a1].strip() or b[b0:b1].strip()):
            return False
    return True


class DriftClassifier:
    def __init__(self, decode: Any, specials: frozenset[int], markers: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self._specials = specials
        # Tokens that carry structure (roles, tool calls, think tags): the specials and other added tokens.
        self._markers = specials | markers

    def compare(self, stream: StreamFacts, render: Sequence[int]) -> list[Difference]:
        s_spans = _pieces(stream.ids, self._specials)
        r_spans = _pieces(render, self._specials)
        s_keys = [tuple(stream.ids[a:b]) for a, b in s_spans]
        r_keys = [tuple(render[a:b]) for a, b in r_spans]
        matcher = difflib.SequenceMatcher(a=s_keys, b=r_keys, autojunk=False)
        differences = []
        for op, i0, i1, j0, j1 in matcher.get_opcodes():
            if op == "equal":
                continue
            s0 = s_spans[i0][0] if i0 < len(s_spans) else len(stream.ids)
            s1 = s_spans[i1 - 1][1] if i1 > i0 else s0
            r0 = r_spans[j0][0] if j0 < len(r_spans) else len(render)
            r1 = r_spans[j1 - 1][1] if j1 > j0 else r0
            differences.append(self._classify(stream, render, (s0, s1), (r0, r1)))
        return _check_relocations(differences)

    def _classify(
        self, stream: StreamFacts, render: Sequence[int], span: tuple[int, int], render_span: tuple[int, int]
    ) -> Difference:
        (s0, s1), (r0, r1) = span, render_span
        s_ids, r_ids = list(stream.ids[s0:s1]), list(render[r0:r1])
        common = 0
        while common < min(len(s_ids), len(r_ids)) and s_ids[common] == r_ids[common]:
            common += 1
        tail = 0
        # A last turn cut short ends the stream on a sampled token, where the render writes a close
        # and a separator: a sampled newline there only looks like the separator, it is not one.
        truncated_end = s1 == len(stream.ids) and r1 == len(render) and stream.sampled[s1 - 1]
        while (
            not truncated_end
            and tail < min(len(s_ids), len(r_ids)) - common
            and s_ids[-1 - tail] == r_ids[-1 - tail]
        ):
            tail += 1
        # Judge the differing tokens only: a text piece also holds role headers and shared text.
        s_diff, r_diff = s_ids[common : len(s_ids) - tail], r_ids[common : len(r_ids) - tail]
        s_text, r_text = self._decode(s_diff), self._decode(r_diff)
        # Judged on tokens: the same text in other ids (a BPE split) is not a whitespace difference.
        whitespace = s_text != r_text and _whitespace_only(s_text, r_text)
        first, last = s0 + common, s0 + len(s_ids) - tail
        sampled = [stream.sampled[i] for i in range(first, last)] or [
            stream.sampled[min(first, len(stream.ids) - 1)]
        ]

        def diff(kind: str, position: int = first) -> Difference:
            return Difference(kind, position, s_text, r_text, whitespace)

        if not s_diff and s0 == len(stream.ids) and r1 == len(render):
            # After the last sampled close, a render may add a separator (and an EOS, as Phi-3 does).
            tail_ok = all(t in self._specials or not self._decode([t]).strip() for t in r_diff)
            return diff("final_separator_absent" if tail_ok else "unclassified")
        if s_diff and all(i in stream.synthesized for i in range(first, last)) and not r_diff:
            return diff("truncation_close_synthesized")
        if not s_diff and last in stream.synthesized and _OPEN_REASONING_CLOSED.match(r_text):
            # The render also ends the reasoning a truncated turn left open, before the close.
            return diff("truncation_close_synthesized")
        if (
            len(s_diff) == 1 == len(r_diff)
            and s_diff[0] in stream.close_ids
            and r_diff[0] in stream.close_ids
        ):
            return diff("stop_token_rewrite")
        if any(sampled):
            if (
                s_diff
                and not r_diff
                and last == len(stream.ids)
                and all(sampled)
                and all(t in stream.close_ids for t in s_diff)
            ):
                return diff("stop_token_rewrite")  # GLM: the sampled opener that ended the last turn
            if s_text == r_text:
                return diff("assistant_bpe" if all(sampled) else "gen_prompt_merge")
            kind = self._reasoning_kind(stream, first, s_diff, s_text, r_text)
            if kind is not None:
                return diff(kind)
            # Only whitespace after the region (a sampled newline lined up with the separator).
            at_end = (
                s1 == len(stream.ids)
                and r1 == len(render)
                and not self._decode(s_ids[len(s_ids) - tail :]).strip()
            )
            unexplained = self._first_unexplained(stream, first, s_diff, r_diff, at_end=at_end)
            if unexplained is None:
                return diff("assistant_canonicalization")
            return diff("unclassified", unexplained)
        before_sample = last < len(stream.ids) and stream.sampled[last]
        if before_sample and not _THINK_TAGS.sub("", s_text + r_text).strip():
            # The generation prompt pre-fills a think opener the history render writes differently.
            return diff("think_wrapper")
        if _relocated_system(s_text, r_text, stream.system_texts):
            return diff("system_relocated")
        if _DATE.sub("<date>", s_text) == _DATE.sub("<date>", r_text) != s_text:
            return diff("date_changed")
        return diff("unclassified")

    def _reasoning_kind(
        self, stream: StreamFacts, first: int, s_diff: list[int], s_text: str, r_text: str
    ) -> str | None:
        """An empty think block on one side only, or the stream's reasoning that a render strips,
        with nothing else differing but whitespace."""
        for longer, shorter in ((s_text, r_text), (r_text, s_text)):
            wrapper = _EMPTY_THINK.match(longer)
            if wrapper and longer[wrapper.end() :].strip() == shorter.strip():
                return "think_wrapper"
        # What the stream holds beyond the assistant's own tokens may only be a pre-filled think opener.
        prompt_part = [t for i, t in enumerate(s_diff) if not stream.sampled[first + i]]
        if _THINK_TAGS.sub("", self._decode(prompt_part)).strip():
            return None
        after_turn = first + len(s_diff)
        if (
            (after_turn == len(stream.ids) or stream.ids[after_turn] in stream.close_ids)
            and _UNCLOSED_THINK.fullmatch(s_text)
            and not r_text.strip()
        ):
            return "history_reasoning_stripped"  # reasoning cut by max_tokens, dropped by the render
        for block in _REASONING_BLOCKS:
            rest, found = block.subn("", s_text, count=1)
            if found and not block.search(r_text) and _whitespace_only(rest, r_text):
                return "history_reasoning_stripped"
        # The render keeps an empty think block (GLM, Nemotron): only the text inside it went.
        before = self._decode(list(stream.ids[max(0, first - 4) : first]))
        after = self._decode(list(stream.ids[first + len(s_diff) : first + len(s_diff) + 4]))
        if (
            not r_text.strip()
            and _OPENS_THINK.search(before)
            and _CLOSES_THINK.match(after)
            and "<think>" not in s_text
            and "</think>" not in s_text
        ):
            return "history_reasoning_stripped"
        return None

    def _first_unexplained(
        self, stream: StreamFacts, first: int, s_diff: list[int], r_diff: list[int], *, at_end: bool = False
    ) -> int | None:
        """The stream position of the first difference that is not a canonicalization of the
        assistant's own text: a marker token missing, extra or changed, a changed or lost
        non-assistant token, or text the render adds away from the assistant's tokens. None if all
        are. Markers are paired first, so that text is only ever compared with its counterpart."""
        positions = [first + k for k in range(len(s_diff))]
        # Reasoning the stream holds and the render drops, an empty think block on either side, and
        # the close and separator a render adds after a truncated last turn are not structure lost.
        s_keep = self._without_think_blocks(s_diff, lambda k: self._own_or_think(stream, positions[k]))
        r_keep = self._without_think_blocks(r_diff, lambda k: False)
        if at_end and stream.sampled[-1]:
            self._trim_truncation_tail(s_diff, r_diff, r_keep)
        s_marks = [n for n, k in enumerate(s_keep) if s_diff[k] in self._markers]
        r_marks = [n for n, k in enumerate(r_keep) if r_diff[k] in self._markers]
        s_seq, r_seq = [s_diff[s_keep[n]] for n in s_marks], [r_diff[r_keep[n]] for n in r_marks]
        if s_seq != r_seq:
            pairs = zip(s_seq, r_seq, strict=False)
            k = next((n for n, (a, b) in enumerate(pairs) if a != b), min(len(s_seq), len(r_seq)))
            if k < len(s_marks):
                return positions[s_keep[s_marks[k]]]
            return positions[s_keep[s_marks[k - 1]]] + 1 if k else first
        s_bounds, r_bounds = [-1, *s_marks, len(s_keep)], [-1, *r_marks, len(r_keep)]
        for n in range(len(s_bounds) - 1):
            kept = s_keep[s_bounds[n] + 1 : s_bounds[n + 1]]
            anchor = positions[s_keep[s_bounds[n]]] + 1 if n else first
            s_part = [s_diff[k] for k in kept]
            r_part = [r_diff[k] for k in r_keep[r_bounds[n] + 1 : r_bounds[n + 1]]]
            bad = self._text_unexplained(stream, [positions[k] for k in kept], anchor, s_part, r_part)
            if bad is not None:
                return bad
        return None

    def _trim_truncation_tail(self, s_diff: list[int], r_diff: list[int], r_keep: list[int]) -> None:
        """Drop from `r_keep` what a render writes after a last turn cut short: its close, what
        follows the close, and the end of reasoning the stream left open. Whitespace before the
        close stays: it is the turn's own text (a sampled newline the render may fuse with others)."""
        texts = [self._decode([t]) for t in r_diff]
        tail = len(r_keep)
        while tail and (r_diff[r_keep[tail - 1]] in self._specials or not texts[r_keep[tail - 1]].strip()):
            tail -= 1
        while tail < len(r_keep) and r_diff[r_keep[tail]] not in self._specials:
            tail += 1
        del r_keep[tail:]
        if self._decode(s_diff).count("</think>") >= "".join(texts).count("</think>"):
            return
        end = len(r_keep)
        while end and not texts[r_keep[end - 1]].strip():
            end -= 1
        if end and texts[r_keep[end - 1]] == "</think>":
            del r_keep[end - 1 :]

    def _own_or_think(self, stream: StreamFacts, position: int) -> bool:
        """Sampled, or part of a think opener the generation prompt pre-filled."""
        return (
            stream.sampled[position] or not _THINK_TAGS.sub("", self._decode([stream.ids[position]])).strip()
        )

    def _without_think_blocks(self, tokens: list[int], removable: Any) -> list[int]:
        """Indices of `tokens` without `<think>...</think>` blocks that are empty, or whose every token
        is `removable`."""
        keep = list(range(len(tokens)))
        texts = [self._decode([t]) if t in self._markers else "" for t in tokens]
        for opener in [k for k, text in enumerate(texts) if text == "<think>"]:
            closer = next((k for k in range(opener + 1, len(tokens)) if texts[k] == "</think>"), None)
            if closer is None:
                continue
            span = range(opener, closer + 1)
            empty = not self._decode(tokens[opener + 1 : closer]).strip()
            if (empty or all(removable(k) for k in span)) and all(k in keep for k in span):
                keep = [k for k in keep if k not in span]
        return keep

    def _prompt_text_kept(self, s_sub: list[int], own: list[bool], r_sub: list[int]) -> bool:
        """Prompt tokens around the assistant's own tokens whose text the render keeps as it is: only
        the split into tokens and the assistant's text differ."""
        run = _split_own(own)
        if run is None:
            return False
        before, after = self._decode(s_sub[: run[0]]), self._decode(s_sub[run[1] :])
        text = self._decode(r_sub)
        return len(text) >= len(before) + len(after) and text.startswith(before) and text.endswith(after)

    def _text_unexplained(
        self, stream: StreamFacts, positions: list[int], anchor: int, s_part: list[int], r_part: list[int]
    ) -> int | None:
        """Where two marker-free texts differ in more than the assistant's own tokens, or None.
        `positions` are the stream positions of `s_part`, `anchor` where it starts. Judged on the
        differing middle as a whole: a token-level alignment of BPE pieces is arbitrary."""
        head = 0
        while head < min(len(s_part), len(r_part)) and s_part[head] == r_part[head]:
            head += 1
        tail = 0
        while tail < min(len(s_part), len(r_part)) - head and s_part[-1 - tail] == r_part[-1 - tail]:
            tail += 1
        s_mid, r_mid = s_part[head : len(s_part) - tail], r_part[head : len(r_part) - tail]
        at_mid = positions[head : len(positions) - tail]
        if not s_mid:
            if not r_mid:
                return None
            at = positions[head] if head < len(positions) else (positions[-1] + 1 if positions else anchor)
            # Text the template writes into the assistant's turn (JSON spacing, newlines).
            return None if _next_to_sampled(stream, at) else at
        own = [stream.sampled[p] for p in at_mid]
        if all(own) or (any(own) and self._prompt_text_kept(s_mid, own, r_mid)):
            return None  # the assistant's text, and prompt tokens fused with it whose text is kept
        return at_mid[own.index(False)]


def _split_own(own: list[bool]) -> tuple[int, int] | None:
    """(start, end) of the sampled run when `own` is prompt tokens, sampled ones, prompt tokens."""
    start = own.index(True)
    end = len(own) - own[::-1].index(True)
    return (start, end) if all(own[start:end]) else None


def _next_to_sampled(stream: StreamFacts, at: int) -> bool:
    return (at > 0 and stream.sampled[at - 1]) or (at < len(stream.ids) and stream.sampled[at])


def _relocated_system(s_text: str, r_text: str, system_texts: Sequence[str]) -> bool:
    """Exactly one system prompt (and the whitespace joining it to the user text) on one side only:
    a Mistral template writes it into whichever user message is last."""
    for system in system_texts:
        if not system.strip():
            continue
        for longer, shorter in ((s_text, r_text), (r_text, s_text)):
            if system in longer and longer.replace(system, "", 1).strip() == shorter.strip():
                return True
    return False


def _check_relocations(differences: list[Difference]) -> list[Difference]:
    """A relocation moves the system prompt forward: out of one user message of the stream, into at
    most one later place of the render. Anything else (a stream without it, two copies) is a bug."""
    moves = [i for i, d in enumerate(differences) if d.kind == "system_relocated"]
    removed = [differences[i].position for i in moves if _has_system_in_stream(differences[i])]
    added = [differences[i].position for i in moves if not _has_system_in_stream(differences[i])]
    if not moves or (len(removed) == 1 and len(added) <= 1 and all(at > removed[0] for at in added)):
        return differences
    return [replace(d, kind="unclassified") if i in moves else d for i, d in enumerate(differences)]


def _has_system_in_stream(difference: Difference) -> bool:
    return len(difference.stream_text.strip()) > len(difference.render_text.strip())


def report(differences: Sequence[Difference], mode: DriftMode, prompt_len: int) -> dict[str, Any]:
    kept = [d for d in differences if not (mode == "ignore_strippable" and d.whitespace_only)]
    counts = Counter(d.kind for d in kept)
    return {
        "mode": mode,
        "differences": [d.as_json(prompt_len) for d in kept],
        "counts": dict(sorted(counts.items())),
        "unclassified": sum(1 for d in kept if not d.allowed),
    }
